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

from embedq.producers.index.idset import digest
from embedq.producers.index.sinks.contract import Refused, Sink
from embedq.producers.index.sinks.manifests import Ledger, Manifest, Part, utc_now


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
    format = "parquet"
    ROW_GROUP_ROWS = 8192

    def __init__(self, path: Path, manifest: Manifest, *, shard_rows: int) -> None:
        super().__init__(path, manifest, shard_rows=shard_rows)
        self._buffer: list[tuple[list[str], np.ndarray]] = []
        self._buffered = 0
        self._writer: Any = None
        self._shard_rows = 0

    @classmethod
    def manifest_path(cls, path: Path) -> Path:
        return path / "_embedq.json"

    @classmethod
    def sidecars(cls, path: Path) -> list[Path]:
        return []  # the manifest lives inside the dataset directory

    def _shard_name(self) -> str:
        return f"part-{len(self.manifest.parts):05d}.parquet"

    def _tmp_path(self) -> Path:
        return self.path / f".{self._shard_name()}.tmp"

    def write(self, ids: list[str], vectors: Any, texts: list[str] | None = None) -> Refused:
        """``vectors``: a dense matrix (the ``vector`` column), or a pyarrow table of a kind's columns
        (``producers/index/kinds.py``)."""
        self._buffer.append((ids, vectors if hasattr(vectors, "schema") else self._vectors(vectors)))
        self._buffered += len(ids)
        self.ledger.pending_rows += len(ids)
        if self._buffered >= self.ROW_GROUP_ROWS:
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
        ids = [i for chunk_ids, _ in self._buffer for i in chunk_ids]
        if hasattr(self._buffer[0][1], "schema"):  # a kind's own columns
            columns = pa.concat_tables([t for _, t in self._buffer])
            table = columns.add_column(0, "id", pa.array(ids, pa.string()))
            if self._writer is None:
                schema = table.schema.with_metadata({b"embedq.fingerprint": fp.model_dump_json().encode()})
                self._writer = pq.ParquetWriter(self._tmp_path(), schema)
            self._writer.write_table(table.cast(self._writer.schema), row_group_size=len(ids))
            self._shard_rows += len(ids)
            self._buffer, self._buffered = [], 0
            return
        dim = self.dimension
        value_type = pa.float16() if self.manifest.vector_dtype == "float16" else pa.float32()
        if self._writer is None:
            schema = pa.schema([("id", pa.string()), ("vector", pa.list_(value_type, dim))],
                               metadata={b"embedq.fingerprint": fp.model_dump_json().encode()})
            self._writer = pq.ParquetWriter(self._tmp_path(), schema)
        flat = np.concatenate([v for _, v in self._buffer]).reshape(-1)
        table = pa.table({"id": pa.array(ids, pa.string()),
                          "vector": pa.FixedSizeListArray.from_arrays(pa.array(flat, value_type), dim)},
                         schema=self._writer.schema)
        self._writer.write_table(table, row_group_size=len(ids))
        self._shard_rows += len(ids)
        self._buffer, self._buffered = [], 0

    def flush(self) -> None:
        self._write_group()
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        tmp, final = self._tmp_path(), self.path / self._shard_name()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(self.path)
        self.manifest.parts.append(Part(file=final.name, rows=self._shard_rows))
        self._shard_rows = 0

    def close(self) -> None:
        if self._writer is not None:  # an unfinished shard: not committed, removed by the next run
            self._writer.close()
            self._writer = None

    def repair(self) -> None:
        import pyarrow.parquet as pq

        listed = {p.file for p in self.manifest.parts}
        for f in self.path.iterdir():
            if (f.name.startswith(".part-") or f.name.startswith("part-")) and f.name not in listed:
                f.unlink()
        for part in self.manifest.parts:
            ids = pq.read_table(self.path / part.file, columns=["id"]).column("id").to_pylist()
            self.ledger.committed.update(digest(i) for i in ids)


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
