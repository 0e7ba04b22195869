"""What a worker shows of itself: Prometheus metrics endpoint, task-event summaries, Celery's ``inspect``
views (``stats``, ``reserved``, ``embedq_stats``) and its record in the live-worker registry.

None of it ever carries a user's text: jobs are summarised by their texts' count, model, queue and options.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from celery import bootsteps
from celery.worker.control import inspect_command
from celery.worker.request import Request

from embedq.batching.traffic import BULK, ONLINE
from embedq.kinds import TASKS
from embedq.protocol import short_options
from embedq.settings import Settings
from embedq.version import __version__
from embedq.workers.metrics import DEFAULT_PORTS
from embedq.workers.stats import COUNTERS, TIMERS

if TYPE_CHECKING:
    from embedq.batching import PrefetchWindow
    from embedq.workers.metrics import WorkerMetrics
    from embedq.workers.service import EmbeddingService

log = logging.getLogger(__name__)


class Worker(Protocol):
    """What this module reads of a worker (:class:`embedq.workers.consumer.Worker` is one): named here, so that
    what shows a worker does not import what runs it (the consumer imports this module)."""

    settings: Settings
    service: EmbeddingService | None
    metrics: WorkerMetrics | None
    window: PrefetchWindow | None
    hostname: str
    started_at: float
    stopped: bool


def serve_metrics(worker: Worker) -> None:
    """Serve Prometheus metrics: on ``metrics_port`` when it is set (0: none), else on the first free port of
    :data:`~embedq.workers.metrics.DEFAULT_PORTS` (9808-9839), so the workers of one machine need no per-worker
    setting. A set port that is taken, or a machine whose 32 default ports are all taken, stops the worker with a
    clear message: a worker nobody can see is worse than one that does not start."""
    if worker.metrics is not None:
        serve_endpoint(worker.metrics, worker.settings, "embedq worker")


def serve_endpoint(metrics: WorkerMetrics, settings: Any, who: str) -> None:
    """:func:`serve_metrics` for any process of a worker (a split worker's device process serves its own)."""
    if settings.metrics_port == 0:
        return
    addr = settings.metrics_addr
    ports = [settings.metrics_port] if settings.metrics_port is not None else list(DEFAULT_PORTS)
    for port in ports:
        try:
            metrics.serve(port, addr)
        except OSError as exc:
            if settings.metrics_port is None and exc.errno == errno.EADDRINUSE:
                continue  # another worker's (or program's): try the next one
            raise SystemExit(f"{who}: cannot serve metrics on {addr}:{port} ({exc.strerror or exc}); "
                             "set EMBEDQ_METRICS_PORT to a free port, or 0 for none") from None
        log.info("metrics on http://%s:%d/metrics", addr, port)
        return
    raise SystemExit(f"{who}: cannot serve metrics: every default port on {addr} "
                     f"({DEFAULT_PORTS[0]}-{DEFAULT_PORTS[-1]}) is taken; set EMBEDQ_METRICS_PORT to a free port, "
                     "or 0 for none")


def short_args(req: Any) -> str:
    """A job's arguments as Flower shows them: its kind's one-line summary (counts, never texts)."""
    name = getattr(getattr(req, "task", None), "name", None)  # the task it was delivered to (not ``shadow``)
    spec = TASKS.get(name) if isinstance(name, str) else None
    return spec.summary(req.args) if spec is not None else "[?]"


def event_kwargs(kwargs: Any, service: Any, queue_name: str, traffic_class: str = "online",
                 kind: str = "embed") -> str:
    """What Flower shows as a task's keyword arguments: the kind, the model, the queue, the traffic class
    and the job's options."""
    info = f"kind={kind!r}, model={service.info.model_id!r}, queue={queue_name!r}, class={traffic_class!r}"
    options = short_options(kwargs)
    return info + (f", options={options}" if options and options != "{}" else "")


class EmbedRequest(Request):
    """A job's Celery request. ``inspect reserved`` (and Flower's worker page) list the requests a worker
    holds with their arguments: they show the texts' count and the options, never the texts."""

    def info(self, safe: bool = False) -> dict[str, Any]:
        out = super().info(safe=True)
        out["args"] = short_args(self)
        out["kwargs"] = short_options(self._kwargs if isinstance(self._kwargs, dict) else {})
        return out


def identity(worker: Worker | None) -> dict[str, Any]:
    """What this worker serves: shown by ``inspect stats`` (Flower), ``embedq_stats`` and the registry."""
    service = worker.service if worker is not None else None
    settings = worker.settings if worker is not None else Settings()
    out: dict[str, Any] = {"ready": service is not None and not worker.stopped, "version": __version__,
                           "queues": settings.queues, "metrics_port": metrics_port(worker)}
    if service is not None:
        info = service.info
        out.update(model=info.model_id, device=info.device, dtype=info.dtype, linear_kernel=info.linear_kernel,
                   runtime_choice=info.runtime_choice or "forced", memory_policy=service.memory_policy,
                   kinds=list(info.kinds), dimension=info.dimension, max_seq_length=info.max_seq_length,
                   pooling=info.pooling, labels=list(info.labels), weights_sha256=info.weights_sha256,
                   max_batch_tokens=settings.batch_tokens,
                   preemption=service.preemption)
    return out


def metrics_port(worker: Worker | None) -> int | None:
    """The port this worker's metrics endpoint is bound to (None: it serves none)."""
    metrics = worker.metrics if worker is not None else None
    return metrics.port if metrics is not None else None


def worker_record(worker: Worker) -> dict[str, Any]:
    """This worker's entry in the live-worker registry (embedq/monitor.py; ``embedq status``)."""
    service = worker.service
    record: dict[str, Any] = {"hostname": worker.hostname, "pid": os.getpid(), "started_at": worker.started_at,
                              "reported_at": time.time(), **identity(worker)}
    if service is not None:
        st = service.stats.snapshot()
        record.update(buffered=len(service.scheduler), **window_stats(worker))
        record["counters"] = {k: st[k] for k in COUNTERS}
        record["errors_by_code"] = st["errors_by_code"]
        record["jobs_by_class"] = st["jobs_by_class"]
        record["jobs_by_kind"] = st["jobs_by_kind"]
        record["timers"] = {k: round(st[k], 3) for k in TIMERS}
        # what producers admit online jobs by (embedq/admission.py): texts buffered and not started, per class
        # (unlocked reads of two lengths: the reporter thread must not wait on the inference thread's lock)
        record["backlog"] = {ONLINE: service.scheduler.waiting(ONLINE), BULK: service.scheduler.waiting(BULK)}
        if getattr(service, "device", None):  # a host of the split layout: its device process's counters
            record["device_process"] = service.device
    if worker.metrics is not None:
        record["rates"] = worker.metrics.rates.current()
        rate = worker.metrics.throughput.rate
        record["throughput"] = None if rate is None else round(rate, 2)
    return record


class WorkerInfo(bootsteps.StartStopStep):
    """Consumer bootstep that adds the model, device and dtype to ``celery inspect stats``, which Flower
    shows for each worker (``/api/workers``). (A start-stop step: only those are asked for their info.)"""

    def info(self, c: Any) -> dict[str, Any]:
        return {"embedq": identity(getattr(c.app, "embedq_worker", None))}


@inspect_command()
def embedq_stats(state: Any) -> dict[str, Any]:
    """``celery inspect embedq_stats``: the service's counters and model."""
    worker = getattr(state.consumer.app, "embedq_worker", None)
    service = worker.service if worker is not None else None
    if service is None:
        return {"ready": False}
    out = {**identity(worker), "buffered": len(service.scheduler) + service.dedupe.waiting, **window_stats(worker),
           "preparing": service.preparer.preparing, **service.stats.snapshot()}
    if getattr(service, "device", None):  # a host of the split layout: its device process's counters
        out["device_process"] = service.device
    return out


def window_stats(worker: Worker) -> dict[str, int]:
    window = worker.window
    if window is None:
        return {}
    return {"held_messages": window.messages, "held_texts": window.texts, "peak_held_messages": window.peak_messages,
            "peak_held_texts": window.peak_texts, "prefetch_limit": window.limit()}
