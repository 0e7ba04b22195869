"""Workers that die or stop: SIGKILL mid-run, a poison job, SIGTERM, and leases on long-held messages.

Real redis-server, real worker processes. ``visibility_timeout=5`` so a dead worker's messages come back
within seconds (leases are renewed every 1.25 s, the restore sweep runs as often).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from conftest import FAKE, WorkerHandle, gated_handle

from embedq import errors
from embedq.broker import make_app
from embedq.producers.client import Client
from embedq.producers.embedded import RedisServer, start_worker, stop_worker
from embedq.protocol import decode_result
from embedq.settings import Settings
from embedq.workers.delivery import Ledger, Verdict, dead_letters

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

CRASHY = [sys.executable, str(Path(__file__).with_name("crashy_worker.py"))]


#: The deterministic fake model (embedq/backends/fake.py) for the tests of what happens to messages; a SIGKILLed
#: worker (test_a) and a SIGTERM mid-run (whose handed-back buffer needs the real model's pace) keep the real one.


def _settings(redis_server, **overrides) -> Settings:
    # online_queue_limit=0: these tests flood the queue on purpose (backpressure is tested in test_traffic.py)
    return Settings(broker_url=redis_server.url, queue=f"embedq.test.{uuid.uuid4().hex[:8]}",
                    visibility_timeout=5, online_queue_limit=0, **overrides)


class Recorder:
    """Every record any worker stores (Celery publishes each on ``celery-task-meta-<id>``), by job id."""

    def __init__(self, url: str) -> None:
        self.records: dict[str, list[dict]] = {}
        self._pubsub = redis.Redis.from_url(url).pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe("celery-task-meta-*")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self._pubsub.get_message(timeout=0.2)
            if msg and msg["type"] == "pmessage":
                meta = json.loads(msg["data"])
                self.records.setdefault(meta["task_id"], []).append(meta)

    def close(self) -> None:
        time.sleep(0.5)
        self._stop.set()
        self._thread.join()
        self._pubsub.close()


def _short_texts(corpus: list[str], n: int) -> list[str]:
    short = [t for t in corpus if len(t) < 400]
    return [f"{short[i % len(short)]} #{i}" for i in range(n)]


@pytest.fixture
def own_redis():
    """A Redis of the test's own: killed workers leave unacknowledged entries that no other test should see."""
    with RedisServer() as server:
        yield server


#: Jobs queued before each worker starts, then kept queued or held by it while the test waits to kill it;
#: doubled whenever the worker ran dry between two looks (a faster machine), so every kill lands mid-run.
BACKLOG = 100


