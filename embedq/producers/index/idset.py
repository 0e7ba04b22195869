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
