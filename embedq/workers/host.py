"""The host side of issue 53's layout (step 4): a service for the consumer of a host process, whose micro-batches run
in the device process.

A host process receives, checks and tokenizes jobs exactly as today's worker does (:class:`HostService` is an
:class:`~embedq.workers.service.EmbeddingService`: ``submit_many``, ``cancel``, ``fail``, the counters, the results
thread). Where today's service puts a prepared job into its scheduler (``enqueue``), the host writes the job's token
ids into its :class:`~embedq.workers.arena.IdsArena` and sends the device process one ITEMS record per item
(:mod:`embedq.workers.channel`); the device process schedules the items of every host together
(:mod:`embedq.workers.device`) and sends each finished job's rows back (ROWS), or its error (FAILED). The host's
reader thread puts the rows into the job and hands the finished job to today's results thread, which encodes and
stores it (the consumer then acknowledges it): so only ids go one way and output arrays the other.

A cancelled job is the device's to drop (CANCEL): one that has not started comes back as FAILED with ``cancelled``,
one that has runs out. If the device process is gone (EOF on the channel), :meth:`HostService.health` says so: the
worker's watchdog then stops the host, which hands every message it holds back to its queue (nothing is lost; the
jobs run again where a device is). `embedq worker --device-process` runs it (embedq/workers/split.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import threading
import time
from typing import Any

import numpy as np

from embedq import errors
from embedq.batching.traffic import BULK
from embedq.workers.arena import IdsArena
from embedq.workers.channel import (
    CANCEL,
    ENDED,
    FAILED,
    ITEM,
    ITEMS,
    ROWS,
    SLOT,
    STARTED,
    STATS,
    Channel,
    unpack_rows,
)
from embedq.workers.device import error_of
from embedq.workers.jobs import Job
from embedq.workers.service import EmbeddingService

log = logging.getLogger(__name__)

#: Seconds a job waits at most for room in a full arena before it fails with ``unavailable`` (the arena is sized to
#: what the host may hold, so only a device that stopped answering fills it).
ARENA_WAIT = 60.0


def client_code(client: str | None) -> int:
    """A producer identity as the 64-bit number ITEM records carry: the same on every host, so a client's fair share
    is one across hosts (0 for none)."""
    if not client:
        return 0
    return int.from_bytes(hashlib.blake2b(client.encode(), digest_size=8).digest(), "little") or 1


def arena_capacity(settings: Any, max_seq_length: int) -> int:
    """Ids the arena holds: the host's whole prefetch window of the longest items, pairs' segment ids included."""
    return max(1 << 16, 2 * max(1, settings.prefetch_window) * max(1, max_seq_length))


class HostService(EmbeddingService):
    """:class:`~embedq.workers.service.EmbeddingService` with its micro-batches in the device process at the other
    end of ``channel`` (its inference thread is never started; its scheduler stays empty)."""

    def __init__(self, backend: Any, settings: Any, on_done: Any, channel: Channel, *, capacity: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(backend, settings, on_done, **kwargs)
        self.channel = channel
        self.heads = list(backend.head_names())
        self.arena = IdsArena.create(capacity or arena_capacity(settings, backend.info.max_seq_length))
        self._slots = itertools.count(1)
        self._sent: dict[int, tuple[Job, int]] = {}  # slot -> (job, its arena span), until its outcome is in
        self._slot_of: dict[Job, int] = {}
        self._ended: set[Job] = set()  # suspect jobs whose run alone has ended at the device (ENDED), rows to come
        self._lock = threading.Condition()  # _sent, the arena and the channel's send side
        self.device_gone = threading.Event()
        self.device: dict[str, Any] = {}  # the device process's counters, as it last sent them (STATS)
        self._reader = threading.Thread(target=self._read, name="embedq-device-link", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> HostService:
        self.channel.send_hello({"arena": self.arena.name, "capacity": self.arena.capacity, "pid": os.getpid(),
                                 "heads": self.heads})
        self._outbox.start()
        self._reader.start()
        return self

    @property
    def at_device(self) -> int:
        """Jobs sent to the device process whose outcome has not come back."""
        return len(self._sent)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Write what has come back and stop; jobs still at the device stay unfinished (their messages are
        not acknowledged, so they are redelivered)."""
        super().stop(timeout)
        self.channel.shutdown()
        self._reader.join(timeout)

    def close(self) -> None:
        """Let go of the arena (after :meth:`stop`)."""
        self.arena.close()

    def health(self, stall_timeout: float) -> str | None:
        if not self._stopping and self.device_gone.is_set():
            return "the device process is gone"
        return super().health(stall_timeout)

    # -- intake (consumer thread) ------------------------------------------------------------
    def enqueue(self, ready: list[Job]) -> None:
        """The prepared jobs to the device process: their ids into the arena, their items as ITEMS records, in one
        message for the jobs of one fetch (a message per job cost one-text jobs a round of system calls each)."""
        pending: list[np.ndarray] = []
        for job in self._runnable(ready):
            try:
                pending.append(self._records(job, pending))
            except errors.EmbedqError as exc:
                self.fail(job, exc)
        self._flush(pending)

    def _records(self, job: Job, pending: list[np.ndarray]) -> np.ndarray:
        """The job's ITEMS records, its ids written into the arena (``pending``, the records not sent yet, are sent
        first if the arena has no room: the device frees room only for what it has)."""
        assert job.prepared is not None
        items = job.prepared.items
        arrays: list[list[int]] = []
        for e in items:
            arrays.append(e.ids)
            if e.type_ids is not None:
                arrays.append(e.type_ids)
        records = np.zeros(len(items), dtype=ITEM)
        slot = next(self._slots)
        records["slot"], records["item"] = slot, np.arange(len(items))
        records["length"] = [len(e.ids) for e in items]
        records["types"] = [e.type_ids is not None for e in items]
        records["head"] = [self.heads.index(e.head) for e in items]
        records["prompt"] = [e.prompt_length for e in items]
        records["cost"] = [job.cost(i) for i in range(len(items))]
        records["traffic"] = int(job.traffic_class == BULK)
        records["suspect"] = bool(job.suspect)
        records["client"] = client_code(job.client)
        records["deadline"] = math.nan if job.deadline is None else job.deadline
        end = time.monotonic() + ARENA_WAIT
        with self._lock:
            while (written := self.arena.write(arrays)) is None:
                self._flush(pending)
                if self.device_gone.is_set() or time.monotonic() > end:
                    raise errors.Unavailable(f"job {job.id}: no room for its token ids (the device process "
                                             "does not answer)")
                self._lock.wait(1.0)
            start, offsets = written
            index = np.cumsum([0] + [1 + (e.type_ids is not None) for e in items[:-1]])
            records["offset"] = offsets[index]
            self._sent[slot] = (job, start)
            self._slot_of[job] = slot
        return records

    def _flush(self, pending: list[np.ndarray]) -> None:
        """Send the ITEMS records of ``pending`` in one message (and empty it)."""
        if not pending:
            return
        records = pending[0] if len(pending) == 1 else np.concatenate(pending)
        pending.clear()
        with self._lock:
            try:
                self.channel.send(ITEMS, records)
            except OSError:  # the device process is gone: health says so; the jobs' messages are handed back
                self.device_gone.set()

    def cancel(self, job: Job, error: errors.EmbedqError | None = None) -> bool:
        """Consumer thread: a job at the device is the device's to drop (CANCEL: it comes back as FAILED with
        ``cancelled`` if it had not started); any other, as the service does."""
        slot = self._slot_of.get(job)
        if slot is None or job.done:
            return super().cancel(job, error)
        if job.started is not None:  # it runs out (STARTED came)
            return False
        with self._lock:
            if slot not in self._sent or self.device_gone.is_set():
                return False
            try:
                self.channel.send(CANCEL, np.array([(slot,)], dtype=SLOT))
            except OSError:
                self.device_gone.set()
                return False
        return True

    # -- what comes back (reader thread) ----------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                message = self.channel.recv()
                if message.kind == ROWS:
                    self._rows(message.records, message.payload)
                elif message.kind == STARTED:
                    self._job_started(message.records)
                elif message.kind == ENDED:
                    self._run_ended(message.records)
                elif message.kind == STATS:
                    self.device = json.loads(bytes(message.payload))
                elif message.kind == FAILED:
                    self._failed(message.records, message.payload)
                else:
                    log.warning("the device process sent a %r message; ignored", message)
        except (EOFError, OSError):
            pass
        except Exception:  # a bug on either side: as if the device were gone (health stops the host)
            log.exception("reading the device process's channel failed")
        self.device_gone.set()
        with self._lock:
            self._lock.notify_all()

    def _job_started(self, records: np.ndarray) -> None:
        """The device starts these jobs' first micro-batch: they are running (:attr:`running`; a cancel comes too
        late for them), and the consumer is told (its task-started event)."""
        now = time.monotonic()
        for slot in records["slot"].tolist():
            entry = self._sent.get(slot)
            if entry is None or entry[0].started is not None:
                continue
            job = entry[0]
            job.started = now
            if job.suspect and self.on_isolated_run is not None:  # counted before the device runs it alone: if it
                self.on_isolated_run(job, True)  # dies meanwhile, the count stays (STARTED is read before the EOF)
            if self.on_started is not None:
                self.on_started(job)

    def _run_ended(self, records: np.ndarray) -> None:
        """A suspect job's run alone has ended at the device (its rows may still be on their way): uncounted."""
        for slot in records["slot"].tolist():
            entry = self._sent.get(slot)
            if entry is not None:
                self._uncount(entry[0])

    def _uncount(self, job: Job) -> None:
        if job.suspect and job.started is not None and job not in self._ended:
            self._ended.add(job)
            if self.on_isolated_run is not None:
                self.on_isolated_run(job, False)

    @property
    def running(self) -> tuple[Job, ...]:
        """The jobs at the device whose first micro-batch has started and whose rows are not all back: what a dead
        device process had in the model, or may have had (the watchdog blames them, as a worker's in-model jobs)."""
        return tuple(job for job, _ in list(self._sent.values()) if job.started is not None and job not in self._ended)

    def _rows(self, records: np.ndarray, payload: memoryview) -> None:
        for slot, item, row in unpack_rows(records, payload):
            entry = self._sent.get(slot)
            if entry is None:
                continue
            job = entry[0]
            if job.rows is None:  # failed or cancelled here meanwhile: the device has read its ids, its span is free
                self._done(slot)
                continue
            if job.rows[item] is not None:
                continue
            job.rows[item] = row
            job.remaining -= 1
            if job.remaining == 0:
                self._done(slot)
                if not job.done:
                    self._finish(job)

    def _failed(self, records: np.ndarray, payload: memoryview) -> None:
        for slot, (code, message) in zip(records["slot"].tolist(), json.loads(bytes(payload))):
            job = self._done(slot)
            if job is None or job.done:
                continue
            error = error_of(code, message)
            if isinstance(error, errors.Cancelled):  # counted as cancelled, not as a failure
                job.done, job.rows = True, None
                self.stats.add(jobs_cancelled=1, items_cancelled=job.size)
                self._outbox.put(job, error)
            else:
                self.fail(job, error)

    def _done(self, slot: int) -> Job | None:
        """The device is done with ``slot``: its span is freed (its ids may be written over)."""
        with self._lock:
            entry = self._sent.pop(slot, None)
            if entry is None:
                return None
            self._slot_of.pop(entry[0], None)
            self.arena.free(entry[1])
            self._lock.notify_all()
        job = entry[0]
        self._uncount(job)  # its run alone ended (if ENDED did not say so already): not blamed for a later death
        self._ended.discard(job)
        return job
