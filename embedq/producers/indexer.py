"""``embedq index``: embed a JSONL file of ``{"id", "text"}`` lines through the queue.

Jobs are submitted in chunks with a bounded number in flight and collected in order, so memory
(here and in Redis: each result is deleted once written) stays bounded by the window.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedq import errors
from embedq.producers.client import Client, JobHandle
from embedq.protocol import Fingerprint, validate_texts


@dataclass
class Summary:
    texts: int = 0
    tokens: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    fingerprint: Fingerprint | None = None

    @property
    def texts_per_second(self) -> float:
        return self.texts / self.seconds if self.seconds else 0.0


def read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh):
            if not line.strip():
                continue
            row = json.loads(line)
            yield str(row.get("id", n)), row.get("text")


def count_lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


class _NpyWriter:
    def __init__(self, path: Path, total: int) -> None:
        self.path, self.total, self.rows = path, total, 0
        self.array: np.ndarray | None = None
        self.ids_path = path.with_suffix(".ids.txt")
        self.ids = self.ids_path.open("w", encoding="utf-8")

    def write(self, ids: list[str], vectors: np.ndarray, fingerprint: Fingerprint) -> None:
        if self.array is None:
            self.array = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.float32,
                                                   shape=(self.total, vectors.shape[1]))
        self.array[self.rows:self.rows + len(ids)] = vectors
        self.rows += len(ids)
        self.ids.writelines(i + "\n" for i in ids)

    def close(self, fingerprint: Fingerprint | None) -> None:
        self.ids.close()
        if self.array is not None:
            self.array.flush()
            del self.array
            if self.rows != self.total:  # failures left rows empty: shrink to what was written
                full = np.load(self.path, mmap_mode="r")
                np.save(self.path, np.array(full[: self.rows]))
        if fingerprint is not None:
            self.path.with_suffix(".fingerprint.json").write_text(fingerprint.model_dump_json(indent=2))


class _ParquetWriter:
    def __init__(self, path: Path) -> None:
        try:
            import pyarrow as pa  # noqa: F401
        except ImportError:
            raise errors.InvalidOption("Parquet output needs pyarrow: pip install 'embedq[parquet]'") from None
        self.path = path
        self.writer: Any = None

    def write(self, ids: list[str], vectors: np.ndarray, fingerprint: Fingerprint) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        dim = vectors.shape[1]
        if self.writer is None:
            schema = pa.schema([("id", pa.string()), ("vector", pa.list_(pa.float32(), dim))],
                               metadata={b"embedq.fingerprint": fingerprint.model_dump_json().encode()})
            self.writer = pq.ParquetWriter(self.path, schema)
        flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
        table = pa.table({"id": pa.array(ids, pa.string()),
                          "vector": pa.FixedSizeListArray.from_arrays(flat, dim)}, schema=self.writer.schema)
        self.writer.write_table(table)

    def close(self, fingerprint: Fingerprint | None) -> None:
        if self.writer is not None:
            self.writer.close()


def run_index(client: Client, input_path: Path, output_path: Path, *, chunk_size: int = 64,
              max_in_flight: int = 32, options: dict[str, Any] | None = None, progress: bool = True,
              timeout: float = 600.0) -> Summary:
    options = options or {}
    total = count_lines(input_path)
    suffix = output_path.suffix.lower()
    if suffix == ".npy":
        writer: Any = _NpyWriter(output_path, total)
    elif suffix == ".parquet":
        writer = _ParquetWriter(output_path)
    else:
        raise errors.InvalidOption(f"output must end in .parquet or .npy, not {suffix!r}")
    summary = Summary()
    from tqdm import tqdm

    bar = tqdm(total=total, unit="text", disable=not progress, smoothing=0.1, dynamic_ncols=True)
    in_flight: deque[tuple[list[str], JobHandle]] = deque()
    t0 = time.perf_counter()

    def collect_one() -> None:
        ids, handle = in_flight.popleft()
        vectors = handle.result(timeout)
        fp = handle.fingerprint
        if summary.fingerprint is None:
            summary.fingerprint = fp
        elif fp != summary.fingerprint:
            raise errors.InvalidOption(f"workers answered with another embedding space: {fp} != "
                                       f"{summary.fingerprint}; refusing to mix them in one output")
        writer.write(ids, vectors, fp)
        summary.texts += len(ids)
        summary.tokens += (handle.usage or {}).get("tokens", 0)
        bar.update(len(ids))

    try:
        chunk_ids: list[str] = []
        chunk_texts: list[str] = []
        rows = read_jsonl(input_path)
        while True:
            row = next(rows, None)
            if row is not None:
                doc_id, text = row
                try:
                    validate_texts([text], max_texts=1, max_chars=client.settings.max_chars)
                except errors.EmbedqError as exc:
                    summary.failures.append({"id": doc_id, "code": exc.code, "message": exc.message})
                    bar.update(1)
                    continue
                chunk_ids.append(doc_id)
                chunk_texts.append(text)
            if chunk_ids and (len(chunk_ids) >= chunk_size or row is None):
                in_flight.append((chunk_ids, client.submit(chunk_texts, **options)))
                chunk_ids, chunk_texts = [], []
                while len(in_flight) >= max_in_flight:
                    collect_one()
            if row is None:
                break
        while in_flight:
            collect_one()
    finally:
        bar.close()
        writer.close(summary.fingerprint)
        summary.seconds = time.perf_counter() - t0
    if summary.failures:
        err_path = output_path.with_suffix(".errors.jsonl")
        with err_path.open("w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(f) + "\n" for f in summary.failures)
    return summary
