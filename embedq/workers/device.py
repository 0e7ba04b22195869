"""The device side of issue 53's layout: the items of every host process in one scheduler, rows back to their hosts,
all on one thread.

Host processes receive, check and tokenize jobs, write their token ids into their arena
(:class:`~embedq.workers.arena.IdsArena`) and send ITEMS records over their channel
(:mod:`embedq.workers.channel`). On the device side each host is a :class:`HostLink`, which turns the records of each
job into a proxy :class:`~embedq.workers.jobs.Job` (its items' ids views of the host's arena; no tokenizer, no
options) and hands it to the one :class:`DeviceService` with
:meth:`~embedq.workers.service.EmbeddingService.enqueue`: so the scheduler packs the items of all hosts' jobs
together, online before bulk, with the bulk share, deadlines, suspects alone and preemption between layers, as in
one process. Where a worker's results thread encodes and stores, :class:`RowsOut` (the service's outbox here)
sends each finished job's rows back to its host (ROWS) or its error (FAILED); the host finishes, stores and acks.

**One thread.** The device process does nothing but choose micro-batches and launch them, so its inference thread
does all of it: before each pick (``_intake``) and at each preemption point it reads what its hosts sent (a
``select`` of no wait: a few microseconds) and sends the rows and errors that are ready; when it has nothing to run
it sleeps in ``select`` on the hosts' channels (:class:`Wakeful`, the service's condition), so new items wake it
at once. No reader or results thread takes the GIL or a lock from it between two micro-batches (measured on the CPU:
docs/BENCHMARKS.md *The split layout on the CPU*).

A host that is gone (EOF on its channel: its process died or closed it) has its jobs dropped: those not started
are cancelled unrun, those in the model run out and their rows go nowhere. Its messages are the broker's to
redeliver. `embedq worker --device-process` runs it (embedq/workers/split.py, device_main.py).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import select
import threading
from typing import Any

import numpy as np

from embedq import errors
from embedq.backends.base import Encoded, Prepared
from embedq.batching.traffic import BULK, ONLINE
from embedq.workers.arena import IdsArena
from embedq.workers.channel import (
    CANCEL,
    ENDED,
    FAILED,
    ITEMS,
    ROWS,
    SLOT,
    STARTED,
    Channel,
    pack_rows,
)
from embedq.workers.jobs import Job
from embedq.workers.service import EmbeddingService
from embedq.workers.stats import Stats

log = logging.getLogger(__name__)

_CLASSES = (ONLINE, BULK)  # ITEM's ``traffic`` code
#: Messages read from one host at one intake: a flooding host cannot hold the next micro-batch back for long.
DRAIN_LIMIT = 64


class HostLink:
    """One host process as the device process sees it: its channel, its arena, its jobs in the service. Read by the
    service's inference thread (:meth:`drain`); ``send`` may be called from any thread."""

    def __init__(self, number: int, channel: Channel, service: Any) -> None:
        self.number = number
        self.channel = channel
        self.service = service
        hello = channel.recv_hello()
        self.pid = int(hello.get("pid", 0))
        self.heads: list[str] = [str(h) for h in hello.get("heads", [])]
        self.arena = IdsArena.attach(str(hello["arena"]), int(hello["capacity"]))
        self.jobs: dict[int, Job] = {}  # slot -> its proxy job, until its outcome is sent
        self.lock = threading.Lock()  # the channel's send side
        self.gone = threading.Event()  # a send failed, or the channel ended: nothing more is sent to it
        self.dropped = False  # its end was read (EOF): its jobs were dropped, it is read no more

    def start(self) -> HostLink:
        """Join the service: its inference thread reads this host from now on."""
        self.service.attach(self)
        return self

    def fileno(self) -> int:
        return self.channel.fileno()

    def drain(self, limit: int = DRAIN_LIMIT) -> None:
        """Read what the host has sent (at most ``limit`` messages, none waited for): ITEMS into the service, CANCEL
        as cancels; the end of the channel drops the host's jobs (a failed send does not: the end is read first)."""
        if self.dropped:
            return
        try:
            for _ in range(limit):  # called when the channel is readable (the intake's select): receive first
                message = self.channel.recv()
                if message.kind == ITEMS:
                    self.service.enqueue(self._jobs(message.records))
                elif message.kind == CANCEL:
                    for slot in message.records["slot"].tolist():
                        job = self.jobs.get(slot)
                        if job is not None:
                            self.service.cancel(job)
                else:
                    log.warning("host %d sent a %r message; ignored", self.number, message)
                if not self.channel.poll(0):
                    return
            return
        except (EOFError, OSError):
            pass
        except Exception:  # a bug on either side: this host is dropped, the others go on
            log.exception("reading host %d's channel failed; dropping its jobs", self.number)
        self._drop()

    def _jobs(self, records: np.ndarray) -> list[Job]:
        """The proxy jobs of ITEMS records (a job's items all in one message, one after the other, in order). Each
        item's ids (and segment ids) are views of the host's arena, valid until the host has this job's outcome
        (the host frees a job's span only then): nothing is copied, no Python list is built per token."""
        jobs: list[Job] = []
        if not len(records):
            return jobs
        read = self.arena.read  # a view, or ValueError for a record outside the arena
        offsets, lengths = records["offset"].tolist(), records["length"].tolist()
        heads = [self.heads[h] for h in records["head"].tolist()]
        types, prompts = records["types"].tolist(), records["prompt"].tolist()
        items = [Encoded(read(offset, length), read(offset + length, length) if typed else None, prompt, head)
                 for offset, length, typed, prompt, head in zip(offsets, lengths, types, prompts, heads)]
        slots = records["slot"]
        bounds = [0, *(np.flatnonzero(slots[1:] != slots[:-1]) + 1).tolist(), len(records)]
        firsts = records[bounds[:-1]]
        for (start, end), slot, deadline, traffic, client, suspect in zip(
                itertools.pairwise(bounds), firsts["slot"].tolist(), firsts["deadline"].tolist(),
                firsts["traffic"].tolist(), firsts["client"].tolist(), firsts["suspect"].tolist()):
            mine = items[start:end]
            job = Job(id=f"{self.number}:{slot}", texts=None, context=(self, slot), size=len(mine),
                      traffic_class=_CLASSES[traffic], client=str(client),
                      deadline=None if math.isnan(deadline) else deadline, suspect=bool(suspect))
            job.prepared = Prepared(mine, sum(lengths[start:end]))
            job.rows, job.remaining = [None] * len(mine), len(mine)
            jobs.append(job)
        self.jobs.update((job.context[1], job) for job in jobs)
        return jobs

    def send(self, kind: int, records: np.ndarray, payload: bytes | memoryview = b"") -> None:
        """Send to the host unless it is gone (then what it would have got is dropped)."""
        if self.gone.is_set():
            return
        try:
            with self.lock:
                self.channel.send(kind, records, payload)
        except OSError:
            self.gone.set()

    def _drop(self) -> None:
        """The host is gone (or sent what cannot be read): its jobs not started are cancelled, the others run out
        unsent, and the channel is ended, so a host still alive sees the device gone for it (its watchdog stops it
        and hands its messages back; the supervisor starts it again) instead of waiting for rows that never come."""
        self.gone.set()
        self.dropped = True
        self.channel.shutdown()
        jobs = list(self.jobs.values())
        for job in jobs:
            self.service.cancel(job)
        self.service.detach(self)
        log.info("host %d (pid %d) is gone: %d of its jobs dropped", self.number, self.pid, len(jobs))

    def close(self) -> None:
        self.channel.shutdown()
        self.arena.close()


