"""Celery integration: tasks whose messages bypass the pool and go to the coalescing service.

There is one Celery task per job kind (``protocol.TASKS``: ``embedq.embed``, ``embedq.rerank``,
``embedq.predict``, ``embedq.tokenize``), all with the same *strategy*: Celery hands each message to it.
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

import logging
import queue
import time
from dataclasses import dataclass, field
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
from embedq.protocol import RESENT_HEADER, SENT_HEADER, TASK_NAME, TASKS, TaskSpec
from embedq.results import ResultStore
from embedq.settings import Settings
from embedq.workers import transport
from embedq.workers.delivery import Ledger, Verdict, renew_leases
from embedq.workers.metrics import Reporter, WorkerMetrics
from embedq.workers.observe import WorkerInfo, event_kwargs, job_started, short_args, window_stats, worker_record
from embedq.workers.runtime import RUNTIME
from embedq.workers.service import EmbeddingService, Job

log = logging.getLogger(__name__)

ACK_INTERVAL = 0.02  # seconds between drains of finished jobs on the consumer thread
CANCEL_INTERVAL = 0.05  # seconds between reads of the cancellation stream
CANCEL_STALE = 0.1  # a delivery checks the stream itself when the last read is older than this
CANCEL_BACKOFF = 2.0  # seconds without reading the stream after a failed read (the broker is away)


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


def configure(settings: Settings) -> None:
    RUNTIME.settings = settings
    RUNTIME.bulk_queues = frozenset({settings.bulk_queue_name})
    transport.fetch_order = _fetch_order


def traffic_class(routing_key: str | None) -> TrafficClass:
    return BULK if routing_key in RUNTIME.bulk_queues else ONLINE


def _routing_key(req: Any) -> str | None:
    return (getattr(req, "delivery_info", None) or {}).get("routing_key")


def _fetch_order(queues: list[str]) -> list[str]:
    """The transport asks which queues to fetch from now: online ones first, and bulk ones only while
    the prefetch window has room for bulk (a share of it stays free for online jobs)."""
    window = RUNTIME.window
    online = [q for q in queues if q not in RUNTIME.bulk_queues]
    bulk = [q for q in queues if q in RUNTIME.bulk_queues]
    if window is None:
        return online + bulk
    return (online if window.admits(bulk=False) else []) + (bulk if window.admits(bulk=True) else [])


def load_service() -> EmbeddingService:
    """Load the model and start the inference thread (once per process).

    ``embedq worker`` calls this before Celery starts, so a model that cannot load stops the worker
    with a clear error and a non-zero exit instead of a consumer that dies inside Celery.
    """
    if RUNTIME.service is None:
        from embedq.backends import load_backend  # the worker process only: imports torch

        settings = RUNTIME.settings or Settings()
        metrics = RUNTIME.metrics = WorkerMetrics()
        t0 = time.perf_counter()
        backend = load_backend(
            settings.model, device=settings.device, dtype=settings.dtype, torch_threads=settings.torch_threads,
            linear_kernel=settings.linear_kernel,
        )
        metrics.model_load_seconds = time.perf_counter() - t0
        log.info("loaded %s on %s (%s, %s linear kernel) in %.1fs", backend.info.model_id, backend.info.device,
                 backend.info.dtype, backend.info.linear_kernel, metrics.model_load_seconds)
        RUNTIME.service = EmbeddingService(backend, settings, on_done=_store_outcome, on_isolated_run=_count_run,
                                           on_started=job_started, metrics=metrics).start()
        metrics.bind(RUNTIME.service, window_state=window_stats, queues=settings.queues,
                     redis=redis_client(settings) if settings.broker_url else None)
    return RUNTIME.service


def _count_run(job: Job, starting: bool) -> None:
    """Inference thread: a suspect job starts (or has finished) its run alone; count it while it runs."""
    if RUNTIME.ledger is not None:
        try:
            RUNTIME.ledger.count_run(job.id, 1 if starting else -1)
        except BROKER_ERRORS:
            log.warning("could not count the run of suspect job %s (broker unreachable)", job.id)


def _store_outcome(job: Job, outcome: dict[str, Any] | errors.EmbedqError) -> None:
    """Results thread: write the terminal record (riding out a broker restart), then queue the ack.

    If the service stops before the record is stored, the job is left unacknowledged: its message is
    handed back (or redelivered) and the job runs again.
    """
    req = job.context.primary
    if not isinstance(outcome, errors.EmbedqError):
        outcome["worker"] = req.hostname  # the indexer's summary counts texts per worker
    delay = 0.2
    while True:
        try:
            if not ResultStore(req.task.app).store(req.id, outcome):
                # Another outcome came first (the job was cancelled while it ran): that one stands.
                log.info("job %s already has an outcome; its %s is not stored", job.id,
                         "error" if isinstance(outcome, errors.EmbedqError) else "result")
            break
        except BROKER_ERRORS as exc:
            if RUNTIME.service is not None and RUNTIME.service.stopping:
                log.warning("could not store job %s before stopping (%s); it will run again", job.id,
                            type(exc).__name__)
                return
            log.warning("storing job %s failed (%s); retrying in %.1fs", job.id, type(exc).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
    RUNTIME.finished.put((job, outcome, time.monotonic()))


def _apply_window() -> None:
    """Consumer thread: set the channel's prefetch count to what the text window allows now."""
    qos = getattr(RUNTIME.consumer, "qos", None)
    if qos is None or RUNTIME.window is None:
        return
    delta = RUNTIME.window.limit() - qos.value
    if delta > 0:
        qos.increment_eventually(delta)
    elif delta < 0:
        qos.decrement_eventually(-delta)
    if qos.prev != qos.value:
        qos.update()  # at once, so the transport stops (or resumes) fetching before the next message


