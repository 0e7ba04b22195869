"""Micro-batches in the model: launching one, landing it, and storing its rows into their jobs.

:class:`MicroBatches` is owned by the :class:`~embedq.workers.service.EmbeddingService` (its ``batches``) and runs on
the inference thread between "this batch was chosen" and "its rows are in their jobs". ``launch`` starts a
micro-batch in the model (``backend.launch``; a bulk one with the preemption hook between its layers) and returns a
:class:`Flight`; ``land`` waits for the flight's rows, counts the batch, and stores each row into its job (a job whose
items all have their rows goes to the results thread). On a device that runs behind the CPU
(``backend.launches_async``) the service lands a flight only after it has launched the next one, so two micro-batches
are in flight; elsewhere each lands as it is launched (``run``). A micro-batch that fails is split in halves and
retried (``_isolate``), so only the culprit's job fails; a non-finite row fails its job.

Its state: the micro-batches in the model (``running``, read by the watchdog) and the running bulk micro-batch's
pause accounting (``paused``, ``paused_cpu``, ``layer``: the service's preemption adds to them). What it calls of the
service it is handed as callables when made: the preemption point, the steering hook before a launch, finishing and
failing a job, and the liveness beat.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from embedq import errors
from embedq.backends.base import Backend, row_is_finite
from embedq.batching import batch_cost
from embedq.workers.dedupe import Dedupe
from embedq.workers.jobs import Job
from embedq.workers.stats import Stats

log = logging.getLogger(__name__)


@dataclass
class Flight:
    """A launched micro-batch: ``rows()`` waits for its rows."""

    keys: list[tuple[Job, int]]
    jobs: tuple[Job, ...]
    rows: Callable[[], list[Any]]
    lengths: list[int]
    t0: float
    preemptible: bool
    paused: float  # seconds its launch spent paused for online batches
    cpu: float  # CPU seconds of this thread its launch took (less the online batches run inside it)


class MicroBatches:
    """Launch, land and store micro-batches (inference thread)."""

    def __init__(self, backend: Backend, stats: Stats, metrics: Any, dedupe: Dedupe, *,
                 at_point: Callable[[int], None],
                 before_launch: Callable[[list[tuple[Job, int]]], None], finish: Callable[[Job], None],
                 fail: Callable[[Job, errors.EmbedqError], None], progress: Callable[[], None]) -> None:
        self.backend, self.stats, self.metrics = backend, stats, metrics
        self.dedupe = dedupe  # riders of launched items (workers/dedupe.py): they get their rows, or fail, with them
        self._at_point = at_point  # the service's preemption point: called with the point's number (1, 2, ...)
        self._before_launch = before_launch  # a steering program's seam (workers/hooks.py)
        self._finish = finish  # every item of the job has its row: to the results thread
        self._fail = fail  # the job fails with this error
        self._progress = progress  # the inference thread shows progress (the watchdog's beat)
        # The running bulk micro-batch: seconds paused so far, CPU seconds the online batches run inside it took,
        # preemption points met.
        self.paused, self.paused_cpu, self.layer = 0.0, 0.0, 0
        self._in_model: list[tuple[Job, ...]] = []  # the jobs of each micro-batch in the model now

    @property
    def running(self) -> tuple[Job, ...]:
        """The jobs of the micro-batches in the model now (read by the watchdog from other threads)."""
        return tuple(itertools.chain.from_iterable(self._in_model))

    def run(self, keys: list[tuple[Job, int]], preemptible: bool = False) -> None:
        """One micro-batch through the model, to its stored rows. ``preemptible``: a bulk batch online batches may
        pause between two layers (its model time leaves out the pauses)."""
        flight = self.launch(keys, preemptible)
        if flight is not None:
            self.land(flight)

    def _between_layers(self) -> None:
        self.layer += 1
        self._at_point(self.layer)

    def launch(self, keys: list[tuple[Job, int]], preemptible: bool = False) -> Flight | None:
        """Start a micro-batch in the model (``backend.launch``); :meth:`land` waits for it and stores its rows."""
        keys = self.dedupe.live(keys)
        if not keys:
            return None
        batch = [job.prepared.items[i] for job, i in keys]
        lengths = [len(item.ids) for item in batch]
        if preemptible:  # (not in a preempting batch: that one runs inside the bulk batch's pause)
            self.paused, self.paused_cpu, self.layer = 0.0, 0.0, 0
        self._before_launch(keys)
        jobs = tuple(dict.fromkeys(itertools.chain((job for job, _ in keys), self.dedupe.riding_jobs(keys))))
        self._in_model.append(jobs)  # a preempting batch runs inside a bulk one: both are in the model
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            if preemptible:
                with self.backend.between_layers(self._between_layers):
                    rows = self.backend.launch(batch)
            else:
                rows = self.backend.launch(batch)
        except Exception as exc:
            rows = _raising(exc)
        cpu = time.thread_time() - c0 - (self.paused_cpu if preemptible else 0.0)
        return Flight(keys, jobs, rows, lengths, t0, preemptible, self.paused if preemptible else 0.0, cpu)

    def land(self, flight: Flight) -> None:
        """Wait for a launched micro-batch's rows and store them; a batch that failed is split (:meth:`_isolate`)."""
        keys = flight.keys
        c0 = time.thread_time()
        try:
            rows = flight.rows()
            bad = [not row_is_finite(row) for row in rows]
        except Exception as exc:
            rows, bad = None, None
            failure: Exception = exc
        # Not in a finally: if something the thread cannot survive escapes the model, these jobs stay "running",
        # and the worker's watchdog counts the delivery against them (see the service's health()).
        self._in_model = [jobs for jobs in self._in_model if jobs is not flight.jobs]
        self._progress()
        # The model's CPU on this thread (its launch, the wait for its rows), measured where it runs: what the worker
        # costs beyond it is the queue path's own (bench/pipeline.py).
        self.stats.time("model_cpu_seconds", flight.cpu + time.thread_time() - c0)
        # From launch to rows: with two micro-batches in flight (launches_async) their times overlap.
        elapsed = time.perf_counter() - flight.t0 - flight.paused
        lengths = flight.lengths
        cost = batch_cost(lengths, padded=self.backend.is_padded)
        real = sum(lengths)
        by_class: dict[str, int] = {}
        by_kind: dict[str, int] = {}
        for job, _ in keys:
            by_class[job.traffic_class] = by_class.get(job.traffic_class, 0) + 1
            by_kind[job.kind] = by_kind.get(job.kind, 0) + 1
        self.stats.batch(items=len(keys), real=real, padded=cost, seconds=elapsed, by_class=by_class, by_kind=by_kind)
        log.info("micro-batch: %d items, %d real / %d padded tokens, %.1f ms (%s)%s", len(keys), real, cost,
                 elapsed * 1e3, ", ".join(f"{n} {k}" for k, n in by_kind.items()),
                 f", paused {flight.paused * 1e3:.1f} ms" if flight.paused else "")
        if self.metrics is not None:
            self.metrics.observe_batch(len(keys), real, cost, elapsed)
        if rows is None:
            self._isolate(keys, failure, flight.preemptible)
            return
        good = [(key, row) for key, row, b in zip(keys, rows, bad) if not b]
        self._store_rows([k for k, _ in good], [r for _, r in good])
        for key, b in zip(keys, bad):
            if b:
                self._fail_item(key, lambda i: errors.BackendError(f"inputs[{i}] produced a non-finite output"))

    def _isolate(self, keys: list[tuple[Job, int]], exc: Exception, preemptible: bool = False) -> None:
        """A failing micro-batch: split it and retry the halves so only the culprit fails (a bulk batch's halves
        stay preemptible)."""
        if len(keys) == 1:
            job, i = keys[0]
            log.warning("inputs[%d] of job %s failed in the model: %s", i, job.id, type(exc).__name__)
            self._fail_item(keys[0], lambda i: errors.BackendError(f"inputs[{i}] failed in the model: "
                                                                   f"{type(exc).__name__}"))
            return
        mid = len(keys) // 2
        self.run(keys[:mid], preemptible)
        self.run(keys[mid:], preemptible)

    def _fail_item(self, key: tuple[Job, int], error: Callable[[int], errors.EmbedqError]) -> None:
        """An item failed: its job fails, and the job of each rider of it (the same content fails the same way), each
        with the error of its own item's index."""
        for job, i in (key, *self.dedupe.riders(key)):
            self._fail(job, error(i))

    def _store_rows(self, keys: list[tuple[Job, int]], rows: list[Any]) -> None:
        riders = self.dedupe.riders
        for key, row in zip(keys, rows):
            self._store(key, row)
            for rider in riders(key):  # (each its own copy)
                self._store(rider, self.dedupe.copy(row))

    def _store(self, key: tuple[Job, int], row: Any) -> None:
        job, i = key
        if job.done or job.rows is None:
            return
        job.rows[i] = row
        job.remaining -= 1
        if job.remaining == 0:
            self._finish(job)


def _raising(exc: Exception) -> Callable[[], list[Any]]:
    def rows() -> list[Any]:
        raise exc

    return rows
