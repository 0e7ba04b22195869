"""The buffer of items waiting for the model, and the choice of the next micro-batch."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from itertools import islice

from embedq.batching.packer import Item, plan


class Scheduler:
    """Coalesces the items of all buffered jobs into token-budget micro-batches.

    ``next_batch`` looks at the oldest ``window`` items (arrival order), packs them by length and
    returns the batch that holds the oldest item. So every call makes progress on the head of the
    queue (no item waits behind an endless stream of better-fitting ones), while the batch itself
    is length-homogeneous. Not thread-safe: the worker guards it with its own lock.
    """

    def __init__(self, *, max_tokens: int, max_items: int, window: int = 4096, padded: bool = True) -> None:
        if window < 1:
            raise ValueError("window must be positive")
        self.max_tokens = max_tokens
        self.max_items = max_items
        self.window = window
        self.padded = padded
        self._items: dict[Hashable, Item] = {}  # insertion order is arrival order
        self._seq = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, key: Hashable, length: int) -> Item:
        if key in self._items:
            raise KeyError(f"item {key!r} is already buffered")
        item = Item(key=key, length=int(length), seq=self._seq)
        self._seq += 1
        self._items[key] = item
        return item

    def add_many(self, pairs: Iterable[tuple[Hashable, int]]) -> None:
        for key, length in pairs:
            self.add(key, length)

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Drop buffered items (a cancelled or failed job); returns how many were dropped."""
        dropped = 0
        for key in keys:
            if self._items.pop(key, None) is not None:
                dropped += 1
        return dropped

    def next_batch(self) -> list[Item]:
        """Remove and return the next micro-batch (empty when nothing is buffered)."""
        if not self._items:
            return []
        window = list(islice(self._items.values(), self.window))
        oldest = window[0]
        batches = plan(window, max_tokens=self.max_tokens, max_items=self.max_items, padded=self.padded)
        chosen = next(b for b in batches if oldest in b)
        for item in chosen:
            del self._items[item.key]
        return chosen
