"""Queue entries built to stop a worker (issue 35's probe): each is refused or dropped, and the worker goes on.

Every entry is written straight into the worker's Redis list or sent as a hand-built Celery message, bypassing
the producer's checks. After each, the test asserts what the worker promises: a typed error for the job the
entry names (where it names one), the process alive, and good jobs answered.
"""

from __future__ import annotations

import base64
import bz2
import datetime as dt
import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from celery.result import AsyncResult
from conftest import WorkerHandle
from test_bad_input import publish_raw

from embedq import errors
from embedq.batching.traffic import Deadlines
from embedq.protocol import MAX_DEADLINE_SECONDS, TASK_NAME
from embedq.settings import Settings
from embedq.workers.messages import deadline_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
RUNTIME = "torch"  # a named runtime: no measurement at start

MAX_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def worker(redis_server, tmp_path_factory):
    queue = f"embedq.test.{tmp_path_factory.mktemp('hostile').name}"
    settings = Settings(broker_url=redis_server.url, queue=queue, max_message_bytes=MAX_BYTES, linear_kernel=RUNTIME)
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("logs") / "worker.log")
    yield handle
    handle.stop()


def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    return out


def _serving(worker: WorkerHandle, what: str) -> None:
    vectors = worker.client.embed([f"still serving after {what}"], timeout=60)
    assert vectors.shape == (1, 384) and np.isfinite(vectors).all()
    assert worker.proc.poll() is None, f"the worker exited after {what}"


def _envelope(body: str, headers: dict, **properties) -> bytes:
    """A kombu Redis envelope as kombu writes it, with ``properties`` overriding its own."""
    props = {"correlation_id": headers.get("id"), "delivery_mode": 2, "body_encoding": "base64",
             "delivery_info": {"exchange": "", "routing_key": "q"}, "priority": 0,
             "delivery_tag": str(uuid.uuid4()), **properties}
    return json.dumps({"body": base64.b64encode(body.encode()).decode(), "content-encoding": "utf-8",
                       "content-type": "application/json", "headers": headers, "properties": props}).encode()


def _headers(task: str = TASK_NAME, **extra) -> dict:
    job_id = str(uuid.uuid4())
    return {"lang": "py", "task": task, "id": job_id, "root_id": job_id, "parent_id": None, "group": None,
            "retries": 0, "eta": None, "expires": None, "timelimit": [None, None], **extra}


# -- finding 1: a deadline no wait can hold ---------------------------------------------------------------------

def test_a_far_expires_is_clamped_to_the_longest_deadline():
    """Whatever ``expires`` a message carries, the worker's deadline is at most MAX_DEADLINE_SECONDS away."""
    now = time.monotonic()
    for expires in (dt.datetime(9999, 12, 31, tzinfo=dt.timezone.utc),
                    dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=1e10)):
        deadline = deadline_of(expires)
        assert deadline is not None and deadline <= time.monotonic() + MAX_DEADLINE_SECONDS
        assert deadline >= now + MAX_DEADLINE_SECONDS - 60


def test_a_finished_jobs_deadline_wakes_no_one():
    class Job:
        done = False

    deadlines, finished, waiting = Deadlines(), Job(), Job()
    finished.done = True
    deadlines.add(5.0, finished)
    deadlines.add(9.0, waiting)
    assert deadlines.next_deadline(lambda job: job.done) == 9.0
    waiting.done = True
    assert deadlines.next_deadline(lambda job: job.done) is None


def test_a_job_expiring_in_a_billion_seconds_leaves_the_worker_serving(worker):
    """The probe's X-Embedq-Deadline: 1e10, sent as a raw message (a producer refuses it): the job runs, and the
    idle inference thread then waits on its deadline. It used to die there (OverflowError in the wait)."""
    app, queue = worker.client.app, worker.settings.queue_name
    for expires in ("9999-12-31T23:59:59+00:00",
                    (dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=100_000)).isoformat()):
        job_id = str(uuid.uuid4())
        app.send_task(TASK_NAME, args=[["a far deadline"]], queue=queue, task_id=job_id, expires=expires)
        AsyncResult(job_id, app=app).get(timeout=60)
        _serving(worker, f"a job expiring at {expires}")
        _serving(worker, "a second job")


# -- finding 2: nesting --------------------------------------------------------------------------------------------

def test_a_deeply_nested_queue_entry_is_dropped(worker):
    client = redis.Redis.from_url(worker.settings.broker_url)
    for depth in (5_000, 100_000):
        client.lpush(worker.settings.queue_name, "[" * depth + "]" * depth)
        client.lpush(worker.settings.queue_name, '{"a":' * depth + "1" + "}" * depth)
        _serving(worker, f"entries nested {depth} deep")
    assert "dropped a queue entry that is not a task message" in worker.log()


