"""Finishing a worker's messages: from a job's stored outcome to its acknowledged message(s).

:class:`Acks` is the part of :class:`~embedq.workers.consumer.Worker` that runs once a job is done. On the results
thread it writes the jobs' terminal records (``store_outcomes``: one round trip, riding out a broker restart) and
queues them (those with Celery canvas work through the canvas thread, ``workers/canvas_thread.py``, which queues
them once their work is sent); on the consumer thread, every ``ACK_INTERVAL``, ``drain_finished`` acknowledges
every queued job's messages in one pipeline, releases their room in the prefetch window (and sets the channel's
prefetch count to what the window allows now, ``apply_window``) and sends the task events Flower shows.
``renew_leases`` keeps every held message from being redelivered while the worker lives.

It holds no state of its own: it uses the worker's (the attributes annotated on the class).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from embedq import errors
from embedq.batching import PrefetchWindow
from embedq.batching.traffic import BULK, TrafficClass
from embedq.broker import BROKER_ERRORS
from embedq.results import ResultStore
from embedq.workers import transport
from embedq.workers.canvas_thread import CanvasThread
from embedq.workers.delivery import renew_leases
from embedq.workers.jobs import Job
from embedq.workers.metrics import WorkerMetrics
from embedq.workers.service import EmbeddingService

log = logging.getLogger(__name__)

#: A job whose terminal record was already stored before this delivery (see delivery.Ledger.check).
ALREADY_STORED = "already-stored"
#: Seconds between two calls of a :class:`Ticker` while its worker holds no job.
IDLE_TICK = 1.0


class Ticker:
    """``fun`` on the consumer's event loop every ``interval`` seconds while ``holding`` (the worker's held jobs) is
    not empty, every :data:`IDLE_TICK` seconds while it is: an idle worker's event loop wakes once a second, not
    every ACK_INTERVAL (a worker with nothing to acknowledge or cancel spent 2 % of a core waking 70 times a
    second). :meth:`wake` (a delivery) brings a far call forward to ``interval`` from now."""

    def __init__(self, timer: Any, interval: float, fun: Callable[[], Any], holding: Any) -> None:
        self.timer, self.interval, self.fun, self.holding = timer, interval, fun, holding
        self.entry: Any = None
        self.due = 0.0
        self.canceled = False
        self._schedule()

    def _tick(self) -> None:
        try:
            self.fun()
        finally:
            if not self.canceled:
                self._schedule()

    def _schedule(self) -> None:
        delay = self.interval if self.holding else IDLE_TICK
        self.due = time.monotonic() + delay
        self.entry = self.timer.call_after(delay, self._tick)

    def wake(self) -> None:
        if not self.canceled and self.due - time.monotonic() > self.interval:
            self.entry.cancel()
            self._schedule()

    def cancel(self) -> None:
        self.canceled = True
        self.entry.cancel()


class Acks:
    """Store finished jobs' records, acknowledge their messages, renew held messages' leases; mixed into the
    worker, whose state it uses."""

    service: EmbeddingService | None
    canvas_thread: CanvasThread | None
    metrics: WorkerMetrics | None
    window: PrefetchWindow | None
    consumer: Any
    finished: queue.SimpleQueue
    started: queue.SimpleQueue
    held: dict[str, Job]
    flush_intake: Callable[[], None]
    traffic_class: Callable[[str | None], TrafficClass]

    def store_outcome(self, job: Job, outcome: dict[str, Any] | errors.EmbedqError) -> None:
        """Results thread: write the terminal record (riding out a broker restart), then queue the ack."""
        self.store_outcomes([(job, outcome)])

    def store_outcomes(self, done: list[tuple[Job, dict[str, Any] | errors.EmbedqError]]) -> None:
        """Results thread: write the terminal records of finished jobs in one round trip (riding out a broker
        restart), then queue their acks.

        If the service stops before the records are stored, the jobs are left unacknowledged: their messages
        are handed back (or redelivered) and the jobs run again. Storing again after a failed attempt is safe: a
        record is written only where there is none."""
        if not done:
            return
        for job, outcome in done:
            if not isinstance(outcome, errors.EmbedqError):
                outcome["worker"] = job.context.primary.hostname  # the indexer's summary counts texts per worker
        app = done[0][0].context.primary.task.app
        canvas_ids = {job.id for job, _ in done if job.canvas is not None}
        delay = 0.2
        while True:
            try:
                written = ResultStore(app).store_many([(job.id, outcome) for job, outcome in done], canvas_ids)
                break
            except BROKER_ERRORS as exc:
                if self.service is not None and self.service.stopping:
                    log.warning("could not store %d job(s) before stopping (%s); they will run again", len(done),
                                type(exc).__name__)
                    return
                log.warning("storing %d job(s) failed (%s); retrying in %.1fs", len(done), type(exc).__name__,
                            delay)
                if self.service is not None:  # riding out an outage is progress, for the watchdog
                    self.service.results_beat()
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        # Jobs with canvas work go to the canvas thread, which queues their acks once the work is sent; the others'
        # acks are queued now.
        handed = [(job, outcome, wrote) for (job, outcome), wrote in zip(done, written) if job.canvas is not None]
        now = time.monotonic()
        for (job, outcome), wrote in zip(done, written):
            if not wrote:  # another outcome came first (the job was cancelled while it ran): that one stands
                log.info("job %s already has an outcome; its %s is not stored", job.id,
                         "error" if isinstance(outcome, errors.EmbedqError) else "result")
            if job.canvas is None:
                self.finished.put((job, outcome, now))
        if handed:
            assert self.canvas_thread is not None
            self.canvas_thread.put(handed, on_wait=self.service.results_beat if self.service is not None else None)

    def resend_canvas(self, job: Job, record: dict[str, Any] | None) -> None:
        """Consumer thread: a redelivered job whose record is stored and whose canvas work is still marked pending
        (its worker died after storing and before deleting the marker): the canvas thread sends the work now, for the
        stored outcome, then the job is acknowledged as already stored."""
        assert self.canvas_thread is not None
        self.canvas_thread.resend(job, record)

    def apply_window(self) -> None:
        """Consumer thread: set the channel's prefetch count to what the text window allows now."""
        qos = getattr(self.consumer, "qos", None)
        if qos is None or self.window is None:
            return
        delta = self.window.limit() - qos.value
        if delta > 0:
            qos.increment_eventually(delta)
        elif delta < 0:
            qos.decrement_eventually(-delta)
        if qos.prev != qos.value:
            qos.update()  # at once, so the transport stops (or resumes) fetching before the next message

    def current_channel(self) -> Any:
        task_consumer = getattr(self.consumer, "task_consumer", None)
        return getattr(task_consumer, "channel", None)

    def ack(self, req: Any) -> None:
        """Acknowledge one message. After a reconnect its channel is gone; the unacked entry in Redis is
        the same, so it is removed through the current channel."""
        if req.acknowledged:
            return
        message = req.message
        try:
            message.ack()
        except Exception:
            channel = self.current_channel()
            if channel is None:
                raise
            channel.qos.ack(message.delivery_tag)
        req.acknowledged = True

    def drain_finished(self) -> None:
        """Consumer thread: acknowledge what has been stored and emit the task events."""
        self.flush_intake()
        while True:
            try:
                job = self.started.get_nowait()
            except queue.Empty:
                break
            job.context.primary.send_event("task-started")
        finished = []
        while True:
            try:
                finished.append(self.finished.get_nowait())
            except queue.Empty:
                break
        if not finished:
            return
        # Every stored job's messages acknowledged in one round trip (a message whose channel is gone after a
        # reconnect goes through the current channel, one by one).
        pending = [(job, req) for job, _, _ in finished for req, _ in job.context.reqs if not req.acknowledged]
        failed = {id(message) for message in transport.ack_many([req.message for _, req in pending])}
        for job, req in pending:
            if id(req.message) in failed:
                try:
                    self.ack(req)
                except Exception:  # the broker is away: the message is redelivered and found already stored
                    log.warning("could not acknowledge job %s; it will be redelivered and recognised", job.id)
        released = False
        for job, outcome, done_at in finished:
            runtime = done_at - (job.started if job.started is not None else job.received)
            if self.metrics is not None and outcome != ALREADY_STORED:
                self.metrics.observe("job_seconds", max(done_at - job.received, 0.0), job.traffic_class)
            if self.held.get(job.id) is job:
                del self.held[job.id]
            failed = isinstance(outcome, errors.EmbedqError)
            for req, size in job.context.reqs:
                if not req.acknowledged and req.message.acknowledged:
                    req.acknowledged = True
                worker_state.task_ready(req, successful=not failed)
                if self.window is not None:
                    self.window.released(size, bulk=self.traffic_class(routing_key_of(req)) == BULK)
                    released = True
            _send_outcome_event(job.context.primary, outcome, runtime)
        if released:
            self.apply_window()

    def renew_leases(self) -> None:
        """Consumer thread: keep every held message from being redelivered while this worker lives."""
        channel = self.current_channel()
        if channel is None or not self.held:
            return
        tags = [req.message.delivery_tag for job in self.held.values() for req, _ in job.context.reqs]
        try:
            renew_leases(channel, tags)
        except Exception as exc:
            log.warning("could not renew the leases of %d held messages: %s", len(tags), type(exc).__name__)


def routing_key_of(req: Any) -> str | None:
    info = getattr(req, "delivery_info", None)
    key = info.get("routing_key") if isinstance(info, dict) else None
    return key if isinstance(key, str) else None

def _send_outcome_event(req: Any, outcome: Any, runtime: float) -> None:
    """The task event Flower shows for a job's outcome."""
    if isinstance(outcome, errors.Cancelled):
        req.send_event("task-revoked", terminated=False, signum=None, expired=False)
    elif isinstance(outcome, errors.Expired):
        req.send_event("task-revoked", terminated=False, signum=None, expired=True)
    elif isinstance(outcome, errors.EmbedqError):
        req.send_event("task-failed", exception=repr(outcome), traceback="")
    elif outcome == ALREADY_STORED:
        req.send_event("task-succeeded", result="already stored", runtime=runtime)
    else:
        req.send_event("task-succeeded", result=f"{outcome['usage']['texts']} vectors", runtime=runtime)
