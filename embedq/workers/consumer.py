"""Celery integration: tasks whose messages bypass the pool and go to the coalescing service.

There is one Celery task per job kind (every entry of the kinds table, ``kinds.TASKS``, plugins' kinds included),
all with the same *strategy*: Celery hands each message to it. It builds the Celery request, lets the
:class:`~embedq.workers.service.EmbeddingService` validate, tokenize and buffer it, and returns at once: the consumer
keeps pulling messages up to the prefetch window (the unacknowledged limit), so the scheduler sees the texts of *all*
waiting jobs. A done job's result (or typed error) is stored by the results thread, its canvas work sent by the
canvas thread; only then is its message acknowledged, on the consumer's thread, which owns the broker channel.

Delivery is at least once and idempotent (see :mod:`embedq.workers.delivery`): held messages keep
their lease, redelivered ones are checked against what is stored, suspects of a crash run alone and
are dead-lettered after ``max_attempts`` worker deaths, and a message that cannot be read is refused
with a typed error, never logged with its body and never run. On SIGTERM :class:`GracefulStop`
finishes the micro-batch in progress, stores and acknowledges what is done, and hands the rest back.

This module holds the :class:`Worker` (its state, routing, loading the model, delivering jobs, cancellations) and
what Celery calls (the tasks, their strategy, :class:`GracefulStop`, :class:`EmbedqConsumer`, :func:`register`).
The worker's other parts are mixed in from beside it: reading and refusing messages in ``workers/messages.py``,
storing outcomes and acknowledging messages in ``workers/acks.py``, liveness, fail-stop and the warm shutdown in
``workers/stopping.py`` (with ``EXIT_FAILED``).
"""

from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from celery import Celery, Task, bootsteps
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from kombu.utils.imports import symbol_by_name

from embedq import errors
from embedq.batching import PrefetchWindow
from embedq.batching.traffic import BULK, ONLINE, TrafficClass
from embedq.broker import BROKER_ERRORS, lease_interval, redis_client
from embedq.cancellation import CancelFeed
from embedq.kinds import TASKS, TaskSpec
from embedq.protocol import RESENT_HEADER, SENT_HEADER, TASK_NAME, client_of
from embedq.settings import Settings
from embedq.workers import transport
from embedq.workers.acks import ALREADY_STORED, Acks, Ticker, routing_key_of
from embedq.workers.canvas import canvas_of
from embedq.workers.canvas_rules import CanvasRules
from embedq.workers.canvas_thread import CanvasThread
from embedq.workers.delivery import Ledger, Verdict
from embedq.workers.host import HostService
from embedq.workers.jobs import Job
from embedq.workers.loading import load_model
from embedq.workers.messages import Messages, deadline_of, expires_iso
from embedq.workers.metrics import Reporter, WorkerMetrics
from embedq.workers.observe import WorkerInfo, event_kwargs, short_args, window_stats, worker_record
from embedq.workers.service import EmbeddingService
from embedq.workers.split import DEVICE_SOCKET_ENV, connect
from embedq.workers.stopping import LIVENESS_INTERVAL, Stopping

log = logging.getLogger(__name__)

ACK_INTERVAL = 0.02  # seconds between drains of finished jobs on the consumer thread
INTAKE_MAX = 256  # jobs delivered before the intake is handed to the service even in the middle of a fetch
CANCEL_INTERVAL = 0.05  # seconds between reads of the cancellation stream
CANCEL_STALE = 0.1  # a delivery checks the stream itself when the last read is older than this
CANCEL_BACKOFF = 2.0  # seconds without reading the stream after a failed read (the broker is away)


@dataclass
class Delivery:
    """The Celery requests (messages) that carry one job: usually one, more when it was delivered again
    while this worker held it. Each is acknowledged once the job's record is stored."""

    reqs: list[tuple[Any, int]] = field(default_factory=list)  # (request, texts counted in the window)

    @property
    def primary(self) -> Any:
        return self.reqs[0][0]


