"""Celery's canvas on embedq's jobs, end to end: a user's own tasks on a real plain Celery worker beside a real embedq
worker, one private Redis (broker and result store of both).

``link`` (to the queue the signature names), ``link_error`` on a job failing with a typed error (an old-style errback:
the job id), a 2-step chain (to ``EMBEDQ_CALLBACK_QUEUE``), a chord of 3 embedq jobs, a group collected with
``GroupResult.get()``, and a job whose worker is SIGKILLed between storing its result and acknowledging its message,
whose callback still runs exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from canvas_user_app import RECORDS, make_app
from celery import chain, chord, group
from conftest import WorkerHandle

from embedq import errors
from embedq.keys import CANVAS_KEY
from embedq.producers.embedded import RedisServer
from embedq.protocol import decode_array, decode_result
from embedq.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TESTS = Path(__file__).resolve().parent
KILLER = [sys.executable, str(TESTS / "faults" / "canvas_kill_worker.py")]
TEXTS = ["the cat sat on the mat", "a quick brown fox", "embeddings for everyone"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A private Redis, an embedq worker whose callback queue is the user's (and a second one allowed, for
    signatures that name their queue: EMBEDQ_CALLBACK_QUEUES), and the user's plain Celery worker consuming both."""
    tag = uuid.uuid4().hex[:8]
    queues = {"embedq": f"embedq.test.canvas.{tag}", "user": f"user.{tag}", "named": f"user.named.{tag}"}
    logs = tmp_path_factory.mktemp("canvas-logs")
    with RedisServer() as server:
        # the fake model (embedq/backends/fake.py): the canvas, not the vectors, is under test; the SIGKILL
        # between store and ack runs once against the real model (test_a_job_redelivered..., point "stored")
        settings = Settings(broker_url=server.url, queue=queues["embedq"], callback_queue=queues["user"],
                            callback_queues=queues["named"], visibility_timeout=5, model="embedq-fake",
                            allow_fake_backend=True)
        worker = WorkerHandle(settings, logs / "embedq.log")
        env = {**os.environ, "USER_BROKER_URL": server.url,
               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        node = f"user-{tag}@localhost"
        user = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "canvas_user_app", "worker", "-P", "solo", "-n", node,
             "-Q", f"{queues['user']},{queues['named']}", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "--loglevel", "INFO"],
            cwd=TESTS, env=env, stdout=(logs / "user.log").open("wb"), stderr=subprocess.STDOUT)
        app = make_app(server.url, queues["embedq"])
        try:
            deadline = time.monotonic() + 60
            while not app.control.ping(destination=[node], timeout=0.5):
                assert user.poll() is None and time.monotonic() < deadline, (logs / "user.log").read_text()
            yield {"app": app, "worker": worker, "settings": settings, "queues": queues, "logs": logs,
                   "redis": redis.Redis.from_url(server.url), "url": server.url}
        finally:
            user.terminate()
            user.wait(30)
            worker.stop()
            app.close()


def embed(app, texts, **options):
    return app.signature("embedq.embed", args=[list(texts)], kwargs=options)


def store(app, tag, **options):
    return app.signature("user.store", kwargs={"tag": tag}, **options)


def records(stack, tag, n, timeout=120.0):
    """The user task's records under ``tag`` once there are ``n`` of them (the timeout only bounds a wait for a
    state that never comes)."""
    r, end = stack["redis"], time.monotonic() + timeout
    while r.llen(RECORDS.format(tag)) < n:
        assert time.monotonic() < end, f"{r.llen(RECORDS.format(tag))} of {n} records under {tag}"
        time.sleep(0.05)
    return [json.loads(raw) for raw in r.lrange(RECORDS.format(tag), 0, -1)]


def vectors_of(result) -> np.ndarray:
    """The vectors of a callback's payload: the JSON form (float lists), nothing base64."""
    vectors = result["vectors"]
    assert vectors["encoding"] == "float" and isinstance(vectors["data"][0][0], float), vectors
    return decode_array(vectors)


def test_link_reaches_the_users_task_on_the_queue_its_signature_names(stack):
    app, tag = stack["app"], uuid.uuid4().hex
    job = embed(app, TEXTS[:2]).apply_async(link=store(app, tag, queue=stack["queues"]["named"]))
    (payload,) = records(stack, tag, 1)
    direct, _ = decode_result(job.get(timeout=60))
    assert payload["kind"] == "embed" and payload["usage"]["texts"] == 2
    np.testing.assert_allclose(vectors_of(payload), direct, atol=1e-6)


def test_link_error_gets_the_failed_jobs_id(stack):
    app, tag = stack["app"], uuid.uuid4().hex
    job = embed(app, TEXTS[:1], model="not-this-model").apply_async(link_error=app.signature(
        "user.failed", kwargs={"tag": tag}), link=store(app, f"{tag}-never"))
    assert records(stack, tag, 1) == [job.id]
    with pytest.raises(errors.UnknownModel):
        job.get(timeout=60)
    assert stack["redis"].llen(RECORDS.format(f"{tag}-never")) == 0


