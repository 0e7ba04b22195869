"""Fair share between clients: one client's large jobs cannot hold back another's small ones (issue 50).

:class:`FairScheduler` keeps one length-bucket :class:`~embedq.batching.Scheduler` per client (a producer identity:
``Job.client``), made when the client's first item comes and dropped when its last one leaves. Every micro-batch
shares the token budget out between the clients that have items waiting, in round-robin order:

* the client at the head of the order starts the batch from its oldest item, growing it up to one *quota*
  (``budget / active clients``); each next client then grows it with its own items (least padding first) while the
  batch costs at most one more quota; what the budget still leaves is filled from every client in the same order
  (a client alone in a batch's length range gets the whole batch: the share never idles the model);
* the head then moves to the end of the order, and a client that had nothing waiting joins at the *head*: its
  first item is in the very next micro-batch, whatever another client has buffered (a one-text job waits about one
  micro-batch behind a flood, not behind the flood);
* a *light* client at the head (its waiting items cost at most its quota) gets a batch of the light clients alone,
  so that its one-text job costs its own text, not a full batch of the flood's (``light_only`` asks for such a batch
  at a preemption point: a flood never preempts a light client's batch).

With a single client a micro-batch is exactly the one :class:`~embedq.batching.Scheduler` makes (the same items,
the same order, the same padding): fairness costs nothing until a second client waits. Pure logic, not
thread-safe (the worker guards it with its lock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable

from embedq.batching.items import Item
from embedq.batching.scheduler import Scheduler


class FairScheduler:
    """Token-budget micro-batches shared fairly between clients (the interface of a :class:`Scheduler`, plus the
    ``client`` of the items added)."""

    def __init__(self, *, max_tokens: int, max_items: int, padded: bool = True) -> None:
        if max_tokens < 1 or max_items < 1:
            raise ValueError("max_tokens and max_items must be positive")
        self.max_tokens = max_tokens
        self.max_items = max_items
        self.padded = padded
        #: client -> its items, in round-robin order (the head starts the next batch); only clients with items
        self.clients: OrderedDict[str, Scheduler] = OrderedDict()
        self._owner: dict[Hashable, str] = {}  # item key -> its client
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def waiting_by_client(self) -> dict[str, int]:
        """Items waiting per client (round-robin order)."""
        return {client: len(s) for client, s in self.clients.items()}

    def _scheduler(self, client: str) -> Scheduler:
        s = self.clients.get(client)
        if s is None:  # a client that had nothing waiting starts the next batch
            s = self.clients[client] = Scheduler(max_tokens=self.max_tokens, max_items=self.max_items,
                                                 padded=self.padded)
            self.clients.move_to_end(client, last=False)
        return s

    def add(self, key: Hashable, length: int, client: str = "") -> Item:
        if key in self._owner:
            raise KeyError(f"item {key!r} is already buffered")
        item = self._scheduler(client).add(key, length)
        self._owner[key] = client
        self._size += 1
        return item

    def add_many(self, pairs: Iterable[tuple[Hashable, int]], client: str = "") -> None:
        for key, length in pairs:
            self.add(key, length, client)

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Drop buffered items (a cancelled or failed job); returns how many were dropped."""
        dropped = 0
        for key in keys:
            client = self._owner.pop(key, None)
            if client is None:
                continue
            s = self.clients[client]
            dropped += s.discard((key,))
            if not s:
                del self.clients[client]
        self._size -= dropped
        return dropped

    def _taken(self, items: list[Item]) -> None:
        for item in items:
            client = self._owner.pop(item.key)
            s = self.clients.get(client)
            if s is not None and not s:  # its last item: the client leaves the order
                del self.clients[client]
        self._size -= len(items)

    def next_batch(self, *, max_tokens: int | None = None, max_items: int | None = None,
                   exclude: Collection[str] = (), light_only: bool = False) -> list[Item]:
        """Remove and return the next micro-batch (empty when nothing is buffered); see the module's docstring.

        ``max_tokens``/``max_items`` narrow this one batch, as for :meth:`Scheduler.next_batch`; ``exclude``: clients
        left out of it (those of a running micro-batch this one preempts); ``light_only``: only clients that wait for
        less than their share of the budget (empty if none does): a flood does not preempt a light client's batch."""
        names = [c for c in self.clients if c not in exclude] if exclude else list(self.clients)
        if light_only:
            share = max((self.max_tokens if max_tokens is None else max_tokens) // len(self.clients), 1)
            names = [c for c in names if self.clients[c].tokens <= share]
        if not names:
            return []
        if len(names) == 1:  # one client: exactly its own scheduler's batch
            batch = self.clients[names[0]].next_batch(max_tokens=max_tokens, max_items=max_items)
            self._taken(batch)
            self._rotate(names[0])
            return batch
        budget = self.max_tokens if max_tokens is None else max_tokens
        cap = self.max_items if max_items is None else max_items
        quota = max(budget // len(names), 1)
        if self.clients[names[0]].tokens <= quota:
            # The head waits for less than its share (a one-text job behind a flood): a short batch of such light
            # clients alone, so that its answer costs its own texts, not a full batch of the flood's.
            light = [self.clients[c] for c in names if self.clients[c].tokens <= quota][:cap]
            batch = light[0].next_batch(max_tokens=budget, max_items=cap)
            for s in light[1:]:
                s.fill(batch, max_tokens=budget, max_items=cap)
            self._taken(batch)
            self._rotate(names[0])
            return batch
        # At most ``cap`` clients can have an item in one batch: the others wait their turn in the order.
        order = [self.clients[c] for c in names[:cap]]
        batch = order[0].next_batch(max_tokens=quota, max_items=cap)
        for i, s in enumerate(order[1:], start=2):
            s.fill(batch, max_tokens=min(quota * i, budget), max_items=cap)
        for s in order:  # what the shares leave of the budget, in the same order
            if len(batch) >= cap:
                break
            s.fill(batch, max_tokens=budget, max_items=cap)
        self._taken(batch)
        self._rotate(names[0])
        return batch

    def _rotate(self, head: str) -> None:
        """The head had its turn: to the end of the order (if it still has items)."""
        if head in self.clients:
            self.clients.move_to_end(head)

    def fill(self, batch: list[Item], *, max_tokens: int | None = None, max_items: int | None = None) -> list[Item]:
        """Add this scheduler's items to ``batch`` (taken from another scheduler) while they fit, client by client in
        round-robin order (each within an equal share of what the budget leaves, then what remains); returns the
        items added."""
        if not self.clients or not batch:
            return []
        before = len(batch)
        if len(self.clients) == 1:
            added = next(iter(self.clients.values())).fill(batch, max_tokens=max_tokens, max_items=max_items)
            self._taken(added)
            return added
        budget = self.max_tokens if max_tokens is None else max_tokens
        cap = self.max_items if max_items is None else max_items
        order = list(self.clients.values())[:max(cap - len(batch), 1)]
        longest = max(item.length for item in batch)
        start = longest * len(batch) if self.padded else sum(item.length for item in batch)
        quota = max((budget - start) // len(self.clients), 1)
        for i, s in enumerate(order, start=1):
            s.fill(batch, max_tokens=min(start + quota * i, budget), max_items=cap)
        for s in order:
            if len(batch) >= cap:
                break
            s.fill(batch, max_tokens=budget, max_items=cap)
        added = batch[before:]
        self._taken(added)
        return added
