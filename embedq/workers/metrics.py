"""Prometheus metrics of a worker, and its record in the live-worker registry (embedq/monitor.py).

Every name starts with ``embedq_`` and is declared once, in :data:`CATALOG`; ops/ (alert rules, the
Grafana dashboard) uses only these names, and a test checks it.

Counters are read at scrape time from the service's :class:`~embedq.workers.stats.Stats`, the one
place the worker counts, so the metrics, ``celery inspect embedq_stats`` and ``embedq status`` never
disagree. Distributions (micro-batch sizes, durations, waits) are histograms observed where they
happen. Queue depths are read from Redis at scrape time (cached for :data:`QUEUE_CACHE_SECONDS` here and
shared between workers for ``monitor.DEPTHS_TTL``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import start_http_server as _start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from embedq import monitor
from embedq.version import __version__
from embedq.workers import refused
from embedq.workers.stats import COUNTERS, LABELLED, MODEL_COUNTERS, MODEL_LABELLED

log = logging.getLogger(__name__)

PREFIX = "embedq_"
RATE_WINDOW = 60.0  # seconds of history behind the "recent" rates
#: The ports a worker without an explicit EMBEDQ_METRICS_PORT tries, in order: the first free one is its own, so the
#: workers (and replicas) of one machine need no per-worker setting; ops/'s Prometheus configurations scrape them all.
DEFAULT_PORTS = range(9808, 9840)
QUEUE_CACHE_SECONDS = 2.0
#: Seconds after which an interval's weight in the measured throughput (:class:`Throughput`) has halved.
THROUGHPUT_HALF_LIFE = 15.0

#: name (without ``embedq_``) -> (type, help). Counters are exposed with a ``_total`` suffix; they are the
#: service's (declared once in workers/stats.py).
CATALOG: dict[str, tuple[str, str]] = {
    **{name: ("counter", help) for name, help in COUNTERS.items()},
    **{metric: ("counter", help) for metric, _label, help in LABELLED.values()},
    "queue_depth": ("gauge", "Messages in a queue: waiting in Redis plus received and not yet acknowledged."),
    "queue_waiting": ("gauge", "Messages waiting in a queue's Redis list."),
    "queue_unacked": ("gauge", "Messages of a queue received by workers and not yet acknowledged (any worker)."),
    "broker_up": ("gauge", "1 if this worker's last read of the queue depths reached Redis, else 0."),
    "jobs_in_flight": ("gauge", "Jobs this worker holds: received and not yet acknowledged."),
    "items_in_flight": ("gauge", "Texts in the jobs this worker holds."),
    "items_buffered": ("gauge", "Texts waiting in this worker for a micro-batch (in its scheduler, or beside an "
                       "identical one there)."),
    "prefetch_limit": ("gauge", "Messages the worker lets the broker deliver now (the prefetch window)."),
    "padding_ratio": ("gauge", "Share of computed tokens that were padding, over the last minute."),
    "tokens_per_second": ("gauge", "Real tokens through the model per second, over the last minute."),
    "items_per_second": ("gauge", "Texts embedded per second, over the last minute."),
    "model_load_seconds": ("gauge", "Seconds the model took to load."),
    "worker_info": ("gauge", "Always 1; the labels say what this worker serves."),
    "device_process_info": ("gauge", "Always 1, on a split worker's device process (embedq worker --device-process), "
                            "which exports the micro-batch counters and histograms its hosts leave at 0; the labels "
                            "say what it runs and for how many hosts."),
    "bulk_paused_seconds": ("counter", "Seconds bulk micro-batches spent paused between two layers while online "
                            "micro-batches ran."),
    "online_wait_seconds": ("counter", "Seconds online jobs waited from the worker's receipt to their first "
                            "micro-batch, summed (divide by online_started; buffer_seconds has the distribution)."),
    "model_cpu_seconds": ("counter", "CPU seconds the inference thread spent in the model: launching micro-batches "
                          "and waiting for their rows (on a GPU, the cost of launching its kernels)."),
    "preempt_seconds": ("histogram", "Duration of one preemption: a bulk micro-batch paused between two layers."),
    "batch_items": ("histogram", "Texts per micro-batch."),
    "batch_tokens": ("histogram", "Padded tokens per micro-batch (what max_batch_tokens bounds)."),
    "batch_real_tokens": ("histogram", "Real tokens per micro-batch."),
    "inference_seconds": ("histogram", "Duration of one micro-batch through the model."),
    "tokenize_seconds": ("histogram", "Duration of validating and tokenizing one job."),
    "queue_seconds": ("histogram", "Time from the producer's send to the worker's receipt (the job's wait in "
                      "Redis), by traffic class; jobs from embedq's Client, which stamps the send time."),
    "buffer_seconds": ("histogram", "Time from the worker's receipt to the job's first micro-batch, by traffic "
                       "class."),
    "job_seconds": ("histogram", "Time from the worker's receipt to the job's result stored, by traffic class."),
}

_POW2 = tuple(float(2 ** i) for i in range(0, 11))  # 1 .. 1024
_TOKENS = tuple(float(2 ** i) for i in range(4, 17))  # 16 .. 65536
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_WAIT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
BUCKETS = {"batch_items": _POW2, "batch_tokens": _TOKENS, "batch_real_tokens": _TOKENS,
           "inference_seconds": _FAST, "tokenize_seconds": _FAST, "queue_seconds": _WAIT,
           "buffer_seconds": _WAIT, "job_seconds": _WAIT, "preempt_seconds": _FAST}
#: Histograms labelled by traffic class.
BY_CLASS = frozenset({"queue_seconds", "buffer_seconds", "job_seconds"})


#: What only a split worker's device process exports.
DEVICE_ONLY = frozenset({"device_process_info"})


def exported_names(*, worker: bool = False) -> set[str]:
    """Every sample family name a worker's processes export (``_total``, ``_bucket``… suffixes left out); ``worker``:
    those a worker (a host of the split layout included) exports, without its device process's own."""
    return {PREFIX + name for name in CATALOG if not (worker and name in DEVICE_ONLY)}


