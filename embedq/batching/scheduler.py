"""The buffer of items waiting for the model, and the choice of the next micro-batch."""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import OrderedDict
from collections.abc import Hashable, Iterable

from embedq.batching.items import Item


class Scheduler:
    """Coalesces the items of all buffered jobs into token-budget micro-batches.

    Items wait in length buckets (each in arrival order) and in one arrival-order list. ``next_batch``
    always starts from the *oldest* item, so every call makes progress on the head of the queue and
    nothing starves behind a stream of better-fitting items; it then grows the batch one neighbour in
    length at a time, each time taking whichever of the next shorter or next longer item adds the
    least padding, until the token budget or the item cap is reached. Batches are therefore
    length-homogeneous, and the cost of a call is proportional to the batch it returns, not to
    how much is buffered (a GPU worker asks for a new batch every few milliseconds).

    An item that alone exceeds the budget runs alone: it is never clamped (that would change its
    vector) and never blocks. Not thread-safe: the worker guards it with its own lock.
    """

    def __init__(self, *, max_tokens: int, max_items: int, padded: bool = True) -> None:
        if max_tokens < 1 or max_items < 1:
            raise ValueError("max_tokens and max_items must be positive")
        self.max_tokens = max_tokens
        self.max_items = max_items
        self.padded = padded
        self._arrival: OrderedDict[Hashable, Item] = OrderedDict()
        self._buckets: dict[int, OrderedDict[Hashable, Item]] = {}
        self._lengths: list[int] = []  # sorted lengths that have a non-empty bucket
        self._seq = 0
        #: the lengths of the waiting items, summed (what they would cost run one by one)
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._arrival)

    def add(self, key: Hashable, length: int) -> Item:
        if key in self._arrival:
            raise KeyError(f"item {key!r} is already buffered")
        item = Item(key=key, length=max(int(length), 1), seq=self._seq)
        self._seq += 1
        self._arrival[key] = item
        self.tokens += item.length
        bucket = self._buckets.get(item.length)
        if bucket is None:
            bucket = self._buckets[item.length] = OrderedDict()
            insort(self._lengths, item.length)
        bucket[key] = item
        return item

    def add_many(self, pairs: Iterable[tuple[Hashable, int]]) -> None:
        for key, length in pairs:
            self.add(key, length)

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Drop buffered items (a cancelled or failed job); returns how many were dropped."""
        dropped = 0
        for key in keys:
            item = self._arrival.pop(key, None)
            if item is None:
                continue
            dropped += 1
            self.tokens -= item.length
            bucket = self._buckets[item.length]
            del bucket[key]
            if not bucket:
                self._drop_length(item.length)
        return dropped

    def _fits(self, longest: int, count: int, total: int, max_tokens: int, max_items: int) -> bool:
        return count <= max_items and (longest * count if self.padded else total) <= max_tokens

    def _take(self, length: int) -> Item:
        """Remove and return the oldest item of the bucket ``length`` (which must be non-empty)."""
        _, item = self._buckets[length].popitem(last=False)
        del self._arrival[item.key]
        self.tokens -= item.length
        return item

    def _drop_length(self, length: int) -> None:
        del self._buckets[length]
        del self._lengths[bisect_right(self._lengths, length) - 1]

    def next_batch(self, *, max_tokens: int | None = None, max_items: int | None = None) -> list[Item]:
        """Remove and return the next micro-batch (empty when nothing is buffered).

        ``max_tokens``/``max_items`` narrow this one batch (the worker's traffic classes use it)."""
        if not self._arrival:
            return []
        # The oldest item overall is also the oldest of its length bucket.
        oldest = self._take(next(iter(self._arrival.values())).length)
        batch = [oldest]
        self._grow(batch, oldest.length, oldest.length, max_tokens, max_items)
        return batch

    def fill(self, batch: list[Item], *, max_tokens: int | None = None, max_items: int | None = None) -> list[Item]:
        """Add this scheduler's items to ``batch`` (taken from another scheduler) while they fit, least
        padding first; returns the items added."""
        if not self._arrival or not batch:
            return []
        before = len(batch)
        longest = max(item.length for item in batch)
        self._grow(batch, longest, sum(item.length for item in batch), max_tokens, max_items)
        return batch[before:]

    def _grow(self, batch: list[Item], longest: int, total: int, max_tokens: int | None,
              max_items: int | None) -> None:
        """Grow ``batch`` one neighbour in length at a time: whichever of the next shorter or next longer
        buffered item adds the least padding, until the budget or the item cap is reached."""
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        max_items = self.max_items if max_items is None else max_items
        lengths, buckets = self._lengths, self._buckets
        # left: the longest bucket no longer than the batch's longest item; right: the next longer one.
        left = bisect_right(lengths, longest) - 1
        right = left + 1
        taken: set[int] = set()
        while len(batch) < max_items:
            while left >= 0 and not buckets[lengths[left]]:
                left -= 1
            while right < len(lengths) and not buckets[lengths[right]]:
                right += 1
            choice = None
            waste = 0
            if left >= 0 and self._fits(longest, len(batch) + 1, total + lengths[left], max_tokens, max_items):
                choice, waste = left, longest - lengths[left]  # padding of the new, shorter row
            if right < len(lengths):
                n = lengths[right]
                grow = (n - longest) * len(batch)  # every row already in pads up to the new longest
                if self._fits(n, len(batch) + 1, total + n, max_tokens, max_items) and (choice is None or grow < waste):
                    choice = right
            if choice is None:
                break
            item = self._take(lengths[choice])
            batch.append(item)
            taken.add(item.length)
            total += item.length
            if choice == right:
                longest = item.length
                left, right = right, right + 1
        for length in taken | {batch[0].length}:
            if length in buckets and not buckets[length]:
                self._drop_length(length)
