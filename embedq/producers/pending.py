"""The jobs a client sent and has not collected yet (:class:`Pending`, the :class:`~embedq.producers.client.Client`'s
``pending``), and what waiting on them takes: sending them again under their ids when Redis lost them (its epoch
changed since they were sent) or when one has had no result long after sending."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from embedq import errors
from embedq.batching.traffic import ONLINE
from embedq.producers.direct import JobWriter
from embedq.producers.handle import JobHandle

log = logging.getLogger(__name__)


class Pending:
    """A client's jobs sent and not collected yet, held weakly (a handle dropped unread is forgotten here)."""

    def __init__(self, writer: JobWriter, epoch: Callable[..., str], resend_after: float) -> None:
        """``writer``: sends a job again; ``epoch``: the broker's epoch (``epoch(refresh=True)`` read now, else at
        most a second old); ``resend_after``: seconds without a result after which a job is sent again."""
        self._writer = writer
        self._epoch = epoch
        self.resend_after = resend_after
        self._handles: weakref.WeakSet[JobHandle] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, handles: Iterable[JobHandle]) -> None:
        with self._lock:
            for handle in handles:
                self._handles.add(handle)

    def discard(self, handle: JobHandle) -> None:
        """``handle`` has its outcome (or nobody waits for it): nothing to send again."""
        with self._lock:
            self._handles.discard(handle)

    def discard_all(self, handles: Iterable[JobHandle]) -> None:
        with self._lock:
            for handle in handles:
                self._handles.discard(handle)

    def waiting(self) -> list[JobHandle]:
        """The handles still without an outcome."""
        with self._lock:
            return [handle for handle in self._handles if not handle.collected]

    def __bool__(self) -> bool:
        return bool(self.waiting())

    def __len__(self) -> int:
        return len(self.waiting())

    def outstanding(self, queue: str, default_client: str) -> dict[str, int]:
        """Texts of the online jobs on ``queue`` not collected yet, by the client identity each carries
        (``default_client`` where it carries none)."""
        out: dict[str, int] = {}
        for handle in self.waiting():
            sent = handle.sent
            if sent.queue == queue and handle.traffic_class == ONLINE and sent.args is not None:
                who = sent.client_id or default_client
                out[who] = out.get(who, 0) + handle.spec.size(sent.args)
        return out

    def check(self, handles: Iterable[JobHandle], *, refresh: bool = False) -> None:
        """Between two looks at waited-for jobs (``handles``): has Redis lost its data since one was sent (then
        every job still waiting is sent again: :meth:`resend_lost`), or has one had no result long after sending
        (then it is)? ``refresh``: read the epoch now (after an outage), not at most a second old. This covers the one
        window in which Redis can lose a message whatever its persistence: a worker killed between popping it and
        recording it as unacknowledged (kombu's BRPOP and its unacknowledged record are two steps). A copy of a job
        that is held or already stored costs the worker one lookup."""
        handles = list(handles)
        if not handles:
            return
        epoch = self._epoch(refresh=refresh)
        if any(h.sent.epoch is not None and h.sent.epoch != epoch for h in handles):
            self.resend_lost(epoch)
        now = time.monotonic()
        for handle in handles:
            if not handle.collected and now - handle.sent.at >= self.resend_after:
                log.info("job %s has no result after %.0fs; sending it again", handle.id, self.resend_after)
                self._send_again(handle, self._epoch())

    def resend_lost(self, epoch: str) -> None:
        """Redis restarted (or came back without its data): send every job still waiting again, under its own id.
        A worker that holds the job takes the copy as the same job; one that finds its record already stored
        acknowledges the copy without running it."""
        with self._lock:
            lost = [h for h in self._handles if not h.collected and h.sent.epoch not in (None, epoch)]
            if lost:
                log.warning("the broker restarted; sending %d waiting jobs again", len(lost))
            for handle in lost:
                self._send_again(handle, epoch)

    def _send_again(self, handle: JobHandle, epoch: str) -> None:
        sent = handle.sent
        if sent.args is None:
            raise errors.JobLost(f"job {handle.id} may be lost: the broker restarted and the job cannot be resent")
        self._writer.send_task(handle.spec, sent.args, sent.options or {}, sent.queue, handle.deadline, sent.client_id,
                               job_id=handle.id, resent=sent.resent + 1)
        sent.again(epoch)
