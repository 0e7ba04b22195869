"""The producer's batch calls: ``Client.submit_many`` (many jobs, one round trip) and ``Client.collect`` (many
results per round trip).

The messages ``submit_many`` writes straight into Redis must be the ones ``app.send_task`` would send: compared
field by field, and read by a plain Celery worker and by a real embedq worker alike. Results are stored here
through the one writer of terminal records (:class:`~embedq.results.ResultStore`), so ``collect`` is tested
without a model where the worker adds nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from embedq import errors
from embedq.kinds import KINDS, task_reprs
from embedq.producers import client as client_module
from embedq.producers import direct as direct_module
from embedq.producers import handle as handle_module
from embedq.producers.client import Client
from embedq.protocol import CLIENT_HEADER, RESENT_HEADER, SENT_HEADER, Fingerprint, encode_result
from embedq.results import ResultStore
from embedq.settings import Settings

pytestmark = pytest.mark.integration  # the session's redis-server, and real workers

FINGERPRINT = Fingerprint(model="m", weights_sha256="0" * 64, pooling="mean", normalize=True, dimensions=4,
                          dtype="float32", embedq_version="test")


def _client(redis_server, name: str, **settings) -> Client:
    settings.setdefault("online_queue_limit", 100_000)
    return Client(Settings(broker_url=redis_server.url, queue=f"embedq.test.batch.{name}", **settings))


def _payload(value: float, rows: int = 1) -> dict:
    return encode_result("embed", {"vectors": np.full((rows, 4), value, np.float32)}, FINGERPRINT, items=rows,
                         tokens=3 * rows)


def _send_task_copy(client: Client, message: dict, *, kind: str, args: list, options: dict, queue: str,
                    deadline) -> None:
    """What ``app.send_task`` sends for the same job (same id, same send time)."""
    name = message["headers"]["task"]
    client.app.send_task(name, args=args, kwargs=options, queue=queue, task_id=message["headers"]["id"],
                         expires=deadline, ignore_result=not client.follow_results,
                         headers={SENT_HEADER: message["headers"][SENT_HEADER],
                                  CLIENT_HEADER: message["headers"][CLIENT_HEADER]},
                         **task_reprs(KINDS[kind], args, options))


def _stable(message: dict) -> dict:
    """A message without what differs between two sends of one job: kombu's delivery tag, and the expiration
    (milliseconds left at the moment of sending)."""
    out = json.loads(json.dumps(message))
    out["properties"].pop("delivery_tag")
    out["properties"].pop("expiration", None)
    return out


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
@pytest.mark.parametrize("follow_results", [True, False])
def test_submit_many_writes_the_message_send_task_would(redis_server, serializer, follow_results):
    client = Client(Settings(broker_url=redis_server.url, queue=f"embedq.test.batch.wire.{serializer}",
                             serializer=serializer), follow_results=follow_results)
    r = client.redis()
    cases = [("embed", [["hello", "wörld"], "one text", ["🙂 emoji"] * 3], {"normalize": True, "dimensions": 8}),
             ("rerank", [("query", ["a", "b"]), ("q2", ["c"])], {"raw_scores": True}),
             ("predict", [["a", ["b", "c"]]], {}),
             ("decode", [[1, 2, 3], [[4, 5], [6]]], {"skip_special_tokens": False}),
             ("embed_hybrid", [["x"]], {"outputs": ["dense"], "prompt": "query: "})]
    for kind, jobs, options in cases:
        for deadline in (None, 60):
            queue = client.settings.queue_name
            r.delete(queue)
            handles = client.submit_many(jobs, kind=kind, deadline=deadline, **options)
            ours = [json.loads(raw) for raw in reversed(r.lrange(queue, 0, -1))]  # oldest first
            assert [m["headers"]["id"] for m in ours] == [h.id for h in handles]
            assert {m["headers"][CLIENT_HEADER] for m in ours} == {client.client_id}
            r.delete(queue)
            for message, handle in zip(ours, handles):
                args, wire = handle.sent.args, handle.sent.options
                _send_task_copy(client, message, kind=kind, args=args, options=wire, queue=queue,
                                deadline=handle.deadline)
                theirs = json.loads(r.lpop(queue))
                # the same fields in the same order, the same body byte for byte
                assert json.dumps(_stable(message)) == json.dumps(_stable(theirs)), kind
                if deadline is not None:
                    ms = [int(m["properties"]["expiration"]) for m in (message, theirs)]
                    assert abs(ms[0] - ms[1]) < 2000 and 55_000 < ms[0] <= 60_000
                else:
                    assert "expiration" not in message["properties"]
            # kombu's queue binding is there, as its declare before a publish makes it
            assert r.smembers(f"_kombu.binding.{queue}") == {f"{queue}\x06\x16\x06\x16{queue}".encode()}
            assert r.smembers(f"_kombu.binding_permanent.{queue}") == r.smembers(f"_kombu.binding.{queue}")
    # written directly (not through send_task), and no result channel was subscribed on the way (a round trip each)
    assert client.writer.route("embedq.embed", client.settings.queue_name) is not None and client.writer.direct_now()
    assert not client.app.backend.result_consumer.subscribed_to
    client.close()


PLAIN_APP = '''
import json, os
import redis
from celery import Celery

app = Celery("plain", broker=os.environ["PLAIN_BROKER"])
app.conf.update(accept_content=["json", "msgpack"], worker_hijack_root_logger=False)
out = redis.Redis.from_url(os.environ["PLAIN_BROKER"])


@app.task(name="embedq.embed", bind=True)
def embed(self, texts, **options):
    seen = {k: v for k, v in vars(self.request).items() if not k.startswith("_")}
    out.rpush(os.environ["PLAIN_OUT"], json.dumps({"texts": texts, "options": options, "request": seen},
                                                  default=repr))
'''


@pytest.mark.integration
@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_a_plain_celery_worker_reads_submit_many_and_send_task_alike(redis_server, tmp_path, serializer):
    queue = f"embedq.test.batch.plain.{serializer}"
    client = Client(Settings(broker_url=redis_server.url, queue=queue, serializer=serializer))
    r = client.redis()
    out = f"{queue}.out"
    r.delete(queue, out)
    handle = client.submit_many([["hello", "wörld"]], deadline=60, normalize=True)[0]
    message = json.loads(r.lindex(queue, 0))
    _send_task_copy(client, message, kind="embed", args=handle.sent.args, options=handle.sent.options,
                    queue=queue, deadline=handle.deadline)
    (tmp_path / "plain_app.py").write_text(PLAIN_APP)
    env = {**os.environ, "PLAIN_BROKER": redis_server.url, "PLAIN_OUT": out, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "plain_app", "worker", "--pool=solo", "-Q", queue,
                             "--without-heartbeat", "--without-gossip", "--without-mingle", "--loglevel=WARNING"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120
        while r.llen(out) < 2:
            assert proc.poll() is None, "the Celery worker exited"
            assert time.monotonic() < end, "the Celery worker ran no task"
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
        client.close()
    ours, theirs = (json.loads(raw) for raw in r.lrange(out, 0, -1))
    assert ours["texts"] == ["hello", "wörld"] and ours["options"] == {"normalize": True}
    for seen in (ours, theirs):  # what differs between two sends of one job (see _stable)
        seen["request"]["delivery_info"].pop("delivery_tag", None)
        seen["request"]["properties"].pop("delivery_tag")
        expiration = [int(seen["request"]["properties"].pop("expiration"))]
        assert 55_000 < expiration[0] <= 60_000
    differ = {k: (ours["request"].get(k), theirs["request"].get(k))
              for k in ours["request"].keys() | theirs["request"].keys()
              if ours["request"].get(k) != theirs["request"].get(k)}
    assert not differ and ours == theirs
    assert ours["request"]["id"] == handle.id and ours["request"][SENT_HEADER] == message["headers"][SENT_HEADER]


@pytest.mark.integration
def test_a_real_worker_runs_submit_many_jobs_as_it_runs_submits(worker, corpus):
    client = worker.client
    jobs = [corpus[i:i + n] for i, n in zip(range(0, 600, 37), [1, 5, 2, 30, 1, 8] * 3)]
    handles = client.submit_many(jobs)
    results = client.collect(handles, timeout=300)
    singles = [client.submit(texts).result(timeout=300) for texts in jobs[:4]]
    for texts, got in zip(jobs, results):
        assert got.shape == (len(texts), 384)
    for got, want in zip(results, singles):
        assert np.abs(got - want).max() <= 1e-5
    # the records left Redis; each handle keeps its outcome
    r = client.redis()
    assert not r.exists(*(client.app.backend.get_key_for_task(h.id) for h in handles))
    assert np.array_equal(handles[0].result(timeout=0), results[0])
    assert handles[0].fingerprint is not None and handles[0].usage["texts"] == len(jobs[0])
    assert not client.pending


def test_every_job_is_checked_before_any_is_sent(redis_server):
    client = _client(redis_server, "invalid")
    r = client.redis()
    queue = client.settings.queue_name
    bad = [(["fine", ""], errors.EmptyText), ([], errors.EmptyInput),
           (["x" * (client.settings.max_chars + 1)], errors.TextTooLong), (3, errors.InvalidType)]
    for job, error in bad:
        jobs = [["ok"], job]
        with pytest.raises(error) as raised:
            client.submit_many(jobs)
        assert "job 1 of the 2" in "".join(getattr(raised.value, "__notes__", [""]))
        # the single submit raises the same error, with the same message
        with pytest.raises(type(raised.value)) as single:
            client.submit(jobs[1])
        assert single.value.message == raised.value.message
    with pytest.raises(errors.InvalidOption):
        client.submit_many([["a"]], kind="no-such-kind")
    with pytest.raises(errors.InvalidOption):
        client.submit_many([["a"]], dimensions="8")
    with pytest.raises(errors.InvalidType):
        client.submit_many(["not a pair"], kind="rerank")
    big = _client(redis_server, "invalid", max_message_bytes=2048)
    with pytest.raises(errors.MessageTooLarge):
        big.submit_many([["a"], ["y" * 3000]])
    assert r.llen(queue) == 0
    assert client.submit_many([]) == []
    big.close()
    client.close()


def test_backpressure_is_checked_once_per_batch(redis_server, monkeypatch):
    reads = []
    waiting = client_module.monitor.waiting
    monkeypatch.setattr(client_module.monitor, "waiting", lambda r, q: reads.append(q) or waiting(r, q))
    client = _client(redis_server, "admit", online_queue_limit=5, bulk_queue_limit=5, bulk_wait_timeout=0.3)
    r = client.redis()
    for queue in (client.settings.queue_name, client.settings.bulk_queue_name):
        r.delete(queue)
    client.submit_many([["a"]] * 4)
    assert len(reads) == 1
    time.sleep(client_module.DEPTH_REUSE)
    client.submit_many([["b"]] * 3)  # the queue had room: the batch goes in whole
    assert len(reads) == 2 and r.llen(client.settings.queue_name) == 7
    time.sleep(client_module.DEPTH_REUSE)
    with pytest.raises(errors.Overloaded):  # full: refused before anything is sent
        client.submit_many([["c"]] * 2)
    assert len(reads) == 3 and r.llen(client.settings.queue_name) == 7
    looks = []
    client.on_bulk_wait = lambda queue, depth, waited: looks.append(depth)
    client.submit_many([["d"]] * 5, traffic_class="bulk")
    with pytest.raises(errors.Overloaded):  # bulk waits for room, here in vain
        client.submit_many([["e"]] * 2, traffic_class="bulk")
    assert looks and r.llen(client.settings.bulk_queue_name) == 5
    client.close()


def test_collect_reads_stored_and_arriving_results_in_order(redis_server):
    client = _client(redis_server, "collect")
    store = ResultStore(client.app)
    handles = client.submit_many([["a"], ["b", "c"], ["d"]] * 20)
    for i, handle in enumerate(handles[:30]):  # done before collect: read many per round trip
        store.store(handle.id, _payload(i, len(handle.sent.args[0])))

    def finish():  # the rest arrive while collect waits on their channels
        time.sleep(0.3)
        for i, handle in enumerate(handles[30:], 30):
            store.store(handle.id, _payload(i, len(handle.sent.args[0])))

    threading.Thread(target=finish).start()
    results = client.collect(handles, timeout=30)
    assert [float(v[0, 0]) for v in results] == list(range(60))
    assert [len(v) for v in results] == [1, 2, 1] * 20
    assert handles[5].fingerprint == FINGERPRINT and handles[5].usage == {"texts": 1, "tokens": 3}
    r = client.redis()
    assert not r.exists(*(client.app.backend.get_key_for_task(h.id) for h in handles))  # forgotten in one go
    assert not client.pending
    # each handle keeps its outcome; payloads undecoded on request
    assert client.collect(handles[:2], decode=False) == [h.payload(timeout=0) for h in handles[:2]]
    assert np.array_equal(handles[1].result(timeout=0), results[1])
    client.close()


def test_collect_errors_timeouts_and_deadlines(redis_server):
    client = _client(redis_server, "collect-errors")
    store = ResultStore(client.app)
    handles = client.submit_many([["a"]] * 4)
    store.store(handles[0].id, _payload(0))
    store.store(handles[2].id, errors.BackendError("the model failed"))
    with pytest.raises(errors.BackendError):  # raised at once, as handle.result() raises it
        client.collect(handles, timeout=30)
    assert isinstance(handles[2].error, errors.BackendError)
    out = client.collect(handles, timeout=0.3, return_exceptions=True)
    assert float(out[0][0, 0]) == 0.0 and isinstance(out[2], errors.BackendError)
    assert all(isinstance(out[i], errors.JobTimeout) for i in (1, 3))
    with pytest.raises(errors.JobTimeout):
        client.collect(handles[1:2], timeout=0.2)
    store.store(handles[1].id, _payload(1))
    store.store(handles[3].id, _payload(3))
    assert [float(v[0, 0]) for v in client.collect([handles[1], handles[3]])] == [1.0, 3.0]
    # a job past its deadline (and the grace) has no result to wait for
    late = client.submit_many([["x"]] * 2, deadline=0.2)
    store.store(late[1].id, _payload(9))
    t0 = time.monotonic()
    out = client.collect(late, timeout=30, return_exceptions=True)
    assert isinstance(out[0], errors.Expired) and float(out[1][0, 0]) == 9.0
    assert time.monotonic() - t0 < handle_module.DEADLINE_GRACE + 2
    client.close()


def test_handles_that_follow_no_results_still_wait_for_them(redis_server):
    """``follow_results=False`` (the gateway's client): ``handle.result()`` waits for the stored record (Celery's
    get of an ignored result would answer None at once)."""
    client = Client(Settings(broker_url=redis_server.url, queue="embedq.test.batch.nofollow"), follow_results=False)
    store = ResultStore(client.app)
    handle = client.submit(["a"])
    single = client.submit_many([["b"]])[0]
    threading.Timer(0.3, lambda: [store.store(h.id, _payload(v)) for h, v in ((handle, 1), (single, 2))]).start()
    assert float(handle.result(timeout=10)[0, 0]) == 1.0
    assert float(single.result(timeout=10)[0, 0]) == 2.0
    client.close()


def test_a_handle_waits_through_its_clients_collect(redis_server):
    """``handle.result()`` is ``client.collect([handle])``: a result arriving while it waits is read, the record stays
    (``forget=False``) until ``forget()``, a typed error is kept; ``status()`` and ``ready()`` read the record."""
    client = _client(redis_server, "one-waiter")
    store = ResultStore(client.app)
    handle, failing = client.submit_many([["a"], ["b"]])
    threading.Timer(0.3, lambda: store.store(handle.id, _payload(7))).start()
    assert float(handle.result(timeout=10, forget=False)[0, 0]) == 7.0
    key = client.app.backend.get_key_for_task(handle.id)
    assert client.redis().exists(key) and handle.status() == "SUCCESS" and handle.ready()
    handle.forget()
    assert not client.redis().exists(key) and handle.forgotten
    store.store(failing.id, errors.BackendError("the model failed"))
    assert failing.status() == "FAILURE" and failing.ready()
    with pytest.raises(errors.BackendError):
        failing.result(timeout=10)
    assert isinstance(failing.error, errors.BackendError) and not client.pending
    client.close()


def test_a_short_wait_sends_a_job_with_no_result_long_after_sending_again(redis_server):
    """Every wait, however short (``collect`` as ``handle.result``), sends a job with no result ``resend_after`` after
    sending again under its id: a message lost in kombu's BRPOP window is not waited for in vain."""
    client = _client(redis_server, "resend", resend_after=0.05)
    r, queue = client.redis(), client.settings.queue_name
    r.delete(queue)
    handles = client.submit_many([["a"], ["b"]])
    time.sleep(0.1)
    out = client.collect(handles, timeout=0.05, return_exceptions=True)
    assert all(isinstance(o, errors.JobTimeout) for o in out) and [h.resent for h in handles] == [1, 1]
    copies = [json.loads(m)["headers"] for m in r.lrange(queue, 0, 1)]
    assert r.llen(queue) == 4 and {c["id"] for c in copies} == {h.id for h in handles}
    assert all(c[RESENT_HEADER] == 1 and c[CLIENT_HEADER] == client.client_id for c in copies)
    time.sleep(0.1)
    with pytest.raises(errors.JobTimeout):
        handles[0].payload(timeout=0.05)
    assert [h.resent for h in handles] == [2, 1]
    r.delete(queue)
    client.close()


def test_a_batch_larger_than_one_push_keeps_its_order(redis_server):
    """(What a batch costs the producer is measured by bench/pipeline.py, not here.)"""
    client = _client(redis_server, "cpu")
    jobs = [[f"a short text number {i}"] for i in range(2000)]
    client.submit_many(jobs[:100])
    handles = client.submit_many(jobs)
    # more messages than one LPUSH carries (PUSH_MESSAGES): still in submission order, each job once
    sent = [json.loads(m)["headers"]["id"] for m in reversed(client.redis().lrange(client.settings.queue_name, 0, -1))]
    assert len(jobs) > direct_module.PUSH_MESSAGES and sent[100:] == [h.id for h in handles]
    client.redis().delete(client.settings.queue_name)
    client.close()
