"""BGE-M3 (``embed_hybrid``): dense, lexical and ColBERT outputs from one forward pass, against FlagEmbedding's
definition (``BGEM3FlagModel.encode``, fp32, written out below from FlagEmbedding 1.4.2's source) on a tiny random
XLM-RoBERTa saved in BGE-M3's layout; batch invariance, jobs asking for different outputs sharing micro-batches,
and jobs through a real worker."""

from __future__ import annotations

import random
import uuid

import numpy as np
import pytest
import tiny_models
from conftest import WorkerHandle, sparse_delta

from embedq.backends import load_backend
from embedq.producers.client import Client
from embedq.protocol import HybridOptions, decode_hybrid
from embedq.settings import Settings

pytestmark = pytest.mark.integration

LONG = " ".join(["tokens"] * 200)


@pytest.fixture(scope="module")
def m3(tmp_path_factory, corpus):
    return tiny_models.bge_m3(tmp_path_factory.mktemp("m3") / "bge-m3", corpus[:400])


def _cut(rng: random.Random, text: str) -> str:
    return " ".join(text.split()[:rng.randint(1, 50)])


def _texts(corpus, n=30, seed=0) -> list[str]:
    rng = random.Random(seed)
    return [_cut(rng, t) for t in rng.sample(corpus, n)] + ["hi", LONG]


