"""Identical items run once (issue 57): while the same item waits in several jobs, the model sees it once and every job
gets its row.

An item's *content* is what the model's row of it depends on, and nothing else: its token ids (after the prompt and
truncation), its segment ids, the length of its prompt and its head (``Encoded``). A worker serves one model and a
head post-processes nothing a job's options change later (normalizing, dimensions and the encoding are applied per job
by ``finish``), so two items of the same content get the same row; batch invariance (docs/FIDELITY.md) makes the row
of an item run with others the row it gets alone. The content is compared exactly (the bytes of the ids, a dict key),
never through a digest, so two different items can never share a row.

:class:`Dedupe` is owned by the service (``EmbeddingService.dedupe``) and sits between its intake and the scheduler:

* **Groups per lane.** A *lane* is a traffic class and a client (the scheduler's fairness is per lane). The first item
  of a content in a lane is the group's *entry* in the scheduler; the later ones of that lane join its group without
  being buffered (:meth:`add`), so the packer never sees them. They arrived later in the same lane, so waiting for the
  entry is waiting no longer than alone.
* **A batch takes the other lanes along.** When a micro-batch is taken (:meth:`take`), the entries of the same content
  waiting in other lanes leave the scheduler and ride along (they are run sooner than their own turn, never later), as
  do the duplicates of one content inside the batch. The first live item of each group is launched; the others are its
  *riders* until its row lands (:meth:`riders`): each rider gets a copy of the row, so no job's ``finish`` can change
  another's.
* **Nothing is lost when a job leaves.** An entry whose job is cancelled, expires or fails stays in the scheduler
  while a member of its group is live (:meth:`discard`), so they keep their place; the first live member is launched.
  A launched item whose job failed meanwhile hands its riders to the first live one when the batch is run again (a
  failing batch is split: :meth:`live`). A rider fails when its launched item fails (the same content fails the same
  way), each job once.
* **Crash suspects never share.** A job redelivered after its worker died runs alone (``Job.suspect``): it is neither an
  entry nor a rider.

``EMBEDQ_DEDUPE=false`` turns it off (:meth:`add` then puts every item into the scheduler). Not thread-safe on its own:
:meth:`add`, :meth:`discard` and :meth:`take` run under the service's lock; the riders of launched items are the
inference thread's alone.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from embedq.backends.base import Encoded
from embedq.batching.traffic import BULK
from embedq.workers.jobs import Job
from embedq.workers.stats import Stats

Key = tuple[Job, int]  # (job, index of the item in the job): the scheduler's key of an item
Lane = tuple[str, str]  # (traffic class, client)


def content_of(item: Encoded) -> Hashable:
    """What the model's row of ``item`` depends on, as an exact dict key: the same for an item whose ids are a list (a
    worker's own tokenizer) and one whose ids are a numpy view (a device process's arena)."""
    return (_ids_bytes(item.ids), None if item.type_ids is None else _ids_bytes(item.type_ids), item.prompt_length,
            item.head)


def _ids_bytes(ids: Any) -> Hashable:
    if isinstance(ids, np.ndarray):
        if ids.dtype == np.int32:
            return ids.tobytes()
        ids = ids.tolist()
    try:
        return array("i", ids).tobytes()  # 4-byte native ints, as the arena's int32
    except OverflowError:  # ids past int32 (no vocabulary has them): still exact, never equal to the bytes above
        return tuple(ids)


def _copy(row: Any) -> Any:
    """A rider's own row: a numpy array (or a tuple of them) copied, so no job's post-processing changes another's."""
    if isinstance(row, np.ndarray):
        return row.copy()
    if isinstance(row, tuple):
        return tuple(_copy(part) for part in row)
    return row