def _current_channel() -> Any:
    task_consumer = getattr(RUNTIME.consumer, "task_consumer", None)
    return getattr(task_consumer, "channel", None)


def _ack(req: Any) -> None:
    """Acknowledge one message. After a reconnect its channel is gone; the unacked entry in Redis is
    the same, so it is removed through the current channel."""
    if req.acknowledged:
        return
    message = req.message
    try:
        message.ack()
    except Exception:
        channel = _current_channel()
        if channel is None:
            raise
        channel.qos.ack(message.delivery_tag)
    req.acknowledged = True


def _drain_finished() -> None:
    """Consumer thread: acknowledge what has been stored and emit the task events."""
    while True:
        try:
            job = RUNTIME.started.get_nowait()
        except queue.Empty:
            break
        job.context.primary.send_event("task-started")
    released = False
    while True:
        try:
            job, outcome, done_at = RUNTIME.finished.get_nowait()
        except queue.Empty:
            break
        runtime = done_at - (job.started if job.started is not None else job.received)
        if RUNTIME.metrics is not None and outcome != ALREADY_STORED:
            RUNTIME.metrics.observe("job_seconds", max(done_at - job.received, 0.0), job.traffic_class)
        if RUNTIME.held.get(job.id) is job:
            del RUNTIME.held[job.id]
        failed = isinstance(outcome, errors.EmbedqError)
        for req, size in job.context.reqs:
            try:
                _ack(req)
            except Exception:  # the broker is away: the message is redelivered and found already stored
                log.warning("could not acknowledge job %s; it will be redelivered and recognised", job.id)
            worker_state.task_ready(req, successful=not failed)
            if RUNTIME.window is not None:
                RUNTIME.window.released(size, bulk=traffic_class(_routing_key(req)) == BULK)
                released = True
        req = job.context.primary
        if isinstance(outcome, errors.Cancelled):
            req.send_event("task-revoked", terminated=False, signum=None, expired=False)
        elif isinstance(outcome, errors.Expired):
            req.send_event("task-revoked", terminated=False, signum=None, expired=True)
        elif failed:
            req.send_event("task-failed", exception=repr(outcome), traceback="")
        elif outcome == ALREADY_STORED:
            req.send_event("task-succeeded", result="already stored", runtime=runtime)
        else:
            req.send_event("task-succeeded", result=f"{outcome['usage']['texts']} vectors", runtime=runtime)
    if released:
        _apply_window()


