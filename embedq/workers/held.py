"""The messages a worker holds: from delivery to acknowledgement, on Celery's consumer thread.

:class:`HeldMessages` owns what a worker holds and everything done to it on the consumer thread, which owns the
broker channel: the held jobs (``jobs``: job id -> job, from delivery until its messages are acknowledged), the jobs
delivered and not yet handed to the service (``intake``, tokenized together per fetch), the prefetch window (texts
and messages held, per traffic class: what the transport may fetch next, :meth:`fetch_order`, :meth:`fetch_plan`,
:meth:`fetch_admits`, and the channel's prefetch count, :meth:`apply_window`), the queue of stored jobs to
acknowledge (``finished``, put by the worker's results side: workers/records.py) and of started jobs to announce
(``started``, put by the inference thread). Every ``ACK_INTERVAL`` :meth:`drain_finished` acknowledges the finished
jobs' messages in one pipeline, releases their room in the window and sends the task events Flower shows;
:meth:`renew_leases` keeps every held message from being redelivered while the worker lives; on a stop
:meth:`settle_fetch` reads the fetch in flight and :meth:`hand_back` puts every held message back on its queue.

:class:`Ticker` runs the consumer thread's periodic calls at a busy or an idle pace.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery.worker import state as worker_state

from embedq import errors
from embedq.batching import PrefetchWindow
from embedq.batching.traffic import BULK, ONLINE, TrafficClass
from embedq.settings import Settings
from embedq.workers import transport
from embedq.workers.delivery import Ledger, renew_leases
from embedq.workers.jobs import Job

log = logging.getLogger(__name__)

#: A job whose terminal record was already stored before this delivery (see delivery.Ledger.check).
ALREADY_STORED = "already-stored"
#: Seconds between two calls of a :class:`Ticker` while its worker holds no job.
IDLE_TICK = 1.0


@dataclass
class Delivery:
    """The Celery requests (messages) that carry one job: usually one, more when it was delivered again
    while this worker held it. Each is acknowledged once the job's record is stored."""

    reqs: list[tuple[Any, int]] = field(default_factory=list)  # (request, texts counted in the window)

    @property
    def primary(self) -> Any:
        return self.reqs[0][0]


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