class Rates:
    """Recent rates from samples of the cumulative counters (thread-safe)."""

    def __init__(self, window: float = RATE_WINDOW) -> None:
        self.window = window
        self._samples: deque[tuple[float, int, int, int, int]] = deque()
        self._lock = threading.Lock()

    def sample(self, stats: Any, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._samples.append((now, stats.jobs_succeeded, stats.items_succeeded, stats.real_tokens,
                                  stats.padded_tokens))
            while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
                self._samples.popleft()

    def current(self) -> dict[str, float]:
        with self._lock:
            if len(self._samples) < 2:
                return {"window_s": 0.0, "jobs_per_s": 0.0, "items_per_s": 0.0, "tokens_per_s": 0.0,
                        "padding_ratio": 0.0}
            (t0, j0, i0, r0, p0), (t1, j1, i1, r1, p1) = self._samples[0], self._samples[-1]
        dt = max(t1 - t0, 1e-9)
        padded = p1 - p0
        return {"window_s": round(dt, 1), "jobs_per_s": (j1 - j0) / dt, "items_per_s": (i1 - i0) / dt,
                "tokens_per_s": (r1 - r0) / dt, "padding_ratio": (1 - (r1 - r0) / padded) if padded else 0.0}


class Throughput:
    """Texts/s this worker runs while busy: a decaying average of the intervals between two samples in which texts
    waited in its scheduler at both ends (so it was running flat out between them); None before the first such
    interval. Producers divide the texts ahead of an online job by it (``embedq/admission.py``). An interval with
    texts waiting and none run (a stalled model) counts: it is this worker's speed then."""

    def __init__(self, half_life: float = THROUGHPUT_HALF_LIFE) -> None:
        self.half_life = half_life
        self.rate: float | None = None
        self._last: tuple[float, int, int] | None = None

    def sample(self, items_run: int, waiting: int, now: float | None = None) -> float | None:
        """``items_run``: the texts run through the model so far (the counter); ``waiting``: texts buffered now."""
        now = time.monotonic() if now is None else now
        last, self._last = self._last, (now, items_run, waiting)
        if last is not None and now > last[0] and last[2] and waiting:
            seconds = now - last[0]
            seen = max(items_run - last[1], 0) / seconds
            weight = 1.0 - 0.5 ** (seconds / self.half_life)
            self.rate = seen if self.rate is None else self.rate + weight * (seen - self.rate)
        return self.rate


class WorkerMetrics:
    """The histograms a worker observes, and a collector for everything read at scrape time.

    ``bind`` attaches the running worker: its service, a callable returning the prefetch window's state,
    the queues it consumes and a Redis client for their depths.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, device_process: bool = False) -> None:
        self.registry = registry or CollectorRegistry()
        #: a split worker's device process: no queues, no prefetch window, no broker of its own; it exports what only
        #: it counts (stats.MODEL_COUNTERS: micro-batches, items, tokens; the histograms), which its hosts export at
        #: 0, and none of the jobs' counters, which are the hosts': sums over every target add up
        self.device_process = device_process
        self.hosts = 0  # a device process: the hosts connected now
        self.hist = {name: Histogram(PREFIX + name, CATALOG[name][1], buckets=BUCKETS[name], registry=self.registry,
                                     labelnames=("traffic_class",) if name in BY_CLASS else ())
                     for name in BUCKETS}
        self._children: dict[tuple[str, str], Any] = {}  # (name, class) -> the histogram (child) to observe
        self.rates = Rates()
        self.throughput = Throughput()
        self.model_load_seconds = 0.0
        self.service: Any = None
        self.window_state: Callable[[], dict[str, int]] = dict
        self.queues: list[str] = []
        self.redis: Any = None
        self._depths: tuple[float, dict[str, monitor.QueueDepth] | None] = (0.0, None)
        self.port: int | None = None  # the port the endpoint is bound to (the registry announces it)
        self._depth_lock = threading.Lock()
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def bind(self, service: Any, *, window_state: Callable[[], dict[str, int]], queues: list[str],
             redis: Any) -> None:
        self.service, self.window_state, self.queues, self.redis = service, window_state, queues, redis

    # -- observations (any thread) ------------------------------------------------------------
    def observe_batch(self, items: int, real: int, padded: int, seconds: float) -> None:
        self.hist["batch_items"].observe(items)
        self.hist["batch_tokens"].observe(padded)
        self.hist["batch_real_tokens"].observe(real)
        self.hist["inference_seconds"].observe(seconds)

    def observe(self, name: str, value: float, traffic_class: str | None = None) -> None:
        key = (name, traffic_class or "online")
        child = self._children.get(key)
        if child is None:  # prometheus_client's labels() looks the child up on every call: once per name and class
            hist = self.hist[name]
            child = self._children[key] = hist.labels(key[1]) if name in BY_CLASS else hist
        child.observe(value)

    # -- scrape ------------------------------------------------------------------------------
    def depths(self) -> dict[str, monitor.QueueDepth] | None:
        """Queue depths, at most QUEUE_CACHE_SECONDS old; None when Redis cannot be read."""
        with self._depth_lock:
            taken, cached = self._depths
            if time.monotonic() - taken < QUEUE_CACHE_SECONDS:
                return cached
            try:
                cached = monitor.shared_queue_depths(self.redis, self.queues) if self.redis is not None else None
            except Exception as exc:
                log.debug("queue depths unavailable: %s", type(exc).__name__)
                cached = None
            self._depths = (time.monotonic(), cached)
            return cached

    def serve(self, port: int, addr: str = "127.0.0.1") -> Any:
        """Start the HTTP endpoint (a daemon thread). Raises OSError when the port is taken."""
        server, _thread = _start_http_server(port, addr=addr, registry=self.registry)
        self.port = server.server_port
        return server


class _Collector:
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Any]:
        return []  # collected lazily: nothing to check at registration

    def collect(self) -> Any:
        m = self.m
        service = m.service
        if service is not None:
            st = service.stats.snapshot()
            labelled = {metric for metric, _label, _help in LABELLED.values()}
            for name in MODEL_COUNTERS if m.device_process else COUNTERS:
                if name not in labelled:  # jobs_failed/items_failed are exported by code
                    yield _counter(name, st[name])
            for attr, (name, label, _help) in LABELLED.items():
                if m.device_process and attr not in MODEL_LABELLED:
                    continue
                family = CounterMetricFamily(PREFIX + name, CATALOG[name][1], labels=[label])
                for value, n in sorted(st[attr].items()):
                    family.add_metric([value], n)
                yield family
            for name in ("bulk_paused_seconds", "online_wait_seconds", "model_cpu_seconds"):
                yield _counter(name, st[name])
            yield _gauge("items_buffered", len(service.scheduler) + service.dedupe.waiting)
            rates = m.rates.current()
            yield _gauge("padding_ratio", rates["padding_ratio"])
            yield _gauge("tokens_per_second", rates["tokens_per_s"])
            yield _gauge("items_per_second", rates["items_per_s"])
            info = service.info
            if m.device_process:
                family = GaugeMetricFamily(PREFIX + "device_process_info", CATALOG["device_process_info"][1],
                                           labels=["model", "device", "dtype", "linear_kernel", "hosts", "version"])
                family.add_metric([info.model_id, info.device, info.dtype, info.linear_kernel, str(m.hosts),
                                   __version__], 1)
                yield family
                yield _gauge("model_load_seconds", m.model_load_seconds)
                return
            window = m.window_state()
            yield _gauge("jobs_in_flight", window.get("held_messages", 0))
            yield _gauge("items_in_flight", window.get("held_texts", 0))
            yield _gauge("prefetch_limit", window.get("prefetch_limit", 0))
            family = GaugeMetricFamily(PREFIX + "worker_info", CATALOG["worker_info"][1],
                                       labels=["model", "device", "dtype", "linear_kernel", "queue", "kinds",
                                               "version"])
            family.add_metric([info.model_id, info.device, info.dtype, info.linear_kernel,
                               ",".join(m.queues), ",".join(info.kinds), __version__], 1)
            yield family
        yield _gauge("model_load_seconds", m.model_load_seconds)
        depths = m.depths()
        yield _gauge("broker_up", 0 if depths is None else 1)
        for name, attr in (("queue_depth", "depth"), ("queue_waiting", "waiting"), ("queue_unacked", "unacked")):
            family = GaugeMetricFamily(PREFIX + name, CATALOG[name][1], labels=["queue"])
            for queue, depth in sorted((depths or {}).items()):
                family.add_metric([queue], getattr(depth, attr))
            yield family


def _counter(name: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, CATALOG[name][1], value=value)


def _gauge(name: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, CATALOG[name][1], value=value)


class Reporter(threading.Thread):
    """Every REPORT_INTERVAL: sample the rates and publish this worker's record in the registry.

    A daemon thread, so neither a slow Redis nor a broker restart ever stalls the consumer's event loop.
    """

    def __init__(self, record: Callable[[], dict[str, Any]], metrics: WorkerMetrics | None, redis: Any,
                 interval: float = monitor.REPORT_INTERVAL) -> None:
        super().__init__(name="embedq-reporter", daemon=True)
        self.record, self.metrics, self.redis, self.interval = record, metrics, redis, interval
        self._stop_event = threading.Event()
        self.hostname: str | None = None

    def report(self) -> None:
        metrics = self.metrics  # None: a record without rates (a worker still loading its model)
        service = metrics.service if metrics is not None else None
        if metrics is not None and service is not None:
            metrics.rates.sample(service.stats)
            metrics.throughput.sample(service.stats.items, len(service.scheduler))
        record = self.record()
        self.hostname = record["hostname"]
        monitor.publish_worker(self.redis, record)

    def run(self) -> None:
        while True:
            try:
                self.report()
            except Exception as exc:  # Redis away: the record expires, and comes back with Redis
                if refused.is_refused(exc, "publishing its registry record", refused.url_of(self.redis)):
                    return
                log.debug("could not publish the worker record: %s", type(exc).__name__)
            if self._stop_event.wait(self.interval):
                return

    def stop(self) -> None:
        """No more reports; the last one stands until its key expires or another record replaces it."""
        self._stop_event.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=5)  # a report in progress must not put the record back after it is deleted

    def withdraw(self) -> None:
        self.stop()
        if self.hostname is not None:
            try:
                monitor.withdraw_worker(self.redis, self.hostname)
            except Exception:
                log.debug("could not withdraw the worker record")
