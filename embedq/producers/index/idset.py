"""A compact set of document ids, for resuming and for catching duplicate ids in an input.

A Python ``set`` of ten million id strings takes about a gigabyte; this keeps 16-byte BLAKE2b digests
in a sorted NumPy array (160 MB for ten million) plus a small set of recent additions that is merged
in now and then. At 128 bits, two distinct ids share a digest with probability ~1e-22 for 10^8 ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

_DTYPE = "S16"


def digest(doc_id: str) -> bytes:
    return hashlib.blake2b(doc_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class IdSet:
    def __init__(self, merge_at: int = 1 << 18) -> None:
        self._sorted = np.empty(0, dtype=_DTYPE)
        self._recent: set[bytes] = set()
        self._merge_at = merge_at

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)

    def __contains__(self, key: bytes) -> bool:
        if key in self._recent:
            return True
        i = int(np.searchsorted(self._sorted, key))
        # NumPy's S16 reads back without trailing NUL bytes; digests are all 16 bytes, so stripping is exact
        return i < len(self._sorted) and self._sorted[i] == key.rstrip(b"\0")

    def add(self, key: bytes) -> None:
        self._recent.add(key)
        if len(self._recent) >= self._merge_at:
            self._merge()

    def update(self, keys: Iterable[bytes]) -> None:
        new = np.fromiter(keys, dtype=_DTYPE)
        if len(new):
            self._merge(new)

    def _merge(self, extra: np.ndarray | None = None) -> None:
        parts = [self._sorted, np.fromiter(self._recent, dtype=_DTYPE, count=len(self._recent))]
        if extra is not None:
            parts.append(extra)
        self._sorted = np.unique(np.concatenate(parts))
        self._recent.clear()


class IdMap:
    """A compact map of 16-byte digests to 16-byte digests: a committed id's content hash (``content.py``).

    Sorted NumPy arrays of keys and values plus a dict of recent additions merged in now and then, as
    :class:`IdSet`; a key added again takes its new value."""

    def __init__(self, merge_at: int = 1 << 18) -> None:
        self._keys = np.empty(0, dtype=_DTYPE)
        self._values = np.empty(0, dtype=_DTYPE)
        self._recent: dict[bytes, bytes] = {}
        self._merge_at = merge_at

    def __len__(self) -> int:
        self._merge()
        return len(self._keys)

    def get(self, key: bytes) -> bytes | None:
        value = self._recent.get(key)
        if value is not None:
            return value
        i = int(np.searchsorted(self._keys, key))
        if i < len(self._keys) and self._keys[i] == key.rstrip(b"\0"):
            return bytes(self._values[i]).ljust(16, b"\0")
        return None

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self._recent[key] = value
        if len(self._recent) >= self._merge_at:
            self._merge()

    def values(self) -> IdSet:
        """The distinct values, as an :class:`IdSet`."""
        self._merge()
        out = IdSet()
        out.update(bytes(v).ljust(16, b"\0") for v in self._values)
        return out

    def _merge(self) -> None:
        if not self._recent:
            return
        keys = np.concatenate([np.fromiter(self._recent.keys(), dtype=_DTYPE, count=len(self._recent)), self._keys])
        values = np.concatenate([np.fromiter(self._recent.values(), dtype=_DTYPE, count=len(self._recent)),
                                 self._values])
        # the recent ones first: np.unique keeps the first occurrence of each key (a stable sort)
        keys, first = np.unique(keys, return_index=True)
        self._keys, self._values = keys, values[first]
        self._recent.clear()
