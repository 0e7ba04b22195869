"""Token-budget packing of a known set (items and what a micro-batch costs: :mod:`embedq.batching.items`).

The live policy is :class:`~embedq.batching.Scheduler`'s; :func:`plan` packs a fixed set of
items with exactly that policy, as if they had all been buffered at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from embedq.batching.items import Item
from embedq.batching.scheduler import Scheduler


def plan(items: Iterable[Item], *, max_tokens: int, max_items: int, padded: bool = True) -> list[list[Item]]:
    """Split items (unique keys, arrival order ``seq``) into micro-batches within ``max_tokens`` and
    ``max_items``, in the order a worker holding all of them would run them.

    Every item appears in exactly one batch; an item that alone exceeds the budget gets a batch of its
    own (never clamped).
    """
    sched = Scheduler(max_tokens=max_tokens, max_items=max_items, padded=padded)
    by_key: dict[Hashable, Item] = {}
    for item in sorted(items, key=lambda it: it.seq):
        by_key[item.key] = item
        sched.add(item.key, item.length)
    batches: list[list[Item]] = []
    while len(sched):
        batches.append([by_key[it.key] for it in sched.next_batch()])
    return batches