def _renew_leases() -> None:
    """Consumer thread: keep every held message from being redelivered while this worker lives."""
    channel = _current_channel()
    if channel is None or not RUNTIME.held:
        return
    tags = [req.message.delivery_tag for job in RUNTIME.held.values() for req, _ in job.context.reqs]
    try:
        renew_leases(channel, tags)
    except Exception as exc:
        log.warning("could not renew the leases of %d held messages: %s", len(tags), type(exc).__name__)


def coalescing_strategy(task: Task, app: Celery, consumer: Any, **_: Any):
    """Celery calls this once per consumer start; it returns the per-message handler."""
    from celery.worker.request import create_request_cls
    from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2

    service = load_service()
    settings = service.settings
    hostname = consumer.hostname
    eventer = consumer.event_dispatcher
    connection_errors = consumer.connection_errors
    Req = create_request_cls(symbol_by_name(task.Request), task, consumer.pool, hostname, eventer, app=app)
    if RUNTIME.window is None:  # kept across consumer restarts: held messages are still held
        RUNTIME.window = PrefetchWindow(max_messages=settings.prefetch_window, max_texts=settings.prefetch_texts,
                                        online_reserve=settings.online_reserve)
    if RUNTIME.ledger is None:
        RUNTIME.ledger = Ledger(task.backend, max_attempts=settings.max_attempts)
    if RUNTIME.cancels is None and settings.broker_url:
        RUNTIME.cancels = CancelFeed(redis_client(settings, timeout=2.0))
    RUNTIME.consumer = consumer
    if RUNTIME.reporter is None and RUNTIME.metrics is not None and RUNTIME.metrics.redis is not None:
        RUNTIME.hostname, RUNTIME.started_at = hostname, time.time()
        RUNTIME.reporter = Reporter(worker_record, RUNTIME.metrics, RUNTIME.metrics.redis)
        RUNTIME.reporter.start()
    for entry in RUNTIME.timers:
        entry.cancel()
    RUNTIME.timers = [consumer.timer.call_repeatedly(ACK_INTERVAL, _drain_finished),
                      consumer.timer.call_repeatedly(lease_interval(settings), _renew_leases),
                      consumer.timer.call_repeatedly(CANCEL_INTERVAL, _follow_cancellations)]
    _follow_cancellations()

    def handler(message, body, ack, reject, callbacks, **kw):
        if RUNTIME.stopped:  # a delivery that raced the graceful stop: straight back to the queue
            message.reject(requeue=True)
            return
        too_large = _too_large(message, settings.max_message_bytes)
        if too_large is not None:
            refuse(task, message, too_large)
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
            refuse(task, message, errors.InvalidMessage(
                f"content type {message.content_type!r} refused: only json and msgpack are accepted"))
            return
        except Exception as exc:
            refuse(task, message, errors.InvalidMessage(f"malformed task message ({type(exc).__name__})"))
            return
        if not isinstance(req.id, str) or not req.id:
            refuse(task, message, errors.InvalidMessage("the message has no job id"))
            return
        spec = TASKS.get(req.name) or TASKS[TASK_NAME]
        size = spec.size(args)
        routing_key = _routing_key(req) or settings.queue_name
        klass = traffic_class(routing_key)
        worker_state.task_reserved(req)
        RUNTIME.window.received(size, bulk=klass == BULK)
        _apply_window()
        held = RUNTIME.held.get(req.id)
        if held is not None:  # delivered again while held (resent, or restored across a reconnect)
            held.context.reqs.append((req, size))
            service.stats.add(duplicates=1)
            return
        req.send_event("task-received", name=req.name, args=short_args(req),
                       kwargs=event_kwargs(kwargs, service, routing_key, klass, spec.kind), expires=_iso(req.expires))
        job = Job(id=req.id, texts=args, options=kwargs, context=Delivery([(req, size)]), size=size, spec=spec,
                  traffic_class=klass, deadline=_deadline(req.expires))
        RUNTIME.held[job.id] = job
        verdict = Verdict()
        headers = req._request_dict or {}
        sent_at = headers.get(SENT_HEADER)
        if isinstance(sent_at, (int, float)) and RUNTIME.metrics is not None:
            RUNTIME.metrics.observe("queue_seconds", max(time.time() - sent_at, 0.0), klass)
        redelivered = bool(req.delivery_info.get("redelivered") or headers.get("redelivered"))
        if redelivered or headers.get(RESENT_HEADER):
            service.stats.add(redelivered=int(redelivered))
            try:
                verdict = RUNTIME.ledger.check(job.id, redelivered=redelivered)
            except Exception as exc:  # cannot tell: the safe side is to run it alone
                log.warning("could not read the history of job %s: %s", job.id, type(exc).__name__)
                verdict = Verdict(suspect=redelivered, crashes=int(redelivered))
        if verdict.stored:
            service.count_received(job.size, klass, spec.kind)
            service.stats.add(already_stored=1)
            RUNTIME.finished.put((job, ALREADY_STORED, time.monotonic()))
        elif verdict.crashes >= settings.max_attempts:
            _dead_letter(service, job, verdict.crashes, hostname, message)
        elif _is_cancelled(req.id):
            service.count_received(job.size, klass, spec.kind)
            service.cancel(job)
        else:
            job.suspect = verdict.suspect
            service.submit(job)

    return handler