class Worker(Messages, Acks, Stopping):
    """One worker process: its settings, the service, the messages it holds, finished jobs to acknowledge,
    and what it does with them on Celery's consumer thread.

    An object, not module state: ``embedq worker`` creates it, loads the model through it and hands it to
    Celery on the app (:func:`register`; ``app.embedq_worker``), where the task strategy, the bootsteps and
    the ``inspect`` command find it. Threads: the consumer thread (deliveries, acks, leases,
    cancellations), the service's inference and results threads (:meth:`store_outcome`,
    :meth:`count_run`, :meth:`job_started`) and the reporter. What crosses threads goes through the two
    queues; counters through the service's :class:`~embedq.workers.stats.Stats`.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.bulk_queues = frozenset({settings.bulk_queue_name})  # queues whose jobs are bulk (the rest online)
        self.service: EmbeddingService | None = None
        self.canvas_thread: CanvasThread | None = None  # sends jobs' Celery canvas work (workers/canvas_thread.py)
        self.canvas_rules = CanvasRules.from_settings(settings)  # what a message's canvas may hold (at the edge)
        self.metrics: WorkerMetrics | None = None
        self.reporter: Reporter | None = None
        self.ledger: Ledger | None = None
        self.window: PrefetchWindow | None = None  # kept across consumer restarts: held messages stay held
        self.cancels: CancelFeed | None = None
        self.consumer: Any = None  # Celery's Consumer: its qos is the channel's prefetch count
        self.finished: queue.SimpleQueue = queue.SimpleQueue()  # (job, outcome, monotonic time stored)
        self.started: queue.SimpleQueue = queue.SimpleQueue()  # jobs whose first micro-batch started (events)
        self.held: dict[str, Job] = {}  # job id -> job, from delivery until acknowledged (consumer thread only)
        self.intake: list[Job] = []  # delivered jobs not yet handed to the service (see flush_intake)
        self.timers: list[Any] = []
        self.hostname, self.started_at = "", 0.0  # the node's name; Unix time the worker started consuming
        self.stopped = False
        self.cancels_retry_at = 0.0  # monotonic time before which the stream is not read (after a failure)
        self.revoked_seen = 0  # size of Celery's revoked set at the last look (Flower's "revoke", celery control)

    # -- routing -----------------------------------------------------------------------------------

    def traffic_class(self, routing_key: str | None) -> TrafficClass:
        return BULK if routing_key in self.bulk_queues else ONLINE

    def fetch_order(self, queues: list[str]) -> list[str]:
        """The transport asks which queues to fetch from now: online ones first, and bulk ones only while
        the prefetch window has room for bulk (a share of it stays free for online jobs)."""
        window = self.window
        online = [q for q in queues if q not in self.bulk_queues]
        bulk = [q for q in queues if q in self.bulk_queues]
        if window is None:
            return online + bulk
        return (online if window.admits(bulk=False) else []) + (bulk if window.admits(bulk=True) else [])

    def fetch_plan(self, queues: list[str]) -> list[tuple[list[str], int]]:
        """The transport asks, right after a BRPOP brought a message, how many more to take in the same round
        trip: online queues first, then bulk ones, each class as many as the prefetch window has room for (see
        :meth:`PrefetchWindow.fetch_room`), at most ``fetch_batch`` in all."""
        window, most = self.window, self.settings.fetch_batch - 1
        if window is None or self.stopped or most < 1:
            return []
        plan: list[tuple[list[str], int]] = []
        for bulk in (False, True):
            group = [q for q in queues if (q in self.bulk_queues) == bulk]
            n = window.fetch_room(bulk=bulk, most=most) if group and most > 0 else 0
            if n > 0:
                plan.append((group, n))
                most -= n
        return plan

    def fetch_admits(self, queue_name: str) -> bool:
        """The transport asks before each message of a fetch of many: does the window admit one more of this
        queue's class now? (No: the rest of the fetch goes back to the queue unseen.)"""
        window = self.window
        return window is None or (not self.stopped and window.admits(bulk=queue_name in self.bulk_queues))

    # -- the model ---------------------------------------------------------------------------------

    def load_service(self) -> EmbeddingService:
        """Load the model and start the inference thread (once).

        ``embedq worker`` calls this before Celery starts, so a model that cannot load stops the worker
        with a clear error and a non-zero exit instead of a consumer that dies inside Celery.
        """
        if self.service is None:
            settings = self.settings
            metrics = self.metrics = WorkerMetrics()
            device = os.environ.get(DEVICE_SOCKET_ENV)  # a host process of the split layout (workers/split.py)
            backend, policy, metrics.model_load_seconds = load_model(settings, device="cpu" if device else None)
            if device:
                self.service = HostService(backend, settings, on_done=self.store_outcome, memory_policy=policy,
                                           on_done_many=self.store_outcomes, on_isolated_run=self.count_run,
                                           on_started=self.job_started, metrics=metrics,
                                           channel=connect(device)).start()
            else:
                self.service = EmbeddingService(backend, settings, on_done=self.store_outcome,
                                                memory_policy=policy, on_done_many=self.store_outcomes,
                                                on_isolated_run=self.count_run, on_started=self.job_started,
                                                metrics=metrics).start()
            self.canvas_thread = CanvasThread(settings, self.service.stats, self.finished,
                                              lambda: self.service is None or self.service.stopping,
                                              ALREADY_STORED).start()
            metrics.bind(self.service, window_state=partial(window_stats, self), queues=settings.queues,
                         redis=redis_client(settings) if settings.broker_url else None)
        return self.service

    def job_started(self, job: Job) -> None:
        """Inference thread: the job's first micro-batch starts (its task-started event goes out on the
        consumer thread, which owns the event connection)."""
        if self.metrics is not None and job.started is not None:
            self.metrics.observe("buffer_seconds", max(job.started - job.received, 0.0), job.traffic_class)
        self.started.put(job)

    def count_run(self, job: Job, starting: bool) -> None:
        """Inference thread: a suspect job starts (or has finished) its run alone; count it while it runs."""
        if self.ledger is not None:
            try:
                self.ledger.count_run(job.id, 1 if starting else -1)
            except BROKER_ERRORS:
                log.warning("could not count the run of suspect job %s (broker unreachable)", job.id)

    # -- the consumer thread -----------------------------------------------------------------------

    def strategy(self, task: Task, app: Celery, consumer: Any):
        """Celery calls this (through :func:`coalescing_strategy`) once per consumer start and task; it
        returns the per-message handler."""
        from celery.worker.request import create_request_cls

        service = self.load_service()
        settings, hostname, eventer = service.settings, consumer.hostname, consumer.event_dispatcher
        if eventer is not None and getattr(eventer, "buffer_group", None):
            # Task events are buffered and published as one "task.multi" message when the event loop comes round
            # (Celery's own scheme); Celery also publishes every 24, which splits one fetch's events into several
            # round trips. Flower and `celery events` read either form.
            eventer.buffer_limit = max(getattr(eventer, "buffer_limit", 0), 4 * settings.fetch_batch)
        connection_errors = consumer.connection_errors
        Req = create_request_cls(symbol_by_name(task.Request), task, consumer.pool, hostname, eventer, app=app)
        if self.window is None:
            self.window = PrefetchWindow(max_messages=settings.prefetch_window, max_texts=settings.prefetch_texts,
                                         online_reserve=settings.online_reserve,
                                         online_overflow=settings.online_overflow_texts)
        if self.ledger is None:
            self.ledger = Ledger(task.backend, max_attempts=settings.max_attempts)
        if self.cancels is None and settings.broker_url:
            self.cancels = CancelFeed(redis_client(settings, timeout=2.0))
        self.consumer = consumer
        if self.reporter is None and self.metrics is not None and self.metrics.redis is not None:
            self.hostname, self.started_at = hostname, time.time()
            self.reporter = Reporter(partial(worker_record, self), self.metrics, self.metrics.redis)
            self.reporter.start()
        for entry in self.timers:  # called once per task and consumer (re)start: the last set stands
            entry.cancel()
        self.timers = [Ticker(consumer.timer, ACK_INTERVAL, self.drain_finished, self.held),
                       consumer.timer.call_repeatedly(lease_interval(settings), self.renew_leases),
                       Ticker(consumer.timer, CANCEL_INTERVAL, self.follow_cancellations, self.held),
                       consumer.timer.call_repeatedly(LIVENESS_INTERVAL, self.check_liveness)]
        self.follow_cancellations()

        def handler(message, body, ack, reject, callbacks, **kw):
            if self.stopped:  # a delivery that raced the graceful stop: straight back to the queue
                message.reject(requeue=True)
                return
            try:
                self.receive(task, app, message, body, ack, reject, Req, hostname, eventer, connection_errors)
            except Exception as exc:  # whatever a message holds, the consumer goes on (and the job gets an answer)
                log.exception("refusing a message that could not be handled")
                if not getattr(message, "acknowledged", False):
                    self.refuse(task, message,
                                errors.InvalidMessage(f"cannot handle the message ({type(exc).__name__})"))

        return handler

    def deliver(self, req: Any, args: Any, kwargs: Any, message: Any, spec: TaskSpec) -> None:
        """Consumer thread: a readable job message of ``spec``'s kind (the task the message names: a ``shadow``
        header changes no kind). Hold it, then run it, cancel it, recognise it as already stored or dead-letter
        it."""
        service, settings = self.service, self.settings
        assert service is not None and self.window is not None and self.ledger is not None
        size = spec.size(args)
        routing_key = routing_key_of(req) or settings.queue_name
        klass = self.traffic_class(routing_key)
        # What the task events show, worked out before the message is counted anywhere: nothing below may fail
        # between counting it (reserved, the prefetch window) and holding it.
        event = {"name": spec.name, "args": short_args(req), "expires": expires_iso(req.expires),
                 "kwargs": event_kwargs(kwargs, service, routing_key, klass, spec.kind)}
        worker_state.task_reserved(req)
        self.window.received(size, bulk=klass == BULK)
        self.apply_window()
        held = self.held.get(req.id)
        if held is not None:  # delivered again while held (resent, or restored across a reconnect)
            held.context.reqs.append((req, size))
            service.stats.add(duplicates=1)
            return
        req.send_event("task-received", **event)
        headers = req._request_dict or {}
        job = Job(id=req.id, texts=args, options=kwargs, context=Delivery([(req, size)]), size=size, spec=spec,
                  traffic_class=klass, deadline=deadline_of(req.expires), canvas=canvas_of(req),
                  client=client_of(headers))
        self.held[job.id] = job
        if len(self.held) == 1:  # the first job held: the ack and cancellation timers back to a busy worker's pace
            for ticker in (t for t in self.timers if isinstance(t, Ticker)):
                ticker.wake()
        verdict = Verdict()
        sent_at = headers.get(SENT_HEADER)
        if isinstance(sent_at, (int, float)) and self.metrics is not None:
            self.metrics.observe("queue_seconds", max(time.time() - sent_at, 0.0), klass)
        redelivered = bool(req.delivery_info.get("redelivered") or headers.get("redelivered"))
        if redelivered or headers.get(RESENT_HEADER):
            service.stats.add(redelivered=int(redelivered))
            try:
                verdict = self.ledger.check(job.id, redelivered=redelivered)
            except Exception as exc:  # cannot tell: the safe side is to run it alone
                log.warning("could not read the history of job %s: %s", job.id, type(exc).__name__)
                verdict = Verdict(suspect=redelivered, crashes=int(redelivered))
        if verdict.stored:
            if verdict.canvas_pending and redelivered and job.canvas is not None:
                # its worker died between storing the record and sending the canvas work (or deleting the marker)
                self.resend_canvas(job, verdict.record)  # acknowledged once the work is sent
            else:
                self.finished.put((job, ALREADY_STORED, time.monotonic()))
            service.count_received(job.size, klass, spec.kind)
            service.stats.add(already_stored=1)
        elif verdict.crashes >= settings.max_attempts:
            self.dead_letter(job, verdict.crashes, req.hostname, message)
        elif self.is_cancelled(req.id):
            service.count_received(job.size, klass, spec.kind)
            service.cancel(job)
        else:
            job.suspect = verdict.suspect
            self.intake.append(job)  # tokenized with the rest of its fetch (flush_intake)
            if len(self.intake) >= INTAKE_MAX:
                self.flush_intake()

    def flush_intake(self) -> None:
        """Consumer thread: hand the jobs delivered since the last flush to the service, which tokenizes the texts
        of all of them together (the transport calls this once a fetch has been delivered; the ack timer too)."""
        if self.intake and self.service is not None:
            jobs, self.intake = self.intake, []
            self.service.submit_many(jobs)

    # -- cancellation, dead letters ------------------------------------------------------------------

    def is_cancelled(self, job_id: str) -> bool:
        """Consumer thread, on delivery: cancelled through embedq (the stream, read now unless read within
        CANCEL_STALE seconds) or revoked through Celery (Flower's button, ``celery control revoke``)."""
        feed = self.cancels
        if feed is not None and time.monotonic() - feed.synced > CANCEL_STALE:
            self.follow_cancellations()
        return (feed is not None and job_id in feed) or job_id in worker_state.revoked

    def follow_cancellations(self) -> None:
        """Consumer thread: drop the held jobs cancelled since the last look (those not yet started)."""
        feed, service = self.cancels, self.service
        ids: list[str] = []
        now = time.monotonic()
        if feed is not None and now >= self.cancels_retry_at:
            try:
                ids = feed.poll()
            except Exception as exc:  # the broker is away: cancellations wait for it (and the event loop does not)
                self.cancels_retry_at = now + CANCEL_BACKOFF
                log.debug("could not read cancellations: %s", type(exc).__name__)
        revoked = worker_state.revoked
        if len(revoked) != self.revoked_seen:
            self.revoked_seen = len(revoked)
            ids += [job_id for job_id in self.held if job_id in revoked]
        if service is None:
            return
        for job_id in ids:
            job = self.held.get(job_id)
            if job is not None and service.cancel(job):
                log.debug("job %s cancelled before it ran", job_id)

    def dead_letter(self, job: Job, crashes: int, hostname: str, message: Any) -> None:
        service = self.service
        assert service is not None and self.ledger is not None
        queue_name = (message.delivery_info or {}).get("routing_key") or service.settings.queue_name
        log.error("job %s was running when the worker died %d times: dead-lettered", job.id, crashes)
        try:
            self.ledger.dead_letter(job.id, queue=queue_name, crashes=crashes, worker=hostname, texts=job.size)
        except BROKER_ERRORS:
            log.warning("could not record dead letter %s", job.id)
        service.count_received(job.size, job.traffic_class)
        service.stats.add(dead_letters=1)
        service.fail(job, errors.DeadLetter(
            f"the worker died while running this job {crashes} times (max_attempts={service.settings.max_attempts}); "
            "it is not delivered again"))


