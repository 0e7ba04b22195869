"""Traffic classes: online jobs (someone is waiting) before bulk jobs (nobody is), without starving bulk.

:class:`TrafficScheduler` keeps one :class:`~embedq.batching.Scheduler` per class and builds every
micro-batch from the online items first, then fills what the token budget leaves with bulk items
(least padding first). Two rules bound what each class can do to the other:

* **Online waits at most about one micro-batch.** A micro-batch cannot be interrupted, so an online job
  that arrives while a bulk batch runs waits for it. While online traffic is about (an online item was
  buffered within ``online_hold`` seconds) bulk items go into a micro-batch only while it costs at most
  ``online_tokens`` padded tokens, so that wait is short; with no online traffic bulk runs at the full
  ``max_tokens``. Online items themselves always use the full budget: with online traffic alone the
  worker batches exactly as it would without classes.
* **Bulk is never starved.** While both classes wait, the real tokens run for each are counted; when
  bulk's share falls under ``bulk_share``, the next batch starts from the oldest bulk item (and online
  items fill it). The count restarts whenever one class has nothing waiting, so only contention counts.

With ``preemptive`` set (the worker's model can stop between two layers, issue 18) the first rule gives way
to a better one: an online job waits at most one *layer* of a bulk batch, because the service runs a
micro-batch of online items between two layers of the bulk batch (:meth:`next_online_batch`). So a batch is
of one class, bulk batches always take the full ``max_tokens`` (their efficient size) and online batches are
never lengthened with bulk items. The bulk share still holds: while bulk is owed its share, no online batch
is handed out for a preemption and the next batch is bulk's.

Within each class the model's time is shared between clients (:class:`~embedq.batching.fair.FairScheduler`,
issue 50): a caller's one-text job is not held behind another caller's flood, nor one indexer behind another.

:class:`Deadlines` orders buffered jobs by deadline so expired ones are dropped before they cost compute.
Pure logic: no Celery, Redis or torch; the clock is injected.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Collection, Hashable, Iterable
from typing import Any, Literal

from embedq.batching.fair import FairScheduler
from embedq.batching.items import Item

TrafficClass = Literal["online", "bulk"]
ONLINE: TrafficClass = "online"
BULK: TrafficClass = "bulk"
TRAFFIC_CLASSES: tuple[TrafficClass, ...] = (ONLINE, BULK)
#: Online clients remembered by when they last sent (see TrafficScheduler.other_online_clients) before stale ones go.
SEEN_LIMIT = 1024
#: Seconds an online client that sent work counts as about (TrafficScheduler.other_online_clients): longer than the
#: gap between one client's jobs, so that a tenant sending one job at a time still counts while another floods.
CLIENT_HOLD = 10.0


class TrafficScheduler:
    """Online-first micro-batches over two classes of buffered items (not thread-safe)."""

    def __init__(self, *, max_tokens: int, max_items: int, padded: bool = True, online_tokens: int | None = None,
                 bulk_share: float = 0.1, online_hold: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 <= bulk_share <= 1.0:
            raise ValueError("bulk_share must be between 0 and 1")
        self.max_tokens = max_tokens
        self.max_items = max_items
        self.padded = padded
        self.online_tokens = min(online_tokens or max_tokens, max_tokens)
        self.bulk_share = bulk_share
        self.online_hold = online_hold
        self.clock = clock
        self.classes: dict[TrafficClass, FairScheduler] = {
            name: FairScheduler(max_tokens=max_tokens, max_items=max_items, padded=padded) for name in TRAFFIC_CLASSES}
        self.served: dict[TrafficClass, int] = dict.fromkeys(TRAFFIC_CLASSES, 0)
        self._last_online = float("-inf")
        #: online client -> when it last added an item (bounded: stale entries are dropped past SEEN_LIMIT)
        self._online_seen: dict[str, float] = {}
        #: bulk batches can be interrupted between layers: one class per batch, bulk at the full budget
        self.preemptive = False

    def __len__(self) -> int:
        return sum(len(s) for s in self.classes.values())

    def waiting(self, traffic_class: TrafficClass) -> int:
        return len(self.classes[traffic_class])

    def waiting_by_client(self, traffic_class: TrafficClass) -> dict[str, int]:
        """Items of this class waiting, per client (round-robin order: the first starts the next batch)."""
        return self.classes[traffic_class].waiting_by_client()

    def add(self, key: Hashable, length: int, traffic_class: TrafficClass = ONLINE, client: str = "") -> Item:
        if traffic_class == ONLINE:
            self._saw_online(client)
        return self.classes[traffic_class].add(key, length, client)

    def add_many(self, pairs: Iterable[tuple[Hashable, int]], traffic_class: TrafficClass = ONLINE,
                 client: str = "") -> None:
        if traffic_class == ONLINE:
            self._saw_online(client)
        self.classes[traffic_class].add_many(pairs, client)

    def _saw_online(self, client: str) -> None:
        now = self._last_online = self.clock()
        seen = self._online_seen
        seen[client] = now
        if len(seen) > SEEN_LIMIT:  # many clients: forget those not seen within online_hold
            for name in [name for name, at in seen.items() if now - at >= CLIENT_HOLD]:
                del seen[name]

    def others_waiting(self, clients: frozenset[str]) -> bool:
        """Whether online items of a client outside ``clients`` wait. Safe to call without the worker's lock (the
        preemption point's quick look): a read that races an arrival may say no (the next point sees it), and one
        that races a change of the order says yes (the locked pick decides)."""
        try:
            return any(client not in clients for client in list(self.classes[ONLINE].clients))
        except RuntimeError:  # the order changed while it was copied
            return True

    def still_waiting(self, clients: frozenset[str]) -> bool:
        """Whether one of ``clients`` has online items waiting (a dict lookup each: safe without the worker's lock)."""
        waiting = self.classes[ONLINE].clients
        return any(client in waiting for client in clients)

    def other_online_clients(self, clients: frozenset[str]) -> bool:
        """Whether an online client outside ``clients`` has work waiting, or added some within :data:`CLIENT_HOLD`
        seconds: a large online micro-batch of ``clients`` is then worth making preemptible (issue 50), at the cost
        of the runtime a layered run takes; with one client alone it runs as before."""
        if self.others_waiting(clients):
            return True
        now = self.clock()
        return any(now - at < CLIENT_HOLD for name, at in list(self._online_seen.items())
                   if name not in clients)

    def preemption(self, batch: Iterable[tuple[TrafficClass, str]]) -> frozenset[str] | None:
        """Whether online micro-batches may pause a micro-batch of these (traffic class, client) items between two
        layers (None: it runs unhooked), and if so the clients whose online items may not (empty: anyone's): a bulk
        batch, by anyone's; an online batch, by clients with nothing in it, while another client has online work
        waiting or sent some lately (:data:`CLIENT_HOLD`) and one of its own clients has more waiting (issue 50: a
        flood of one client does not hold another's one-text job for a whole micro-batch, not even for the short one
        :meth:`shared_budget` then makes; one client alone, and a light client's batch, keep the faster unlayered
        runtime)."""
        if not self.preemptive:
            return None
        batch = list(batch)
        if all(klass == BULK for klass, _ in batch):
            return frozenset()
        if any(klass == BULK for klass, _ in batch):
            return None
        clients = frozenset(client for _, client in batch)
        if not self.still_waiting(clients):  # a light batch (its clients have nothing more): short, and nobody
            return None  # lighter to let in: the faster unlayered runtime
        if not self.other_online_clients(clients):  # one client alone: nobody to let in, keep its runtime
            return None
        return clients

    def shared_budget(self) -> int:
        """Padded tokens the next online micro-batch may cost: ``online_tokens`` while the client at the head of the
        online order shares the worker with another online client (waiting, or seen within :data:`CLIENT_HOLD`), so
        that the other's next job waits for a short batch, not a full one of the flood; else ``max_tokens``."""
        clients = self.classes[ONLINE].clients
        if not clients:
            return self.max_tokens
        head = next(iter(clients))
        return self.online_tokens if self.other_online_clients(frozenset((head,))) else self.max_tokens

    def discard(self, keys: Iterable[Hashable]) -> int:
        keys = list(keys)
        return sum(s.discard(keys) for s in self.classes.values())

    def online_active(self) -> bool:
        return bool(self.classes[ONLINE]) or self.clock() - self._last_online < self.online_hold

    def bulk_budget(self) -> int:
        """Padded tokens a micro-batch with bulk items in it may cost now."""
        if self.preemptive:
            return self.max_tokens
        return self.online_tokens if self.online_active() else self.max_tokens

    def bulk_owed(self) -> bool:
        """While both classes contend: bulk has had less than its share of the tokens run (never while no bulk item
        waits: online preempting online, issue 50, is no contention with bulk)."""
        if not self.classes[BULK]:
            return False
        total = self.served[ONLINE] + self.served[BULK]
        return bool(total) and self.served[BULK] < self.bulk_share * total

    def next_online_batch(self, exclude: Collection[str] = ()) -> list[Item]:
        """A micro-batch of online items alone, to run between two layers of a running batch (counted as
        contention); empty when no online item waits or bulk is owed its share. ``exclude``: the clients of a
        running online batch (their items wait for it; only the items of other clients that wait for less than their
        share preempt it: a flood never preempts a light client's short batch)."""
        online = self.classes[ONLINE]
        if not online or self.bulk_owed():
            return []
        batch = online.next_batch(exclude=exclude, light_only=bool(exclude))
        self.served[ONLINE] += sum(item.length for item in batch)
        return batch

    def next_batch(self) -> list[Item]:
        """Remove and return the next micro-batch (empty when nothing is buffered)."""
        online, bulk = self.classes[ONLINE], self.classes[BULK]
        if not online or not bulk:  # no contention: one class, and the share count restarts
            self.served = dict.fromkeys(TRAFFIC_CLASSES, 0)
            if online:
                return online.next_batch(max_tokens=self.shared_budget())
            batch = bulk.next_batch(max_tokens=self.bulk_budget())
            if self.preemptive:  # online items that come while it runs preempt it: that is contention
                self.served[BULK] += sum(item.length for item in batch)
            return batch
        first = BULK if self.bulk_owed() else ONLINE
        if self.preemptive:  # one class per batch
            batch = self.classes[first].next_batch(max_tokens=self.shared_budget() if first == ONLINE else None)
            self.served[first] += sum(item.length for item in batch)
            return batch
        second = BULK if first == ONLINE else ONLINE
        if first == ONLINE:  # online at its budget; bulk only while the batch stays short
            batch = online.next_batch(max_tokens=self.shared_budget())
            fill_budget = self.online_tokens
        else:  # bulk's turn: a short bulk batch, then the waiting online items ride along
            batch = bulk.next_batch(max_tokens=self.online_tokens)
            fill_budget = self.max_tokens
        head = sum(item.length for item in batch)
        added = self.classes[second].fill(batch, max_tokens=fill_budget, max_items=self.max_items)
        self.served[first] += head
        self.served[second] += sum(item.length for item in added)
        return batch


class Deadlines:
    """Buffered jobs with a deadline, soonest first (a heap; finished jobs are skipped, then pruned)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, deadline: float, job: Any) -> None:
        heapq.heappush(self._heap, (deadline, self._seq, job))
        self._seq += 1

    def next_deadline(self, finished: Callable[[Any], bool] | None = None) -> float | None:
        """The soonest deadline; with ``finished``, of a job that is not finished (finished ones at the top are
        forgotten: a done job's deadline must not wake anyone)."""
        heap = self._heap
        while finished is not None and heap and finished(heap[0][2]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def due(self, now: float) -> list[Any]:
        """Remove and return the jobs whose deadline is ``now`` or earlier."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def prune(self, finished: Callable[[Any], bool]) -> None:
        """Forget finished jobs (a long deadline would otherwise keep a done job referenced)."""
        self._heap = [entry for entry in self._heap if not finished(entry[2])]
        heapq.heapify(self._heap)
