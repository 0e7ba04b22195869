"""Traffic classes with a real worker: online ahead of bulk, deadlines, cancellation, backpressure.

The worker's own counters (``celery inspect embedq_stats``) show what reached the model: ``items``
counts every text run through it, ``items_by_class`` per class. To hold jobs in Redis the worker is
frozen with SIGSTOP (it holds nothing it has not received) and thawed with SIGCONT.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import time

import pytest

from embedq import errors, monitor
from embedq.settings import Settings
from tests.conftest import WorkerHandle, gated_handle

pytestmark = pytest.mark.integration

LIMIT = 4


@pytest.fixture(scope="module")
def tworker(redis_server, tmp_path_factory):
    queue = f"embedq.test.{tmp_path_factory.mktemp('traffic').name}"
    settings = Settings(broker_url=redis_server.url, queue=queue, online_queue_limit=LIMIT, bulk_queue_limit=LIMIT)
    handle = gated_handle(settings, tmp_path_factory.mktemp("logs") / "worker.log")  # a gate, see its first test
    yield handle
    handle.stop()


@contextlib.contextmanager
def frozen(worker: WorkerHandle):
    """The worker process stopped (SIGSTOP): jobs sent now wait in Redis."""
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)


def _long_texts(n: int, tag: str) -> list[str]:
    return [f"{tag} {i} " + " ".join(f"w{(i * 7 + k) % 97}" for k in range(300)) for i in range(n)]


def _stored(worker: WorkerHandle, handle, timeout: float = 60.0) -> dict:
    """The terminal record the worker stored (not the handle's own reading of it)."""
    backend = worker.client.app.backend
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        meta = backend.get_task_meta(handle.id, cache=False)
        if meta["status"] in ("SUCCESS", "FAILURE"):
            return meta
        time.sleep(0.05)
    raise AssertionError(f"no record for {handle.id} after {timeout}s")


def _done_at(worker: WorkerHandle, handle) -> datetime.datetime:
    """When the worker stored the job's terminal record."""
    done = _stored(worker, handle)["date_done"]
    return done if isinstance(done, datetime.datetime) else datetime.datetime.fromisoformat(done)


def _idle(worker: WorkerHandle, timeout: float = 120.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        stats = worker.stats()
        if stats["held_messages"] == 0:
            return stats
        time.sleep(0.2)
    raise AssertionError("the worker did not finish its jobs")


def test_online_jobs_overtake_a_bulk_backlog_and_buffered_jobs_expire_or_cancel_unrun(tworker):
    """With the worker's gate closed (it buffers, runs nothing) a bulk backlog, a bulk job whose deadline then
    passes, one then cancelled and an online query are all held; once it opens, the query runs first and is stored
    before the backlog, and the expired and cancelled jobs never reach the model. States, not durations: on a fast
    machine the backlog would otherwise be done before the others arrive, on a slow one the deadline pass unrun."""
    client = tworker.client
    before = _idle(tworker)
    received = before["jobs_received"]
    with tworker.gate_closed():
        big = client.submit(_long_texts(60, "bulk"), traffic_class="bulk")
        # long texts: none fits beside the short online query in its micro-batch (the bulk fill)
        due = time.monotonic() + 1.0
        doomed = client.submit(_long_texts(3, "due soon"), traffic_class="bulk", deadline=1.0)
        unwanted = client.submit(_long_texts(5, "not needed"), traffic_class="bulk")
        tworker.wait_until(lambda st: st["jobs_received"] - received == 3, "the three bulk jobs held")
        assert unwanted.cancel() is True
        tworker.wait_until(lambda st: st["jobs_cancelled"] - before["jobs_cancelled"] == 1, "the cancelled job dropped")
        online = client.submit(["a quick query"])
        tworker.wait_until(lambda st: st["jobs_received"] - received == 4, "the online query held")
        time.sleep(max(due - time.monotonic(), 0.0) + 0.05)  # the deadline is a time: outlived while held
    vectors = online.result(60, forget=False)
    assert vectors.shape == (1, 384)
    assert big.result(120, forget=False).shape == (60, 384)
    # the online query's record was written before the backlog's (the worker's own clock)
    assert _done_at(tworker, online) < _done_at(tworker, big), "the online job waited for the whole bulk backlog"
    with pytest.raises(errors.Cancelled):
        unwanted.result(5)
    assert isinstance(_stored(tworker, doomed)["result"], errors.Expired)  # the worker's own record
    with pytest.raises(errors.Expired):
        doomed.result(60)
    after = _idle(tworker)
    # what reached the model: the big job and the online query, nothing of the expired or cancelled jobs
    assert after["items"] - before["items"] == 61
    bulk_before = before["items_by_class"].get("bulk", 0)
    assert after["items_by_class"]["bulk"] - bulk_before == 60
    assert after["errors_by_code"].get("expired", 0) - before["errors_by_code"].get("expired", 0) == 1
    assert after["jobs_cancelled"] - before["jobs_cancelled"] == 1
    assert after["items_cancelled"] - before["items_cancelled"] == 5
    assert after["jobs_by_class"]["bulk"] - before["jobs_by_class"].get("bulk", 0) == 3


def test_queued_jobs_that_expire_or_are_cancelled_never_reach_the_model(tworker):
    client = tworker.client
    before = _idle(tworker)
    with frozen(tworker):
        expiring = client.submit(["expires in the queue"], deadline=0.5)
        cancelled = client.submit(["cancelled in the queue"] * 2)
        kept = client.submit(["still wanted"])
        assert cancelled.cancel() is True
        time.sleep(1.0)  # past the first job's deadline, while it waits in Redis
    assert kept.result(60).shape == (1, 384)
    meta = _stored(tworker, expiring)
    assert meta["status"] == "FAILURE" and isinstance(meta["result"], errors.Expired)
    with pytest.raises(errors.Expired):
        expiring.result(5)
    with pytest.raises(errors.Cancelled):
        cancelled.result(5)
    after = _idle(tworker)
    assert after["items"] - before["items"] == 1  # only the kept job's text
    assert after["errors_by_code"].get("expired", 0) - before["errors_by_code"].get("expired", 0) == 1
    assert after["jobs_cancelled"] - before["jobs_cancelled"] == 1
    assert after["jobs_received"] - before["jobs_received"] == 3  # the worker met all three and dropped two
    # a finished job cannot be cancelled any more; its result is intact
    assert kept.cancel() is False


def test_a_cancelled_job_that_already_ran_keeps_its_result(tworker):
    client = tworker.client
    handle = client.submit(["done already"])
    _stored(tworker, handle)
    assert handle.cancel() is False
    assert handle.result(10).shape == (1, 384)


def test_a_full_online_queue_refuses_at_once_and_a_full_bulk_queue_is_waited_out(tworker):
    client = tworker.client
    settings = tworker.settings
    r = client.redis()
    with frozen(tworker):
        online = []
        for _ in range(LIMIT + 2):  # the frozen worker's pending fetch may take one of them out of the list
            if monitor.waiting(r, settings.queue_name) >= LIMIT:
                break
            online.append(client.submit(["online while full"]))
        assert monitor.waiting(r, settings.queue_name) == LIMIT
        t0 = time.monotonic()
        with pytest.raises(errors.Overloaded, match="online jobs waiting") as refused:
            client.submit(["one too many"])
        assert time.monotonic() - t0 < 10.0  # at once: a wait for room would last until the worker thaws
        assert refused.value.retryable and refused.value.http_status == 429

        bulk = [client.submit(["bulk while full"], traffic_class="bulk") for _ in range(LIMIT)]
        assert monitor.waiting(r, settings.bulk_queue_name) == LIMIT
        waits = client.bulk_waits
        late: list = []
        sender = threading.Thread(target=lambda: late.append(client.submit(["bulk, waited"], traffic_class="bulk")))
        sender.start()
        sender.join(1.5)
        assert sender.is_alive(), "a bulk producer must wait while the bulk queue is full, not fail"
    sender.join(60)
    assert not sender.is_alive() and len(late) == 1
    assert client.bulk_waits == waits + 1 and client.bulk_waited_seconds > 0
    for handle in [*online, *bulk, *late]:
        assert handle.result(60).shape == (1, 384)


def test_traffic_class_and_deadline_are_checked_at_the_edge(tworker):
    client = tworker.client
    with pytest.raises(errors.InvalidOption, match="traffic_class"):
        client.submit(["x"], traffic_class="urgent")
    with pytest.raises(errors.InvalidOption, match="deadline"):
        client.submit(["x"], deadline=-1)
    import datetime as dt

    with pytest.raises(errors.Expired):
        client.submit(["x"], deadline=dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1))


def test_bulk_wait_timeout_gives_up_with_overloaded(redis_server):
    """No worker at all on this queue: a bulk producer gives up after bulk_wait_timeout."""
    from embedq.producers.client import Client

    settings = Settings(broker_url=redis_server.url, queue="embedq.test.nobody", bulk_queue_limit=1,
                        bulk_wait_timeout=0.5)
    with Client(settings) as client:
        client.submit(["first"], traffic_class="bulk")
        t0 = time.monotonic()
        with pytest.raises(errors.Overloaded, match="stayed full"):
            client.submit(["second"], traffic_class="bulk")
        assert 0.4 < time.monotonic() - t0 < 5
        client.redis().delete(settings.bulk_queue_name)
