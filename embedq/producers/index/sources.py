"""Inputs of ``embedq index``: JSONL, CSV/TSV, Parquet and plain text (one document per line).

Every source streams :class:`Record` objects and never holds the file in memory. A record that
cannot be used (not JSON, no text field, a bad id) still comes out, carrying its error, so the run
can write it to the errors file and carry on. Line formats may be gzip-compressed (``.gz``); ``-``
reads standard input (JSONL when its first non-blank line is a JSON object, else one text per line, unless a
format is given).
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import itertools
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from embedq import errors
from embedq.protocol import validate_texts

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "csv", "tsv", "parquet", "text")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv",
             ".parquet": "parquet", ".pq": "parquet", ".txt": "text", ".text": "text"}
MAX_ID_CHARS = 1024


@dataclass(frozen=True, slots=True)
class Record:
    id: str
    text: Any = None
    error: errors.EmbedqError | None = None


#: stdin's format when none is given: told by its first non-blank line (see Source)
SNIFF = "jsonl or text"


def detect_format(path: str) -> str:
    """The input format named by a file's suffix (``.jsonl.gz`` is jsonl); stdin's is told by its first line
    (:data:`SNIFF`: JSONL when it is a JSON object, else one text per line)."""
    if path == "-":
        return SNIFF
    name = path.lower().removesuffix(".gz")
    fmt = _SUFFIXES.get(Path(name).suffix)
    if fmt is None:
        raise errors.InvalidOption(f"cannot tell the format of {path!r} from its name; pass --input-format "
                                   f"({', '.join(FORMATS)})")
    return fmt


def record_text(text: Any, max_chars: int) -> str:
    """A record's text as the indexer embeds it: what a job takes (:func:`~embedq.protocol.validate_texts`), and
    not blank. A job embeds a text of whitespace (as TEI does); a record of one is a hole in the data, not a
    document, so it goes to the errors file instead of becoming a vector."""
    validate_texts([text], max_texts=1, max_chars=max_chars)
    if text.isspace():
        raise errors.EmptyText("inputs[0] is whitespace only (a blank record is not embedded)")
    return text


def clean_id(value: Any, where: str) -> str:
    """A record's id as a string, or :class:`~embedq.errors.InvalidRecord`."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise errors.InvalidRecord(f"{where}: the id must be a string or an integer, not {type(value).__name__}")
    doc_id = str(value)
    if not doc_id or len(doc_id) > MAX_ID_CHARS or "\n" in doc_id or "\r" in doc_id:
        raise errors.InvalidRecord(f"{where}: the id must be 1-{MAX_ID_CHARS} characters without line breaks")
    return doc_id


