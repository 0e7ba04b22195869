"""Each distinct text of a run embedded once (issue 57): what the run knows of the texts it has vectors for.

The runner hashes every usable record's text (``content.py``) and asks :class:`Repeats` where its vector comes from:

* a text that a job in flight already carries (another id, the same text) rides with that job: when the job's rows
  come back they are written under its own ids and under the riders' (:meth:`Repeats.attach`, ``_Chunk.riders``);
* a text whose vector is stored already (in the output, written there by this run or an earlier one, or in a
  ``--reuse`` output) waits in :attr:`Repeats.deferred` and is written from the stored row (``Sink.rows_by_hash``)
  at the next resolve, after a commit, so rows written by this run can be read back; what no store holds any more
  (a row replaced meanwhile) is embedded after all;
* any other text goes into a job, and becomes the text jobs in flight carry.

Rows are never read back from an output that keeps no content hashes (made before them, or a sink that keeps none):
there only repeats that meet in flight are shared. Memory: the riders and the deferred records are bounded by the
window and by :data:`DEFER_MAX`; the hashes written by this run are 16 bytes each (an ``IdSet``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedq import errors
from embedq.producers.index.content import SCHEME
from embedq.producers.index.idset import IdSet
from embedq.producers.index.sinks.contract import Sink

#: the most records that wait for a stored row before the runner resolves them (a commit and one lookup per store)
DEFER_MAX = 16_384


@dataclass(eq=False)
class Chunk:
    """A job's worth of texts: its records, and the records that ride with it (the same text under other ids)."""

    ids: list[str]
    texts: list[str]
    hashes: list[bytes] = field(default_factory=list)
    riders: list[tuple[str, int, str]] = field(default_factory=list)  # (id, the index of its text here, text)
    handle: Any = None
    head_since: float | None = None  # when it became the oldest job in flight (reset when resubmitted)
    attempts: int = 0

    def add(self, doc_id: str, text: str, content_hash: bytes) -> None:
        self.ids.append(doc_id)
        self.texts.append(text)
        self.hashes.append(content_hash)

    def split(self) -> tuple[Chunk, Chunk]:
        """Two halves, each with the riders of its texts."""
        half = len(self.ids) // 2
        first = Chunk(self.ids[:half], self.texts[:half], self.hashes[:half])
        second = Chunk(self.ids[half:], self.texts[half:], self.hashes[half:])
        for doc_id, i, text in self.riders:
            if i < half:
                first.riders.append((doc_id, i, text))
            else:
                second.riders.append((doc_id, i - half, text))
        return first, second


class Repeats:
    """Which texts of a run have a vector coming or stored (see the module's docstring)."""

    def __init__(self, sink: Sink, readers: list[Sink], *, read_back: bool = True) -> None:
        self.sink = sink
        self.readers = readers  # --reuse outputs, opened to read rows back
        self.in_flight: dict[bytes, Chunk] = {}  # a text's hash -> the chunk that carries it (not yet written)
        self.written = IdSet()  # hashes of the rows this run wrote
        self.deferred: list[tuple[str, bytes, str]] = []  # (id, hash, text): to write from a stored row
        # whether rows can be read back from the output itself (not a windows output's: a text has many rows)
        self.read_back = read_back and sink.ledger.keeps_hashes

    def attach(self, doc_id: str, text: str, content_hash: bytes, *, defer: bool = True) -> bool:
        """Route a record whose text may have a vector coming or stored: True when it needs no job of its own
        (``defer``: False for a record no store had a row for when it was deferred)."""
        chunk = self.in_flight.get(content_hash)
        if chunk is not None:
            chunk.riders.append((doc_id, chunk.hashes.index(content_hash), text))
            return True
        if defer and self._stored(content_hash):
            self.deferred.append((doc_id, content_hash, text))
            return True
        return False

    def _stored(self, content_hash: bytes) -> bool:
        if self.read_back and (content_hash in self.written or content_hash in self.sink.ledger.contents()):
            return True
        return any(content_hash in reader.ledger.contents() for reader in self.readers)

    def carry(self, chunk: Chunk, index: int) -> None:
        """``chunk`` carries its text ``index`` now: later records of the same text ride with it."""
        self.in_flight[chunk.hashes[index]] = chunk

    def landed(self, chunk: Chunk) -> None:
        """``chunk``'s rows were written (or it failed): its texts are no longer in flight."""
        for content_hash in chunk.hashes:
            if self.in_flight.get(content_hash) is chunk:
                del self.in_flight[content_hash]

    def moved(self, old: Chunk, parts: tuple[Chunk, ...]) -> None:
        """``old`` was split into ``parts``: the texts it carried are carried by them."""
        for part in parts:
            for content_hash in part.hashes:
                if self.in_flight.get(content_hash) is old:
                    self.in_flight[content_hash] = part

    def take_deferred(self) -> list[tuple[str, bytes, str]]:
        out, self.deferred = self.deferred, []
        return out

    def stores(self) -> list[Sink]:
        """Where stored rows are read from, in order: the output itself (where it keeps hashes), then ``--reuse``."""
        return ([self.sink] if self.read_back else []) + self.readers


def start_hashes(sink: Sink) -> str | None:
    """A new output of a sink that stores content hashes keeps them (:data:`~embedq.producers.index.content.SCHEME` in
    its manifest); one of another scheme is refused; one made before them is continued by id (the note to show)."""
    m = sink.manifest
    if sink.stores_hashes and m.content_hash is None and m.fingerprint is None and not len(sink.committed):
        m.content_hash = SCHEME
    elif m.content_hash not in (None, SCHEME):
        raise errors.OutputMismatch(f"{sink.where} keeps content hashes of another scheme ({m.content_hash}); this "
                                    "embedq cannot tell its edited texts: pass --overwrite")
    elif m.content_hash is None and len(sink.committed):
        return ("the output was made before content hashes: ids it holds are kept as they are even where their text "
                "changed (--overwrite re-indexes it by content)")
    return None


def take_rows(data: Any, index: list[int]) -> Any:
    """The rows ``index`` of ``data`` in a sink's ``write`` form: a float matrix, a pyarrow table, or a list of
    :class:`~embedq.producers.index.kinds.ColumnArrays` (each column's arrays by its shape)."""
    if isinstance(data, np.ndarray):
        return data[index]
    if hasattr(data, "schema"):  # a pyarrow table
        return data.take(index)
    from embedq.producers.index.kinds import ColumnArrays

    out = []
    for col in data:
        shape = col.column.shape
        if shape in ("dense", "scalar"):
            arrays = [np.asarray(col.arrays[0])[index]]
        else:  # sparse (offsets, indices, values) and ragged (offsets, vectors): rows by their offsets
            offsets = np.asarray(col.arrays[0])
            spans = [(int(offsets[i]), int(offsets[i + 1])) for i in index]
            new_offsets = np.zeros(len(index) + 1, dtype=offsets.dtype)
            new_offsets[1:] = np.cumsum([b - a for a, b in spans])
            arrays = [new_offsets, *(_gather(np.asarray(a), spans) for a in col.arrays[1:])]
        out.append(ColumnArrays(col.column, arrays, col.dimensions))
    return out


def _gather(values: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    if not spans:
        return values[:0]
    return np.concatenate([values[a:b] for a, b in spans])