def _deadline(expires: Any) -> float | None:
    """A Celery ``expires`` (an aware datetime) as a monotonic time."""
    if expires is None:
        return None
    try:
        return time.monotonic() + (expires.timestamp() - time.time())
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None


def _iso(expires: Any) -> str | None:
    return expires.isoformat() if hasattr(expires, "isoformat") else None


def _is_cancelled(job_id: str) -> bool:
    """Consumer thread, on delivery: cancelled through embedq (the stream, read now unless read within
    CANCEL_STALE seconds) or revoked through Celery (Flower's button, ``celery control revoke``)."""
    feed = RUNTIME.cancels
    if feed is not None and time.monotonic() - feed.synced > CANCEL_STALE:
        _follow_cancellations()
    return (feed is not None and job_id in feed) or job_id in worker_state.revoked


def _follow_cancellations() -> None:
    """Consumer thread: drop the held jobs cancelled since the last look (those not yet started)."""
    feed, service = RUNTIME.cancels, RUNTIME.service
    ids: list[str] = []
    now = time.monotonic()
    if feed is not None and now >= RUNTIME.cancels_retry_at:
        try:
            ids = feed.poll()
        except Exception as exc:  # the broker is away: cancellations wait for it (and the event loop does not)
            RUNTIME.cancels_retry_at = now + CANCEL_BACKOFF
            log.debug("could not read cancellations: %s", type(exc).__name__)
    revoked = worker_state.revoked
    if len(revoked) != RUNTIME.revoked_seen:
        RUNTIME.revoked_seen = len(revoked)
        ids += [job_id for job_id in RUNTIME.held if job_id in revoked]
    if service is None:
        return
    for job_id in ids:
        job = RUNTIME.held.get(job_id)
        if job is not None and service.cancel(job):
            log.debug("job %s cancelled before it ran", job_id)


def _dead_letter(service: EmbeddingService, job: Job, crashes: int, hostname: str, message: Any) -> None:
    queue_name = (message.delivery_info or {}).get("routing_key") or service.settings.queue_name
    log.error("job %s was running when the worker died %d times: dead-lettered", job.id, crashes)
    try:
        RUNTIME.ledger.dead_letter(job.id, queue=queue_name, crashes=crashes, worker=hostname, texts=job.size)
    except BROKER_ERRORS:
        log.warning("could not record dead letter %s", job.id)
    service.count_received(job.size, job.traffic_class)
    service.stats.add(dead_letters=1)
    service.fail(job, errors.DeadLetter(
        f"the worker died while running this job {crashes} times (max_attempts={service.settings.max_attempts}); "
        "it is not delivered again"))


