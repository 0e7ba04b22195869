"""``embedq index -o lancedb:///absolute/path/to/db?table=docs``: a LanceDB table (embedded: no server).

The URL names the database's folder (an absolute local path; it is created if missing, its parent must exist) and,
with ``table``, the table in it. The ``lancedb`` package is imported only here, absolutely (this module's name is
``embedq.producers.index.sinks.lancedb``; ``from __future__ import annotations`` keeps every import absolute).

**The table** is created by the first commit: ``id`` (string), ``content_hash`` (``fixed_size_binary(16)``, each
row's content hash, ``content.py``; with a BTREE index made with the table; absent from a table made before content
hashes, whose record names no scheme: it is continued by id alone), then the kind's columns exactly as the kinds table
builds them for Parquet (``kinds.py``: the runner hands this sink one pyarrow table per result, so no kind is named
here): dense -> a fixed-size list of float32 (float16 with ``--vector-dtype float16``), LanceDB's vector type, named
``vector`` for the plain ``embed`` kind (LanceDB's default vector column) and by the kind's column name otherwise;
ragged (``--kind multi``: ``embed_all``'s per-token states; BGE-M3's ``colbert``) -> a list of fixed-size vectors,
LanceDB's multivector type; sparse -> ``<name>indices`` list<int32> and ``<name>values`` list<float32> (plain
columns: LanceDB has no sparse vector type); scalar -> one value. ``--store-text`` adds ``text``. An existing table
without embedq's record is used only when it is empty and its columns are exactly these (types and dimensions);
otherwise it is refused before anything is embedded. ``--long-inputs windows`` (``windowed.py``): ``window``,
``start``, ``end`` (int32) after ``id``; (id, window) is each row's key (checked distinct when a run starts).

**The record** (format, options, embedding-space fingerprint, row count, runs: the file sinks' manifest) is the
metadata of the ``id`` field, key ``embedq.manifest`` (``tbl.schema.field("id").metadata``): written by the commit
that creates the table, so the table never holds a row without it, and updated at each commit. It is read and
compared before anything is embedded (format, vector dtype, options: the kind is one of them), and the fingerprint
against the workers' one-text probe before anything is written.

**Commits**: rows are buffered and appended at each checkpoint (``--checkpoint-seconds``) by one ``add``: a LanceDB
commit is atomic (a new version appears whole or not at all), so a run killed at any point leaves whole commits, and
the next run reads the ids the table holds and embeds the rest. Append, not ``merge_insert("id")``: with one writer
(the lock) and resume from the table's own ids the indexer never sends an id the table holds, and an append costs
the batch, where a merge joins every batch against the table's whole id column (a cost that grows with the table all
night). The append is checked: the row count after it must be the count before plus the batch, and the ids read when
a run starts must be distinct, or the run stops with an error (another writer went around the lock). The record's
row count may lag the table by the last commit (killed between the append and the record's update): the table's own
count is what a run starts from.

**Re-indexing** (a table that keeps content hashes): a write of an id committed before the run replaces its row by
one ``merge_insert`` on ``id`` at the commit (one LanceDB version: the old row and the new one are never both there;
the new ids' rows are still one ``add``); in a windows table an edited document's old windows are deleted first, then
its new ones appended (a kill between leaves it absent: embedded again). ``--prune`` deletes the ids the input no
longer has at once, in deletes of 1,024 ids (each its own version); ``rows_by_hash`` reads rows back by
``content_hash IN (...)`` (through its index), and ``--reuse`` opens the table for that alone (``open_reader``: no
lock, nothing written). One writer per table: an ``flock`` on ``<db>.<table>.embedq.lock`` beside the database's
folder, dropped by the kernel when the writer dies.

**The ANN index** (``--build-index``): IVF_HNSW_SQ with cosine distance on each vector column (dense and
multivector) after the load (LanceDB's defaults: one IVF partition per ~1M vectors, HNSW m=20, ef_construction=300,
8-bit scalar quantization; a 2,000-row table gets one partition). ``tbl.search(q).distance_type("cosine")`` uses it.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import numpy as np

from embedq import errors
from embedq.producers.index.idset import IdSet, digest
from embedq.producers.index.kinds import index_kind
from embedq.producers.index.sinks import contract
from embedq.producers.index.sinks.locks import OutputLock, writable
from embedq.producers.index.sinks.manifests import (
    Ledger,
    Manifest,
    check_reusable,
    check_space,
    resume_or_start,
    utc_now,
)
from embedq.producers.index.sinks.urls import database_errors_path, split_param
from embedq.producers.index.windowed import COLUMNS, WindowRows, per_window
from embedq.protocol import Fingerprint

MANIFEST_KEY = b"embedq.manifest"
HASH = "content_hash"  # each row's content hash (content.py), where the record names a scheme
IDS_PER_FILTER = 1_024  # ids or hashes per SQL filter (a delete, a lookup by hash)
ROWS_PER_ADD = 65_536  # rows buffered before an append even between checkpoints (bounds this process's memory)
_TABLE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # what LanceDB accepts as a table name (and a file name fits)


def _lancedb() -> Any:
    import lancedb

    return lancedb


def _pa() -> Any:
    import pyarrow as pa

    return pa


def _sql_string(text: str) -> str:
    """``text`` as a SQL string literal (LanceDB's filters)."""
    return "'" + text.replace("'", "''") + "'"


def _type_name(t: Any) -> str:
    return str(t).replace("item: ", "")


class Target(contract.Target):
    """A LanceDB table as an ``embedq index`` output (see the module's docstring)."""

    format = "lancedb"
    builds_index = True  # --build-index (build_index)
    stores_text = True  # --store-text
    stores_windows = True  # --long-inputs windows: int32 window, start, end after id (windowed.py)

    def __init__(self, url: str, config: Any) -> None:
        self.url = url
        rest, table = split_param(url, "table")
        parts = urlsplit(rest)
        if not table:
            raise errors.InvalidOption(f"{url} names no table: add ?table=NAME")
        if not _TABLE_NAME.match(table) or set(table) == {"."}:  # LanceDB reads . and .. as path segments
            raise errors.InvalidOption(f"{url}: invalid table name {table[:40]!r}: a LanceDB table name has only "
                                       "letters, digits, _, - and . (not . or .. alone), at most 128 of them")
        try:  # and whatever else this LanceDB refuses, here rather than at the first commit
            from lancedb.util import validate_table_name

            validate_table_name(table)
        except ValueError as exc:
            raise errors.InvalidOption(f"{url}: invalid table name: {exc}") from None
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise errors.InvalidOption(f"{url}: a LanceDB output is a local folder named by an absolute path, "
                                       "lancedb:///absolute/path/to/db?table=NAME (three slashes)")
        if parts.query:
            names = ", ".join(sorted({k for k, _ in parse_qsl(parts.query, keep_blank_values=True)}))
            raise errors.InvalidOption(f"{url}: a lancedb:// output takes only ?table= (not {names})")
        self.path = Path(unquote(parts.path))
        self.table = table
        self.config = config
        self.db: Any = None
        self.tbl: Any = None
        self.manifest: Manifest | None = None
        self.made_folder = False
        self._checked = False

    # -- what the runner asks ----------------------------------------------------------------------
    def describe(self) -> str:
        return self.url

    def default_errors_path(self) -> Path:
        return database_errors_path(self.table, self.describe())

    def check(self) -> None:
        """The folder reachable and writable, an existing table embedq's (or empty). Nothing is written."""
        if self._checked:
            return
        where = self.path if self.path.exists() else self.path.parent
        why = writable(where)
        if why is not None:
            what = "the database folder" if where == self.path else "the parent folder of the database"
            raise errors.InvalidOption(f"cannot write the LanceDB database {self.path}: {what} {where} {why}")
        self.tbl, self.manifest = None, None
        if self.path.exists():
            self.db = _lancedb().connect(str(self.path))
            if self.table in self._tables():
                self.tbl = self.db.open_table(self.table)
                self.manifest = self._read_manifest()
                if self.manifest is None and not self.config.overwrite and self.tbl.count_rows():
                    raise errors.OutputMismatch(
                        f"table {self.table} of {self.path} holds rows that embedq index did not write (no "
                        f"{MANIFEST_KEY.decode()} in its id field's metadata); choose another table")
        self._checked = True

    def _tables(self) -> list[str]:
        names, token = [], None
        while True:  # list_tables pages its answer
            page = self.db.list_tables(page_token=token)
            names += page.tables
            token = page.page_token
            if not token:
                return names

    def _read_manifest(self) -> Manifest | None:
        schema = self.tbl.schema
        if schema.get_field_index("id") < 0:
            return None
        raw = (schema.field("id").metadata or {}).get(MANIFEST_KEY)
        if raw is None:
            return None
        try:
            return Manifest.model_validate_json(raw)
        except ValueError as exc:
            raise errors.InvalidOption(f"table {self.table} of {self.path}: its {MANIFEST_KEY.decode()} is not a "
                                       f"readable embedq record ({exc}); pass --overwrite to start afresh") from None

    def lock(self) -> OutputLock:
        # <db>.<table>.embedq.lock
        return OutputLock(self.path.with_name(f"{self.path.name}.{self.table}"), f"{self.path}?table={self.table}")

    def exists(self) -> bool:
        return self.tbl is not None

    def remove(self) -> None:
        """The table is created by the first commit: only a database folder this run made (still empty) goes."""
        if self.made_folder:
            with contextlib.suppress(OSError):
                self.path.rmdir()

    def open(self, *, vector_dtype: Any, options: dict[str, Any], shard_rows: int, overwrite: bool) -> LanceSink:
        self._checked = False  # read again under the lock (a table handle does not see later commits by itself)
        self.check()
        if not self.path.exists():
            self.path.mkdir()
            self.made_folder = True
        if self.db is None:
            self.db = _lancedb().connect(str(self.path))
        if overwrite and self.tbl is not None:
            self.db.drop_table(self.table)
            self.tbl, self.manifest = None, None
        manifest = resume_or_start(self.manifest, format=self.format, vector_dtype=vector_dtype, options=options,
                                   where=f"table {self.table} of {self.path}", container="table")
        sink = LanceSink(self, manifest)
        sink.load_committed()
        return sink

    def open_reader(self, *, vector_dtype: Any, options: dict[str, Any]) -> LanceSink:
        """``--reuse``: the table opened to read its rows back by content hash; nothing is created, written or
        locked."""
        where = f"table {self.table} of {self.path}"
        if not self.path.is_dir():
            raise errors.InvalidOption(f"--reuse: {where} does not exist")
        self.db = _lancedb().connect(str(self.path))
        if self.table not in self._tables():
            raise errors.InvalidOption(f"--reuse: {where} does not exist")
        self.tbl = self.db.open_table(self.table)
        self.manifest = self._read_manifest()
        manifest = check_reusable(self.manifest, vector_dtype=vector_dtype, options=options, where=where,
                                  container="table")
        sink = LanceSink(self, manifest, reader=True)
        sink.load_committed()
        return sink

    def build_index(self) -> tuple[str, float]:
        """IVF_HNSW_SQ (cosine) on every vector column, after the load; what was built and the seconds it took."""
        from lancedb.index import HnswSq

        if self.tbl is None or not self.tbl.count_rows():
            return "none (the table is empty)", 0.0
        pa = _pa()
        built = []
        t0 = time.perf_counter()
        for field in self.tbl.schema:
            t = field.type
            inner = t.value_type if pa.types.is_list(t) else t
            if not (pa.types.is_fixed_size_list(inner) and pa.types.is_floating(inner.value_type)):
                continue
            self.tbl.create_index(field.name, config=HnswSq(distance_type="cosine"), replace=True)
            kind = "multivector" if pa.types.is_list(t) else "vector"
            built.append(f"IVF_HNSW_SQ {field.name}_idx ({field.name}, {kind}, cosine)")
        return "; ".join(built) or "none (no vector column)", time.perf_counter() - t0


class LanceSink(contract.Sink):
    """Rows appended to a LanceDB table at each commit, the record in its id field's metadata (the module's
    docstring)."""

    arrow_columns = True  # a kind's columns as one pyarrow table: stored as they are
    container = "table"
    stores_hashes = True

    def __init__(self, target: Target, manifest: Manifest, *, reader: bool = False) -> None:
        adopted = target.tbl is not None and target.manifest is None  # an empty table of someone else's
        # an adopted empty table: one probe first checks its vector column against the space before any text
        super().__init__(Ledger(manifest), where=f"table {target.table} of {target.path}", probe_first=adopted)
        self.target = target
        self.schema: Any = target.tbl.schema if target.tbl is not None else None
        self.adopted = adopted
        self.reader = reader  # opened by ``--reuse``: read back, never written
        self._buffer: list[Any] = []  # new ids' rows
        self._replacing: list[Any] = []  # rows of ids committed before this run, each replacing its old row
        self._buffered = 0
        self._table_rows = 0  # rows the table holds (committed)
        self._add_hash = False  # an adopted empty table gets the content_hash column before its first rows
        self.windowed = per_window(manifest.options)  # one row per window (windowed.py)
        self._dropping: list[str] = []  # windowed: edited documents whose old windows go before the new ones come

    def load_committed(self) -> None:
        tbl = self.target.tbl
        if tbl is None:
            return
        hashes = self.ledger.keeps_hashes
        if hashes and tbl.schema.get_field_index(HASH) < 0:
            raise errors.OutputMismatch(f"{self.where} has no {HASH} column, though its record keeps content hashes "
                                        "(changed outside embedq index); pass --overwrite to start afresh")
        batches = tbl.search().select(["id", *([HASH] if hashes else []), *(["window"] if self.windowed else [])])
        rows = ((doc_id, h, w) for batch in batches.to_batches() for doc_id, h, w in
                zip(batch.column("id").to_pylist(), *(batch.column(c).to_pylist() if on else itertools.repeat(None)
                                                      for c, on in ((HASH, hashes), ("window", self.windowed)))))
        self._table_rows = self.ledger.take_rows(rows, where=self.where, container="table", windowed=self.windowed)

    # -- Sink's contract ---------------------------------------------------------------------------
    def accept(self, fingerprint: Fingerprint) -> None:
        have = self.manifest.fingerprint
        check_space(have, fingerprint, where=self.where, container="table")
        if self.adopted and have is None and index_kind(self.target.config.kind, self.target.format).columns is None:
            # the plain dense path: its columns are known now (a kind's are compared at its first write)
            pa = _pa()
            value = pa.float16() if self.manifest.vector_dtype == "float16" else pa.float32()
            want = [("id", pa.string()), *[(c, pa.int32()) for c in COLUMNS if self.windowed],
                    *([(HASH, pa.binary(16))] if self.ledger.keeps_hashes else []),
                    ("vector", pa.list_(value, fingerprint.dimensions))]
            self._compare(pa.schema(want + ([("text", pa.string())] if self.target.config.store_text else [])))
        self.manifest.fingerprint = fingerprint

    def _compare(self, want: Any) -> None:
        have = {f.name: f.type for f in self.schema}
        if HASH not in have and HASH in want.names:  # an adopted empty table: the column is added with the record
            self._add_hash = True
            want = want.remove(want.get_field_index(HASH))
        problems = [f"{f.name} is {_type_name(have[f.name])}, this run writes {_type_name(f.type)}" if f.name in have
                    else f"no column {f.name} ({_type_name(f.type)})" for f in want if have.get(f.name) != f.type]
        problems += [f"column {name} is not written by this run" for name in have if name not in want.names]
        if problems:
            raise errors.OutputMismatch(f"{self.where} has another schema: {'; '.join(problems)}. Write to another "
                                        "table, or pass --overwrite to replace it")

    def write(self, ids: list[str], data: Any, texts: list[str] | None = None,
              hashes: list[bytes] | None = None, windows: WindowRows | None = None) -> contract.Refused:
        """Buffer the rows (appended by the next commit); an id committed before this run replaces its row (a
        document: all its windows)."""
        if self.reader:
            raise errors.InvalidOption(f"--reuse: {self.where} is opened to read rows back, not to write")
        pa = _pa()
        if isinstance(data, np.ndarray):
            half = self.manifest.vector_dtype == "float16"
            rows = np.ascontiguousarray(data, dtype=np.float16 if half else np.float32)
            value = pa.float16() if half else pa.float32()
            table = pa.table({"vector": pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1), value),
                                                                          int(rows.shape[1]))})
        else:
            table = data
        table = table.add_column(0, "id", pa.array(ids, pa.string()))
        for k, (name, column) in enumerate((windows.arrow() if self.windowed and windows is not None else {}).items()):
            table = table.add_column(1 + k, name, column)
        if self.ledger.keeps_hashes:
            if hashes is None:
                raise ValueError(f"{self.where} keeps content hashes: write needs each row's")
            table = table.add_column(1 + 3 * self.windowed, HASH, pa.array(hashes, pa.binary(16)))
        if texts is not None:
            table = table.append_column("text", pa.array(texts, pa.string()))
        if self.schema is None:
            self.schema = table.schema
        elif not self._buffer and self._table_rows == 0 and self.adopted:
            self._compare(table.schema)
        if len(self.committed) and self.windowed:  # the old windows deleted first, at the append (_append)
            self._dropping += dict.fromkeys(doc_id for doc_id in ids if digest(doc_id) in self.committed)
        elif len(self.committed):
            replacing = np.fromiter((digest(doc_id) in self.committed for doc_id in ids), bool, len(ids))
            if replacing.any():
                self._replacing.append(table.filter(pa.array(replacing)))
                table = table.filter(pa.array(~replacing))
        self._buffer.append(table)
        self._buffered += len(ids)
        self.ledger.pending_rows += table.num_rows  # a replaced row is counted once, before this run
        if self._buffered >= ROWS_PER_ADD:
            self._append()
        return []

    def _append(self) -> None:
        """The buffered new rows as one LanceDB commit (creating the table with its record), the replacing ones as
        one more (``merge_insert`` on ``id``: an old row and its new one never both there), then the count checked."""
        if not self._buffer and not self._replacing:
            return
        pa = _pa()
        batch = pa.concat_tables(self._buffer) if self._buffer else None
        n = batch.num_rows if batch is not None else 0
        inserted = 0
        try:
            # windowed: an edited document's old windows go first (a kill between: it is absent, embedded again)
            inserted -= self._delete_ids(self._dropping)
            self._dropping = []
            if batch is None:
                pass
            elif self.target.tbl is None:
                self.manifest.rows = n
                self.manifest.updated = utc_now()
                record = self.ledger.record()
                field = batch.schema.field("id").with_metadata({MANIFEST_KEY: record})
                schema = batch.schema.set(batch.schema.get_field_index("id"), field)
                self.target.tbl = self.target.db.create_table(self.target.table, batch.cast(schema))
                self.ledger.stored(record)
                self.manifest.rows = 0  # counted again by commit()
                if self.ledger.keeps_hashes:  # rows_by_hash a lookup (rows appended later are scanned)
                    from lancedb.index import BTree

                    self.target.tbl.create_index(HASH, config=BTree())
            else:
                if self.adopted and self.target.manifest is None:  # the record before the rows: never rows without
                    if self._add_hash:
                        self.target.tbl.add_columns(pa.field(HASH, pa.binary(16)))
                    self.ledger.save(self._store_record, force=True)
                    self.target.manifest = self.manifest
                self.target.tbl.add(batch)
            if self._replacing:
                merge = self.target.tbl.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
                inserted = merge.execute(pa.concat_tables(self._replacing)).num_inserted_rows  # 0 unless pruned
            count = self.target.tbl.count_rows()
        except (OSError, RuntimeError, ValueError) as exc:
            raise errors.Unavailable(f"writing to {self.where} failed: {exc}; run again to continue from the last "
                                     "commit") from None
        self._buffer, self._replacing, self._buffered = [], [], 0
        if count != self._table_rows + n + inserted:
            raise errors.Unavailable(f"{self.where} holds {count} rows after appending {n + inserted} to "
                                     f"{self._table_rows}: another writer went around embedq's lock; stop it, then "
                                     "run again")
        self._table_rows = count
        self.ledger.pending_rows += inserted

    def flush(self) -> None:
        """At a commit: the rows since the last one as one append (then :meth:`save_manifest`)."""
        self._append()

    def save_manifest(self) -> None:
        """The record into the id field's metadata, when it changed (a metadata update is a table version); none
        before the table exists."""
        if self.target.tbl is not None and not self.reader:
            self.ledger.save(self._store_record)

    def _store_record(self, record: str) -> None:
        try:
            self.target.tbl.update_field_metadata({"path": "id", "metadata": {MANIFEST_KEY.decode(): record}})
        except (OSError, RuntimeError, ValueError) as exc:
            raise errors.Unavailable(f"committing to {self.where} failed: {exc}; run again to continue from the "
                                     "last commit") from None

    def prune(self, keep: IdSet) -> int:
        """Delete the rows whose id is not in ``keep`` at once (each delete of IDS_PER_FILTER ids is a LanceDB
        commit: a kill between two leaves the rest to the next ``--prune`` run); returns how many ids."""
        tbl = self.target.tbl
        if tbl is None or self.reader:
            return 0
        gone = list(dict.fromkeys(doc_id for batch in tbl.search().select(["id"]).to_batches()
                                  for doc_id in batch.column("id").to_pylist() if digest(doc_id) not in keep))
        try:
            deleted = self._delete_ids(gone)
        except (OSError, RuntimeError, ValueError) as exc:
            raise errors.Unavailable(f"pruning {self.where} failed: {exc}; run again to finish it") from None
        self._table_rows -= deleted
        self.manifest.rows -= deleted
        return len(gone)

    def _delete_ids(self, ids: list[str]) -> int:
        """Delete every row of these ids, IDS_PER_FILTER ids a LanceDB commit; returns the rows deleted."""
        deleted = 0
        for i in range(0, len(ids), IDS_PER_FILTER):
            names = ", ".join(_sql_string(doc_id) for doc_id in ids[i:i + IDS_PER_FILTER])
            deleted += self.target.tbl.delete(f"id IN ({names})").num_deleted_rows
        return deleted

    def rows_by_hash(self, hashes: list[bytes]) -> tuple[list[bytes], Any]:
        """The rows of these content hashes the table holds (one per hash, in the order asked): the plain ``embed``
        kind's as a float matrix of the table's vector dtype, a kind's as a pyarrow table of its columns."""
        tbl = self.target.tbl
        if tbl is None or not self.ledger.keeps_hashes or not hashes:
            return [], None
        pa = _pa()
        columns = [f.name for f in tbl.schema if f.name not in ("id", HASH, "text")]
        wanted = list(dict.fromkeys(bytes(h) for h in hashes))
        parts = []
        for i in range(0, len(wanted), IDS_PER_FILTER):
            literals = ", ".join(f"X'{h.hex()}'" for h in wanted[i:i + IDS_PER_FILTER])
            parts.append(tbl.search().where(f"{HASH} IN ({literals})").select([HASH, *columns]).to_arrow())
        rows = pa.concat_tables(parts)
        first: dict[bytes, int] = {}
        for k, h in enumerate(rows.column(HASH).to_pylist()):
            first.setdefault(h, k)
        found = [h for h in wanted if h in first]
        rows = rows.take(pa.array([first[h] for h in found], pa.int64())).select(columns)
        if not found:
            return [], None
        if index_kind(self.manifest.options.get("kind", "embed"), self.target.format).columns is not None:
            return found, rows
        vectors = rows.column("vector").combine_chunks()
        return found, vectors.flatten().to_numpy(zero_copy_only=False).reshape(len(found), vectors.type.list_size)

    def close(self) -> None:
        """Rows not appended yet are dropped (the next run embeds them again); a reader lets go of the table."""
        self._buffer, self._replacing, self._buffered, self._dropping = [], [], 0, []
        if self.reader:
            self.target.tbl = self.target.db = None
