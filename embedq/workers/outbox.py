"""The results thread: finished and failed jobs queue up in an :class:`Outbox`, and its thread turns each into its
outcome and hands them to the worker to store.

A finished job's rows go through ``backend.finish`` (its head post-processes, checks and encodes them) and the
result-size cap; a failed or cancelled job's outcome is its typed error. Every job waiting when the thread comes round
(up to :data:`WRITE_BATCH`) goes to ``on_done_many`` at once, so their outcomes are stored in one round trip and
writing results never stands between two forward passes. The thread also counts each outcome (succeeded, or failed
with its code).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from embedq import errors
from embedq.backends.base import Backend
from embedq.protocol import result_size
from embedq.settings import Settings
from embedq.workers import refused
from embedq.workers.jobs import DoneCallback, DoneManyCallback, Job
from embedq.workers.stats import Stats

log = logging.getLogger(__name__)

#: Most finished jobs the results thread stores at once.
WRITE_BATCH = 256


class Outbox:
    """Jobs on their way out (``put``) and the results thread that finishes them (``start``, ``close``)."""

    def __init__(self, backend: Backend, settings: Settings, stats: Stats, on_done: DoneCallback,
                 on_done_many: DoneManyCallback | None = None) -> None:
        self.backend = backend
        self.settings = settings
        self.stats = stats
        self.on_done = on_done
        self.on_done_many = on_done_many
        # (job, None) to finish a job, (job, error) to fail it; None stops the results thread.
        self._queue: queue.SimpleQueue[tuple[Job, errors.EmbedqError | None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="embedq-results", daemon=True)
        # Liveness (the watchdog, EmbeddingService.health): when the thread last showed progress (took a batch,
        # stored it, rode out a broker outage one more try), and whether it is handling a batch now.
        self.beat = time.monotonic()
        self.busy = False

    def start(self) -> None:
        self.thread.start()

    def put(self, job: Job, error: errors.EmbedqError | None = None) -> None:
        """``job`` is done: every item has its row (no ``error``), or it failed with ``error``."""
        if not self.busy and self._queue.empty():  # an idle thread was ready until now: a stall counts from here
            self.beat = time.monotonic()
        self._queue.put((job, error))

    def close(self) -> None:
        """The results thread stops once it has written what was put before."""
        self._queue.put(None)

    def _loop(self) -> None:
        """Results thread: finish jobs as they come, taking every job waiting at once (up to WRITE_BATCH) so their
        outcomes are stored in one round trip (``on_done_many``)."""
        stop = False
        while not stop:
            self.busy = False
            entry = self._queue.get()
            self.beat, self.busy = time.monotonic(), True
            if entry is None:
                break
            entries = [entry]
            while len(entries) < WRITE_BATCH:
                try:
                    entry = self._queue.get_nowait()
                except queue.Empty:
                    break
                if entry is None:
                    stop = True
                    break
                entries.append(entry)
            self._handle(entries)
            self.beat = time.monotonic()
        self.busy = False

    def _handle(self, entries: list[tuple[Job, errors.EmbedqError | None]]) -> None:
        """Results thread: the outcomes of ``entries`` to ``on_done_many`` (or ``on_done``), at once."""
        t0 = time.perf_counter()
        done = [(job, self._outcome(job, outcome)) for job, outcome in entries]
        try:
            if self.on_done_many is not None:
                self.on_done_many(done)
            else:
                for job, outcome in done:
                    self.on_done(job, outcome)
        except Exception as exc:
            if not refused.is_refused(exc, "storing results"):  # refused: the worker stops; the jobs go back
                log.exception("storing the outcomes of %d job(s) failed", len(done))
        self.stats.time("results_seconds", time.perf_counter() - t0)

    def stalled(self, stall_timeout: float) -> float | None:
        """Seconds without progress while results wait (a batch in hand, or jobs queued), past ``stall_timeout``;
        else None."""
        idle = time.monotonic() - self.beat
        if idle > stall_timeout and (self.busy or not self._queue.empty()):
            return idle
        return None

    def _outcome(self, job: Job, outcome: errors.EmbedqError | None) -> dict[str, Any] | errors.EmbedqError:
        """Results thread: a finished job's result payload (or the typed error of a job that failed)."""
        if outcome is not None:
            return outcome
        try:
            payload: dict[str, Any] | errors.EmbedqError = self._payload(job)
        except errors.EmbedqError as exc:
            payload = exc
        except Exception as exc:  # never let the results thread die
            log.exception("encoding the result of job %s failed", job.id)
            payload = errors.BackendError(f"could not encode the result: {type(exc).__name__}")
        if isinstance(payload, errors.EmbedqError):
            self.stats.failure(payload.code, job.size)
        else:
            self.stats.add(jobs_succeeded=1, items_succeeded=job.size)
        return payload

    def _payload(self, job: Job) -> dict[str, Any]:
        """Results thread: the backend's head post-processes, checks and encodes; the size is capped."""
        rows, prepared = job.rows or [], job.prepared
        job.rows, job.prepared = None, None  # the job's memory goes with its result
        assert prepared is not None
        payload = self.backend.finish(job.kind, rows, prepared, job.options)
        # where its time went, in ms (the gateway's TEI headers: x-tokenization-time, x-inference-time): tokenizing
        # it, and from its first micro-batch's start to its last row (none for a job that runs no model)
        usage = payload["usage"]
        usage["tokenization_ms"] = round(job.tokenize_seconds * 1000, 3)
        if job.started is not None and job.finished is not None:
            usage["inference_ms"] = round((job.finished - job.started) * 1000, 3)
        size = result_size(payload)
        if size > self.settings.max_result_bytes:
            raise errors.ResultTooLarge(
                f"the result would take about {size} bytes; the limit is {self.settings.max_result_bytes} "
                "(EMBEDQ_MAX_RESULT_BYTES): send fewer inputs per job or a compact encoding")
        return payload