def test_a_worker_sigkilled_three_times_loses_nothing_and_no_job_has_two_results(own_redis, tmp_path, corpus):
    """Three SIGKILLs, each after the live worker made progress and while it holds jobs.

    Work goes in in waves (not a fixed amount up front, which a fast machine drains before the third kill): one
    queued before each worker starts, more whenever the backlog in front of the live worker runs low, so the
    test paces itself to the worker's throughput on fast and slow machines alike.
    """
    redis_server = own_redis
    settings = _settings(redis_server, max_attempts=10)
    log = tmp_path / "worker.log"
    texts = _short_texts(corpus, 20_000)  # a pool: only what the pacing needs is submitted
    recorder = Recorder(redis_server.url)
    r = redis.Redis.from_url(redis_server.url)
    # unacked_index scores are the time.time() of each delivery or lease renewal: the entries scored after a
    # worker's start are the messages that worker holds, not its killed predecessor's (back after 5 s)
    alive_since = time.time()
    client = Client(settings)
    handles: list = []
    wave = BACKLOG

    def submit_wave() -> None:
        handles.extend(client.submit([t]) for t in texts[len(handles):len(handles) + wave])

    submit_wave()
    worker = WorkerHandle(settings, log)
    submitting = threading.Event()  # cleared once no more waves come (or the test failed): the collector ends
    submitting.set()
    try:
        vectors: dict[str, np.ndarray] = {}
        failures: list[BaseException] = []

        def collect() -> None:  # in submission order, following `handles` as waves are added
            try:
                i = 0
                while i < len(handles) or submitting.is_set():
                    if i == len(handles):
                        time.sleep(0.05)
                        continue
                    vectors[handles[i].id] = handles[i].result(timeout=180)
                    i += 1
            except BaseException as exc:
                failures.append(exc)

        collector = threading.Thread(target=collect)
        collector.start()
        held_at_kill = []
        for _ in range(3):  # kill it while it holds jobs, each time after it made some progress
            since = len(recorder.records)  # jobs with a stored result
            deadline = time.monotonic() + 120
            while True:
                assert not failures, failures
                held = r.zcount("unacked_index", f"({alive_since}", "+inf")
                if len(recorder.records) >= since + 30 and held >= 20:
                    break
                ahead = r.llen(settings.queue_name) + held
                if ahead == 0 and len(recorder.records) > since:  # it drained everything between two looks
                    wave *= 2
                if ahead < wave // 2:
                    submit_wave()
                assert time.monotonic() < deadline and collector.is_alive(), "no progress to kill into"
                time.sleep(0.05)
            held_at_kill.append(held)
            os.kill(worker.proc.pid, signal.SIGKILL)
            worker.proc.wait()
            alive_since = time.time()
            worker.client.close()
            submit_wave()  # queued while no worker runs: the next one starts with a backlog
            worker = WorkerHandle(settings, log)
        submitting.clear()
        collector.join(300)
        assert not failures, failures
        assert len(vectors) == len(handles)
        assert len(held_at_kill) == 3 and min(held_at_kill) > 0, held_at_kill
        # every job ended with a correct result: the same as the text embedded again now, in other batches
        texts = texts[:len(handles)]
        reference = np.concatenate([client.embed(texts[k:k + 64]) for k in range(0, len(texts), 64)])
        got = np.concatenate([vectors[h.id] for h in handles])
        assert np.abs(got - reference).max() <= 1e-6
        assert not dead_letters(redis.Redis.from_url(redis_server.url))
    finally:
        submitting.clear()
        recorder.close()
        worker.stop()
        client.close()
    # none with two different results: every record stored for a job is a success with the same vectors
    ids = {h.id for h in handles}
    assert ids <= set(recorder.records)
    for job_id in ids:
        stored = recorder.records[job_id]
        assert all(r["status"] == "SUCCESS" for r in stored), stored
        first = decode_result(stored[0]["result"])[0]
        for other in stored[1:]:
            assert np.abs(decode_result(other["result"])[0] - first).max() <= 1e-6


def _supervise(settings: Settings, log: Path, until, timeout: float) -> int:
    """Keep one crashy worker running (restart it whenever it dies) until ``until()``; return the deaths."""
    deaths = 0
    proc = start_worker(settings, log_path=log, command=CRASHY)
    deadline = time.monotonic() + timeout
    try:
        while not until():
            assert time.monotonic() < deadline, f"gave up after {deaths} worker deaths"
            if proc.poll() is not None:
                assert proc.returncode == -signal.SIGKILL, proc.returncode
                deaths += 1
                proc = start_worker(settings, log_path=log, command=CRASHY)
            time.sleep(0.2)
        assert proc.poll() is None
        return deaths
    finally:
        stop_worker(proc)


def test_a_resent_copy_of_a_suspect_job_stays_a_suspect(redis_server):
    """A producer resends a job that has no result after resend_after; if that job has already killed a
    worker, the copy must run alone and be counted like the redelivered original (else a poison job's copy
    takes a worker down in a batch, uncounted)."""
    app = make_app(Settings(broker_url=redis_server.url))
    ledger = Ledger(app.backend, max_attempts=3)
    job = str(uuid.uuid4())
    assert ledger.check(job, redelivered=False) == Verdict()  # resent, no history: a plain delivery
    assert ledger.check(job, redelivered=True) == Verdict(suspect=True, crashes=1)  # back after a death
    ledger.count_run(job, 1)  # it runs alone, and the worker dies in that run
    assert ledger.check(job, redelivered=False) == Verdict(suspect=True, crashes=2)  # a resent copy
    assert ledger.check(job, redelivered=True) == Verdict(suspect=True, crashes=2)  # the original
    app.close()


