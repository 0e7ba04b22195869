"""Rows into an ``embedq index`` output: a job's result under its ids and its riders' (the same text under other ids),
and rows written from stored vectors (``repeats.py``), with their content hashes and the run's counts.

:class:`RowWriter` is the runner's (``runner.py``) one way to write: it decodes a result in the form the sink takes
(``kinds.py``), checks its space before the first write, writes under the stop guard (a Ctrl-C waits for the write),
makes the rows the output refuses those records' errors, and counts what was embedded, reused and replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from embedq import errors
from embedq.producers.index.idset import digest
from embedq.producers.index.kinds import IndexKind
from embedq.producers.index.repeats import Chunk, Repeats, take_rows
from embedq.producers.index.sinks.contract import Sink
from embedq.producers.index.stopping import Stopper
from embedq.producers.index.summary import Summary
from embedq.protocol import decode_result


class RowWriter:
    def __init__(self, sink: Sink, repeats: Repeats, kind: IndexKind, *, vector_dtype: str, store_text: bool,
                 summary: Summary, stop: Stopper, fail: Callable[[str, errors.EmbedqError], None]) -> None:
        self.sink, self.repeats, self.kind = sink, repeats, kind
        self.vector_dtype, self.store_text = vector_dtype, store_text
        self.summary, self.stop, self._fail = summary, stop, fail
        self.bar: Any = None  # the run's progress bar, once it has one

    def result(self, chunk: Chunk, payload: dict[str, Any]) -> int:
        """A job's result under its chunk's ids and its riders'; returns how many of the chunk's own rows were taken."""
        if self.kind.columns is None:
            data, fingerprint = decode_result(payload)
        elif self.sink.arrow_columns:
            fingerprint, data = self.kind.table(payload, self.vector_dtype)
        else:  # a sink that maps the kind's columns itself (pgvector.py)
            fingerprint, data = self.kind.arrays(payload)
        with self.stop.writing():
            self.sink.accept(fingerprint)  # OutputMismatch before the first write
        n = self.put(chunk.ids, data, chunk.texts, chunk.hashes, embedded=True)
        if chunk.riders:
            ids, rows, texts = (list(column) for column in zip(*chunk.riders))
            self.put(ids, take_rows(data, rows), texts, [chunk.hashes[i] for i in rows])
        self.repeats.landed(chunk)
        return n

    def stored(self, deferred: list[tuple[str, bytes, str]]) -> list[tuple[str, bytes, str]]:
        """Write the deferred records (id, hash, text) from the rows the stores hold (the output, then ``--reuse``);
        returns those no store holds a row for (to embed)."""
        waiting: dict[bytes, list[tuple[str, str]]] = {}
        for doc_id, content_hash, text in deferred:
            waiting.setdefault(content_hash, []).append((doc_id, text))
        for store in self.repeats.stores():
            if not waiting:
                break
            found, data = store.rows_by_hash(list(waiting))
            ids: list[str] = []
            rows: list[int] = []
            texts: list[str] = []
            hashes: list[bytes] = []
            for row, content_hash in enumerate(found):
                for doc_id, text in waiting.pop(content_hash, ()):
                    ids.append(doc_id)
                    rows.append(row)
                    texts.append(text)
                    hashes.append(content_hash)
            if ids:
                self.put(ids, take_rows(data, rows), texts, hashes)
        return [(doc_id, h, text) for h, pairs in waiting.items() for doc_id, text in pairs]

    def put(self, ids: list[str], data: Any, texts: list[str], hashes: list[bytes], *, embedded: bool = False) -> int:
        """Rows into the output (with their content hashes where it keeps them); ``embedded``: their texts were embedded
        by this run, else written from a vector it had. Returns how many the output took."""
        stored_texts = texts if self.store_text else None
        with self.stop.writing():
            if self.sink.ledger.keeps_hashes:
                refused = self.sink.write(ids, data, stored_texts, hashes)  # type: ignore[call-arg]
            else:
                refused = self.sink.write(ids, data, stored_texts)
        for doc_id, exc in refused:  # rows the database refuses (Milvus: an empty sparse vector)
            self._fail(doc_id, exc)
        bad = {doc_id for doc_id, _ in refused}
        committed = self.sink.committed
        n = 0
        for doc_id, content_hash in zip(ids, hashes):
            if doc_id in bad:
                continue
            n += 1
            self.repeats.written.add(content_hash)
            self.summary.replaced += digest(doc_id) in committed
        if embedded:
            self.summary.texts += n
        else:
            self.summary.reused += n
        if self.bar is not None:
            self.bar.update(n)
        return n