# -- finding 3: compression bombs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("compression", ["application/x-bz2", "bzip2", "application/x-gzip", "application/x-lzma"])
def test_a_compression_bomb_is_refused_before_it_is_inflated(worker, compression):
    """1 GiB of zeros in a few kilobytes: refused with message_too_large, and the worker's peak memory does not
    grow by anything near it (kombu alone would inflate the whole body before any size check)."""
    import lzma
    import zlib
    block = b"\0" * (8 << 20)
    stream = {"application/x-bz2": bz2.compress, "bzip2": bz2.compress,
              "application/x-gzip": zlib.compress, "application/x-lzma": lzma.compress}[compression](block)
    bomb = stream * 128 if compression != "application/x-gzip" else zlib.compress(block * 32, 9)
    before = _status(worker.proc.pid)
    job_id = publish_raw(worker.client.app, worker.settings.queue_name, bomb, content_type="application/json",
                         content_encoding="binary", compression=compression)
    with pytest.raises(errors.MessageTooLarge):
        AsyncResult(job_id, app=worker.client.app).get(timeout=60)
    after = _status(worker.proc.pid)
    assert after["VmHWM"] - before["VmHWM"] < 64 << 20, (before, after)
    _serving(worker, f"a {compression} bomb")


def test_a_compressed_job_within_bounds_is_served(worker):
    """Celery clients may use task_compression: a compressed job within the size bound is run as any other."""
    for compression in ("bzip2", "gzip", "application/x-lzma"):
        job_id = str(uuid.uuid4())
        worker.client.app.send_task(TASK_NAME, args=[["a compressed job"]], queue=worker.settings.queue_name,
                                    task_id=job_id, compression=compression)
        payload = AsyncResult(job_id, app=worker.client.app).get(timeout=60)
        assert payload["usage"]["texts"] == 1


# -- finding 4: Celery's built-in tasks ---------------------------------------------------------------------------

@pytest.mark.parametrize("task,args", [
    ("celery.accumulate", [[1, 2, 3], {}, {}]),
    ("celery.backend_cleanup", [[], {}, {}]),
    ("celery.chord_unlock", [["never-ready"], {"callback": {"task": "celery.accumulate", "args": []}}, {}]),
    ("celery.group", [[], {"tasks": [], "partial_args": [], "group_id": "x"}, {}]),
    ("celery.map", [[], {"task": {"task": "celery.accumulate"}, "it": [1]}, {}]),
])
def test_celery_builtin_tasks_are_refused_on_embedq_queues(worker, task, args):
    job_id = publish_raw(worker.client.app, worker.settings.queue_name, json.dumps(args), task=task)
    with pytest.raises(errors.InvalidMessage, match="unknown task"):
        AsyncResult(job_id, app=worker.client.app).get(timeout=60)
    assert f"refused message {job_id}" in worker.log()
    _serving(worker, task)


# -- finding 9: envelope fields of the wrong type -----------------------------------------------------------------

@pytest.mark.parametrize("properties", [{"delivery_tag": None}, {"delivery_tag": 7}, {"delivery_tag": ""},
                                        {"delivery_info": []}, {"body_encoding": 3}])
def test_an_envelope_with_fields_of_the_wrong_type_is_dropped_without_a_reconnect(worker, properties):
    client = redis.Redis.from_url(worker.settings.broker_url)
    lost = worker.log().count("Connection to broker lost")
    headers = _headers()
    client.lpush(worker.settings.queue_name, _envelope(json.dumps([["x"], {}, {}]), headers, **properties))
    _serving(worker, f"an envelope with {properties}")
    assert worker.log().count("Connection to broker lost") == lost
    held = [json.loads(raw)[0]["headers"].get("id") for raw in client.hvals("unacked")]
    assert headers["id"] not in held, "a dropped entry must not stay in the unacked hash"


@pytest.mark.parametrize("headers", [{"task": ["a", "list"]}, {"task": {"a": 1}}, {"id": ["x"]}, {"id": 5},
                                     {"expires": "not a date"}, {"expires": 1e308}, {"eta": "x"},
                                     {"timelimit": "x"}, {"retries": "x"}])
def test_headers_of_the_wrong_type_are_refused(worker, headers):
    client = redis.Redis.from_url(worker.settings.broker_url)
    client.lpush(worker.settings.queue_name, _envelope(json.dumps([["x"], {}, {}]), {**_headers(), **headers}))
    _serving(worker, f"headers {headers}")


def test_a_shadow_header_changes_no_kind_and_an_id_redis_cannot_key_is_refused(worker):
    """``shadow`` is Celery's display name: an embed message stays an embed job whatever it says. A lone surrogate
    as the job id cannot be written to Redis: the message is refused and acknowledged (it used to be held
    forever, its result unstorable, its slot of the prefetch window never released)."""
    client = redis.Redis.from_url(worker.settings.broker_url)
    headers = _headers(shadow="embedq.tokenize")
    client.lpush(worker.settings.queue_name, _envelope(json.dumps([["a shadowed job"], {}, {}]), headers))
    payload = AsyncResult(headers["id"], app=worker.client.app).get(timeout=60)
    assert "vectors" in payload and "tokens" not in payload, sorted(payload)
    bad = _headers(id="\ud800")
    bad_entry = json.dumps({**json.loads(_envelope(json.dumps([["x"], {}, {}]), {**bad, "id": "ID"})),
                            "headers": {**bad}}, ensure_ascii=True)
    for _ in range(3):
        client.lpush(worker.settings.queue_name, bad_entry)
    _serving(worker, "messages whose id is a lone surrogate")
    held = [json.loads(raw)[0]["headers"].get("id") for raw in client.hvals("unacked")]
    assert "\ud800" not in held