def _settled(handle) -> bool:
    """Like a producer waiting on the job (which resends a job lost in the BRPOP window after
    resend_after), but for 10 ms at most."""
    if handle.ready():
        return True
    try:
        handle.payload(timeout=0.01)
    except errors.JobTimeout:
        return False
    except errors.EmbedqError:
        pass
    return True


def test_d_a_poison_job_is_dead_lettered_after_max_attempts_and_the_others_succeed(own_redis, tmp_path):
    redis_server = own_redis
    # resend_after=30: a copy the client resends before the killed worker's messages come back (visibility 5 s)
    # would reach a new worker unmarked and crash it once more, uncounted; later copies meet the poison's record.
    settings = _settings(redis_server, max_attempts=3, resend_after=30, **FAKE)
    client = Client(settings)
    before = [client.submit([f"an ordinary text {i}"]) for i in range(40)]
    poison = client.submit(["this text is POISON to the model"])
    after = [client.submit([f"another ordinary text {i}"]) for i in range(40)]
    log = tmp_path / "worker.log"
    try:
        deaths = _supervise(settings, log, until=lambda: all(_settled(h) for h in [*before, poison, *after]),
                            timeout=240)
        with pytest.raises(errors.DeadLetter, match="3 times"):
            poison.result(timeout=5)
        assert deaths == 3  # it took the worker down max_attempts times, then never again
        for handle in [*before, *after]:  # bystanders ran alone after the first crash, and succeeded
            assert handle.result(timeout=5).shape == (1, 32)
        [record] = [r for r in dead_letters(redis.Redis.from_url(redis_server.url)) if r["id"] == poison.id]
        assert record["crashes"] == 3 and record["queue"] == settings.queue_name and record["texts"] == 1
        assert "POISON" not in log.read_text()
    finally:
        client.close()


def test_sigterm_finishes_the_batch_hands_the_buffer_back_and_exits_in_bounded_time(redis_server, tmp_path,
                                                                                    corpus):
    from embedq import monitor

    settings = _settings(redis_server, shutdown_timeout=20)
    log = tmp_path / "worker.log"
    texts = _short_texts(corpus, 1500)
    client = Client(settings)
    r = redis.Redis.from_url(redis_server.url)
    # Every job queued before the worker starts: started first, a fast CPU ran the short texts as they were sent
    # and held nothing when the SIGTERM came (handed back 0).
    handles = [client.submit([t]) for t in texts]
    worker = WorkerHandle(settings, log)
    try:
        # The signal goes as soon as the worker has stored 100 results, read from Redis itself: waited through
        # the Client's result consumer (1,500 subscriptions), the 100th came 5 s late in a full CI run, and the
        # worker had run every job by then.
        first = [f"celery-task-meta-{h.id}" for h in handles[:100]]
        deadline = time.monotonic() + 120
        while r.exists(*first) < len(first) and time.monotonic() < deadline:
            time.sleep(0.005)
        t0 = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        rc = worker.proc.wait(60)
        stopped_in = time.monotonic() - t0
        assert rc == 0 and stopped_in < settings.shutdown_timeout + 10, (rc, stopped_in)
        handed_back = int(worker.log().rsplit("handed ", 1)[1].split()[0])
        assert handed_back > 0
        # nothing in limbo: each job is either stored or back in the queue, and nothing is unacknowledged
        stored = sum(r.exists(f"celery-task-meta-{h.id}") for h in handles)
        assert monitor.unacked_by_queue(r).get(settings.queue_name, 0) == 0  # (kombu's hash is server-wide)
        assert stored + r.llen(settings.queue_name) == len(handles)
        worker.client.close()
        worker = WorkerHandle(settings, log)
        assert all(h.result(timeout=120).shape == (1, 384) for h in handles)
        stats = worker.stats()
        assert stats["redelivered"] >= handed_back
        assert stats["isolated_runs"] == 0  # handed back, not crashed: batched as usual
    finally:
        worker.stop()
        client.close()


