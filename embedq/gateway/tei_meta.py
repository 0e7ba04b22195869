"""What TEI tells about each answer, told the same way: its response headers (``x-compute-time``,
``x-compute-characters``, ``x-compute-tokens``, ``x-total-time``, ``x-tokenization-time``, ``x-queue-time``,
``x-inference-time``, ``x-compute-type``) and its Prometheus metric names (``te_request_count``,
``te_request_duration``, ...), so that TEI's dashboards and alerts keep working on a gateway that replaces it.

Where the figures come from: the gateway times the request (total); each job's worker reports in its result's
``usage`` the milliseconds it spent tokenizing the job and from the job's first micro-batch to its last row
(``tokenization_ms``, ``inference_ms``). A request of several jobs reports their mean, as TEI reports a batch's
mean per input. Queue time is the rest: the total less those two — the job's wait in Redis and in the worker's
scheduler, and the result's way back (TEI's is its in-process queue alone).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from embedq import errors
from embedq.gateway.plans import Plan
from embedq.gateway.schemas import JSONResponse

#: TEI's duration buckets (its router/src/prometheus.rs): 35 steps of ×1.5 from 15 µs.
DURATION_BUCKETS = tuple(0.00001 * 1.5 ** (i + 1) for i in range(35))
#: The kinds whose inputs TEI counts as ``te_embed_*`` and as ``te_predict_*`` (rerank runs as predict there).
EMBED_KINDS = frozenset({"embed", "embed_sparse", "embed_all"})
PREDICT_KINDS = frozenset({"predict", "rerank"})

COUNTERS = {
    "te_request_count": "Requests received, by method (single or batch).",
    "te_request_success": "Requests answered, by method (single or batch).",
    "te_request_failure": "Requests failed, by TEI's error class (validation, batch_size, overloaded, model_type, "
                          "dropped, inference).",
    "te_embed_count": "Inputs received by the embed routes (/embed, /embed_sparse, /embed_all, /v1/embeddings).",
    "te_embed_success": "Inputs answered by the embed routes.",
    "te_predict_count": "Inputs received by /predict and /rerank.",
    "te_predict_success": "Inputs answered by /predict and /rerank.",
}


def failure_label(exc: BaseException) -> str:
    """TEI's ``err`` label for a request that failed with ``exc``."""
    if isinstance(exc, errors.TooManyInputs):
        return "batch_size"
    if isinstance(exc, errors.Overloaded):
        return "overloaded"
    if isinstance(exc, errors.UnsupportedTask):
        return "model_type"
    if isinstance(exc, (errors.Expired, errors.Cancelled)):
        return "dropped"
    if isinstance(exc, errors.ValidationError):
        return "validation"
    return "inference"


class _Counters:
    """TEI's counters under TEI's exact names (prometheus_client's ``Counter`` would add ``_total``)."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def exposition(self) -> bytes:
        """The counters in Prometheus' text format, as TEI's exporter writes them (prometheus_client would name
        a counter family ``..._total`` in its ``# TYPE`` line)."""
        with self._lock:
            values = dict(self._values)
        lines = []
        for name, doc in COUNTERS.items():
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
            for (sample, labels), value in sorted(values.items()):
                if sample == name:
                    shown = ",".join(f'{k}="{v}"' for k, v in labels)
                    lines.append(f"{name}{{{shown}}} {value}" if shown else f"{name} {value}")
        return ("\n".join(lines) + "\n").encode()


class TeiMetrics:
    """TEI's metrics in a gateway's registry: the counters above, the request-duration histograms, and
    ``te_queue_size`` (messages waiting in the served model's queues, read from Redis at each scrape)."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Gauge, Histogram

        self.counters = _Counters()  # written after the registry's families (GET /metrics)

        def histogram(name: str, doc: str) -> Any:
            return Histogram(name, doc, registry=registry, buckets=DURATION_BUCKETS)

        self.duration = histogram("te_request_duration", "Seconds to answer a request, end to end.")
        self.tokenization = histogram("te_request_tokenization_duration",
                                      "Seconds the worker spent tokenizing a request's jobs (mean per job).")
        self.queue = histogram("te_request_queue_duration", "Seconds a request's jobs waited: in Redis, in the "
                               "worker's scheduler, and the results' way back (mean per job).")
        self.inference = histogram("te_request_inference_duration",
                                   "Seconds from a job's first micro-batch to its last row (mean per job).")
        self.queue_size = Gauge("te_queue_size", "Messages waiting in the served model's queues (online and bulk).",
                                registry=registry)

    def received(self, plan: Plan) -> None:
        self.counters.inc("te_request_count", method=_method(plan))
        family = _family(plan)
        if family:
            self.counters.inc(f"te_{family}_count", len(plan.items))

    def failed(self, exc: BaseException) -> None:
        self.counters.inc("te_request_failure", err=failure_label(exc))

    def answered(self, plan: Plan, timing: Timing) -> None:
        self.counters.inc("te_request_success", method=_method(plan))
        family = _family(plan)
        if family:
            self.counters.inc(f"te_{family}_success", len(plan.items))
        self.duration.observe(timing.total)
        self.tokenization.observe(timing.tokenization)
        self.queue.observe(timing.queue)
        self.inference.observe(timing.inference)


def _method(plan: Plan) -> str:
    return "single" if plan.single else "batch"


def _family(plan: Plan) -> str | None:
    return "embed" if plan.kind in EMBED_KINDS else "predict" if plan.kind in PREDICT_KINDS else None


class Timing:
    """Where a request's time went (seconds), from its start and its jobs' result payloads."""

    def __init__(self, started: float, payloads: list[Any]) -> None:
        usages = [p.get("usage") or {} for p in payloads if isinstance(p, dict)]
        jobs = max(len(usages), 1)
        self.total = time.perf_counter() - started
        self.tokens = sum(int(u.get("tokens", 0)) for u in usages)
        self.tokenization = sum(float(u.get("tokenization_ms", 0.0)) for u in usages) / jobs / 1000
        self.inference = sum(float(u.get("inference_ms", 0.0)) for u in usages) / jobs / 1000
        self.queue = max(self.total - self.tokenization - self.inference, 0.0)

    def headers(self, plan: Plan) -> dict[str, str]:
        """TEI's response headers (times in whole milliseconds)."""
        total = str(int(self.total * 1000))
        return {"x-compute-type": "embedq", "x-compute-time": total, "x-total-time": total,
                "x-compute-characters": str(plan.characters), "x-compute-tokens": str(self.tokens),
                "x-tokenization-time": str(int(self.tokenization * 1000)),
                "x-queue-time": str(int(self.queue * 1000)), "x-inference-time": str(int(self.inference * 1000))}


async def respond(gateway: Any, request: Any, make_plan: Callable[[], Plan], model: str | None = None, *,
                  headers: bool = True) -> Any:
    """A job route's answer: the plan ``make_plan`` makes sent and awaited on ``gateway``
    (:class:`~embedq.gateway.state.Gateway`), counted under TEI's metric names, with TEI's headers
    (``headers=False``: none, as TEI sends none on ``/tokenize`` and ``/decode``)."""
    started = time.perf_counter()
    tei: TeiMetrics = gateway.tei
    try:
        plan = make_plan()
        tei.received(plan)
        payloads = (await gateway.payloads(request, [plan], model))[0]
        answer = plan.answer(payloads)
    except errors.EmbedqError as exc:
        tei.failed(exc)
        raise
    timing = Timing(started, payloads)
    tei.answered(plan, timing)
    return JSONResponse(answer, headers=timing.headers(plan) if headers else None)