class Source:
    """One input. ``id_field=None`` means: use the ``id`` field where a record has one, else its
    position (the line number for line formats, counting blank lines, or the 1-based row number)."""

    def __init__(self, path: str, fmt: str | None = None, *, text_field: str = "text",
                 id_field: str | None = None) -> None:
        self.path = path
        self.format = fmt or detect_format(path)
        self._head: list[bytes] = []  # stdin's lines read to tell its format, read again first
        if self.format not in (*FORMATS, SNIFF):
            raise errors.InvalidOption(f"unknown input format {self.format!r}; use one of {', '.join(FORMATS)}")
        if path == "-" and self.format == "parquet":
            raise errors.InvalidOption("Parquet cannot be read from stdin (its index is at the end); give a path")
        if path != "-" and not Path(path).is_file():
            raise errors.InvalidOption(f"input {path!r} does not exist")
        self.text_field = text_field
        self.id_field = id_field
        self._explicit_id = id_field is not None
        self._id_field = id_field or "id"

    def check(self) -> None:
        """Refuse a file whose columns lack the text (or id) field at once, before anything starts (stdin's are
        checked at its first record, still before the output is created)."""
        if self.path == "-" or self.format not in ("csv", "tsv", "parquet"):
            return
        if self.format == "parquet":
            import pyarrow.parquet as pq

            self._check_columns(pq.ParquetFile(self.path).schema_arrow.names)
            return
        with self._open_binary() as fh:
            text = io.TextIOWrapper(fh, encoding="utf-8", errors="replace", newline="")
            self._check_columns(next(csv.reader(text, delimiter=self._delimiter), []))

    def describe(self) -> str:
        return f"{'stdin' if self.path == '-' else self.path} ({self.format})"

    # -- counting, for the progress bar ------------------------------------------------------------
    def count(self) -> int | None:
        """Records in the input (a fast pass over the file), or None for stdin."""
        if self.path == "-":
            return None
        if self.format == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.path).metadata.num_rows
        with self._open_binary() as fh:
            if self.format in ("csv", "tsv"):
                text = io.TextIOWrapper(fh, encoding="utf-8", errors="replace", newline="")
                return max(sum(1 for _ in csv.reader(text, delimiter=self._delimiter)) - 1, 0)
            return sum(1 for line in fh if line.strip())

    # -- reading -----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Record]:
        if self.format == SNIFF:
            return self._sniffed()
        if self.format == "jsonl":
            return self._jsonl()
        if self.format == "text":
            return self._text()
        if self.format == "parquet":
            return self._parquet()
        return self._csv()

    def _sniffed(self) -> Iterator[Record]:
        """stdin with no format given: JSONL when its first non-blank line is a JSON object (``{...}``), else one
        text per line (``printf 'a\\nb\\n' | embedq index -``); the lines read to tell are read again."""
        for raw in sys.stdin.buffer:
            self._head.append(raw)
            if raw.strip():
                break
        first = self._head[-1].removeprefix(b"\xef\xbb\xbf").lstrip() if self._head else b""
        self.format = "jsonl" if first.startswith(b"{") else "text"
        log.info("stdin: %s (told by its first line; --input-format to say)", self.format)
        yield from iter(self)

    @property
    def _delimiter(self) -> str:
        return "\t" if self.format == "tsv" else ","

    @contextlib.contextmanager
    def _open_binary(self) -> Iterator[IO[bytes]]:
        if self.path == "-":
            head, self._head = self._head, []
            yield itertools.chain(head, sys.stdin.buffer) if head else sys.stdin.buffer  # type: ignore[misc]
        elif self.path.lower().endswith(".gz"):
            with gzip.open(self.path, "rb") as fh:
                yield fh
        else:
            with open(self.path, "rb") as fh:
                yield fh

    def _lines(self) -> Iterator[tuple[int, str | errors.EmbedqError]]:
        """(1-based line number, decoded line without its line break) for every non-blank line."""
        with self._open_binary() as fh:
            for n, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    yield n, raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as exc:
                    yield n, errors.InvalidRecord(f"line {n}: not UTF-8 ({exc.reason} at byte {exc.start})")

    def _text(self) -> Iterator[Record]:
        for n, line in self._lines():
            if isinstance(line, errors.EmbedqError):
                yield Record(str(n), error=line)
            else:
                yield Record(str(n), line)

    def _jsonl(self) -> Iterator[Record]:
        for n, line in self._lines():
            if isinstance(line, errors.EmbedqError):
                yield Record(str(n), error=line)
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                yield Record(str(n), error=errors.InvalidRecord(
                    f"line {n}: not JSON ({exc}); for one text per line, pass --input-format text"))
                continue
            if not isinstance(row, dict):
                yield Record(str(n), error=errors.InvalidRecord(f"line {n}: a JSON object was expected"))
                continue
            yield self._record(row, n, f"line {n}")

    def _record(self, row: dict[str, Any], n: int, where: str) -> Record:
        raw_id = row.get(self._id_field)
        try:
            if raw_id is None:
                if self._explicit_id:
                    raise errors.InvalidRecord(f"{where}: no {self._id_field!r} field")
                doc_id = str(n)
            else:
                doc_id = clean_id(raw_id, where)
        except errors.EmbedqError as exc:
            return Record(str(n), error=exc)
        if self.text_field not in row:
            return Record(doc_id, error=errors.InvalidRecord(f"{where}: no {self.text_field!r} field"))
        return Record(doc_id, row[self.text_field])

    def _csv(self) -> Iterator[Record]:
        csv.field_size_limit(2**31 - 1)  # documents may be long; the worker's max_chars still applies
        with self._open_binary() as fh:
            text = io.TextIOWrapper(fh, encoding="utf-8", errors="replace", newline="")
            reader = csv.DictReader(text, delimiter=self._delimiter)
            self._check_columns(reader.fieldnames or [])
            for n, row in enumerate(reader, 1):
                yield self._record(row, n, f"row {n}")

    def _parquet(self) -> Iterator[Record]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.path)
        names = pf.schema_arrow.names
        self._check_columns(names)
        columns = [self.text_field] + ([self._id_field] if self._id_field in names else [])
        n = 0
        for batch in pf.iter_batches(batch_size=4096, columns=columns):
            cols = {name: batch.column(name).to_pylist() for name in columns}
            for i in range(batch.num_rows):
                n += 1
                yield self._record({name: values[i] for name, values in cols.items()}, n, f"row {n}")

    def _check_columns(self, names: list[str]) -> None:
        """Columnar inputs name their columns up front: a wrong field is one clear error, not N."""
        missing = [f for f in (self.text_field, self.id_field) if f is not None and f not in names]
        if missing:
            raise errors.InvalidOption(f"{self.path}: no column {missing[0]!r}; its columns are "
                                       f"{', '.join(map(repr, names))} (see --text-field / --id-field)")
