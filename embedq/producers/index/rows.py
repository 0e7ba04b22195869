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
from embedq.producers.index.windowed import WindowRows, expand, groups
from embedq.protocol import decode_result
from embedq.windows import failures


class RowWriter:
    def __init__(self, sink: Sink, repeats: Repeats, kind: IndexKind, *, vector_dtype: str, store_text: bool,
                 summary: Summary, stop: Stopper, fail: Callable[[str, errors.EmbedqError], None]) -> None:
        self.sink, self.repeats, self.kind = sink, repeats, kind
        self.vector_dtype, self.store_text = vector_dtype, store_text
        self.summary, self.stop, self._fail = summary, stop, fail
        self.bar: Any = None  # the run's progress bar, once it has one
        summary.documents_before = len(sink.committed)

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
        if fingerprint.pool_windows is False or payload.get("failed"):
            return self._documents(chunk, payload, data)
        n = self.put(chunk.ids, data, chunk.texts, chunk.hashes, embedded=True)
        if chunk.riders:
            ids, rows, texts = (list(column) for column in zip(*chunk.riders))
            self.put(ids, take_rows(data, rows), texts, [chunk.hashes[i] for i in rows])
        self.repeats.landed(chunk)
        return n

    def _documents(self, chunk: Chunk, payload: dict[str, Any], data: Any) -> int:
        """A result with windows (one row per window: ``windowed.py``) or with texts that failed alone
        (``too_many_windows``: those go to the errors file, their job-mates are written); returns how many of the
        chunk's own documents were taken."""
        failed = failures(payload)
        for i, exc in failed.items():
            for doc_id in (chunk.ids[i], *(rider for rider, k, _ in chunk.riders if k == i)):
                self._fail(doc_id, exc)
        own = [(doc_id, text, h, i) for i, (doc_id, text, h) in enumerate(zip(chunk.ids, chunk.texts, chunk.hashes))
               if i not in failed]
        riders = [(doc_id, text, chunk.hashes[i], i) for doc_id, i, text in chunk.riders if i not in failed]
        taken = [0, 0]
        for k, docs in enumerate((own, riders)):
            if not docs:
                continue
            if "window_spans" in payload:  # per window
                rows_of, spans = groups(payload)
                x = expand(docs, rows_of, spans)
                taken[k] = self.put(x.ids, take_rows(data, x.rows), x.texts, x.hashes, embedded=k == 0,
                                    windows=x.windows)
            else:  # one output per text (pooled windows): the failed texts' rows left out
                ids, texts, hashes, index = (list(column) for column in zip(*docs))
                taken[k] = self.put(ids, take_rows(data, index), texts, hashes, embedded=k == 0)
        self.repeats.landed(chunk)
        return taken[0]

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

    def put(self, ids: list[str], data: Any, texts: list[str], hashes: list[bytes], *, embedded: bool = False,
            windows: WindowRows | None = None) -> int:
        """Rows into the output (with their content hashes where it keeps them); ``embedded``: their texts were embedded
        by this run, else written from a vector it had; ``windows``: one row per window (``ids`` repeats a document's
        id once per window). Returns how many documents the output took."""
        stored_texts = texts if self.store_text else None
        keeps = self.sink.ledger.keeps_hashes
        with self.stop.writing():
            if windows is not None:
                refused = self.sink.write(ids, data, stored_texts, hashes if keeps else None,  # type: ignore[call-arg]
                                          windows=windows)
            elif keeps:
                refused = self.sink.write(ids, data, stored_texts, hashes)  # type: ignore[call-arg]
            else:
                refused = self.sink.write(ids, data, stored_texts)
        for doc_id, exc in dict(refused).items():  # rows the database refuses (Milvus: an empty sparse vector)
            self._fail(doc_id, exc)
        bad = {doc_id for doc_id, _ in refused}
        committed = self.sink.committed
        n = 0
        for doc_id, content_hash in (dict(zip(ids, hashes)).items() if windows is not None else zip(ids, hashes)):
            if doc_id in bad:
                continue
            n += 1
            self.repeats.written.add(content_hash)
            old = digest(doc_id) in committed
            self.summary.replaced += old
            self.summary.new_documents += not old
        if embedded:
            self.summary.texts += n
            self.summary.windows += sum(doc_id not in bad for doc_id in ids) if windows is not None else 0
        else:
            self.summary.reused += n
        if self.bar is not None:
            self.bar.update(n)
        return n
