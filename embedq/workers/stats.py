"""The worker's counters: declared once here, updated under one lock from any thread.

The consumer thread (jobs received, refused, cancelled), the inference thread (micro-batches, items run)
and the results thread (outcomes) all count; Prometheus (``workers/metrics.py``), ``celery inspect
embedq_stats``, the live-worker registry (``embedq status``) and the tests read :meth:`Stats.snapshot`,
so they never disagree and no update is lost between threads.
"""

from __future__ import annotations

import threading
from typing import Any

#: Plain counters: name -> help (Prometheus exports them as ``embedq_<name>_total``).
COUNTERS: dict[str, str] = {
    "jobs_received": "Jobs (messages) this worker received, bad ones included.",
    "jobs_succeeded": "Jobs whose result was stored.",
    "jobs_failed": "Jobs that got a typed error.",
    "items_received": "Items (texts, or text pairs) in the jobs this worker received.",
    "items_succeeded": "Items of jobs whose result was stored.",
    "items_failed": "Items in jobs that failed.",
    "jobs_cancelled": "Jobs cancelled before they ran (JobHandle.cancel, Celery revoke).",
    "items_cancelled": "Items in jobs cancelled before they ran.",
    "batches": "Micro-batches run through the model.",
    "items": "Items run through the model.",
    "real_tokens": "Tokens of the items run through the model (no padding).",
    "padded_tokens": "Tokens the model computed, padding included.",
    "redelivered": "Messages that came back after their worker died or stopped.",
    "duplicates": "Deliveries of a job this worker already held (run once).",
    "already_stored": "Redelivered jobs whose result was already stored (not run again).",
    "isolated_runs": "Crash suspects run alone.",
    "dead_letters": "Jobs dead-lettered after killing workers max_attempts times.",
    "preemptions": "Times a bulk micro-batch was paused between two layers to run online micro-batches.",
    "preempting_batches": "Online micro-batches run while a bulk micro-batch was paused.",
    "online_started": "Online jobs whose first micro-batch started.",
    "items_deduplicated": "Items not run through the model because an identical item (same token ids, prompt and "
    "head) waiting at the same time was: each got a copy of its row (EMBEDQ_DEDUPE).",
    "texts_windowed": "Texts of long_inputs='windows' jobs longer than the model, cut into windows (issue 58).",
    "windows": "Window items made of the texts_windowed (each runs through the model as an item of its own).",
    "canvas_failures": "Jobs whose Celery canvas work (callbacks, a chain's next step, a chord part) failed for good: "
    "over EMBEDQ_CANVAS_MAX_BYTES, refused by the broker, or refused by admission; their errbacks ran.",
}
#: Labelled counters: attribute -> (Prometheus name, label, help).
LABELLED: dict[str, tuple[str, str, str]] = {
    "errors_by_code": ("jobs_failed", "code", "Jobs that got a typed error, by error code."),
    "items_failed_by_code": ("items_failed", "code", "Items in jobs that failed, by error code."),
    "jobs_by_class": ("class_jobs_received", "traffic_class", "Jobs received, by traffic class (online, bulk)."),
    "items_by_class": ("class_items_embedded", "traffic_class", "Items run through the model, by traffic class."),
    "jobs_by_kind": ("kind_jobs_received", "kind", "Jobs received, by kind (every kind of the kinds table)."),
    "items_by_kind": ("kind_items_run", "kind", "Items run through the model, by job kind."),
}
#: What only the process that runs the micro-batches counts: a split worker's device process exports these (and
#: LABELLED's by-class and by-kind items, and TIMERS' waits), its hosts the rest (embedq/workers/metrics.py).
MODEL_COUNTERS = ("batches", "items", "real_tokens", "padded_tokens", "isolated_runs", "preemptions",
                  "preempting_batches", "online_started", "items_deduplicated")
MODEL_LABELLED = ("items_by_class", "items_by_kind")
#: Largest values seen (gauges of the run so far).
PEAKS = ("max_batch_cost", "max_batch_items")
#: Seconds spent (floats).
TIMERS = ("inference_seconds", "results_seconds", "bulk_paused_seconds", "online_wait_seconds", "model_cpu_seconds")


class Stats:
    """Counters of one worker. ``add``/``add_labelled``/``peak``/``time`` take the lock; reads of single
    attributes are plain (an int read is atomic); :meth:`snapshot` is a consistent copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        for name in COUNTERS:
            setattr(self, name, 0)
        for name in LABELLED:
            setattr(self, name, {})
        for name in PEAKS:
            setattr(self, name, 0)
        for name in TIMERS:
            setattr(self, name, 0.0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                if name not in COUNTERS:
                    raise KeyError(f"unknown counter {name!r}")
                setattr(self, name, getattr(self, name) + n)

    def add_labelled(self, name: str, label: str, n: int = 1) -> None:
        with self._lock:
            counts = getattr(self, name)
            counts[label] = counts.get(label, 0) + n

    def batch(self, *, items: int, real: int, padded: int, seconds: float, by_class: dict[str, int],
              by_kind: dict[str, int]) -> None:
        """One micro-batch through the model."""
        with self._lock:
            self.batches += 1
            self.items += items
            self.real_tokens += real
            self.padded_tokens += padded
            self.max_batch_cost = max(self.max_batch_cost, padded)
            self.max_batch_items = max(self.max_batch_items, items)
            self.inference_seconds += seconds
            for counts, more in ((self.items_by_class, by_class), (self.items_by_kind, by_kind)):
                for label, n in more.items():
                    counts[label] = counts.get(label, 0) + n

    def failure(self, code: str, items: int) -> None:
        """One failed job of ``items`` items."""
        with self._lock:
            self.jobs_failed += 1
            self.items_failed += items
            self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1
            self.items_failed_by_code[code] = self.items_failed_by_code.get(code, 0) + items

    def time(self, name: str, seconds: float) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {name: getattr(self, name) for name in (*COUNTERS, *PEAKS, *TIMERS)}
            out.update({name: dict(getattr(self, name)) for name in LABELLED})
        out["padding_ratio"] = (1 - out["real_tokens"] / out["padded_tokens"]) if out["padded_tokens"] else 0.0
        return out

    as_dict = snapshot
