"""Storing a worker's finished jobs: their terminal records, then their acknowledgement queued.

:class:`RecordWriter` runs on the service's results thread (``on_done``/``on_done_many``): it writes the jobs' terminal
records in one round trip (``store_outcomes``, riding out a broker restart) through the worker's one
:class:`~embedq.results.ResultStore`, and queues them for the consumer thread to acknowledge (the held messages'
``finished`` queue: workers/held.py); jobs with Celery canvas work go through the canvas thread
(``workers/canvas_thread.py``), which queues them once their work is sent.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from typing import Any

from embedq import errors
from embedq.broker import BROKER_ERRORS
from embedq.results import ResultStore
from embedq.workers import refused
from embedq.workers.canvas_thread import CanvasThread
from embedq.workers.jobs import Job
from embedq.workers.service import EmbeddingService

log = logging.getLogger(__name__)

#: Seconds between two tries to store results while the result store is away, at most; and between two log lines.
RETRY_MAX = 1.0
RETRY_LOG_EVERY = 30.0


class RecordWriter:
    """Write finished jobs' records and queue their acks (results thread).

    Made with the queue it puts stored jobs in; the worker hands it the service and the canvas thread once the
    model is loaded (:meth:`bind`) and the result store once it is on its Celery app (``store``)."""

    def __init__(self, finished: queue.SimpleQueue) -> None:
        self.finished = finished
        self.store: ResultStore | None = None
        self.service: EmbeddingService | None = None
        self.canvas_thread: CanvasThread | None = None

    def bind(self, service: EmbeddingService, canvas_thread: CanvasThread) -> None:
        self.service, self.canvas_thread = service, canvas_thread

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
        store = self.store
        assert store is not None, "the worker gives its writer the result store when it is registered on its app"
        canvas_ids = {job.id for job, _ in done if job.canvas is not None}
        delay, logged = 0.2, -math.inf
        while True:
            try:
                written = store.store_many([(job.id, outcome) for job, outcome in done], canvas_ids)
                break
            except BROKER_ERRORS as exc:
                if refused.is_refused(exc, "storing results"):  # a wrong password: no retry helps; jobs go back
                    return
                if self.service is not None and self.service.stopping:
                    log.warning("could not store %d job(s) before stopping (%s); they will run again", len(done),
                                type(exc).__name__)
                    return
                now = time.monotonic()
                if now >= logged + RETRY_LOG_EVERY:  # the first failure, then one line every RETRY_LOG_EVERY s
                    log.warning("storing %d job(s) failed (%s); retrying every %.1f s at most", len(done),
                                type(exc).__name__, RETRY_MAX)
                    logged = now
                if self.service is not None:  # riding out an outage is progress, for the watchdog
                    self.service.results_beat()
                time.sleep(delay)
                # at most a second between tries: a Sentinel failover ends with a new primary to store to, and a
                # result stored seconds late is an online answer seconds late (bench/failover.py)
                delay = min(delay * 2, RETRY_MAX)
        # Jobs with canvas work go to the canvas thread, which queues their acks once the work is sent; the others'
        # acks are queued now.
        handed = [(job, outcome, wrote) for (job, outcome), wrote in zip(done, written) if job.canvas is not None]
        now = time.monotonic()
        for (job, outcome), wrote in zip(done, written):
            if not wrote:  # another outcome came first (the job was cancelled while it ran): that one stands
                log.info("job %s already has an outcome; its %s is not stored", job.id,
                         "error" if isinstance(outcome, errors.EmbedqError) else "result")
            if job.canvas is None:
                self.finished.put((job, outcome, now))
        if handed:
            assert self.canvas_thread is not None
            self.canvas_thread.put(handed, on_wait=self.service.results_beat if self.service is not None else None)

    def resend_canvas(self, job: Job, record: dict[str, Any] | None) -> None:
        """Consumer thread: a redelivered job whose record is stored and whose canvas work is still marked pending
        (its worker died after storing and before deleting the marker): the canvas thread sends the work now, for the
        stored outcome, then the job is acknowledged as already stored."""
        assert self.canvas_thread is not None
        self.canvas_thread.resend(job, record)
