"""Fidelity of every model family, per dtype: tiny random models of each family TEI serves against
sentence-transformers fp32 ``encode(batch_size=1)`` (the oracle), packed by the real scheduler.

    python bench/families.py                                        # CPU: float32 and bfloat16
    python bench/families.py --device cuda:0 --dtypes float32 float16 bfloat16 --json $OUT/families.json

The models are ``tests/families.py``'s (hidden size 32, two layers, tokenizers trained on the corpus), saved to a
temporary folder as sentence-transformers folders; the decoders on both padding sides, with their instruction
prompt. For each model and dtype: min cosine and max |Δ| against the oracle over ``--n`` corpus texts packed into
token-budget micro-batches, and batch invariance (the same texts under two other budgets and shuffled arrival
orders). Bars: float32 cosine ≥ 0.99999, |Δ| ≤ 1e-5, invariance ≤ 1e-6 (unit vectors); float16/bfloat16 cosine
≥ 0.999. Exits non-zero when a bar is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from families import FAMILIES, save  # noqa: E402

from bench.fidelity import embed_packed  # noqa: E402
from embedq.backends import load_backend, postprocess  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.cli.verify import cosines  # noqa: E402
from embedq.protocol import EmbedOptions  # noqa: E402

CORPUS = ROOT / "data" / "corpus.jsonl"


def main() -> int:
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=500, help="corpus texts per model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "float16", "bfloat16"])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--max-batch-tokens", type=int, default=None, help="default: the worker's (2048 CPU, 16384 CUDA)")
    p.add_argument("--linear-kernel", default="torch", choices=["auto", "torch", "onednn", "onnxruntime"])
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    with CORPUS.open() as fh:
        corpus = [json.loads(line)["text"] for line in fh]
    texts = corpus[:: max(1, len(corpus) // args.n)][: args.n]
    budget = args.max_batch_tokens or (16384 if args.device.startswith("cuda") else 2048)
    rng = random.Random(2026)
    print(f"# embedq families fidelity  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {cpu_summary()}  "
          f"cpus={os.cpu_count()}  device={args.device}"
          + (f" ({torch.cuda.get_device_name(args.device)})" if args.device.startswith("cuda") else "")
          + f"  torch={torch.__version__}  transformers={transformers.__version__}  kernel={args.linear_kernel}")
    print(f"# {len(texts)} corpus texts per model; budget {budget} tokens; oracle: sentence-transformers fp32 "
          "encode(batch_size=1) on the CPU")
    print(f"{'model':<22} {'dtype':<9} {'min cos':>11} {'max |Δ|':>9} {'invariance':>10}  verdict")
    results, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            family = FAMILIES[name]
            for side in (("left", "right") if family.decoder else (None,)):
                label = name if side is None else f"{name}/{side}"
                folder = save(family, Path(tmp) / label.replace("/", "-"), corpus[:2000], padding_side=side)
                prompt_name = next(iter(family.prompts), None)
                oracle = SentenceTransformer(str(folder), device="cpu").encode(
                    texts, batch_size=1, prompt_name=prompt_name, convert_to_numpy=True, show_progress_bar=False)
                options = EmbedOptions.parse({"prompt_name": prompt_name} if prompt_name else {})
                for dtype in args.dtypes:
                    backend = load_backend(str(folder), device=args.device, dtype=dtype,
                                           linear_kernel=args.linear_kernel, batch_tokens=budget)
                    items = backend.prepare("embed", texts, options).items
                    ids, plens = [item.ids for item in items], [item.prompt_length for item in items]
                    order = list(range(len(items)))
                    raw, _ = embed_packed(backend, ids, max_tokens=budget, order=order, prompt_lengths=plens)
                    ours = postprocess(raw, normalize=backend.info.normalizes, dimensions=None)
                    cos = cosines(ours, oracle)
                    delta = float(np.abs(ours - oracle).max())
                    invariance = 0.0
                    unit = partial(postprocess, normalize=True, dimensions=None)
                    for other in (budget // 4, budget * 2):
                        rng.shuffle(order)
                        again, _ = embed_packed(backend, ids, max_tokens=other, order=order, prompt_lengths=plens)
                        invariance = max(invariance, float(np.abs(unit(again) - unit(raw)).max()))
                    fp32 = dtype == "float32"
                    ok = cos.min() >= (0.99999 if fp32 else 0.999) and (not fp32 or (delta <= 1e-5
                                                                                     and invariance <= 1e-6))
                    if not ok:
                        failed.append(f"{label} {dtype}")
                    results.append({"model": label, "dtype": dtype, "min_cosine": float(cos.min()),
                                    "max_abs_delta": delta, "invariance": invariance, "passed": bool(ok)})
                    print(f"{label:<22} {dtype:<9} {cos.min():11.8f} {delta:9.2e} {invariance:10.2e}  "
                          f"{'ok' if ok else 'FAIL'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "n": len(texts), "budget": budget,
                                         "cpu": cpu_summary(), "torch": torch.__version__,
                                         "transformers": transformers.__version__, "results": results}, indent=2))
    print("families: PASS" if not failed else f"families: FAIL ({', '.join(failed)})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
