"""Celery integration: tasks whose messages bypass the pool and go to the coalescing service.

There is one Celery task per job kind (every entry of the kinds table, ``kinds.TASKS``, plugins' kinds included),
all with the same *strategy*: Celery hands each message to it.
It builds the Celery request, lets the :class:`~embedq.workers.service.EmbeddingService` validate, tokenize and buffer
it, and returns at once: the consumer keeps pulling messages up to the prefetch window (the
unacknowledged limit), so the scheduler sees the texts of *all* waiting jobs. When a job is done,
the inference thread stores its result (or typed error) in the result backend; only then is the
message acknowledged — on the consumer's own thread, which owns the broker channel.

Delivery is at least once and idempotent (see :mod:`embedq.workers.delivery`): held messages keep
their lease, redelivered ones are checked against what is stored, suspects of a crash run alone and
are dead-lettered after ``max_attempts`` worker deaths, and a message that cannot be read is refused
with a typed error, never logged with its body and never run. On SIGTERM :class:`GracefulStop`
finishes the micro-batch in progress, stores and acknowledges what is done, and hands the rest back.
"""

from __future__ import annotations

import contextlib
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
from kombu.exceptions import ContentDisallowed
from kombu.utils.imports import symbol_by_name

from embedq import errors
from embedq.batching import PrefetchWindow
from embedq.batching.traffic import BULK, ONLINE, TrafficClass
from embedq.broker import BROKER_ERRORS, lease_interval, redis_client
from embedq.cancellation import CancelFeed
from embedq.kinds import TASKS, TaskSpec
from embedq.protocol import MAX_DEADLINE_SECONDS, RESENT_HEADER, SENT_HEADER, TASK_NAME
from embedq.results import ResultStore
from embedq.settings import Settings
from embedq.workers import memory, transport
from embedq.workers.delivery import Ledger, Verdict, renew_leases
from embedq.workers.jobs import Job
from embedq.workers.metrics import Reporter, WorkerMetrics
from embedq.workers.observe import WorkerInfo, event_kwargs, short_args, window_stats, worker_record
from embedq.workers.service import EmbeddingService

log = logging.getLogger(__name__)

MAX_JOB_ID = 256  # characters: a longer "id" header names no job embedq would have sent (its ids are UUIDs)
ACK_INTERVAL = 0.02  # seconds between drains of finished jobs on the consumer thread
INTAKE_MAX = 256  # jobs delivered before the intake is handed to the service even in the middle of a fetch
CANCEL_INTERVAL = 0.05  # seconds between reads of the cancellation stream
CANCEL_STALE = 0.1  # a delivery checks the stream itself when the last read is older than this
CANCEL_BACKOFF = 2.0  # seconds without reading the stream after a failed read (the broker is away)
LIVENESS_INTERVAL = 1.0  # seconds between two looks at the service's threads (see Worker.check_liveness)
DRAIN_ON_FAILURE = 5.0  # seconds a failing worker lets its results thread write what it holds
#: Exit status of a worker that stopped because it could no longer do its work (EX_SOFTWARE): restart it.
EXIT_FAILED = 70


#: A job whose terminal record was already stored before this delivery (see delivery.Ledger.check).
ALREADY_STORED = "already-stored"


@dataclass
class Delivery:
    """The Celery requests (messages) that carry one job: usually one, more when it was delivered again
    while this worker held it. Each is acknowledged once the job's record is stored."""

    reqs: list[tuple[Any, int]] = field(default_factory=list)  # (request, texts counted in the window)

    @property
    def primary(self) -> Any:
        return self.reqs[0][0]


