"""Liveness that tells the truth: a worker whose inference thread dies or hangs stops serving and exits.

Its heartbeat, its registry record and its consumer live on other threads, so without a watchdog a worker
whose inference thread is gone would take jobs forever and answer none, while ``/health`` says 200. The
faults are injected by tests/controlled_worker.py (``EMBEDQ_TEST_FAULT``): a text holding ``FAULT_IN_MODEL``
kills (or hangs) the inference thread in the model. What the worker promises, checked here on states:

- it exits with status 70 (``stopping.EXIT_FAILED``), for a supervisor to restart it;
- its registry record is gone when it has exited (``/health`` reads the registry);
- the messages it held go back to the queue; those of the micro-batch in the model count as one delivery that
  ended with the worker dead (they run alone next time, and a job that kills every worker it meets is
  dead-lettered after ``max_attempts``), the others are marked handed back and run as usual.
"""

from __future__ import annotations

import uuid

import pytest
import redis
from celery.result import AsyncResult
from conftest import CONTROLLED_WORKER, WorkerHandle, closed_gate

from embedq import errors, monitor
from embedq.keys import ATTEMPTS_KEY, RETURNED_KEY
from embedq.protocol import TASK_NAME
from embedq.settings import Settings
from embedq.workers.stopping import EXIT_FAILED

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

FAULT = "FAULT_IN_MODEL"


def _settings(redis_server, name: str, **extra) -> Settings:
    # One item per micro-batch: the poison job's micro-batch holds it alone, so the test knows which jobs were
    # in the model when the thread died. A named runtime: no measurement at start.
    return Settings(broker_url=redis_server.url, queue=f"embedq.test.live-{name}-{uuid.uuid4().hex[:6]}",
                    max_batch_requests=1, max_attempts=2, linear_kernel="torch", **extra)


def _faulty(settings: Settings, log, fault: str, gated: bool = False) -> WorkerHandle:
    env = {"EMBEDQ_TEST_FAULT": fault}
    if gated:
        env["EMBEDQ_TEST_GATE"] = f"{settings.queue_name}.gate"
    return WorkerHandle(settings, log, command=CONTROLLED_WORKER, extra_env=env)


def _send(settings: Settings, app, text: str) -> str:
    job_id = str(uuid.uuid4())
    app.send_task(TASK_NAME, args=[[text]], queue=settings.queue_name, task_id=job_id)
    return job_id


def _exits(worker: WorkerHandle) -> int:
    code = worker.proc.wait(timeout=120)  # bounds a worker that never notices: the assertion below says so
    return code


def _registered(client, worker: WorkerHandle) -> bool:
    return any(f"-{worker.proc.pid}@" in record.get("hostname", "") for record in monitor.live_workers(client))


def test_a_dead_inference_thread_stops_the_worker_and_only_its_batch_is_blamed(redis_server, tmp_path):
    settings = _settings(redis_server, "die")
    r = redis.Redis.from_url(settings.broker_url)
    first = _faulty(settings, tmp_path / "first.log", "die", gated=True)
    app = first.client.app
    try:
        with closed_gate(settings):
            poison = _send(settings, app, f"this text kills the thread {FAULT}")
            good = [_send(settings, app, f"an innocent job {i}") for i in range(4)]
            first.wait_until(lambda s: s["jobs_received"] >= 5, "all five jobs held")
            assert _registered(r, first)
        assert _exits(first) == EXIT_FAILED, first.log()[-3000:]
        log = first.log()
        assert "the embedq-inference thread has died" in log
        # Gone from the registry (and so from /health) as soon as it has exited.
        assert not _registered(r, first)
        # Everything it held is back in the queue; nothing stays in the unacked hash.
        unfinished = [job_id for job_id in good if not AsyncResult(job_id, app=app).ready()]
        assert r.hlen("unacked") == 0
        assert r.llen(settings.queue_name) == len(unfinished) + 1  # (a fetch in flight must not take one away)
        # Only the poison job's delivery counts as one that ended with the worker dead.
        assert not r.exists(RETURNED_KEY.format(poison))
        assert all(r.exists(RETURNED_KEY.format(job_id)) for job_id in unfinished)
    finally:
        first.stop()

    # A second worker with the same fault: the poison job comes back as a suspect and runs alone (counted), and
    # takes this worker down too; the innocent jobs are still not blamed. Gated until it has answered as ready: it
    # takes the waiting poison job at once and could die before its handle saw it up (seen once in CI). The gate
    # holds a suspect's run alone too: the worker holds the poison job, alive, until the gate opens.
    with closed_gate(settings):
        second = _faulty(settings, tmp_path / "second.log", "die", gated=True)
        try:
            second.wait_until(lambda s: s["jobs_received"] >= 1, "the poison job received, held behind the gate")
            assert second.proc.poll() is None and second.stats()["isolated_runs"] == 0, second.log()[-3000:]
        except BaseException:
            second.stop()
            raise
    try:
        assert _exits(second) == EXIT_FAILED
        assert r.exists(ATTEMPTS_KEY.format(poison))
        assert not any(r.exists(ATTEMPTS_KEY.format(job_id)) for job_id in good), "an innocent job was blamed"
    finally:
        second.stop()

    # max_attempts=2 deliveries ended with a dead worker: the next one dead-letters the poison job instead of
    # running it, and every innocent job is answered.
    third = WorkerHandle(settings, tmp_path / "third.log")
    try:
        with pytest.raises(errors.DeadLetter):
            AsyncResult(poison, app=app).get(timeout=120)
        for job_id in good:
            assert AsyncResult(job_id, app=app).get(timeout=120)["usage"]["texts"] == 1
        assert third.stats()["isolated_runs"] == 0
        assert third.proc.poll() is None
    finally:
        third.stop()


def test_a_hung_inference_thread_stops_the_worker_after_the_stall_timeout(redis_server, tmp_path):
    # the fake model (embedq/backends/fake.py): the watchdog is under test (a dead thread: the real model, above)
    settings = _settings(redis_server, "stall", stall_timeout=2.0, model="embedq-fake", allow_fake_backend=True)
    r = redis.Redis.from_url(settings.broker_url)
    worker = _faulty(settings, tmp_path / "stall.log", "stall")
    app = worker.client.app
    try:
        hung = _send(settings, app, f"this text hangs the model {FAULT}")
        assert _exits(worker) == EXIT_FAILED
        assert "has made no progress" in worker.log()
        assert not _registered(r, worker)
        assert r.hlen("unacked") == 0 and r.llen(settings.queue_name) == 1
    finally:
        worker.stop()
    # A worker without the fault runs it (alone: its last delivery ended with a worker gone).
    healthy = WorkerHandle(settings, tmp_path / "healthy.log")
    try:
        assert AsyncResult(hung, app=app).get(timeout=120)["usage"]["texts"] == 1
        assert healthy.stats()["isolated_runs"] == 1
    finally:
        healthy.stop()