def _too_large(message: Any, limit: int) -> errors.EmbedqError | None:
    body = getattr(message, "body", None)
    if isinstance(body, (bytes, bytearray, str)) and len(body) > limit:
        return errors.MessageTooLarge(f"the message body has {len(body)} bytes; the limit is {limit}")
    return None


def refuse(task: Task, message: Any, error: errors.EmbedqError) -> None:
    """A message that is never run: record its typed error when it names a job, acknowledge it, and log
    its id and the reason only (never its body: it may hold users' texts)."""
    headers = getattr(message, "headers", None)
    task_id = headers.get("id") if isinstance(headers, dict) else None
    log.warning("refused message %s: %s", task_id if isinstance(task_id, str) else "(no id)", error.message)
    if isinstance(task_id, str) and task_id:
        try:
            ResultStore(task.app).store(task_id, error)
        except BROKER_ERRORS:
            log.warning("could not store the refusal of %s", task_id)
    if RUNTIME.service is not None:  # texts unknown: the message could not be read as a job
        RUNTIME.service.count_received(0)
        RUNTIME.service.count_failure(error.code, 0)
    message.ack()


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


def register(app: Celery) -> list[Task]:
    """Register every job kind's task (the worker refuses, per job, the kinds its model does not serve)."""
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
        if RUNTIME.stopped or RUNTIME.service is None:
            return
        RUNTIME.stopped = True
        settings = RUNTIME.service.settings
        t0 = time.monotonic()
        RUNTIME.service.stop(timeout=settings.shutdown_timeout)
        _drain_finished()
        leftover = list(RUNTIME.held.values())
        if leftover and RUNTIME.ledger is not None:
            try:
                RUNTIME.ledger.returned([job.id for job in leftover])
            except BROKER_ERRORS:
                log.warning("could not mark %d returned jobs", len(leftover))
        returned = 0
        for job in leftover:
            for req, _ in job.context.reqs:
                try:
                    req.message.channel.qos.restore_by_tag(req.message.delivery_tag)
                    returned += 1
                except Exception as exc:  # it stays in the unacked hash: redelivered after its lease lapses
                    log.warning("could not hand job %s back: %s", job.id, type(exc).__name__)
        RUNTIME.held.clear()
        if RUNTIME.reporter is not None:
            RUNTIME.reporter.withdraw()
        log.info("stopped in %.1fs: handed %d buffered messages back to the queue", time.monotonic() - t0,
                 returned)


class EmbedqConsumer(Consumer):
    """Celery's consumer, refusing what it cannot run without logging message bodies.

    Celery's own handlers log up to 1 KiB of the body (users' texts) at ERROR/CRITICAL and leave the
    producer waiting; these record a typed ``invalid_message`` error for the job id and log the reason.
    """

    def _task(self) -> Task:
        return self.app.tasks[TASK_NAME]

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        compression = (message.headers or {}).get("compression") if isinstance(message.headers, dict) else None
        how = f"content type {message.content_type!r}" + (f", compression {compression!r}" if compression else "")
        refuse(self._task(), message, errors.InvalidMessage(f"cannot decode the message ({type(exc).__name__}; {how})"))

    def on_unknown_message(self, body: Any, message: Any) -> None:
        refuse(self._task(), message, errors.InvalidMessage("not a Celery task message"))

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        headers = message.headers if isinstance(message.headers, dict) else {}
        name = str(headers.get("task"))[:100]
        refuse(self._task(), message, errors.InvalidMessage(
            f"unknown task {name!r}; this queue runs {', '.join(TASKS)}"))

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        refuse(self._task(), message, errors.InvalidMessage(f"invalid task message ({type(exc).__name__})"))