class HeldMessages:
    """The held messages of one worker and what the consumer thread does with them (see the module's doc).

    Made with the worker's settings; :meth:`bind` hands it the service (which it gives the intake) and the metrics
    once the model is loaded; the worker sets ``consumer`` (Celery's: its qos is the channel's prefetch count, its
    task consumer the channel) at each consumer start and ``closed`` when it stops taking messages."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.bulk_queues = frozenset({settings.bulk_queue_name})  # queues whose jobs are bulk (the rest online)
        # Kept across consumer restarts: held messages stay held.
        self.window = PrefetchWindow(max_messages=settings.prefetch_window, max_texts=settings.prefetch_texts,
                                     online_reserve=settings.online_reserve,
                                     online_overflow=settings.online_overflow_texts)
        self.jobs: dict[str, Job] = {}  # job id -> job, from delivery until acknowledged
        self.intake: list[Job] = []  # delivered jobs not yet handed to the service (see flush_intake)
        self.finished: queue.SimpleQueue = queue.SimpleQueue()  # (job, outcome, monotonic time stored)
        self.started: queue.SimpleQueue = queue.SimpleQueue()  # jobs whose first micro-batch started (events)
        self.prepared_late: queue.SimpleQueue = queue.SimpleQueue()  # jobs tokenized off this thread (preparer.py)
        self.consumer: Any = None
        self.closed = False  # the worker stopped taking messages: a fetch takes no more
        self._submit: Callable[[list[Job]], None] | None = None
        self._metrics: Any = None

    def bind(self, submit: Callable[[list[Job]], None], metrics: Any) -> None:
        """Once the model is loaded: where the intake goes (the service's ``submit_many``), and the metrics."""
        self._submit, self._metrics = submit, metrics

    # -- what the transport fetches ----------------------------------------------------------------

    def traffic_class(self, routing_key: str | None) -> TrafficClass:
        return BULK if routing_key in self.bulk_queues else ONLINE

    def fetch_order(self, queues: list[str]) -> list[str]:
        """The transport asks which queues to fetch from now: online ones first, and bulk ones only while
        the prefetch window has room for bulk (a share of it stays free for online jobs)."""
        window = self.window
        online = [q for q in queues if q not in self.bulk_queues]
        bulk = [q for q in queues if q in self.bulk_queues]
        return (online if window.admits(bulk=False) else []) + (bulk if window.admits(bulk=True) else [])

    def fetch_plan(self, queues: list[str]) -> list[tuple[list[str], int]]:
        """The transport asks, right after a BRPOP brought a message, how many more to take in the same round
        trip: online queues first, then bulk ones, each class as many as the prefetch window has room for (see
        :meth:`PrefetchWindow.fetch_room`), at most ``fetch_batch`` in all."""
        most = self.settings.fetch_batch - 1
        if self.closed or most < 1:
            return []
        plan: list[tuple[list[str], int]] = []
        for bulk in (False, True):
            group = [q for q in queues if (q in self.bulk_queues) == bulk]
            n = self.window.fetch_room(bulk=bulk, most=most) if group and most > 0 else 0
            if n > 0:
                plan.append((group, n))
                most -= n
        return plan

    def fetch_admits(self, queue_name: str) -> bool:
        """The transport asks before each message of a fetch of many: does the window admit one more of this
        queue's class now? (No: the rest of the fetch goes back to the queue unseen.)"""
        return not self.closed and self.window.admits(bulk=queue_name in self.bulk_queues)

    def apply_window(self) -> None:
        """Set the channel's prefetch count to what the text window allows now."""
        qos = getattr(self.consumer, "qos", None)
        if qos is None:
            return
        delta = self.window.limit() - qos.value
        if delta > 0:
            qos.increment_eventually(delta)
        elif delta < 0:
            qos.decrement_eventually(-delta)
        if qos.prev != qos.value:
            qos.update()  # at once, so the transport stops (or resumes) fetching before the next message

    # -- holding -----------------------------------------------------------------------------------

    def flush_intake(self) -> None:
        """Hand the jobs delivered since the last flush to the service, which tokenizes the texts of all of them
        together (the transport calls this once a fetch has been delivered; the ack timer too)."""
        if self.intake and self._submit is not None:
            jobs, self.intake = self.intake, []
            self._submit(jobs)
            self._count_items(jobs)
        self._count_items(_drained(self.prepared_late))  # before any of them is released (drain_finished flushes first)

    def prepared_off_thread(self, jobs: list[Job]) -> None:
        """The preparer's thread: these jobs are tokenized; the consumer thread counts their items at its next flush."""
        for job in jobs:
            self.prepared_late.put(job)

    def _count_items(self, jobs: list[Job]) -> None:
        """A job of long texts in windows holds more items than texts: the window counts its items."""
        for job in jobs:
            extra = job.n_items - job.size
            if extra > 0 and job.context.reqs:
                req, size = job.context.reqs[0]
                job.context.reqs[0] = (req, size + extra)
                self.window.received_more(extra, bulk=self.traffic_class(routing_key_of(req)) == BULK)

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
        """Acknowledge what has been stored and emit the task events."""
        self.flush_intake()
        for job in _drained(self.started):
            job.context.primary.send_event("task-started")
        finished = _drained(self.finished)
        if not finished:
            return
        # Every stored job's messages acknowledged in one round trip (a message whose channel is gone after a
        # reconnect goes through the current channel, one by one).
        pending = [(job, req) for job, _, _ in finished for req, _ in job.context.reqs if not req.acknowledged]
        failed = {id(message) for message in transport.ack_many([req.message for _, req in pending])}
        unacked = [(job, req) for job, req in pending if id(req.message) in failed]
        for n, (job, req) in enumerate(unacked):
            try:
                self.ack(req)
            except Exception:  # the broker is away: the messages are redelivered and found already stored
                # no more tries this round: each costs the connection's retries, on the thread that must notice
                # the lost connection (and, with Sentinel, follow the failover)
                log.warning("could not acknowledge %d job(s) (%s...); they will be redelivered and recognised",
                            len(unacked) - n, job.id)
                break
        for job, outcome, done_at in finished:
            runtime = done_at - (job.started if job.started is not None else job.received)
            if self._metrics is not None and outcome != ALREADY_STORED:
                self._metrics.observe("job_seconds", max(done_at - job.received, 0.0), job.traffic_class)
            if self.jobs.get(job.id) is job:
                del self.jobs[job.id]
            failed = isinstance(outcome, errors.EmbedqError)
            for req, size in job.context.reqs:
                if not req.acknowledged and req.message.acknowledged:
                    req.acknowledged = True
                worker_state.task_ready(req, successful=not failed)
                self.window.released(size, bulk=self.traffic_class(routing_key_of(req)) == BULK)
            _send_outcome_event(job.context.primary, outcome, runtime)
        self.apply_window()

    def renew_leases(self) -> None:
        """Keep every held message from being redelivered while this worker lives, and record again those whose
        delivery record the broker lost (a failover: see :func:`~embedq.workers.delivery.renew_leases`); also called
        once the consumer has reconnected."""
        channel = self.current_channel()
        if channel is None or not self.jobs:
            return
        messages = [req.message for job in self.jobs.values() for req, _ in job.context.reqs
                    if not req.message.acknowledged]
        try:
            renew_leases(channel, messages)
        except Exception as exc:
            log.warning("could not renew the leases of %d held messages: %s", len(messages), type(exc).__name__)

    # -- stopping ----------------------------------------------------------------------------------

    def settle_fetch(self) -> None:
        """Read the reply of the fetch (BRPOP) in flight, if any, before handing messages back: one handed back now
        would go to that fetch, and this process would never read it (kombu's channel does the same when it closes).
        A message it brings is handed back by the handler (the worker is stopped)."""
        channel = self.current_channel()
        if channel is None or not getattr(channel, "_in_poll", None):
            return
        try:
            channel._brpop_read()
        except queue.Empty:
            pass
        except Exception as exc:  # the broker is away: what it held comes back after visibility_timeout
            log.warning("could not read the fetch in flight: %s", type(exc).__name__)

    def hand_back(self, ledger: Ledger | None, blamed: frozenset[str] | set[str] = frozenset()) -> tuple[int, int]:
        """Stopping: put every held message back on its queue. Jobs are marked handed back in ``ledger`` (their next
        delivery is a plain one) except those in ``blamed`` (the micro-batch in the model when the worker failed:
        their next delivery counts as one that ended with the worker dead). Returns (messages handed back, held jobs
        blamed)."""
        self.intake.clear()  # held too: handed back below
        leftover = list(self.jobs.values())
        innocent = [job.id for job in leftover if job.id not in blamed]
        if innocent and ledger is not None:
            try:
                ledger.returned(innocent)
            except Exception:  # they come back as redelivered: run alone once, which is safe
                log.warning("could not mark %d returned jobs", len(innocent))
        returned = 0
        for job in leftover:
            for req, _ in job.context.reqs:
                try:
                    req.message.channel.qos.restore_by_tag(req.message.delivery_tag)
                    returned += 1
                except Exception as exc:  # it stays in the unacked hash: redelivered after its lease lapses
                    log.warning("could not hand job %s back: %s", job.id, type(exc).__name__)
        self.jobs.clear()
        return returned, len(leftover) - len(innocent)


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


def _drained(waiting: queue.SimpleQueue) -> list[Any]:
    """Everything ``waiting`` holds now, oldest first (what other threads put into it later stays there)."""
    out = []
    while True:
        try:
            out.append(waiting.get_nowait())
        except queue.Empty:
            return out
