"""The device side of issue 53's layout (step 3): the items of every host process in one scheduler, rows back to
their hosts.

Host processes receive, check and tokenize jobs, write their token ids into their arena
(:class:`~embedq.workers.arena.IdsArena`) and send ITEMS records over their channel
(:mod:`embedq.workers.channel`). On the device side each host is a :class:`HostLink`, whose reader thread turns the
records of each job into a proxy :class:`~embedq.workers.jobs.Job` (its items' ids read from the host's arena; no
tokenizer, no options) and hands it to the one :class:`~embedq.workers.service.EmbeddingService` of the device with
:meth:`~embedq.workers.service.EmbeddingService.enqueue`: so the scheduler packs the items of all hosts' jobs
together, online before bulk, with the bulk share, deadlines, suspects alone and preemption between layers, as in
one process. Where today's worker's results thread encodes and stores, :class:`RowsOut` (the service's outbox here)
sends each finished job's rows back to its host (ROWS) or its error (FAILED); the host finishes, stores and acks.

A host that is gone (EOF on its channel: its process died or closed it) has its jobs dropped: those not started
are cancelled unrun, those in the model run out and their rows go nowhere. Its messages are the broker's to
redeliver. `embedq worker --device-process` runs it (embedq/workers/split.py, device_main.py).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
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
    ChannelError,
    pack_rows,
)
from embedq.workers.jobs import Job
from embedq.workers.outbox import Outbox
from embedq.workers.service import EmbeddingService
from embedq.workers.stats import Stats

log = logging.getLogger(__name__)

_CLASSES = (ONLINE, BULK)  # ITEM's ``traffic`` code


class HostLink:
    """One host process as the device process sees it: its channel, its arena, its jobs in the service."""

    def __init__(self, number: int, channel: Channel, service: Any) -> None:
        self.number = number
        self.channel = channel
        self.service = service
        hello = channel.recv_hello()
        self.pid = int(hello.get("pid", 0))
        self.heads: list[str] = [str(h) for h in hello.get("heads", [])]
        self.arena = IdsArena.attach(str(hello["arena"]), int(hello["capacity"]))
        self.jobs: dict[int, Job] = {}  # slot -> its proxy job, until its outcome is sent
        self.lock = threading.Lock()  # jobs, and the channel's send side
        self.gone = threading.Event()
        self.thread = threading.Thread(target=self._read, name=f"embedq-host-{number}", daemon=True)

    def start(self) -> HostLink:
        self.thread.start()
        return self

    def _read(self) -> None:
        try:
            while True:
                message = self.channel.recv()
                if message.kind == ITEMS:
                    self.service.enqueue(self._jobs(message.records))
                elif message.kind == CANCEL:
                    with self.lock:
                        jobs = [self.jobs.get(int(s)) for s in message.records["slot"]]
                    for job in jobs:
                        if job is not None:
                            self.service.cancel(job)
                else:
                    log.warning("host %d sent a %r message; ignored", self.number, message)
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
        arena = self.arena.ids
        offsets, lengths = records["offset"].tolist(), records["length"].tolist()
        if min(offsets) < 0 or min(lengths) < 1:
            raise ChannelError("an ITEMS record has a negative offset or no tokens")
        heads = [self.heads[h] for h in records["head"].tolist()]
        types, prompts = records["types"].tolist(), records["prompt"].tolist()
        items = []
        for offset, length, typed, prompt, head in zip(offsets, lengths, types, prompts, heads):
            end = offset + length
            if end + (length if typed else 0) > len(arena):
                raise ChannelError(f"an ITEMS record points outside the host's arena ({offset}:{end})")
            items.append(Encoded(arena[offset:end], arena[end:end + length] if typed else None, prompt, head))
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
        with self.lock:
            self.jobs.update((job.context[1], job) for job in jobs)
        return jobs

    def send(self, kind: int, records: np.ndarray, payload: bytes = b"") -> None:
        """Send to the host unless it is gone (then what it would have got is dropped)."""
        if self.gone.is_set():
            return
        try:
            with self.lock:
                self.channel.send(kind, records, payload)
        except OSError:
            self.gone.set()

    def _drop(self) -> None:
        """The host is gone: its jobs not started are cancelled, the others run out unsent."""
        self.gone.set()
        with self.lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            self.service.cancel(job)
        log.info("host %d (pid %d) is gone: %d of its jobs dropped", self.number, self.pid, len(jobs))

    def close(self) -> None:
        self.channel.shutdown()
        self.thread.join(5)
        self.arena.close()


class DeviceService(EmbeddingService):
    """The device process's service: an :class:`~embedq.workers.service.EmbeddingService` (its outbox a
    :class:`RowsOut`) that tells each host which of its jobs start, before their micro-batch is launched (STARTED,
    one message per host and micro-batch)."""

    def __init__(self, backend: Any, settings: Any, **kwargs: Any) -> None:
        super().__init__(backend, settings, on_done=lambda job, outcome: None, outbox=RowsOut, **kwargs)

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


class RowsOut(Outbox):
    """The device process's results thread (the service's outbox): each finished job's rows, or its error, back to
    its host, in place of encoding and storing (:class:`~embedq.workers.outbox.Outbox`'s loop, its handling
    replaced)."""

    def __init__(self, stats: Stats) -> None:
        super().__init__(None, None, stats, on_done=lambda job, outcome: None)  # type: ignore[arg-type]

    def _handle(self, entries: list[tuple[Job, errors.EmbedqError | None]]) -> None:
        try:
            self._send(entries)
        except Exception:  # never let the results thread die
            log.exception("sending the outcomes of %d job(s) failed", len(entries))

    def _send(self, entries: list[tuple[Job, errors.EmbedqError | None]]) -> None:
        by_host: dict[HostLink, list[tuple[Job, errors.EmbedqError | None]]] = {}
        for job, error in entries:
            by_host.setdefault(job.context[0], []).append((job, error))
        for host, done in by_host.items():
            with host.lock:
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
                self.stats.add(jobs_succeeded=len(ok), items_succeeded=sum(job.size for job in ok))
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

