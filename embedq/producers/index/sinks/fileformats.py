"""Outputs of ``embedq index`` that survive being killed, and never mix embedding spaces.

Each output has a *manifest* (``_embedq.json`` inside a Parquet dataset, ``<output>.embedq.json``
beside an NPY or JSONL file) that records the embedding-space fingerprint, the options, and what has
been *committed*. Rows are appended as they arrive and committed at checkpoints: data is flushed and
fsynced first, then the manifest is replaced atomically. A run that dies between checkpoints leaves
uncommitted bytes behind; the next run cuts the output back to its last commit, reads the committed
ids, and embeds only the rest, so the output holds every id exactly once.

- **Parquet**: a dataset directory of ``part-NNNNN.parquet`` shards (what Spark, pyarrow.dataset,
  pandas, polars and DuckDB read as one table). A shard is written under a hidden name and renamed
  when committed, because a Parquet file is unreadable until its footer is written.
- **NPY**: one ``.npy`` matrix (its header rewritten at each commit) plus ``<name>.ids.txt``.
- **JSONL**: one ``{"id": ..., "vector": [...]}`` object per line.

This module holds the three sinks; ``files.py`` the target that opens them (``open_sink``); ``manifests.py`` the
manifest's model and its check against a run's settings (shared with the database sinks).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from embedq import errors
from embedq.producers.index.idset import IdSet, digest
from embedq.producers.index.sinks.contract import Refused, Sink
from embedq.producers.index.sinks.manifests import Ledger, Manifest, Part, utc_now
from embedq.producers.index.windowed import COLUMNS, WindowRows


def sidecar(path: Path, suffix: str) -> Path:
    """``out.npy`` -> ``out.npy.errors.jsonl``: the whole name, so two outputs never share a sidecar."""
    return path.with_name(path.name + suffix)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class FileSink(Sink):
    """Base of the three file outputs: the manifest a JSON file beside the output (inside a Parquet dataset), rows
    appended to files that are cut back to the last commit when continued. Use ``files.open_sink``."""

    format: ClassVar[str] = ""

    def __init__(self, path: Path, manifest: Manifest, *, shard_rows: int) -> None:
        super().__init__(Ledger(manifest), where=str(path))
        self.path = path
        self.shard_rows = shard_rows

    @property
    def dimension(self) -> int | None:
        return self.ledger.dimension

    # -- paths -------------------------------------------------------------------------------------
    @classmethod
    def manifest_path(cls, path: Path) -> Path:
        return sidecar(path, ".embedq.json")

    @classmethod
    def sidecars(cls, path: Path) -> list[Path]:
        return [cls.manifest_path(path)]

    # -- life cycle --------------------------------------------------------------------------------
    def save_manifest(self) -> None:
        self.manifest.updated = utc_now()
        _atomic_write(self.manifest_path(self.path), self.manifest.model_dump_json(indent=2))

    @abstractmethod
    def repair(self) -> None:
        """Cut the output back to the manifest's last commit and load the committed ids (when continued)."""

    def _vectors(self, vectors: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(vectors, dtype=np.float16 if self.manifest.vector_dtype == "float16"
                                    else np.float32)


# -- Parquet dataset ---------------------------------------------------------------------------
class ParquetSink(FileSink):
    """A dataset of shards. Rows carry a ``content_hash`` column (``fixed_size_binary(16)``) where the manifest keeps
    hashes. Rows an edited or pruned id held before the run are removed at the next commit by rewriting only the
    shards that hold them (each under a new name, listed by the manifest that commits it; the old file is deleted
    after that manifest is stored, and a run killed in between deletes it as unlisted)."""

    format = "parquet"
    stores_hashes = True
    ROW_GROUP_ROWS = 8192

    def __init__(self, path: Path, manifest: Manifest, *, shard_rows: int) -> None:
        super().__init__(path, manifest, shard_rows=shard_rows)
        # (ids, vectors or a kind's table, hashes, window columns, texts) of each write
        self._buffer: list[tuple[list[str], Any, list[bytes] | None, WindowRows | None, list[str] | None]] = []
        self._buffered = 0
        self._writer: Any = None
        self._shard_rows = 0
        self._next_part = 1 + max((int(p.file[5:10]) for p in manifest.parts), default=-1)
        self._before: set[str] = set()  # the shards that hold rows committed before this run
        self._remove = IdSet()  # ids (digests) whose rows of before this run go at the next commit
        self._removing = 0
        self._obsolete: list[Path] = []  # shards a commit replaced: deleted once its manifest is stored

    @classmethod
    def manifest_path(cls, path: Path) -> Path:
        return path / "_embedq.json"

    @classmethod
    def sidecars(cls, path: Path) -> list[Path]:
        return []  # the manifest lives inside the dataset directory

    def _shard_name(self) -> str:
        return f"part-{self._next_part:05d}.parquet"

    def _tmp_path(self) -> Path:
        return self.path / f".{self._shard_name()}.tmp"

    def write(self, ids: list[str], vectors: Any, texts: list[str] | None = None,
              hashes: list[bytes] | None = None, windows: WindowRows | None = None) -> Refused:
        """``vectors``: a dense matrix (the ``vector`` column), or a pyarrow table of a kind's columns
        (``producers/index/kinds.py``); an id committed before the run replaces its rows (removed at the commit);
        ``windows``: the window columns (``windowed.py``), after ``id``; ``texts``: a ``text`` column, last."""
        self._buffer.append((ids, vectors if hasattr(vectors, "schema") else self._vectors(vectors),
                             hashes if self.ledger.keeps_hashes else None, windows, texts))
        self._buffered += len(ids)
        self.ledger.pending_rows += len(ids)
        committed = self.ledger.committed
        for doc_id in ids:
            key = digest(doc_id)
            if key in committed and key not in self._remove:
                self._remove.add(key)
                self._removing += 1
        if self._buffered >= min(self.ROW_GROUP_ROWS, self.shard_rows):
            self._write_group()
        if self._shard_rows >= self.shard_rows:
            self.commit()
        return []

    def _write_group(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._buffer:
            return
        fp = self.manifest.fingerprint
        assert fp is not None and self.dimension is not None
        ids = [i for chunk_ids, *_ in self._buffer for i in chunk_ids]
        columns: dict[str, Any] = {"id": pa.array(ids, pa.string())}
        if self._buffer[0][3] is not None:  # one row per window: id, window, start, end
            for name in COLUMNS:
                columns[name] = pa.array(np.concatenate([w.columns()[name] for *_, w, _ in self._buffer]), pa.int32())
        if self.ledger.keeps_hashes:
            columns["content_hash"] = pa.array([h for _, _, hs, _, _ in self._buffer for h in hs or ()], pa.binary(16))
        if hasattr(self._buffer[0][1], "schema"):  # a kind's own columns
            kind = pa.concat_tables([t for _, t, *_ in self._buffer])
            columns.update(zip(kind.column_names, kind.columns))
        else:
            value_type = pa.float16() if self.manifest.vector_dtype == "float16" else pa.float32()
            flat = np.concatenate([v for _, v, *_ in self._buffer]).reshape(-1)
            columns["vector"] = pa.FixedSizeListArray.from_arrays(pa.array(flat, value_type), self.dimension)
        if self._buffer[0][4] is not None:  # --store-text
            columns["text"] = pa.array([t for *_, texts in self._buffer for t in texts or ()], pa.string())
        table = pa.table(columns)
        if self._writer is None:
            self._check_columns(table.schema.names)
            schema = table.schema.with_metadata({b"embedq.fingerprint": fp.model_dump_json().encode()})
            self._writer = pq.ParquetWriter(self._tmp_path(), schema)
        self._writer.write_table(table.cast(self._writer.schema), row_group_size=len(ids))
        self._shard_rows += len(ids)
        self._buffer, self._buffered = [], 0

    def _check_columns(self, names: list[str]) -> None:
        """A new shard's columns are those of the shards committed before (a dataset is one table): a run with
        ``--store-text`` does not continue a dataset made without it, nor the other way round."""
        import pyarrow.parquet as pq

        if not self.manifest.parts:
            return
        have = pq.read_schema(self.path / self.manifest.parts[-1].file).names
        if ("text" in have) != ("text" in names):
            raise errors.OutputMismatch(f"{self.path} was written {'with' if 'text' in have else 'without'} "
                                        "--store-text; this run asks otherwise: its shards would not make one table. "
                                        "Run it as it was made, or pass --overwrite")

    def flush(self) -> None:
        self._write_group()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self.manifest.parts.append(Part(file=self._seal(), rows=self._shard_rows))
            self._shard_rows = 0
        if self._removing:
            self._rewrite()
        _fsync_dir(self.path)

    def _seal(self) -> str:
        """The shard being written, durable under its final name (returned); the next one gets a new number."""
        tmp, final = self._tmp_path(), self.path / self._shard_name()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        self._next_part += 1
        return final.name

    def _rewrite(self) -> None:
        """Remove the rows of the ids marked for removal from the shards of before this run that hold them."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = []
        for part in self.manifest.parts:
            if part.file not in self._before:
                parts.append(part)
                continue
            ids = pq.read_table(self.path / part.file, columns=["id"]).column("id").to_pylist()
            keep = [digest(i) not in self._remove for i in ids]
            if all(keep):
                parts.append(part)
                continue
            self._obsolete.append(self.path / part.file)
            self._before.discard(part.file)
            self.ledger.pending_rows -= len(keep) - sum(keep)
            if any(keep):
                table = pq.read_table(self.path / part.file).filter(pa.array(keep))
                pq.write_table(table, self._tmp_path(), row_group_size=self.ROW_GROUP_ROWS)
                name = self._seal()
                self._before.add(name)
                parts.append(Part(file=name, rows=table.num_rows))
        self.manifest.parts = parts
        self._remove, self._removing = IdSet(), 0

    def save_manifest(self) -> None:
        super().save_manifest()
        for path in self._obsolete:  # replaced by the manifest just stored
            path.unlink(missing_ok=True)
        self._obsolete.clear()

    def close(self) -> None:
        if self._writer is not None:  # an unfinished shard: not committed, removed by the next run
            self._writer.close()
            self._writer = None

    def prune(self, keep: IdSet) -> int:
        import pyarrow.parquet as pq

        pruned = 0
        for part in self.manifest.parts:
            if part.file not in self._before:
                continue
            for doc_id in pq.read_table(self.path / part.file, columns=["id"]).column("id").to_pylist():
                key = digest(doc_id)
                if key not in keep and key not in self._remove:
                    self._remove.add(key)
                    self._removing += 1
                    pruned += 1
        return pruned

    def rows_by_hash(self, hashes: list[bytes]) -> tuple[list[bytes], Any]:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        if not self.ledger.keeps_hashes or not hashes:
            return [], None
        wanted = pa.array(hashes, pa.binary(16))
        found: dict[bytes, None] = {}
        tables = []
        for part in self.manifest.parts:
            column = pq.read_table(self.path / part.file, columns=["content_hash"]).column("content_hash")
            column = column.combine_chunks()
            hits = pc.indices_nonzero(pc.is_in(column, value_set=wanted))
            rows = []
            for row, content_hash in zip(hits.to_pylist(), column.take(hits).to_pylist()):
                if content_hash not in found:  # one row per hash
                    found[content_hash] = None
                    rows.append(row)
            if rows:
                tables.append(pq.read_table(self.path / part.file).take(rows))
        if not tables:
            return [], None
        table = pa.concat_tables(tables)
        out = [bytes(h) for h in table.column("content_hash").to_pylist()]
        data = table.drop_columns([c for c in ("id", "content_hash", "text") if c in table.column_names])
        if "kind" not in self.manifest.options:  # the plain embed kind: a float matrix, as written
            vectors = data.column("vector").combine_chunks()
            data = vectors.values.to_numpy(zero_copy_only=False).reshape(len(out), -1)
        return out, data

    def repair(self) -> None:
        listed = {p.file for p in self.manifest.parts}
        for f in self.path.iterdir():
            if (f.name.startswith(".part-") or f.name.startswith("part-")) and f.name not in listed:
                f.unlink()
        self.load()

    def load(self) -> None:
        """The committed ids (and their content hashes, where kept) into the ledger."""
        import pyarrow.parquet as pq

        columns = ["id", "content_hash"] if self.ledger.keeps_hashes else ["id"]
        for part in self.manifest.parts:
            table = pq.read_table(self.path / part.file, columns=columns)
            ids = table.column("id").to_pylist()
            if self.ledger.keeps_hashes:
                for doc_id, content_hash in zip(ids, table.column("content_hash").to_pylist()):
                    self.ledger.take(doc_id, content_hash)
            else:
                self.ledger.committed.update(digest(i) for i in ids)
            self._before.add(part.file)


# -- NPY matrix + ids file ---------------------------------------------------------------------
_NPY_HEADER = 128  # fixed, so the header can be rewritten in place with any row count


def _npy_header(dtype: str, rows: int, dim: int) -> bytes:
    descr = "<f2" if dtype == "float16" else "<f4"
    body = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({rows}, {dim}), }}"
    body = body.ljust(_NPY_HEADER - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


class NpySink(FileSink):
    format = "npy"

    def __init__(self, path: Path, manifest: Manifest, *, shard_rows: int) -> None:
        super().__init__(path, manifest, shard_rows=shard_rows)
        self._data: Any = None
        self._ids: Any = None
        # bytes of complete writes only: a write cut short is never counted, so never committed
        self._data_len = manifest.data_bytes or _NPY_HEADER
        self._ids_len = manifest.ids_bytes

    @classmethod
    def ids_path(cls, path: Path) -> Path:
        return path.with_suffix(".ids.txt")

    @classmethod
    def sidecars(cls, path: Path) -> list[Path]:
        return [cls.manifest_path(path), cls.ids_path(path)]

    def _open(self) -> None:
        if self._data is not None:
            return
        assert self.dimension is not None
        if self.manifest.data_bytes == 0:
            with open(self.path, "wb") as fh:
                fh.write(_npy_header(self.manifest.vector_dtype, 0, self.dimension))
            self.ids_path(self.path).write_bytes(b"")
        self._data = open(self.path, "r+b")  # noqa: SIM115 - kept open for the run
        self._data.seek(self._data_len)
        self._ids = open(self.ids_path(self.path), "r+b")  # noqa: SIM115
        self._ids.seek(self._ids_len)

    def write(self, ids: list[str], vectors: np.ndarray, texts: list[str] | None = None) -> Refused:
        self._open()
        data = self._vectors(vectors).tobytes()
        names = "".join(i + "\n" for i in ids).encode("utf-8")
        self._data.write(data)
        self._ids.write(names)
        self._data_len += len(data)
        self._ids_len += len(names)
        self.ledger.pending_rows += len(ids)
        return []

    def flush(self) -> None:
        if self._data is None:
            return
        for fh in (self._data, self._ids):
            fh.flush()
            os.fsync(fh.fileno())
        assert self.dimension is not None
        rows = self.manifest.rows + self.ledger.pending_rows
        self._data.seek(0)
        self._data.write(_npy_header(self.manifest.vector_dtype, rows, self.dimension))
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.seek(self._data_len)
        self.manifest.data_bytes = self._data_len
        self.manifest.ids_bytes = self._ids_len

    def close(self) -> None:
        for fh in (self._data, self._ids):
            if fh is not None:
                fh.close()
        self._data = self._ids = None

    def repair(self) -> None:
        m = self.manifest
        if m.data_bytes == 0:
            for p in (self.path, self.ids_path(self.path)):
                p.unlink(missing_ok=True)
            return
        assert self.dimension is not None
        with open(self.path, "r+b") as fh:
            fh.truncate(m.data_bytes)
            fh.seek(0)
            fh.write(_npy_header(m.vector_dtype, m.rows, self.dimension))
        with open(self.ids_path(self.path), "r+b") as fh:
            fh.truncate(m.ids_bytes)
            fh.seek(0)
            self.ledger.committed.update(digest(line.decode("utf-8").rstrip("\n")) for line in fh)


# -- JSONL -------------------------------------------------------------------------------------
class JsonlSink(FileSink):
    format = "jsonl"

    def __init__(self, path: Path, manifest: Manifest, *, shard_rows: int) -> None:
        super().__init__(path, manifest, shard_rows=shard_rows)
        self._fh: Any = None
        self._len = manifest.data_bytes  # bytes of complete writes only

    def write(self, ids: list[str], vectors: np.ndarray, texts: list[str] | None = None) -> Refused:
        if self._fh is None:
            self._fh = open(self.path, "r+b" if self.path.exists() else "w+b")  # noqa: SIM115 - kept for the run
            self._fh.seek(self._len)
        fmt = "%.5g" if self.manifest.vector_dtype == "float16" else "%.9g"  # shortest exact round trip
        rows = self._vectors(vectors).astype(np.float64)
        lines = [f'{{"id": {json.dumps(i)}, "vector": [{",".join([fmt % x for x in row])}]}}\n'
                 for i, row in zip(ids, rows.tolist())]
        blob = "".join(lines).encode("utf-8")
        self._fh.write(blob)
        self._len += len(blob)
        self.ledger.pending_rows += len(ids)
        return []

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def flush(self) -> None:
        if self._fh is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.manifest.data_bytes = self._len

    def repair(self) -> None:
        if self.manifest.data_bytes == 0:
            self.path.unlink(missing_ok=True)
            return
        decoder = json.JSONDecoder()
        with open(self.path, "r+b") as fh:
            fh.truncate(self.manifest.data_bytes)
            fh.seek(0)
            for line in fh:
                text = line.decode("utf-8")
                doc_id = decoder.raw_decode(text, 7)[0] if text.startswith('{"id": ') else json.loads(text)["id"]
                self.ledger.committed.add(digest(doc_id))


#: The file sinks by format.
FILE_SINKS: dict[str, type[FileSink]] = {"parquet": ParquetSink, "npy": NpySink, "jsonl": JsonlSink}