class Worker:
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
        self.hostname = ""
        self.started_at = 0.0  # Unix time the worker started consuming
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
            from embedq.backends import load_backend, runtime  # the worker process only: imports torch

            settings = self.settings
            runtime.on_chosen = partial(memory.settle, settings.memory_policy)
            metrics = self.metrics = WorkerMetrics()
            t0 = time.perf_counter()
            backend = load_backend(
                settings.model, device=settings.device, dtype=settings.dtype, torch_threads=settings.torch_threads,
                linear_kernel=settings.linear_kernel, batch_tokens=settings.batch_tokens,
                online_tokens=settings.online_tokens, pooling=settings.pooling,
                trust_remote_code=settings.trust_remote_code,
            )
            metrics.model_load_seconds = time.perf_counter() - t0
            log.info("loaded %s on %s (%s, runtime %s) in %.1fs", backend.info.model_id, backend.info.device,
                     backend.info.dtype, backend.info.linear_kernel, metrics.model_load_seconds)
            if backend.info.linear_kernel == "onnxruntime" and (
                    not settings.preempt or backend.preemption_blocker() is not None):  # no layered runtime in use
                # ONNX Runtime runs the model on its own thread pool (torch_threads threads); PyTorch is left
                # with the heads' small ops, and its idle OpenMP workers would compete with ONNX Runtime's for
                # every core (bench/peers.py on 2 cores: 0.85x the raw ONNX Runtime loop with PyTorch's 2
                # threads, 1.03x with 1).
                import torch

                torch.set_num_threads(1)
            policy = memory.settle(settings.memory_policy, backend.info.linear_kernel)
            log.info("memory policy %s (asked %s)", policy, settings.memory_policy)
            self.service = EmbeddingService(backend, settings, on_done=self.store_outcome, memory_policy=policy,
                                            on_done_many=self.store_outcomes,
                                            on_isolated_run=self.count_run, on_started=self.job_started,
                                            metrics=metrics).start()
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
        delay = 0.2
        while True:
            try:
                written = ResultStore(app).store_many([(job.id, outcome) for job, outcome in done])
                break
            except BROKER_ERRORS as exc:
                if self.service is not None and self.service.stopping:
                    log.warning("could not store %d job(s) before stopping (%s); they will run again", len(done),
                                type(exc).__name__)
                    return
                log.warning("storing %d job(s) failed (%s); retrying in %.1fs", len(done), type(exc).__name__,
                            delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        now = time.monotonic()
        for (job, outcome), wrote in zip(done, written):
            if not wrote:  # another outcome came first (the job was cancelled while it ran): that one stands
                log.info("job %s already has an outcome; its %s is not stored", job.id,
                         "error" if isinstance(outcome, errors.EmbedqError) else "result")
            self.finished.put((job, outcome, now))

    # -- the consumer thread -----------------------------------------------------------------------

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
                    self.window.released(size, bulk=self.traffic_class(_routing_key(req)) == BULK)
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

    def strategy(self, task: Task, app: Celery, consumer: Any):
        """Celery calls this (through :func:`coalescing_strategy`) once per consumer start and task; it
        returns the per-message handler."""
        from celery.worker.request import create_request_cls

        service = self.load_service()
        settings = service.settings
        hostname = consumer.hostname
        eventer = consumer.event_dispatcher
        if eventer is not None and getattr(eventer, "buffer_group", None):
            # Task events are buffered and published as one "task.multi" message when the event loop comes round
            # (Celery's own scheme); Celery also publishes every 24, which splits one fetch's events into several
            # round trips. Flower and `celery events` read either form.
            eventer.buffer_limit = max(getattr(eventer, "buffer_limit", 0), 4 * settings.fetch_batch)
        connection_errors = consumer.connection_errors
        Req = create_request_cls(symbol_by_name(task.Request), task, consumer.pool, hostname, eventer, app=app)
        if self.window is None:
            self.window = PrefetchWindow(max_messages=settings.prefetch_window, max_texts=settings.prefetch_texts,
                                         online_reserve=settings.online_reserve)
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
        self.timers = [consumer.timer.call_repeatedly(ACK_INTERVAL, self.drain_finished),
                       consumer.timer.call_repeatedly(lease_interval(settings), self.renew_leases),
                       consumer.timer.call_repeatedly(CANCEL_INTERVAL, self.follow_cancellations),
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

    def receive(self, task: Task, app: Celery, message: Any, body: Any, ack: Any, reject: Any, Req: Any,
                hostname: str, eventer: Any, connection_errors: Any) -> None:
        """Consumer thread: one message of an embedq task: refuse what cannot be read, else deliver it."""
        from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2

        settings = self.settings
        too_large = getattr(message, "refusal", None) or _too_large(message, settings.max_message_bytes)
        if too_large is not None:
            self.refuse(task, message, too_large)
            return
        try:
            if body is None and "args" not in message.payload:
                body, headers, decoded, utc = message.body, message.headers, False, app.uses_utc_timezone()
            elif "args" in message.payload:
                body, headers, decoded, utc = hybrid_to_proto2(message, message.payload)
            else:
                body, headers, decoded, utc = proto1_to_proto2(message, body)
            req = Req(message, on_ack=ack, on_reject=reject, app=app, hostname=hostname, eventer=eventer,
                      task=task, connection_errors=connection_errors, body=body, headers=headers,
                      decoded=decoded, utc=utc)
            args, kwargs = req.args, req.kwargs
        except ContentDisallowed:
            self.refuse(task, message, errors.InvalidMessage(
                f"content type {message.content_type!r} refused: only json and msgpack are accepted"))
            return
        except Exception as exc:
            self.refuse(task, message, errors.InvalidMessage(f"malformed task message ({type(exc).__name__})"))
            return
        if not _job_id_ok(req.id):
            self.refuse(task, message, errors.InvalidMessage(
                f"the message has no job id (a string of 1 to {MAX_JOB_ID} characters, UTF-8)"))
            return
        self.deliver(req, args, kwargs, message, TASKS[task.name])

    def deliver(self, req: Any, args: Any, kwargs: Any, message: Any, spec: TaskSpec) -> None:
        """Consumer thread: a readable job message of ``spec``'s kind (the task the message names: a ``shadow``
        header changes no kind). Hold it, then run it, cancel it, recognise it as already stored or dead-letter
        it."""
        service, settings = self.service, self.settings
        assert service is not None and self.window is not None and self.ledger is not None
        size = spec.size(args)
        routing_key = _routing_key(req) or settings.queue_name
        klass = self.traffic_class(routing_key)
        # What the task events show, worked out before the message is counted anywhere: nothing below may fail
        # between counting it (reserved, the prefetch window) and holding it.
        event = {"name": spec.name, "args": short_args(req), "expires": _iso(req.expires),
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
        job = Job(id=req.id, texts=args, options=kwargs, context=Delivery([(req, size)]), size=size, spec=spec,
                  traffic_class=klass, deadline=_deadline(req.expires))
        self.held[job.id] = job
        verdict = Verdict()
        headers = req._request_dict or {}
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
            service.count_received(job.size, klass, spec.kind)
            service.stats.add(already_stored=1)
            self.finished.put((job, ALREADY_STORED, time.monotonic()))
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

    # -- cancellation, dead letters, refusals --------------------------------------------------------

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

    def refuse(self, task: Task, message: Any, error: errors.EmbedqError) -> None:
        """A message that is never run: record its typed error when it names a job, acknowledge it, and log
        its id and the reason only (never its body: it may hold users' texts)."""
        headers = getattr(message, "headers", None)
        task_id = headers.get("id") if isinstance(headers, dict) else None
        log.warning("refused message %s: %s", task_id if _job_id_ok(task_id) else "(no id)", error.message)
        if _job_id_ok(task_id):
            try:
                ResultStore(task.app).store(task_id, error)
            except Exception as exc:  # the broker is away (or the record cannot be written): the log says so
                log.warning("could not store the refusal of %s (%s)", task_id, type(exc).__name__)
        if self.service is not None:  # texts unknown: the message could not be read as a job
            self.service.count_received(0)
            self.service.count_failure(error.code, 0)
        message.ack()

    # -- liveness ------------------------------------------------------------------------------------

    def check_liveness(self) -> None:
        """Consumer thread, every LIVENESS_INTERVAL: a worker whose inference or results thread died, or whose
        inference thread stopped making progress while work waits, must not go on taking jobs and calling itself
        alive (its heartbeat and registry record come from other threads): it stops (:meth:`fail_stop`)."""
        service = self.service
        if service is None or self.stopped:
            return
        reason = service.health(self.settings.stall_timeout)
        if reason is not None:
            self.fail_stop(reason)

    def fail_stop(self, reason: str) -> None:
        """Consumer thread: stop serving and exit with :data:`EXIT_FAILED`, for a supervisor to restart the worker.

        What was stored is acknowledged; every other held message goes back to its queue. The jobs of the
        micro-batch in the model are not marked as handed back, so their next delivery counts as one that ended
        with the worker dead (they run alone, and are dead-lettered after ``max_attempts``: a poison input cannot
        take down worker after worker); the rest are marked handed back and run as usual."""
        service = self.service
        assert service is not None
        log.critical("stopping: %s", reason)
        self.stopped = True
        running = {job.id for job in service.running}
        self.settle_fetch()
        service.abandon()
        service.drain(DRAIN_ON_FAILURE)
        self.drain_finished()
        returned, blamed = self.hand_back(blamed=running)
        with contextlib.suppress(Exception):  # else Flower sees the heartbeats stop
            self.consumer.event_dispatcher.send("worker-offline")
        log.critical("handed %d messages back (%d job(s) of the micro-batch in the model count a delivery that "
                     "ended with the worker dead); exiting with status %d", returned, blamed, EXIT_FAILED)
        logging.shutdown()
        os._exit(EXIT_FAILED)  # the inference thread may be stuck in native code: nothing would join it

    def settle_fetch(self) -> None:
        """Consumer thread: read the reply of the fetch (BRPOP) in flight, if any, before handing messages back:
        one handed back now would go to that fetch, and this process would never read it (kombu's channel does
        the same when it closes). A message it brings is handed back by the handler (the worker is stopped)."""
        channel = self.current_channel()
        if channel is None or not getattr(channel, "_in_poll", None):
            return
        try:
            channel._brpop_read()
        except queue.Empty:
            pass
        except Exception as exc:  # the broker is away: what it held comes back after visibility_timeout
            log.warning("could not read the fetch in flight: %s", type(exc).__name__)

    def hand_back(self, blamed: frozenset[str] | set[str] = frozenset()) -> tuple[int, int]:
        """Consumer thread, stopping: put every held message back on its queue and withdraw the registry record.
        Jobs are marked handed back (their next delivery is a plain one) except those in ``blamed`` (the micro-batch
        in the model when the worker failed: their next delivery counts as one that ended with the worker dead).
        Returns (messages handed back, held jobs blamed)."""
        self.intake.clear()  # held too: handed back below
        leftover = list(self.held.values())
        innocent = [job.id for job in leftover if job.id not in blamed]
        if innocent and self.ledger is not None:
            try:
                self.ledger.returned(innocent)
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
        self.held.clear()
        if self.reporter is not None:
            self.reporter.withdraw()
        return returned, len(leftover) - len(innocent)

    # -- the warm shutdown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """See :class:`GracefulStop`."""
        if self.stopped or self.service is None:
            return
        self.stopped = True
        t0 = time.monotonic()
        self.service.stop(timeout=self.settings.shutdown_timeout)
        self.drain_finished()
        returned, _ = self.hand_back()
        log.info("stopped in %.1fs: handed %d buffered messages back to the queue", time.monotonic() - t0,
                 returned)


def _routing_key(req: Any) -> str | None:
    info = getattr(req, "delivery_info", None)
    key = info.get("routing_key") if isinstance(info, dict) else None
    return key if isinstance(key, str) else None


def _job_id_ok(job_id: Any) -> bool:
    """A job id embedq can key records by: a string of 1 to MAX_JOB_ID characters that UTF-8 can encode (a lone
    surrogate cannot be written to Redis: its job would never get a record nor its message an ack)."""
    if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_JOB_ID:
        return False
    try:
        job_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


def worker_of(app: Celery) -> Worker:
    """The :class:`Worker` that :func:`register` gave this Celery app."""
    worker = getattr(app, "embedq_worker", None)
    if worker is None:
        raise RuntimeError("this Celery app has no embedq worker: start it with `embedq worker`")
    return worker


def coalescing_strategy(task: Task, app: Celery, consumer: Any, **_: Any):
    """The strategy of every job kind's task (Celery's hook, named in :class:`JobTask`)."""
    return worker_of(app).strategy(task, app, consumer)


def _deadline(expires: Any) -> float | None:
    """A Celery ``expires`` (an aware datetime) as a monotonic time, at most ``MAX_DEADLINE_SECONDS`` from now
    (producers refuse longer deadlines; one sent by other means is clamped, so no wait can overflow)."""
    if expires is None:
        return None
    try:
        left = float(expires.timestamp() - time.time())
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None
    if left != left:  # NaN
        return None
    return time.monotonic() + min(left, float(MAX_DEADLINE_SECONDS))


def _iso(expires: Any) -> str | None:
    return expires.isoformat() if hasattr(expires, "isoformat") else None


def _too_large(message: Any, limit: int) -> errors.EmbedqError | None:
    body = getattr(message, "body", None)
    if isinstance(body, (bytes, bytearray, str)) and len(body) > limit:
        return errors.MessageTooLarge(f"the message body has {len(body)} bytes; the limit is {limit}")
    return None


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
    """Give the app its worker and register every job kind's task (the worker refuses, per job, the kinds
    its model does not serve)."""
    app.embedq_worker = worker
    transport.fetch_order = worker.fetch_order
    transport.fetch_plan = worker.fetch_plan
    transport.fetch_admits = worker.fetch_admits
    transport.after_fetch = worker.flush_intake
    transport.max_body_bytes = transport.fetch_bytes = worker.settings.max_message_bytes
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