class Wakeful(threading.Condition):
    """The device service's condition: ``wait`` sleeps in ``select`` on the hosts' channels and a wake pipe (which
    ``notify`` writes), and reads what came (``on_ready``) before it returns, so a host's items wake the idle
    inference thread as a notify would. The lock is released while it sleeps, as ``Condition.wait`` does."""

    def __init__(self, sources: Any, on_ready: Any) -> None:
        super().__init__(threading.RLock())
        self.sources, self.on_ready = sources, on_ready  # () -> what to select on; () -> read it
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def wait(self, timeout: float | None = None) -> bool:
        self.release()
        try:
            ready, _, _ = select.select([self._wake_r, *self.sources()], [], [], timeout)
        except (OSError, ValueError):  # a host's channel closed meanwhile: read below finds it gone
            ready = [None]
        finally:
            self.acquire()
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        self.on_ready()
        return bool(ready)

    def notify(self, n: int = 1) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake is pending already; closed: stopped
            os.write(self._wake_w, b"!")

    def notify_all(self) -> None:
        self.notify()

    def close(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


class DeviceService(EmbeddingService):
    """The device process's service: an :class:`~embedq.workers.service.EmbeddingService` whose inference thread also
    reads its hosts (:class:`HostLink`, attached with :meth:`attach`) and sends their rows back (:class:`RowsOut`),
    and tells each host which of its jobs start, before their micro-batch is launched (STARTED, one message per host
    and micro-batch)."""

    def __init__(self, backend: Any, settings: Any, **kwargs: Any) -> None:
        super().__init__(backend, settings, on_done=lambda job, outcome: None, outbox=RowsOut, **kwargs)
        self.links: list[HostLink] = []
        self._cond = Wakeful(lambda: self.links, self._intake)  # (links is replaced, never changed in place)

    def attach(self, link: HostLink) -> None:
        """A host joins (any thread): the inference thread reads it from its next intake."""
        self.links = [*self.links, link]
        self._cond.notify()

    def detach(self, link: HostLink) -> None:
        self.links = [other for other in self.links if other is not link]

    def intake(self) -> None:
        """What the inference thread does before each pick, from another thread (a test drives a service it has not
        started yet)."""
        with self._cond:
            self._intake()

    def _intake(self) -> None:
        """Inference thread: read every host that sent something (one ``select`` of no wait for all), then send the
        rows and errors that are ready."""
        links = self.links
        if links:
            try:
                ready = select.select(links, [], [], 0)[0]
            except (OSError, ValueError):  # a channel closed meanwhile: its drain finds it gone
                ready = links
            for link in ready:
                link.drain()
        self._outbox.flush()

    def preempt(self) -> None:
        """At a preemption point: what the hosts sent first (an online job that arrived since the launch)."""
        self._intake()
        super().preempt()

    def stop(self, timeout: float | None = 30.0) -> None:
        super().stop(timeout)
        self._outbox.flush()  # the last micro-batch's rows
        self._cond.close()

    def _started(self, starting: list[Job]) -> None:
        by_host: dict[HostLink, list[int]] = {}
        for job in starting:
            host, slot = job.context
            by_host.setdefault(host, []).append(slot)
        for host, slots in by_host.items():
            host.send(STARTED, np.array([(s,) for s in slots], dtype=SLOT))

    def _run_alone(self, job: Job) -> None:
        super()._run_alone(job)
        host, slot = job.context  # before anything else runs: a death from now on is not this job's
        host.send(ENDED, np.array([(slot,)], dtype=SLOT))


class RowsOut:
    """The device service's outbox: each finished job's rows, or its error, back to its host, in place of a
    worker's results thread (which encodes and stores). Jobs are put by the inference thread (finished, failed,
    cancelled, expired) and sent when it calls :meth:`flush`: at its next intake (after the micro-batch that finished
    them), one ROWS message per host. It has no thread of its own: ``thread`` is never started (the service's
    health and stop read it)."""

    def __init__(self, stats: Stats) -> None:  # (the outbox factory's signature: the hosts count the jobs)
        self.thread = threading.Thread(name="embedq-rows")  # never started
        self.beat = 0.0
        self._ready: list[tuple[Job, errors.EmbedqError | None]] = []

    def start(self) -> None:
        pass

    def put(self, job: Job, error: errors.EmbedqError | None = None) -> None:
        self._ready.append((job, error))

    def stalled(self, stall_timeout: float) -> float | None:
        return None

    def close(self) -> None:
        pass

    def flush(self) -> None:
        entries, self._ready = self._ready, []
        if not entries:
            return
        try:
            self._send(entries)
        except Exception:  # never let the inference thread die
            log.exception("sending the outcomes of %d job(s) failed", len(entries))

    def _send(self, entries: list[tuple[Job, errors.EmbedqError | None]]) -> None:
        by_host: dict[HostLink, list[tuple[Job, errors.EmbedqError | None]]] = {}
        for job, error in entries:
            by_host.setdefault(job.context[0], []).append((job, error))
        for host, done in by_host.items():
            for job, _ in done:
                host.jobs.pop(job.context[1], None)
            ok = [job for job, error in done if error is None]
            failed = [(job, error) for job, error in done if error is not None]
            if ok:
                slots = [job.context[1] for job in ok for _ in range(job.n_items)]
                items = [i for job in ok for i in range(job.n_items)]
                rows = [row for job in ok for row in (job.rows or [])]
                for job in ok:
                    job.rows = job.prepared = None
                host.send(ROWS, *pack_rows(slots, items, rows))
            if failed:
                records = np.array([(job.context[1],) for job, _ in failed], dtype=SLOT)
                payload = json.dumps([[error.code, str(error)] for _, error in failed]).encode()
                host.send(FAILED, records, payload)


def error_of(code: str, message: str) -> errors.EmbedqError:
    """A FAILED entry back as its typed error (the host stores it as if its own service had failed the job)."""
    cls = next((c for c in errors.table() if c.code == code), errors.EmbedqError)
    error = cls(message)
    error.code = code
    return error

