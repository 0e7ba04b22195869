"""How a worker stops: the watchdog's fail-stop, the warm shutdown, and handing held messages back.

:class:`Stopping` is the part of :class:`~embedq.workers.consumer.Worker` that ends it. Every
:data:`LIVENESS_INTERVAL` the consumer thread looks at the service (``check_liveness``): a worker whose inference,
results or canvas thread died, or stopped making progress while work waits for it, stops with
:data:`EXIT_FAILED` for its supervisor to restart it (``fail_stop``), the jobs of the micro-batch in the model blamed
for it. On SIGTERM (the consumer's ``GracefulStop`` bootstep) ``shutdown`` finishes the micro-batch in progress,
stores and acknowledges what is done and hands the rest back. Either way every held message goes back to its queue
(``hand_back``) after the fetch in flight is read (``settle_fetch``).

It holds no state of its own: it uses the worker's (the attributes annotated on the class).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
from collections.abc import Callable
from typing import Any

from embedq.settings import Settings
from embedq.workers.canvas_thread import CanvasThread
from embedq.workers.delivery import Ledger
from embedq.workers.jobs import Job
from embedq.workers.metrics import Reporter
from embedq.workers.service import EmbeddingService

log = logging.getLogger(__name__)

LIVENESS_INTERVAL = 1.0  # seconds between two looks at the service's threads (see Stopping.check_liveness)
DRAIN_ON_FAILURE = 5.0  # seconds a failing worker lets its results thread write what it holds
#: Exit status of a worker that stopped because it could no longer do its work (EX_SOFTWARE): restart it.
EXIT_FAILED = 70


class Stopping:
    """Stop the worker: on a failed liveness check (fail-stop) or gracefully; mixed into the worker, whose state
    it uses."""

    settings: Settings
    service: EmbeddingService | None
    canvas_thread: CanvasThread | None
    ledger: Ledger | None
    reporter: Reporter | None
    consumer: Any
    held: dict[str, Job]
    intake: list[Job]
    stopped: bool
    drain_finished: Callable[[], None]
    current_channel: Callable[[], Any]

    def check_liveness(self) -> None:
        """Consumer thread, every LIVENESS_INTERVAL: a worker whose inference or results thread died, or whose
        inference thread stopped making progress while work waits, must not go on taking jobs and calling itself
        alive (its heartbeat and registry record come from other threads): it stops (:meth:`fail_stop`)."""
        service = self.service
        if service is None or self.stopped:
            return
        reason = service.health(self.settings.stall_timeout)
        if reason is None and self.canvas_thread is not None:
            reason = self.canvas_thread.health(self.settings.stall_timeout)
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
        if self.canvas_thread is not None:  # what it has not sent stays marked, its jobs unacknowledged
            self.canvas_thread.close()
            self.canvas_thread.join(DRAIN_ON_FAILURE)
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

    def shutdown(self) -> None:
        """See :class:`GracefulStop`."""
        if self.stopped or self.service is None:
            return
        self.stopped = True
        t0 = time.monotonic()
        self.service.stop(timeout=self.settings.shutdown_timeout)
        if self.canvas_thread is not None:  # the results thread has handed it all it will: send that, then stop
            self.canvas_thread.close()
            self.canvas_thread.join(self.settings.shutdown_timeout)
        self.drain_finished()
        returned, _ = self.hand_back()
        log.info("stopped in %.1fs: handed %d buffered messages back to the queue", time.monotonic() - t0,
                 returned)