def worker_of(app: Celery) -> Worker:
    """The :class:`Worker` that :func:`register` gave this Celery app."""
    worker = getattr(app, "embedq_worker", None)
    if worker is None:
        raise RuntimeError("this Celery app has no embedq worker: start it with `embedq worker`")
    return worker


def coalescing_strategy(task: Task, app: Celery, consumer: Any, **_: Any):
    """The strategy of every job kind's task (Celery's hook, named in :class:`JobTask`)."""
    return worker_of(app).strategy(task, app, consumer)


class JobTask(Task):
    """A job kind's task: its messages never reach the pool (see :func:`coalescing_strategy`)."""

    acks_late = True
    typing = False
    Strategy = "embedq.workers.consumer:coalescing_strategy"
    Request = "embedq.workers.observe:EmbedRequest"

    def run(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - only reached by .apply()
        raise errors.Unavailable(f"{self.name} runs only inside an embedq worker")


def task_class(spec: TaskSpec) -> type[JobTask]:
    return type(f"{spec.kind.capitalize()}Task", (JobTask,), {"name": spec.name, "__module__": __name__})


def register(app: Celery, worker: Worker) -> list[Task]:
    """Give the app its worker, make ``redis://`` URLs use the worker's transport with the worker's fetch policy,
    and register every job kind's task (the worker refuses, per job, the kinds its model does not serve)."""
    app.embedq_worker = worker
    limit = worker.settings.max_message_bytes
    transport.install(transport.FetchPolicy(order=worker.fetch_order, plan=worker.fetch_plan,
                                            admits=worker.fetch_admits, after_fetch=worker.flush_intake,
                                            max_body_bytes=limit, fetch_bytes=limit))
    app.steps["consumer"].add(GracefulStop)
    app.steps["consumer"].add(WorkerInfo)
    return [app.register_task(task_class(spec)()) for spec in TASKS.values()]


class GracefulStop(bootsteps.StartStopStep):
    """Consumer bootstep: the worker's warm shutdown (SIGTERM, Ctrl-C).

    It runs after Celery has stopped consuming and before the channel closes: the micro-batch in
    progress finishes (bounded by ``shutdown_timeout``), finished jobs are stored and acknowledged,
    and every job still held goes back to the head of its queue, marked as handed back so its next
    delivery is not taken for a crash. kombu's own restore-at-close is switched off: on a lost
    connection it would requeue jobs this worker is still running (and, with Redis away, dump them
    to a file); held messages keep their lease instead and are acknowledged after the reconnect.
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        channel = getattr(c.task_consumer, "channel", None)
        if channel is not None:
            channel.qos.restore_at_shutdown = False

    def stop(self, c: Any) -> None:
        if worker_state.should_stop is not None or worker_state.should_terminate is not None:
            self.shutdown(c)

    def shutdown(self, c: Any) -> None:
        worker_of(c.app).shutdown()


class EmbedqConsumer(Consumer):
    """Celery's consumer, refusing what it cannot run without logging message bodies.

    Celery's own handlers log up to 1 KiB of the body (users' texts) at ERROR/CRITICAL and leave the
    producer waiting; these record a typed ``invalid_message`` error for the job id and log the reason.
    """

    def _task(self) -> Task:
        return self.app.tasks[TASK_NAME]

    def _refuse(self, message: Any, reason: str) -> None:
        refusal = getattr(message, "refusal", None)  # the transport could not read the body (too large inflated)
        worker_of(self.app).refuse(self._task(), message, refusal or errors.InvalidMessage(reason))

    def update_strategies(self) -> None:
        """Only embedq's job kinds run here. Every Celery app registers Celery's built-in tasks
        (``celery.accumulate``, ``celery.chord_unlock``, ``celery.backend_cleanup``, the canvas primitives), and
        Celery would run them from any queue it consumes; on embedq's queues they are unknown tasks, refused with
        a typed error like any other name."""
        super().update_strategies()
        for name in [name for name in self.strategies if name not in TASKS]:
            del self.strategies[name]

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's per-message dispatch, made total: whatever an entry's headers hold (a task "name" that is a
        list, say), the message is refused with a typed error and the consumer goes on."""
        on_task_received = super().create_task_handler(*args, **kwargs)

        def guarded(message: Any) -> Any:
            try:
                return on_task_received(message)
            except Exception as exc:
                log.warning("refusing a message Celery could not dispatch (%s)", type(exc).__name__)
                if not getattr(message, "acknowledged", False):
                    self._refuse(message, f"cannot dispatch the message ({type(exc).__name__})")
                return None

        return guarded

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        compression = (message.headers or {}).get("compression") if isinstance(message.headers, dict) else None
        how = f"content type {message.content_type!r}" + (f", compression {compression!r}" if compression else "")
        self._refuse(message, f"cannot decode the message ({type(exc).__name__}; {how})")

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self._refuse(message, "not a Celery task message")

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        headers = message.headers if isinstance(message.headers, dict) else {}
        name = str(headers.get("task"))[:100]
        self._refuse(message, f"unknown task {name!r}; this queue runs {', '.join(TASKS)}")

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._refuse(message, f"invalid task message ({type(exc).__name__})")
