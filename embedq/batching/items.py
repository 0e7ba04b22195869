"""What the batching parts share: an item waiting to be embedded, and what a micro-batch of items costs.

A padded backend pays ``longest × count`` tokens for a batch; an unpadded one pays the sum of the lengths.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
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
