"""Token-budget packing of variable-length items into micro-batches.

A padded backend pays ``longest × count`` tokens for a batch; an unpadded one pays the sum of the
lengths. Packing sorts items by length so neighbours have similar lengths (little padding) and
greedily fills each batch up to the token budget and the item cap. An item that alone exceeds the
budget is never clamped (that would change its vector) and never blocks: it runs in a batch of
its own.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Item:
    """One text waiting to be embedded: ``key`` names it, ``seq`` is its arrival order."""

    key: Hashable
    length: int
    seq: int


def batch_cost(lengths: Sequence[int], *, padded: bool = True) -> int:
    """Tokens a batch of these lengths costs the backend."""
    if not lengths:
        return 0
    return max(lengths) * len(lengths) if padded else sum(lengths)


def plan(items: Iterable[Item], *, max_tokens: int, max_items: int, padded: bool = True) -> list[list[Item]]:
    """Split items into micro-batches within ``max_tokens`` and ``max_items``.

    Every item appears in exactly one batch. Batches are returned shortest first; each batch is
    a run of consecutive items in length order, so padding is bounded by neighbouring lengths.
    """
    if max_tokens < 1 or max_items < 1:
        raise ValueError("max_tokens and max_items must be positive")
    ordered = sorted(items, key=lambda it: (it.length, it.seq))
    batches: list[list[Item]] = []
    current: list[Item] = []
    longest = 0
    total = 0
    for item in ordered:
        if current:
            n = len(current) + 1
            cost = max(longest, item.length) * n if padded else total + item.length
            if n > max_items or cost > max_tokens:
                batches.append(current)
                current, longest, total = [], 0, 0
        current.append(item)
        longest = max(longest, item.length)
        total += item.length
    if current:
        batches.append(current)
    return batches