def flag_reference(folder, texts: list[str], max_length: int = tiny_models.MAX_LENGTH, batch_size: int = 8):
    """``M3Embedder.encode_single_device`` (FlagEmbedding 1.4.2) with return_dense/sparse/colbert_vecs: CLS
    pooling, normalised dense and ColBERT vectors, ``_process_token_weights`` and ``_process_colbert_vecs``."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder)).eval()
    hidden = model.config.hidden_size
    sparse = torch.nn.Linear(hidden, 1)
    sparse.load_state_dict(torch.load(folder / "sparse_linear.pt", weights_only=True))
    state = torch.load(folder / "colbert_linear.pt", weights_only=True)
    colbert = torch.nn.Linear(hidden, state["weight"].shape[0])
    colbert.load_state_dict(state)
    unused = {tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map[t])
              for t in ("cls_token", "eos_token", "pad_token", "unk_token") if t in tokenizer.special_tokens_map}
    dense_out, lexical_out, colbert_out = [None] * len(texts), [None] * len(texts), [None] * len(texts)
    encoded = [tokenizer(t, truncation=True, max_length=max_length) for t in texts]
    order = np.argsort([-len(e["input_ids"]) for e in encoded], kind="stable")
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            idx = order[start:start + batch_size]
            batch = tokenizer.pad([encoded[i] for i in idx], padding=True, return_tensors="pt")
            last = model(**batch, return_dict=True).last_hidden_state
            dense = F.normalize(last[:, 0], dim=-1)
            weights = torch.relu(sparse(last)).squeeze(-1)
            vecs = colbert(last[:, 1:]) * batch["attention_mask"][:, 1:][:, :, None].float()
            vecs = F.normalize(vecs, dim=-1)
            for row, i in enumerate(idx):
                dense_out[i] = dense[row].numpy()
                result: dict[str, float] = {}
                for w, tid in zip(weights[row].numpy(), batch["input_ids"][row].tolist()):
                    if tid not in unused and w > 0 and w > result.get(str(tid), 0):
                        result[str(tid)] = w
                lexical_out[i] = result
                n = int(batch["attention_mask"][row].sum())
                colbert_out[i] = vecs[row].numpy()[:n - 1]
    return np.stack(dense_out), lexical_out, colbert_out


def _run(backend, texts, options, *, step=7, other=None, other_options=None):
    return decode_hybrid(tiny_models.run_as_the_worker(backend, "embed_hybrid", texts, options, step=step,
                                                       other=other, other_options=other_options))


def _check(got, want, outputs=("dense", "lexical", "colbert")):
    dense, lexical, colbert = want
    if "dense" in outputs:
        assert np.abs(got.dense - dense).max() <= 1e-5
    else:
        assert got.dense is None
    if "lexical" in outputs:
        # Read densely (conftest.sparse_delta), not id by id: the tiny model centres its lexical weights at the
        # median, so pre-activations cluster at 0 and a weight within fp32 noise of 0 may be kept by one side and
        # not the other (another batch composition or runtime than FlagEmbedding's); such an id differs by that
        # tiny weight, which the dense bar (1e-5) covers, while any real difference still shows in full.
        for mine, theirs in zip(got.lexical, lexical):
            assert sparse_delta(mine.indices, mine.values, [int(i) for i in theirs], list(theirs.values())) <= 1e-5
    else:
        assert got.lexical is None
    if "colbert" in outputs:
        for mine, theirs in zip(got.colbert, colbert):
            assert mine.shape == theirs.shape
            assert np.abs(mine - theirs).max() <= 1e-5
    else:
        assert got.colbert is None


# -- b: fidelity ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["auto", "torch", "onnxruntime"])
def test_b_the_three_outputs_equal_flag_embedding(kernel, m3, corpus):
    backend = load_backend(str(m3), linear_kernel=kernel)
    assert backend.info.kinds == ("embed", "embed_all", "embed_hybrid", "tokenize", "decode")
    if kernel == "onnxruntime":
        assert backend.info.linear_kernel == "onnxruntime"
    texts = _texts(corpus)
    want = flag_reference(m3, texts)
    # Other jobs asking for other outputs share every micro-batch.
    got = _run(backend, texts, HybridOptions(), other=_texts(corpus, 12, seed=1),
               other_options=HybridOptions(outputs=["colbert"]))
    _check(got, want)
    assert sum(len(v) for v in got.lexical) > 0 and any(len(v) < n for v, n in
                                                       zip(got.lexical, (len(c) + 1 for c in got.colbert)))
    # The plain embed kind of the same folder is its sentence-transformers model (CLS, Normalize): the same vector.
    from embedq.protocol import EmbedOptions, decode_result

    prepared = backend.prepare("embed", texts, EmbedOptions())
    vectors, _ = decode_result(backend.finish("embed", backend.forward(prepared.items), prepared, EmbedOptions()))
    assert np.abs(vectors - want[0]).max() <= 1e-5


@pytest.mark.parametrize("outputs", [["dense"], ["lexical"], ["colbert"], ["colbert", "dense"]])
def test_b_a_job_gets_only_the_outputs_it_asked_for(outputs, m3, corpus):
    backend = load_backend(str(m3), linear_kernel="torch")
    texts = _texts(corpus, 10)
    got = _run(backend, texts, HybridOptions(outputs=outputs), other=_texts(corpus, 5, seed=2))
    _check(got, flag_reference(m3, texts), outputs)
    # float16 halves the vectors on the wire; lexical weights stay float32
    payload = tiny_models.run_as_the_worker(backend, "embed_hybrid", texts, HybridOptions(outputs=outputs,
                                                                                          encoding="float16"))
    for name in outputs:
        key = "lexical_values" if name == "lexical" else name
        assert payload[key]["dtype"] == ("float32" if name == "lexical" else "float16"), name


def flag_scores(m3, query: str, documents: list[str], weights=(0.4, 0.2, 0.4)) -> list[dict[str, float]]:
    """``M3Embedder.compute_score_single_device`` (FlagEmbedding 1.4.2) for (query, document) pairs, one pair per
    batch: dense q·p, sparse over the vocabulary-wide lexical vectors, ColBERT sum of MaxSim over the query's
    tokens but CLS divided by their count, and 'colbert+sparse+dense' = Σ w·score / Σ w."""
    import torch

    dense, lexical, colbert = flag_reference(m3, [query, *documents])
    out = []
    for i in range(1, len(documents) + 1):
        d = float(torch.from_numpy(dense[0]) @ torch.from_numpy(dense[i]))
        s = sum(float(w) * float(lexical[i][t]) for t, w in lexical[0].items() if t in lexical[i])
        token_scores = torch.einsum("in,jn->ij", torch.from_numpy(colbert[0]), torch.from_numpy(colbert[i]))
        c = float(token_scores.max(-1).values.sum() / colbert[0].shape[0])
        out.append({"dense": d, "sparse": s, "colbert": c,
                    "score": (weights[0] * d + weights[1] * s + weights[2] * c) / sum(weights)})
    return out


def test_scores_equal_flag_embedding_compute_score(m3, corpus):
    from embedq import scores

    backend = load_backend(str(m3), linear_kernel="torch")
    query, documents = "how does a queue batch texts", _texts(corpus, 12, seed=4)
    both = _run(backend, [query, *documents], HybridOptions())
    docs = type(both)(both.dense[1:], both.lexical[1:], both.colbert[1:])
    got = scores.score_all(both, docs)
    for mine, theirs in zip(got, flag_scores(m3, query, documents)):
        for part in ("dense", "sparse", "colbert", "score"):
            assert abs(mine[part] - theirs[part]) <= 1e-5, part
    assert any(entry["sparse"] > 0 for entry in got), "some documents share weighted tokens with the query"
    # other weights, and parts left out: the hybrid is over the parts present
    assert scores.hybrid({"dense": 0.5, "sparse": 2.0}, {"dense": 1, "sparse": 1}) == pytest.approx(1.25)
    with pytest.raises(ValueError):
        scores.hybrid({"colbert": 0.3}, {"dense": 1.0})


# -- c: batch invariance -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["torch", "onednn", "onnxruntime"])
def test_c_a_text_alone_or_in_any_micro_batch_gets_the_same_outputs(kernel, m3, corpus):
    """Every runtime a worker may choose, each named (``auto`` picks one by timing, which may differ per process).
    Lexical weights (at most 0.26 here) are compared densely, see :func:`_check`; 1e-6 on all three outputs."""
    if kernel == "onnxruntime":
        pytest.importorskip("onnxruntime")
    backend = load_backend(str(m3), linear_kernel=kernel)
    rng = random.Random(5)
    text = _cut(rng, rng.choice(corpus))
    alone = _run(backend, [text], HybridOptions())
    for trial in range(3):
        batch = [_cut(rng, t) for t in rng.sample(corpus, rng.randint(3, 20))] + ([LONG] if trial else [])
        batch.insert(rng.randint(0, len(batch)), text)
        got = _run(backend, batch, HybridOptions(), step=len(batch))
        at = batch.index(text)
        assert np.abs(got.dense[at] - alone.dense[0]).max() <= 1e-6
        mine, theirs = got.lexical[at], alone.lexical[0]
        assert sparse_delta(mine.indices, mine.values, theirs.indices, theirs.values) <= 1e-6
        assert np.abs(got.colbert[at] - alone.colbert[0]).max() <= 1e-6


# -- through a worker ---------------------------------------------------------------------------------------
def test_hybrid_jobs_through_a_worker(redis_server, m3, corpus, tmp_path):
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.m3.{uuid.uuid4().hex[:8]}", model=str(m3),
                        linear_kernel="torch")
    client = Client(settings)
    rng = random.Random(13)
    jobs = [[_cut(rng, t) for t in rng.sample(corpus, rng.randint(1, 10))] for _ in range(9)]
    choices = [["dense", "lexical", "colbert"], ["dense"], ["lexical", "colbert"]]
    handles = [client.submit_hybrid(texts, outputs=choices[i % 3]) for i, texts in enumerate(jobs)]
    small = client.submit_hybrid(jobs[0], outputs=["lexical", "colbert"], top_k=2, return_tokens=True,
                                 encoding="float16")
    dense = client.submit(jobs[1])
    worker = WorkerHandle(settings, tmp_path / "worker.log")
    try:
        results = [h.result(timeout=300) for h in handles]
        compact = small.result(timeout=120)
        vectors = dense.result(timeout=120)
        query, documents = "what does a worker do", jobs[2]
        ranked = client.score(query, documents)
        stats = worker.stats()
    finally:
        worker.stop()
        client.close()
    # (Sharing micro-batches across outputs is shown in test_b above, item by item: a 2-layer model runs each job
    # here before the consumer has taken the next one, so the count of batches would show nothing.)
    assert stats["jobs_by_kind"].get("embed_hybrid", 0) == len(jobs) + 2
    assert stats["jobs_by_kind"].get("embed", 0) == 1
    for i, (texts, got) in enumerate(zip(jobs, results)):
        _check(got, flag_reference(m3, texts), choices[i % 3])
    assert handles[0].fingerprint.kind == "embed_hybrid"
    assert handles[0].fingerprint.pooling == "m3:dense+lexical+colbert"
    assert not handles[1].fingerprint.same_space(handles[0].fingerprint), "other outputs, another space"
    want = flag_reference(m3, jobs[0])
    for vector, full in zip(compact.lexical, want[1]):
        assert len(vector) == min(2, len(full)) and vector.tokens is not None
    for mine, theirs in zip(compact.colbert, want[2]):
        assert np.abs(mine - theirs).max() <= 2e-3  # float16 on the wire
    assert np.abs(vectors - flag_reference(m3, jobs[1])[0]).max() <= 1e-5
    want = flag_scores(m3, query, documents)
    assert sorted(entry["index"] for entry in ranked) == list(range(len(documents)))
    assert [entry["score"] for entry in ranked] == sorted((entry["score"] for entry in ranked), reverse=True)
    for entry in ranked:
        assert abs(entry["score"] - want[entry["index"]]["score"]) <= 1e-5