def test_held_messages_are_not_redelivered_while_their_worker_lives(redis_server, tmp_path, corpus):
    """Messages held for several visibility timeouts stay their worker's: leases keep every one its own.

    The worker's gate (tests/controlled_worker.py) keeps the jobs held, unrun, for three visibility timeouts: the
    wait is the subject (the timeout is a duration), and no drain rate has to be guessed (a buffer sized from a
    measured rate drained too fast on a quick CPU, or outlived a client's resend on a slow one). The client's
    resend is set beyond the test, so a copy could only come from a redelivery."""
    from embedq import monitor

    settings = _settings(redis_server, resend_after=3600, **FAKE)
    worker = gated_handle(settings, tmp_path / "worker.log")
    client = Client(settings)
    r = redis.Redis.from_url(redis_server.url)
    queue = settings.queue_name
    try:
        with worker.gate_closed():  # held unrun, whatever their length: short ones keep the run after it short
            handles = [client.submit([t]) for t in _short_texts(corpus, 400)]
            worker.wait_until(lambda st: st["held_messages"] == len(handles), "every job held")
            held_since = time.monotonic()
            while time.monotonic() - held_since < 3 * settings.visibility_timeout:
                assert monitor.waiting(r, queue) == 0, "a held message went back to the queue"
                time.sleep(0.5)
            stats = worker.stats()
            assert stats["held_messages"] == len(handles) and monitor.unacked_by_queue(r).get(queue, 0) == len(handles)
            assert stats["redelivered"] == 0 and stats["duplicates"] == 0, stats
        assert all(h.result(timeout=300).shape == (1, 32) for h in handles)
        stats = worker.stats()
        assert stats["redelivered"] == 0 and stats["duplicates"] == 0, stats
        assert stats["peak_held_messages"] == len(handles)  # all of them held together, for three timeouts
    finally:
        worker.stop()
        client.close()
        r.close()


def test_worker_exits_cleanly_when_stopped_with_nothing_held(redis_server, tmp_path):
    settings = _settings(redis_server, **FAKE)
    proc = start_worker(settings, log_path=tmp_path / "w.log")
    client = Client(settings)
    try:
        assert client.embed(["warm"], timeout=120).shape == (1, 32)
    finally:
        client.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert "handed 0 buffered messages back" in (tmp_path / "w.log").read_text()


def test_held_messages_whose_records_a_failover_lost_are_recorded_again_and_a_sigkill_then_loses_none(own_redis,
                                                                                                      tmp_path):
    """A failover to a replica that had not yet received the delivery records of the messages a worker holds
    (replication is asynchronous) leaves them in that worker's memory only: deleted here from kombu's unacked hash and
    index, as the new primary would lack them. The worker records them again at its next lease renewal, so its
    SIGKILL still loses none: another worker gets them after the visibility timeout and answers every job."""
    settings = _settings(own_redis, resend_after=3600, **FAKE)  # no producer resend: only the records can save them
    worker = gated_handle(settings, tmp_path / "worker.log")
    client = Client(settings)
    r = redis.Redis.from_url(own_redis.url)
    rescuer = None
    try:
        with worker.gate_closed():
            handles = [client.submit([f"held through a failover #{i}"]) for i in range(5)]
            worker.wait_until(lambda st: st["held_messages"] == len(handles), "every job held")
            assert r.hlen("unacked") == len(handles)
            r.delete("unacked", "unacked_index")
            deadline = time.monotonic() + 60  # leases are renewed every 1.25 s
            while r.hlen("unacked") < len(handles):
                assert time.monotonic() < deadline, "the lost delivery records were never written again"
                time.sleep(0.05)
            assert r.zcard("unacked_index") == len(handles)
            worker.proc.send_signal(signal.SIGKILL)
            worker.proc.wait()
        rescuer = WorkerHandle(settings, tmp_path / "rescuer.log")
        assert [h.result(timeout=120).shape for h in handles] == [(1, 32)] * len(handles)
        assert "recorded 5 held messages again" in worker.log()
    finally:
        if rescuer is not None:
            rescuer.stop()
        worker.stop()
        client.close()
        r.close()
