"""The canvas thread: sends the Celery canvas work of stored jobs, off the results thread.

The results thread stores a batch of records (each job with canvas work gets its pending marker in the same step,
``results.py``) and hands the jobs with canvas work over (:meth:`CanvasThread.put`); the other jobs of the batch
are queued for their acks at once. This thread sends each job's work (``workers/canvas.py``: bounded in bytes,
riding out a broker outage, failing what the broker refuses), deletes the markers of the jobs done, and only then
queues those jobs for their acks: a job is acknowledged after its record *and* its canvas work, and a worker killed
in between leaves the marker, so the job's redelivery sends the work (:meth:`CanvasThread.resend`, from the consumer
thread, goes through here too). Stopping with the broker away leaves the rest unsent and marked, unacknowledged.

The hand-off is bounded by the result bytes it holds (:data:`HANDOFF_RESULTS` results of ``max_result_bytes``): past
it the results thread waits, beating while this thread makes progress, so neither hides a stall from the
watchdog (:meth:`CanvasThread.health`: no progress for ``stall_timeout`` while work waits).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from embedq import errors
from embedq.broker import BROKER_ERRORS, redis_client
from embedq.protocol import result_size
from embedq.results import ResultStore
from embedq.settings import Settings
from embedq.workers import canvas
from embedq.workers.jobs import Job
from embedq.workers.stats import Stats

log = logging.getLogger(__name__)

#: Results of max_result_bytes the hand-off holds before the results thread waits for room.
HANDOFF_RESULTS = 2
#: How a redelivered job's work is marked in the hand-off (sent for its stored record, acknowledged as stored).
RESEND = "resend"


class CanvasThread:
    """Canvas work of stored jobs on its own thread (``put``, ``resend``; ``start``, ``close``, ``join``, ``health``).

    ``finished`` is the worker's queue of jobs to acknowledge, ``stopping`` says the worker is stopping (a broker
    error then leaves the work unsent), ``already_stored`` is the outcome a resent job is acknowledged with."""

    def __init__(self, settings: Settings, stats: Stats, finished: Any, stopping: Any, already_stored: str) -> None:
        self.settings = settings
        self.stats = stats
        self.finished = finished
        self.stopping = stopping
        self.already_stored = already_stored
        self.limit = HANDOFF_RESULTS * settings.max_result_bytes
        self._entries: collections.deque[tuple[list[tuple[Job, Any, Any]], int] | None] = collections.deque()
        self._held = 0  # result bytes in the hand-off
        self._cond = threading.Condition()
        self._redis: Any = None
        self.beat = time.monotonic()
        self.busy = False
        self.thread = threading.Thread(target=self._loop, name="embedq-canvas", daemon=True)

    def start(self) -> CanvasThread:
        self.thread.start()
        return self

    # -- hand-off ------------------------------------------------------------------------------------------------
    def put(self, jobs: list[tuple[Job, Any, bool]], on_wait: Any = None) -> None:
        """Results thread: stored jobs (job, outcome, whether this worker wrote the record) whose canvas work is to
        be sent. Waits while the hand-off holds more than its bound (``on_wait()`` each second, while this thread
        makes progress)."""
        size = sum(result_size(outcome) for _, outcome, _ in jobs if isinstance(outcome, dict))
        with self._cond:
            while self._entries and self._held + size > self.limit and self.thread.is_alive():
                self._cond.wait(1.0)
                if on_wait is not None and time.monotonic() - self.beat < self.settings.stall_timeout:
                    on_wait()
            self._ready_until_now()
            self._entries.append((jobs, size))
            self._held += size
            self._cond.notify_all()

    def resend(self, job: Job, record: dict[str, Any] | None) -> None:
        """Consumer thread: a redelivered job whose record is stored and whose canvas work is still marked pending
        (its worker died after storing and before deleting the marker): its work is sent for the stored outcome,
        then the job is acknowledged as already stored."""
        with self._cond:
            self._ready_until_now()
            self._entries.append(([(job, record, RESEND)], 0))
            self._cond.notify_all()

    def _ready_until_now(self) -> None:
        """Under ``_cond``, as work is handed over: an idle thread was ready until now, so a stall is counted from
        here, not from the last work it did (a worker idle past ``stall_timeout`` is not stopped by its next job)."""
        if not self.busy and not self._entries:
            self.beat = time.monotonic()

    def close(self) -> None:
        """The thread stops once it has sent (or, stopping with the broker away, left marked) what it was given."""
        with self._cond:
            self._entries.append(None)
            self._cond.notify_all()

    def join(self, timeout: float | None) -> None:
        if self.thread.is_alive():
            self.thread.join(timeout)

    def health(self, stall_timeout: float) -> str | None:
        """Why this thread can no longer do its work (dead, or no progress for ``stall_timeout`` while work
        waits), or None."""
        if self.thread.ident is not None and not self.thread.is_alive():
            return f"the {self.thread.name} thread has died"
        idle = time.monotonic() - self.beat
        if idle > stall_timeout and (self.busy or self._entries):
            return (f"the {self.thread.name} thread has made no progress for {idle:.0f}s while canvas work waits "
                    f"(EMBEDQ_STALL_TIMEOUT={stall_timeout:g})")
        return None

    # -- the thread ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self.busy = False
                while not self._entries:
                    self._cond.wait()
                entry = self._entries.popleft()
                self.beat, self.busy = time.monotonic(), True
            if entry is None:
                return
            jobs, size = entry
            try:
                self._send(jobs)
            except Exception:  # never let the canvas thread die (the jobs stay unacknowledged: redelivered)
                log.exception("sending the canvas work of %d job(s) failed", len(jobs))
            with self._cond:
                self._held -= size
                self._cond.notify_all()

    def _send(self, jobs: list[tuple[Job, Any, Any]]) -> None:
        done: list[tuple[Job, Any]] = []
        sent: list[str] = []
        app = None
        for job, outcome, how in jobs:
            app = job.context.primary.task.app
            try:
                if how == RESEND:
                    if outcome is not None:
                        canvas.dispatch(app, job.canvas, outcome.get("result"), self._sending(app))
                        log.info("sent the canvas work of job %s, redelivered after its worker stored it and died",
                                 job.id)
                elif how:
                    canvas.dispatch(app, job.canvas, outcome, self._sending(app))
                else:
                    canvas.chord_part(app, job.canvas, ResultStore(app).outcome(job.id), self._sending(app))
            except canvas.Unsent as exc:
                log.warning("could not send the canvas work of job %s before stopping (%s): it stays marked and is "
                            "sent on its redelivery", job.id, exc)
                continue  # left unacknowledged: handed back, and its redelivery sends the work (marker)
            except canvas.Failed as exc:
                log.warning("the canvas work of job %s failed for good: %s", job.id, exc.error.message)
                self.stats.add(canvas_failures=1)
            except BROKER_ERRORS as exc:  # reading the stored outcome: the redelivery will do it
                log.warning("could not send the canvas work of job %s (%s)", job.id, type(exc).__name__)
                continue
            self.beat = time.monotonic()
            if how is True or how == RESEND:
                sent.append(job.id)
            done.append((job, self.already_stored if how == RESEND else outcome))
        if sent and app is not None:
            try:
                ResultStore(app).canvas_sent(sent)
            except BROKER_ERRORS as exc:  # only a redelivery of these jobs (their worker dying now) would send twice
                log.warning("could not clear the canvas markers of %d job(s) (%s)", len(sent), type(exc).__name__)
        now = time.monotonic()
        for job, outcome in done:
            self.finished.put((job, outcome, now))

    def _sending(self, app: Any) -> canvas.Sending:
        settings = self.settings
        return canvas.Sending(max_bytes=settings.canvas_max_bytes, online_queue=settings.queue_name,
                              online_limit=settings.online_queue_limit, stopping=self.stopping,
                              broker_up=self._broker_up, waiting=self._waiting, beat=self._beat)

    def _beat(self) -> None:
        self.beat = time.monotonic()

    def _client(self) -> Any:
        if self._redis is None:
            self._redis = redis_client(self.settings, timeout=2.0)
        return self._redis

    def _broker_up(self) -> bool:
        """A PING answered at once: the broker is up (a send it dropped the connection on was the message's fault)."""
        try:
            return bool(self._client().ping())
        except Exception:
            return False

    def _waiting(self, queue: str) -> int:
        from embedq.monitor import waiting

        try:
            return waiting(self._client(), queue)
        except BROKER_ERRORS as exc:
            raise errors.BrokerUnavailable(f"could not read the depth of {queue}") from exc
