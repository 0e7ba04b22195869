"""The worker: what embedq does with the task messages Celery hands it, and how it stops.

There is one Celery task per job kind (every entry of the kinds table, ``kinds.TASKS``, plugins' kinds included),
all with the same *strategy* (``workers/tasks.py``, the Celery glue): Celery hands each message to the
:class:`Worker`, which reads it (``workers/messages.py``), holds it (``workers/held.py``) and lets the
:class:`~embedq.workers.service.EmbeddingService` validate, tokenize and buffer it, and returns at once: the consumer
keeps pulling messages up to the prefetch window (the unacknowledged limit), so the scheduler sees the texts of *all*
waiting jobs. A done job's result (or typed error) is stored by the results thread (``workers/records.py``), its
canvas work sent by the canvas thread; only then is its message acknowledged, on the consumer's thread, which owns
the broker channel.

Delivery is at least once and idempotent (see :mod:`embedq.workers.delivery`): held messages keep
their lease, redelivered ones are checked against what is stored, suspects of a crash run alone and
are dead-lettered after ``max_attempts`` worker deaths, and a message that cannot be read is refused
with a typed error, never logged with its body and never run.

How it stops (``workers/stopping.py`` has the intervals and ``EXIT_FAILED``): every ``LIVENESS_INTERVAL`` the
consumer thread looks at the service (:meth:`Worker.check_liveness`): a worker whose inference, results or canvas
thread died, or stopped making progress while work waits for it, stops with ``EXIT_FAILED`` for its supervisor to
restart it (:meth:`Worker.fail_stop`), the jobs of the micro-batch in the model blamed for it. On SIGTERM (the
consumer's ``GracefulStop`` bootstep) :meth:`Worker.shutdown` finishes the micro-batch in progress, stores and
acknowledges what is done and hands the rest back. Either way every held message goes back to its queue after the
fetch in flight is read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from functools import partial
from typing import Any

from celery import Celery, Task
from celery.worker import state as worker_state
from kombu.utils.imports import symbol_by_name

from embedq import errors
from embedq.batching import PrefetchWindow
from embedq.batching.traffic import BULK
from embedq.broker import BROKER_ERRORS, lease_interval, redis_client
from embedq.cancellation import CancelFeed
from embedq.kinds import TaskSpec
from embedq.protocol import RESENT_HEADER, SENT_HEADER, client_of
from embedq.results import ResultStore
from embedq.settings import Settings
from embedq.workers import refused
from embedq.workers.canvas import canvas_of
from embedq.workers.canvas_rules import CanvasRules
from embedq.workers.canvas_thread import CanvasThread
from embedq.workers.delivery import Ledger, Verdict
from embedq.workers.held import ALREADY_STORED, Delivery, HeldMessages, Ticker, routing_key_of
from embedq.workers.host import HostService
from embedq.workers.jobs import Job
from embedq.workers.loading import load_model
from embedq.workers.messages import MessageReader, deadline_of, expires_iso
from embedq.workers.metrics import Reporter, WorkerMetrics
from embedq.workers.observe import event_kwargs, short_args, window_stats, worker_record
from embedq.workers.records import RecordWriter
from embedq.workers.service import EmbeddingService
from embedq.workers.split import DEVICE_SOCKET_ENV, connect
from embedq.workers.stopping import DRAIN_ON_FAILURE, EXIT_FAILED, LIVENESS_INTERVAL

log = logging.getLogger(__name__)

ACK_INTERVAL = 0.02  # seconds between drains of finished jobs on the consumer thread
INTAKE_MAX = 256  # jobs delivered before the intake is handed to the service even in the middle of a fetch
CANCEL_INTERVAL = 0.05  # seconds between reads of the cancellation stream
RECHECK_AFTER_START = 0.5  # seconds after a consumer (re)start before the held messages' records are checked
CANCEL_STALE = 0.1  # a delivery checks the stream itself when the last read is older than this
CANCEL_BACKOFF = 2.0  # seconds without reading the stream after a failed read (the broker is away)


class Worker:
    """One worker process: the composition of its parts, and what it does on Celery's consumer thread with the
    messages Celery hands it (deliver, cancel, dead-letter) and when it stops.

    An object, not module state: ``embedq worker`` creates it, loads the model through it and hands it to Celery on
    the app (``workers/tasks.py``: :func:`~embedq.workers.tasks.register`; ``app.embedq_worker``), where the task
    strategy, the bootsteps and the ``inspect`` command find it. Its parts, each owning its state:

    - ``messages`` (:class:`~embedq.workers.held.HeldMessages`): the held jobs, the intake, the prefetch window,
      the queues of finished and started jobs; acknowledging, lease renewal, handing back (consumer thread);
    - ``reader`` (:class:`~embedq.workers.messages.MessageReader`): a message read into a request, or refused;
    - ``records`` (:class:`~embedq.workers.records.RecordWriter`): finished jobs' records written (results thread);
    - the service (``workers/service.py``: the model's threads), the canvas thread, the metrics and reporter, the
      delivery ledger, the cancellation feed, and one result store, made when the worker is on its app.

    Threads: the consumer thread (deliveries, acks, leases, cancellations, the watchdog), the service's inference and
    results threads (``records.store_outcomes``, :meth:`count_run`, :meth:`job_started`) and the reporter. What
    crosses threads goes through the held messages' two queues; counters through the service's
    :class:`~embedq.workers.stats.Stats`.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.messages = HeldMessages(settings)
        self.reader = MessageReader(settings, CanvasRules.from_settings(settings), self.deliver, self._refused)
        self.records = RecordWriter(self.messages.finished)
        self.service: EmbeddingService | None = None
        self.canvas_thread: CanvasThread | None = None  # sends jobs' Celery canvas work (workers/canvas_thread.py)
        self.metrics: WorkerMetrics | None = None
        self.reporter: Reporter | None = None
        self.ledger: Ledger | None = None
        self.cancels: CancelFeed | None = None
        self.timers: list[Any] = []
        self.hostname, self.started_at = "", 0.0  # the node's name; Unix time the worker started consuming
        self.stopped = False
        self.cancels_retry_at = 0.0  # monotonic time before which the stream is not read (after a failure)
        self.revoked_seen = 0  # size of Celery's revoked set at the last look (Flower's "revoke", celery control)

    @property
    def window(self) -> PrefetchWindow:
        return self.messages.window

    def attach(self, app: Celery) -> None:
        """On its Celery app (``tasks.register``): the one result store its records and refusals are written to,
        and the ledger of deliveries."""
        store = ResultStore(app, self.settings)
        self.reader.store = self.records.store = store
        self.ledger = Ledger(app.backend, max_attempts=self.settings.max_attempts)

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
                self.service = HostService(backend, settings, on_done=self.records.store_outcome,
                                           memory_policy=policy, on_done_many=self.records.store_outcomes,
                                           on_isolated_run=self.count_run,
                                           on_started=self.job_started, metrics=metrics,
                                           channel=connect(device)).start()
            else:
                self.service = EmbeddingService(backend, settings, on_done=self.records.store_outcome,
                                                memory_policy=policy, on_done_many=self.records.store_outcomes,
                                                on_isolated_run=self.count_run, on_started=self.job_started,
                                                metrics=metrics).start()
            self.canvas_thread = CanvasThread(settings, self.service.stats, self.messages.finished,
                                              lambda: self.service is None or self.service.stopping,
                                              ALREADY_STORED).start()
            self.records.bind(self.service, self.canvas_thread)
            self.messages.bind(self.service.submit_many, metrics)
            self.service.on_prepared = self.messages.prepared_off_thread
            metrics.bind(self.service, window_state=partial(window_stats, self), queues=settings.queues,
                         redis=redis_client(settings) if settings.broker_url else None)
        return self.service

    def job_started(self, job: Job) -> None:
        """Inference thread: the job's first micro-batch starts (its task-started event goes out on the
        consumer thread, which owns the event connection)."""
        if self.metrics is not None and job.started is not None:
            self.metrics.observe("buffer_seconds", max(job.started - job.received, 0.0), job.traffic_class)
        self.messages.started.put(job)

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
        if self.cancels is None and settings.broker_url:
            self.cancels = CancelFeed(redis_client(settings, timeout=2.0))
        self.messages.consumer = consumer
        if self.reporter is None and self.metrics is not None and self.metrics.redis is not None:
            self.hostname, self.started_at = hostname, time.time()
            self.reporter = Reporter(partial(worker_record, self), self.metrics, self.metrics.redis)
            self.reporter.start()
        for entry in self.timers:  # called once per task and consumer (re)start: the last set stands
            entry.cancel()
        held = self.messages
        self.timers = [Ticker(consumer.timer, ACK_INTERVAL, held.drain_finished, held.jobs),
                       consumer.timer.call_repeatedly(lease_interval(settings), held.renew_leases),
                       Ticker(consumer.timer, CANCEL_INTERVAL, self.follow_cancellations, held.jobs),
                       consumer.timer.call_repeatedly(LIVENESS_INTERVAL, self.check_liveness),
                       # after a reconnect (a failover, say) the held messages' records are checked at once
                       consumer.timer.call_after(RECHECK_AFTER_START, held.renew_leases)]
        self.follow_cancellations()

        def handler(message, body, ack, reject, callbacks, **kw):
            if self.stopped:  # a delivery that raced the graceful stop: straight back to the queue
                message.reject(requeue=True)
                return
            try:
                self.reader.receive(task, app, message, body, ack, reject, Req, hostname, eventer,
                                    connection_errors)
            except Exception as exc:  # whatever a message holds, the consumer goes on (and the job gets an answer)
                log.exception("refusing a message that could not be handled")
                if not getattr(message, "acknowledged", False):
                    self.reader.refuse(message,
                                       errors.InvalidMessage(f"cannot handle the message ({type(exc).__name__})"))

        return handler

    def deliver(self, req: Any, args: Any, kwargs: Any, message: Any, spec: TaskSpec) -> None:
        """Consumer thread: a readable job message of ``spec``'s kind (the task the message names: a ``shadow``
        header changes no kind). Hold it, then run it, cancel it, recognise it as already stored or dead-letter
        it."""
        service, settings, held = self.service, self.settings, self.messages
        assert service is not None and self.ledger is not None
        size = spec.size(args)
        routing_key = routing_key_of(req) or settings.queue_name
        klass = held.traffic_class(routing_key)
        # What the task events show, worked out before the message is counted anywhere: nothing below may fail
        # between counting it (reserved, the prefetch window) and holding it.
        event = {"name": spec.name, "args": short_args(req), "expires": expires_iso(req.expires),
                 "kwargs": event_kwargs(kwargs, service, routing_key, klass, spec.kind)}
        worker_state.task_reserved(req)
        held.window.received(size, bulk=klass == BULK)
        held.apply_window()
        again = held.jobs.get(req.id)
        if again is not None:  # delivered again while held (resent, or restored across a reconnect)
            again.context.reqs.append((req, size))
            service.stats.add(duplicates=1)
            return
        req.send_event("task-received", **event)
        headers = req._request_dict or {}
        job = Job(id=req.id, texts=args, options=kwargs, context=Delivery([(req, size)]), size=size, spec=spec,
                  traffic_class=klass, deadline=deadline_of(req.expires), canvas=canvas_of(req),
                  client=client_of(headers))
        held.jobs[job.id] = job
        if len(held.jobs) == 1:  # the first job held: the ack and cancellation timers back to a busy worker's pace
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
                self.records.resend_canvas(job, verdict.record)  # acknowledged once the work is sent
            else:
                held.finished.put((job, ALREADY_STORED, time.monotonic()))
            service.count_received(job.size, klass, spec.kind)
            service.stats.add(already_stored=1)
        elif verdict.crashes >= settings.max_attempts:
            self.dead_letter(job, verdict.crashes, req.hostname, message)
        elif self.is_cancelled(req.id):
            service.count_received(job.size, klass, spec.kind)
            service.cancel(job)
        else:
            job.suspect = verdict.suspect
            held.intake.append(job)  # tokenized with the rest of its fetch (flush_intake)
            if len(held.intake) >= INTAKE_MAX:
                held.flush_intake()

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
                refused.is_refused(exc, "reading cancellations", self.settings.broker_url)
                self.cancels_retry_at = now + CANCEL_BACKOFF
                log.debug("could not read cancellations: %s", type(exc).__name__)
        revoked = worker_state.revoked
        if len(revoked) != self.revoked_seen:
            self.revoked_seen = len(revoked)
            ids += [job_id for job_id in self.messages.jobs if job_id in revoked]
        if service is None:
            return
        for job_id in ids:
            job = self.messages.jobs.get(job_id)
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

    # -- stopping ----------------------------------------------------------------------------------

    def check_liveness(self) -> None:
        """Consumer thread, every LIVENESS_INTERVAL: a worker whose inference or results thread died, or whose
        inference thread stopped making progress while work waits, must not go on taking jobs and calling itself
        alive (its heartbeat and registry record come from other threads): it stops (:meth:`fail_stop`)."""
        service = self.service
        if service is None or self.stopped:
            return
        reason = service.health(self.settings.stall_timeout)
        if reason is None and self.canvas_thread is not None:
            reason = self.canvas_thread.health(self.settings.stall_timeout)
        if reason is not None:
            self.fail_stop(reason)

    def fail_stop(self, reason: str) -> None:
        """Consumer thread: stop serving and exit with ``EXIT_FAILED``, for a supervisor to restart the worker.

        What was stored is acknowledged; every other held message goes back to its queue. The jobs of the
        micro-batch in the model are not marked as handed back, so their next delivery counts as one that ended
        with the worker dead (they run alone, and are dead-lettered after ``max_attempts``: a poison input cannot
        take down worker after worker); the rest are marked handed back and run as usual."""
        service = self.service
        assert service is not None
        log.critical("stopping: %s", reason)
        self.stopped = self.messages.closed = True
        running = {job.id for job in service.running}
        self.messages.settle_fetch()
        service.abandon()
        service.drain(DRAIN_ON_FAILURE)
        if self.canvas_thread is not None:  # what it has not sent stays marked, its jobs unacknowledged
            self.canvas_thread.close()
            self.canvas_thread.join(DRAIN_ON_FAILURE)
        self.messages.drain_finished()
        returned, blamed = self.messages.hand_back(self.ledger, blamed=running)
        self._withdraw()
        with contextlib.suppress(Exception):  # else Flower sees the heartbeats stop
            self.messages.consumer.event_dispatcher.send("worker-offline")
        log.critical("handed %d messages back (%d job(s) of the micro-batch in the model count a delivery that "
                     "ended with the worker dead); exiting with status %d", returned, blamed, EXIT_FAILED)
        logging.shutdown()
        os._exit(EXIT_FAILED)  # the inference thread may be stuck in native code: nothing would join it

    def shutdown(self) -> None:
        """The warm shutdown (``tasks.GracefulStop``): finish the micro-batch in progress, store and acknowledge
        what is done, hand every other held message back to its queue."""
        if self.stopped or self.service is None:
            return
        self.stopped = self.messages.closed = True
        t0 = time.monotonic()
        self.service.stop(timeout=self.settings.shutdown_timeout)
        if self.canvas_thread is not None:  # the results thread has handed it all it will: send that, then stop
            self.canvas_thread.close()
            self.canvas_thread.join(self.settings.shutdown_timeout)
        self.messages.drain_finished()
        returned, _ = self.messages.hand_back(self.ledger)
        self._withdraw()
        log.info("stopped in %.1fs: handed %d buffered messages back to the queue", time.monotonic() - t0,
                 returned)

    def _withdraw(self) -> None:
        if self.reporter is not None:
            self.reporter.withdraw()

    def _refused(self, error: errors.EmbedqError) -> None:
        """A message refused (texts unknown: it could not be read as a job): counted."""
        if self.service is not None:
            self.service.count_received(0)
            self.service.count_failure(error.code, 0)
