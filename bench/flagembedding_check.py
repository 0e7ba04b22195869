"""embedq's BGE-M3 outputs against the real FlagEmbedding package (not its definition written out in the tests).

FlagEmbedding pulls datasets, peft, accelerate and ir-datasets, too heavy for CI, so tests/test_hybrid.py checks
against FlagEmbedding's definition and this script checks that definition's result against the package itself,
once, by hand, in an environment where FlagEmbedding is installed beside embedq (on top of the project's torch;
never let pip pull another):

    python -m venv /tmp/fe
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/fe/lib/python3.11/site-packages/embedq.pth
    /tmp/fe/bin/pip install FlagEmbedding==1.4.2 torch==2.13.0   # torch: the CPU wheel the project pins
    /tmp/fe/bin/python bench/flagembedding_check.py

It builds the tests' tiny BGE-M3 (random XLM-RoBERTa, sparse_linear.pt, colbert_linear.pt), runs
``BGEM3FlagModel.encode(return_dense, return_sparse, return_colbert_vecs)`` and ``compute_score`` in fp32 on the
CPU, and embedq's backend on the same texts in worker-like mixed micro-batches; prints the largest differences.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import tiny_models  # noqa: E402

from embedq import scores  # noqa: E402
from embedq.backends import load_backend  # noqa: E402
from embedq.protocol import HybridEmbedding, HybridOptions, decode_hybrid  # noqa: E402


def main() -> None:
    import FlagEmbedding
    from FlagEmbedding import BGEM3FlagModel

    corpus = [json.loads(line)["text"] for line in (ROOT / "data" / "corpus.jsonl").open()]
    rng = random.Random(0)
    texts = [" ".join(t.split()[:rng.randint(1, 50)]) for t in rng.sample(corpus, 60)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_models.bge_m3(Path(tmp) / "bge-m3", corpus[:400])
        flag = BGEM3FlagModel(str(folder), use_fp16=False, devices="cpu", batch_size=16,
                              colbert_dim=tiny_models.M3_COLBERT_DIM)
        want = flag.encode(texts, max_length=tiny_models.MAX_LENGTH, return_dense=True, return_sparse=True,
                           return_colbert_vecs=True)
        pairs = [(texts[0], t) for t in texts[1:]]
        weights = [0.4, 0.2, 0.4]
        want_scores = flag.compute_score(pairs, batch_size=1, max_query_length=tiny_models.MAX_LENGTH,
                                         max_passage_length=tiny_models.MAX_LENGTH,
                                         weights_for_different_modes=weights)
        report = {"flagembedding": FlagEmbedding.__version__ if hasattr(FlagEmbedding, "__version__") else "1.4.2"}
        for kernel in ("torch", "onnxruntime"):
            backend = load_backend(str(folder), linear_kernel=kernel)
            got = decode_hybrid(tiny_models.run_as_the_worker(backend, "embed_hybrid", texts, HybridOptions(),
                                                              other=texts[::-1][:20]))
            lexical_keys = all({str(i) for i in v.indices.tolist()} == set(w) for v, w in
                               zip(got.lexical, want["lexical_weights"]))
            lexical = max(abs(float(v) - float(w[str(i)])) for g, w in zip(got.lexical, want["lexical_weights"])
                          for i, v in zip(g.indices.tolist(), g.values))
            colbert = max(float(np.abs(g - w).max()) for g, w in zip(got.colbert, want["colbert_vecs"]))
            docs = HybridEmbedding(got.dense[1:], got.lexical[1:], got.colbert[1:])
            hybrid = scores.score_all(got, docs, weights=dict(zip(("dense", "sparse", "colbert"), weights)))
            report[kernel] = {
                "dense_max_abs_diff": float(np.abs(got.dense - want["dense_vecs"]).max()),
                "lexical_same_keys": lexical_keys, "lexical_max_abs_diff": lexical,
                "colbert_max_abs_diff": colbert,
                "hybrid_max_abs_diff": max(abs(h["score"] - w) for h, w in
                                           zip(hybrid, want_scores["colbert+sparse+dense"])),
                "dense_score_max_abs_diff": max(abs(h["dense"] - w) for h, w in zip(hybrid, want_scores["dense"])),
                "sparse_score_max_abs_diff": max(abs(h["sparse"] - w) for h, w in zip(hybrid, want_scores["sparse"])),
                "colbert_score_max_abs_diff": max(abs(h["colbert"] - w) for h, w in
                                                  zip(hybrid, want_scores["colbert"])),
            }
        print(json.dumps(report, indent=1))
        ok = all(r["lexical_same_keys"] and max(v for k, v in r.items() if k.endswith("diff")) <= 1e-5
                 for k, r in report.items() if isinstance(r, dict))
        print("PASS" if ok else "FAIL")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