class Dedupe:
    """Groups of identical items between the service's intake and its scheduler; see the module's docstring."""

    def __init__(self, scheduler: Any, stats: Stats, enabled: bool = True) -> None:
        self.scheduler = scheduler  # the service's TrafficScheduler (entries pulled along leave it)
        self.stats = stats
        self.enabled = enabled
        self._buffered: dict[Hashable, dict[Lane, Key]] = {}  # content -> its entry in the scheduler, per lane
        self._entries: dict[Key, tuple[Lane, Hashable]] = {}  # entry -> its lane and content
        self._members: dict[Key, list[Key]] = {}  # entry -> the later items of its lane with the same content
        self._riders: dict[Key, list[Key]] = {}  # launched item -> its riders, until its row lands or it fails
        #: items waiting in an entry's group, not in the scheduler themselves (the worker's ``buffered`` adds them)
        self.waiting = 0

    # -- under the service's lock --------------------------------------------------------------------------------------
    def add(self, job: Job) -> list[int]:
        """The items of a prepared ``job`` (not a suspect) that go into the scheduler: every one while off; else those
        whose content no earlier item of its lane waits with (the others join that item's group)."""
        items = job.prepared.items  # type: ignore[union-attr]
        if not self.enabled:
            return list(range(len(items)))
        lane = (job.traffic_class, job.client)
        fresh: list[int] = []
        buffered, entries = self._buffered, self._entries
        for i, item in enumerate(items):
            content = content_of(item)
            lanes = buffered.get(content)
            if lanes is None:
                buffered[content] = {lane: (job, i)}
            elif lane in lanes:
                self._members.setdefault(lanes[lane], []).append((job, i))
                self.waiting += 1
                continue
            else:
                lanes[lane] = (job, i)
            entries[(job, i)] = (lane, content)
            fresh.append(i)
        return fresh

    def discard(self, keys: Iterable[Key]) -> list[Key]:
        """Of the items of a job that leaves (cancelled, expired, failed: ``job.done`` is set), those to drop from the
        scheduler: an entry stays there while one of its group is live (that one is launched in its place)."""
        if not self.enabled:
            return list(keys)
        out: list[Key] = []
        for key in keys:
            where = self._entries.get(key)
            if where is not None:
                members = self._members.get(key)
                if members and any(not job.done for job, _ in members):
                    continue
                self._forget(key, where)
                self.waiting -= len(self._members.pop(key, ()))
            out.append(key)  # (a member is not in the scheduler: its entry launches without it)
        return out

    def _forget(self, key: Key, where: tuple[Lane, Hashable]) -> None:
        del self._entries[key]
        lane, content = where
        lanes = self._buffered[content]
        del lanes[lane]
        if not lanes:
            del self._buffered[content]

    def take(self, keys: list[Key], preemption: Callable[[list[Key]], frozenset[str] | None]
             ) -> tuple[list[Key], list[Job], frozenset[str] | None]:
        """A micro-batch just taken from the scheduler (its items' keys): the items to launch, one per content, every
        job with a live item in it (launched or riding: they start now), and whether online micro-batches may pause it
        (``preemption(keys)``: None, or the clients whose online items may not). The entries of the same contents in
        other lanes leave the scheduler and ride along, each only where it would not have got its row sooner alone:
        one of bulk always (bulk never gets ahead of a batch in the model), one of an online lane only into a batch
        it could not pause (an online batch at a preemption point, a batch run whole, or a client's own)."""
        exclude = preemption(keys)
        if not self.enabled:
            return keys, [job for job, _ in keys], exclude
        groups: dict[Hashable, list[Key]] = {}
        others: dict[Hashable, dict[Lane, Key]] = {}  # content -> its entries in other lanes
        for key in keys:
            where = self._entries.pop(key, None)
            if where is None:  # not an entry (cannot be, but run it as it is)
                groups[("alone", id(key[0]), key[1])] = [key]
                continue
            lane, content = where
            group = groups.setdefault(content, [])
            group.append(key)
            members = self._members.pop(key, ())
            group.extend(members)
            self.waiting -= len(members)
            lanes = self._buffered.pop(content, None)
            if lanes is None:  # an earlier item of this batch had this content: they were grouped there
                lanes = others.pop(content, {})
            lanes.pop(lane, None)
            if lanes:
                others[content] = lanes
        pulled: list[Key] = []
        for content, lanes in others.items():
            stay: dict[Lane, Key] = {}
            for lane, other in lanes.items():
                if lane[0] == BULK or exclude is None or lane[1] in exclude:
                    del self._entries[other]
                    groups[content].append(other)
                    members = self._members.pop(other, ())
                    groups[content].extend(members)
                    self.waiting -= len(members)
                    pulled.append(other)
                else:
                    stay[lane] = other
            if stay:
                self._buffered[content] = stay
        if pulled:
            self.scheduler.discard(pulled)
        launch: list[Key] = []
        jobs: list[Job] = []
        riding = 0
        for group in groups.values():
            live = [key for key in group if not key[0].done]
            if not live:
                continue
            launch.append(live[0])
            if len(live) > 1:
                self._riders[live[0]] = live[1:]
                riding += len(live) - 1
            jobs.extend(job for job, _ in live)
        if riding:
            self.stats.add(items_deduplicated=riding)
        return launch, jobs, exclude

    # -- the inference thread ------------------------------------------------------------------------------------------
    def live(self, keys: list[Key]) -> list[Key]:
        """Of a micro-batch's items about to be launched, those whose job is not done, a launched item whose job is done
        replaced by the first live rider of it (which takes the other riders: a failing batch run again in halves)."""
        if not self._riders:
            return [key for key in keys if not key[0].done]
        out: list[Key] = []
        for key in keys:
            if not key[0].done:
                out.append(key)
                continue
            alive = [rider for rider in self._riders.pop(key, ()) if not rider[0].done]
            if alive:
                out.append(alive[0])
                if len(alive) > 1:
                    self._riders[alive[0]] = alive[1:]
        return out

    def riding_jobs(self, keys: list[Key]) -> list[Job]:
        """The jobs whose items ride on these launched items (in the model with them: the watchdog's ``running``)."""
        if not self._riders:
            return []
        return [job for key in keys for job, _ in self._riders.get(key, ())]

    def riders(self, key: Key) -> list[Key]:
        """The riders of a launched item whose outcome is known now (its row landed, or it failed); forgotten here."""
        return self._riders.pop(key, []) if self._riders else []

    copy = staticmethod(_copy)
