"""Token ids of held jobs in shared memory, for a device process that reads them in place (issue 53, step 1).

The layout issue 53 builds: host processes receive, check and tokenize jobs; one device process per device only
schedules and launches. A host writes each job's token ids into its :class:`IdsArena` (a
``multiprocessing.shared_memory`` block of int32) and hands the device process small records that point into it
(offset and length per item), never the ids themselves; the device process attaches the same block by name and
reads the ids in place (numpy views: nothing is copied until a micro-batch is assembled, nothing is pickled).

Jobs finish out of order (the scheduler packs the items of all held jobs by length), so the arena is a ring whose
head moves only over freed spans (:class:`Spans`): a job's span is freed once its rows are in, and a span that
would cross the end starts again at the beginning. The host sizes the arena from what it may hold (its share of
the prefetch window: texts × the model's longest input), so a held job never fills it; where a span does not fit,
``alloc`` returns None and the host waits for frees (back-pressure), never overwrites.

Only the creating process owns the block: :meth:`IdsArena.attach` takes it out of Python's resource tracker, which
would otherwise unlink the block when the *attaching* process exits (Python < 3.13 registers every attach). The
creator's tracker unlinks it when the creator dies, SIGKILL included, so a dead host leaves nothing in /dev/shm.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

#: The dtype of token ids in the arena (every vocabulary embedq serves fits).
ID_DTYPE = np.dtype(np.int32)
#: Names of the blocks this process created and has not removed yet.
_CREATED: set[str] = set()


@dataclass
class _Span:
    start: int
    end: int
    freed: bool = False


class Spans:
    """Allocation of spans of a ring of ``capacity`` slots, freed in any order; the ring's head moves over freed
    spans only, so a live span is never overwritten (single-threaded: the host's own bookkeeping)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._spans: collections.deque[_Span] = collections.deque()  # in allocation order, oldest first
        self._by_start: dict[int, _Span] = {}

    def __len__(self) -> int:
        """Spans allocated and not yet reclaimed (a freed span behind a live one still counts)."""
        return len(self._spans)

    def alloc(self, n: int) -> int | None:
        """The start of a new span of ``n`` slots, or None while the live spans leave no room for it."""
        if not 1 <= n <= self.capacity:
            raise ValueError(f"a span takes 1 to {self.capacity} slots, not {n}")
        if not self._spans:
            start = 0
        else:
            head, newest = self._spans[0].start, self._spans[-1]
            tail = newest.end
            if newest.start >= head:  # not wrapped: free are [tail, capacity) and [0, head)
                if self.capacity - tail >= n:
                    start = tail
                elif head >= n:
                    start = 0  # [tail, capacity) is left unused until the head passes it
                else:
                    return None
            elif head - tail >= n:  # wrapped: free is [tail, head)
                start = tail
            else:
                return None
        span = _Span(start, start + n)
        self._spans.append(span)
        self._by_start[start] = span
        return start

    def free(self, start: int) -> None:
        """Free the span that starts at ``start``; the head moves past every freed span at the front."""
        span = self._by_start.pop(start, None)
        if span is None:
            raise KeyError(f"no live span starts at {start}")
        span.freed = True
        while self._spans and self._spans[0].freed:
            self._spans.popleft()


class IdsArena:
    """A job's token ids, written by the host (:meth:`create`) and read in place by the device process
    (:meth:`attach`). See the module's docstring."""

    def __init__(self, block: shared_memory.SharedMemory, capacity: int, owner: bool) -> None:
        self.block = block
        self.capacity = capacity
        self.owner = owner
        self.ids = np.ndarray((capacity,), dtype=ID_DTYPE, buffer=block.buf)
        self.spans = Spans(capacity) if owner else None

    @classmethod
    def create(cls, capacity: int) -> IdsArena:
        """A new arena of ``capacity`` token ids (the host's)."""
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        block = shared_memory.SharedMemory(create=True, size=capacity * ID_DTYPE.itemsize)
        _CREATED.add(block.name)
        return cls(block, capacity, True)

    @classmethod
    def attach(cls, name: str, capacity: int) -> IdsArena:
        """The arena ``name`` of another process, to read (the device process's)."""
        block = shared_memory.SharedMemory(name=name)
        # Python < 3.13 registers an attached block with this process's resource tracker, which would unlink it
        # when this process exits, under the creator's feet; the creator alone owns it (a block this process created
        # stays registered: it is its own).
        if block.name not in _CREATED:
            resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
        if block.size < capacity * ID_DTYPE.itemsize:
            block.close()
            raise ValueError(f"arena {name} holds {block.size} bytes, fewer than {capacity} token ids")
        return cls(block, capacity, False)

    @property
    def name(self) -> str:
        return self.block.name

    def write(self, items: Sequence[Sequence[int]]) -> tuple[int, np.ndarray] | None:
        """Write a job's items contiguously: (the span's start, each item's offset), or None while there is no room
        (the caller waits for :meth:`free`). Host only."""
        if self.spans is None:
            raise RuntimeError("only the arena's creator writes to it")
        lengths = np.fromiter((len(item) for item in items), dtype=np.int64, count=len(items))
        if not len(lengths) or (lengths < 1).any():
            raise ValueError("a job has at least one item, and every item at least one token")
        start = self.spans.alloc(int(lengths.sum()))
        if start is None:
            return None
        offsets = start + np.concatenate(([0], np.cumsum(lengths[:-1])))
        for offset, item in zip(offsets.tolist(), items):
            self.ids[offset:offset + len(item)] = item
        return start, offsets

    def read(self, offset: int, length: int) -> np.ndarray:
        """The ids of one item, in place (a view: valid until its span is freed)."""
        if not (offset >= 0 and length > 0 and offset + length <= self.capacity):
            raise ValueError(f"no item at {offset}:{offset + length} in an arena of {self.capacity}")
        return self.ids[offset:offset + length]

    def free(self, start: int) -> None:
        """The job whose span starts at ``start`` is done: its slots may be written again. Host only."""
        if self.spans is None:
            raise RuntimeError("only the arena's creator frees its spans")
        self.spans.free(start)

    def close(self) -> None:
        """Let go of the block; the creator also removes it."""
        del self.ids  # the view must go before the buffer can be released
        try:
            self.block.close()
        except BufferError:  # the device process still holds views of items (jobs of a host that is gone, running
            if self.owner:  # out): the mapping goes with them, or with the process
                raise
        if self.owner:
            self.block.unlink()
            _CREATED.discard(self.block.name)
