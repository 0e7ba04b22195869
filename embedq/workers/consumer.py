"""Celery integration: a task whose messages bypass the pool and go to the coalescing service.

Celery hands each message of ``embedq.embed`` to the task's *strategy*. Ours builds the Celery
request, lets the :class:`~embedq.workers.service.EmbeddingService` validate, tokenize and buffer
it, and returns at once: the consumer keeps pulling messages up to the prefetch window (the
unacknowledged limit), so the scheduler sees the texts of *all* waiting jobs. When a job is done,
the inference thread stores its result (or typed error) in the result backend; only then is the
message acknowledged — on the consumer's own thread, which owns the broker channel.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from celery import Celery, Task, signals
from celery.worker import state as worker_state
from celery.worker.control import inspect_command
from kombu.utils.imports import symbol_by_name

from embedq import errors
from embedq.batching import PrefetchWindow
from embedq.protocol import TASK_NAME
from embedq.settings import Settings
from embedq.workers.service import EmbeddingService, Job

log = logging.getLogger(__name__)

ACK_INTERVAL = 0.02  # seconds between drains of finished jobs on the consumer thread


class _Runtime:
    """Per-process state of a worker: its settings, the service, and finished jobs to ack."""

    settings: Settings | None = None
    service: EmbeddingService | None = None
    finished: queue.SimpleQueue = queue.SimpleQueue()
    timer_entry: Any = None
    window: PrefetchWindow | None = None
    consumer: Any = None  # Celery's Consumer: its qos is the channel's prefetch count


RUNTIME = _Runtime()


def configure(settings: Settings) -> None:
    RUNTIME.settings = settings


def load_service() -> EmbeddingService:
    """Load the model and start the inference thread (once per process).

    ``embedq worker`` calls this before Celery starts, so a model that cannot load stops the worker
    with a clear error and a non-zero exit instead of a consumer that dies inside Celery.
    """
    if RUNTIME.service is None:
        from embedq.backends import load_backend  # the worker process only: imports torch

        settings = RUNTIME.settings or Settings()
        t0 = time.perf_counter()
        backend = load_backend(
            settings.model, device=settings.device, dtype=settings.dtype, torch_threads=settings.torch_threads,
            linear_kernel=settings.linear_kernel,
        )
        log.info("loaded %s on %s (%s, %s linear kernel) in %.1fs", backend.info.model_id, backend.info.device,
                 backend.info.dtype, backend.info.linear_kernel, time.perf_counter() - t0)
        RUNTIME.service = EmbeddingService(backend, settings, on_done=_store_outcome).start()
    return RUNTIME.service


def _store_outcome(job: Job, outcome: dict[str, Any] | errors.EmbedqError) -> None:
    """Runs on the inference (or consumer) thread: write the terminal record, then queue the ack."""
    req = job.context
    backend = req.task.backend  # thread-local backend instance
    if isinstance(outcome, errors.EmbedqError):
        backend.mark_as_failure(req.id, outcome, request=req._context, call_errbacks=True)
    else:
        outcome["worker"] = req.hostname  # the indexer's summary counts texts per worker
        backend.mark_as_done(req.id, outcome, request=req._context)
    RUNTIME.finished.put((req, outcome, time.monotonic() - job.received, job.size))


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


def _drain_finished() -> None:
    """Consumer thread: acknowledge what has been stored and emit the task events."""
    released = False
    while True:
        try:
            req, outcome, runtime, size = RUNTIME.finished.get_nowait()
        except queue.Empty:
            break
        try:
            req.acknowledge()
        finally:
            worker_state.task_ready(req, successful=not isinstance(outcome, errors.EmbedqError))
            if RUNTIME.window is not None:
                RUNTIME.window.released(size)
                released = True
        if isinstance(outcome, errors.EmbedqError):
            req.send_event("task-failed", exception=repr(outcome), traceback="")
        else:
            req.send_event("task-succeeded", result=f"{outcome['usage']['texts']} vectors", runtime=runtime)
    if released:
        _apply_window()


def coalescing_strategy(task: Task, app: Celery, consumer: Any, **_: Any):
    """Celery calls this once per consumer start; it returns the per-message handler."""
    from celery.worker.request import create_request_cls
    from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2

    service = load_service()
    hostname = consumer.hostname
    eventer = consumer.event_dispatcher
    connection_errors = consumer.connection_errors
    Req = create_request_cls(symbol_by_name(task.Request), task, consumer.pool, hostname, eventer, app=app)
    if RUNTIME.window is None:  # kept across consumer restarts: held messages are still held
        RUNTIME.window = PrefetchWindow(max_messages=service.settings.prefetch_window,
                                        max_texts=service.settings.prefetch_texts)
    RUNTIME.consumer = consumer
    if RUNTIME.timer_entry is not None:
        RUNTIME.timer_entry.cancel()
    RUNTIME.timer_entry = consumer.timer.call_repeatedly(ACK_INTERVAL, _drain_finished)

    def handler(message, body, ack, reject, callbacks, **kw):
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
        except Exception as exc:
            _refuse_malformed(task, message, exc)
            return
        worker_state.task_reserved(req)
        req.send_event("task-received", name=req.name, args=_short_args(req), kwargs="")
        args = req.args
        if not isinstance(args, (list, tuple)) or len(args) != 1:
            texts: Any = _BadArgs(args)
        else:
            texts = args[0]
        job = Job(id=req.id, texts=texts, options=req.kwargs, context=req,
                  size=len(texts) if isinstance(texts, (list, tuple)) else 1)
        RUNTIME.window.received(job.size)
        _apply_window()
        if isinstance(texts, _BadArgs):
            service.fail(job, errors.InvalidType(
                f"{TASK_NAME} takes exactly one positional argument (the list of texts)"))
            return
        service.submit(job)

    return handler


class _BadArgs:
    def __init__(self, args: Any) -> None:
        self.args = args


def _short_args(req: Any) -> str:
    try:
        texts = req.args[0]
        return f"[{len(texts)} texts]"
    except Exception:
        return "[?]"


def _refuse_malformed(task: Task, message: Any, exc: Exception) -> None:
    """A message Celery cannot parse: record a typed error if it has an id, and drop it."""
    task_id = (getattr(message, "headers", None) or {}).get("id")
    log.warning("refusing malformed message %s: %s", task_id, type(exc).__name__)
    if task_id:
        task.backend.mark_as_failure(task_id, errors.InvalidType(f"malformed task message: {exc}"))
    message.ack()


class EmbedTask(Task):
    """``embedq.embed``: its messages never reach the pool (see :func:`coalescing_strategy`)."""

    name = TASK_NAME
    acks_late = True
    typing = False
    Strategy = "embedq.workers.consumer:coalescing_strategy"

    def run(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - only reached by .apply()
        raise errors.Unavailable("embedq.embed runs only inside an embedq worker")


def register(app: Celery) -> Task:
    return app.register_task(EmbedTask())


@inspect_command()
def embedq_stats(state: Any) -> dict[str, Any]:
    """``celery inspect embedq_stats``: the service's counters and model."""
    service = RUNTIME.service
    if service is None:
        return {"ready": False}
    return {"ready": True, "model": service.info.model_id, "device": service.info.device,
            "dtype": service.info.dtype, "linear_kernel": service.info.linear_kernel,
            "buffered": len(service.scheduler), **_window_stats(), **service.stats.as_dict()}


def _window_stats() -> dict[str, int]:
    window = RUNTIME.window
    if window is None:
        return {}
    return {"held_messages": window.messages, "held_texts": window.texts, "peak_held_messages": window.peak_messages,
            "peak_held_texts": window.peak_texts, "prefetch_limit": window.limit()}


@signals.worker_shutting_down.connect
def _on_shutdown(**_: Any) -> None:
    if RUNTIME.service is not None:
        RUNTIME.service.stop(timeout=60)
        try:
            _drain_finished()  # ack what was stored; the rest goes back to the queue
        except Exception:
            log.warning("could not acknowledge finished jobs at shutdown", exc_info=True)