def test_a_two_step_chain_goes_to_the_callback_queue(stack):
    app, tag = stack["app"], uuid.uuid4().hex
    result = chain(embed(app, TEXTS), store(app, tag)).apply_async()
    assert result.get(timeout=120) == 3  # the chain's result: the user task's return value
    (payload,) = records(stack, tag, 1)
    assert vectors_of(payload).shape == (3, 32)


def test_a_chord_of_three_jobs_gives_the_body_three_payloads_in_order(stack):
    app, tag = stack["app"], uuid.uuid4().hex
    result = chord([embed(app, [text]) for text in TEXTS], store(app, tag)).apply_async()
    assert result.get(timeout=120) == 3
    (payloads,) = records(stack, tag, 1)
    assert len(payloads) == 3
    client = stack["worker"].client
    for text, payload in zip(TEXTS, payloads):
        np.testing.assert_allclose(vectors_of(payload), client.embed([text]), atol=1e-5)


def test_a_group_of_three_jobs_is_collected_with_group_result_get(stack):
    app = stack["app"]
    results = group(embed(app, [text]) for text in TEXTS).apply_async().get(timeout=120)
    assert [decode_result(r)[0].shape for r in results] == [(1, 32)] * 3
    client = stack["worker"].client
    for text, payload in zip(TEXTS, results):
        np.testing.assert_allclose(decode_result(payload)[0], client.embed([text]), atol=1e-5)


@pytest.mark.parametrize("point", ["stored", "sent"])
def test_a_job_redelivered_after_a_sigkill_between_store_and_ack_calls_its_callback_once(stack, point):
    """The worker dies right after storing the result (``stored``: the callback not yet sent) or right after
    sending it (``sent``: its marker deleted, the message not acknowledged). The message comes back (visibility
    timeout 5 s) to the restarted worker, which finds the record: the callback ran once, not zero or two times."""
    app, tag, r = stack["app"], uuid.uuid4().hex, stack["redis"]
    settings = stack["settings"].model_copy(update={"queue": f"{stack['queues']['embedq']}.kill.{point}"})
    if point == "stored":  # this fault class once against the real model
        settings = settings.model_copy(update={"model": Settings().model, "allow_fake_backend": False})
    job_id = f"kill-{point}-{uuid.uuid4().hex}"
    log = stack["logs"] / f"killer-{point}.log"
    killer = WorkerHandle(settings, log, command=KILLER)
    try:
        embed(app, TEXTS[:1]).apply_async(task_id=job_id, queue=settings.queue_name, link=store(app, tag))
        assert killer.proc.wait(120) == -signal.SIGKILL
        assert app.AsyncResult(job_id).state == "SUCCESS"  # stored before the kill
        assert r.exists(CANVAS_KEY.format(job_id)) == (point == "stored")
        killer.client.close()
        killer = WorkerHandle(settings, log, command=KILLER)
        records(stack, tag, 1)
        # the restarted worker received the redelivered message and found it stored; then the message is
        # acknowledged and nothing is left in flight anywhere (a second callback would have been sent before that
        # ack, and run by the user's worker before the queues are empty)
        killer.wait_until(lambda stats: stats["already_stored"] >= 1, "the redelivered job found stored")
        end = time.monotonic() + 120
        while (r.llen(settings.queue_name) or r.llen(stack["queues"]["user"]) or r.hlen("unacked")
               or r.exists(CANVAS_KEY.format(job_id))):
            assert time.monotonic() < end, "the redelivered job was never acknowledged"
            time.sleep(0.05)
        assert len(records(stack, tag, 1)) == 1
    finally:
        killer.stop()


def test_the_json_form_has_every_array_as_number_lists_and_decodes_to_the_same_arrays():
    from embedq.protocol import decode_arrays, encode_array, json_result

    vectors = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    ids = np.array([3, 1, 4], dtype=np.int32)
    for encoding in ("float32", "float16", "float"):
        payload = {"v": 1, "kind": "x", "vectors": encode_array(vectors, encoding), "ids": encode_array(ids),
                   "labels": ["a", "b"], "usage": {"texts": 2, "tokens": 9}}
        plain = json_result(payload)
        assert json.loads(json.dumps(plain)) == plain  # plain JSON all through
        assert plain["vectors"]["encoding"] == plain["ids"]["encoding"] == "float"
        assert plain["vectors"]["dtype"] == "float32" and plain["ids"]["dtype"] == "int32"
        assert plain["labels"] == ["a", "b"] and plain["usage"] == payload["usage"]
        back, original = decode_arrays(plain), decode_arrays(payload)
        np.testing.assert_array_equal(back["vectors"], original["vectors"])
        np.testing.assert_array_equal(back["ids"], ids)


def test_a_task_that_is_not_an_embedq_kind_is_never_routed_to_an_embedq_queue():
    from embedq.broker import make_app

    settings = Settings(broker_url="redis://127.0.0.1:1/0", queue="embedq.q", callback_queue="user.cb")
    app = make_app(settings)
    route = app.amqp.router.route
    assert route({}, "embedq.embed")["queue"].name == "embedq.q"
    assert route({}, "user.store")["queue"].name == "user.cb"
    assert route({}, "celery.chord_unlock")["queue"].name == "user.cb"
    assert route({"queue": "user.named"}, "user.store")["queue"].name == "user.named"  # the signature's queue wins
