"""``embedq index -o postgresql://user@host:5432/db?table=docs``: PostgreSQL with the pgvector extension.

The URL is libpq's (``postgres://`` too; its query parameters — ``sslmode``, ``connect_timeout``, ... — go to libpq);
``table`` (``name`` or ``schema.name``) is embedq's and is taken out first; its names are checked before anything is
embedded (``pgvector_names.py``: no NUL, none over 63 bytes, an existing schema that is not a session's temporary
one). The password comes from the URL or libpq's environment (``PGPASSWORD``, ``~/.pgpass``, ``PGSERVICE``...) and
is never shown: the summary and every message show the URL with ``***``.

**The table** is created by the first commit, in that commit's transaction: ``id text primary key``, then one column
per output of the kind, by its shape (``embedq/kinds.py`` :class:`~embedq.kinds.Column`; no kind is named here):
``dense`` -> ``vector(dim)`` (``halfvec(dim)`` for ``--vector-dtype float16``, pgvector >= 0.7), named ``embedding``
for the plain ``embed`` kind and by the kind's column name otherwise (an unnamed one, a SPLADE kind's: ``embedding``);
``sparse`` -> ``sparsevec(dim)``, ``dim`` the vocabulary size the result gives (``IndexKind.arrays``: SPLADE's
fingerprint dimensions, BGE-M3's ``lexical_dimensions``; pgvector >= 0.7: an older server refuses a sparse kind
before anything is embedded); ``scalar`` -> ``double precision``; ``ragged`` (a list of vectors per text) is refused:
pgvector has no multi-vector type that an index can use. ``--store-text`` adds ``text``; a table made since content
hashes (the manifest's ``content_hash``) has ``content_hash bytea`` (``content.py``), with a btree index. An existing
table without embedq's record is used only when it is empty and its columns are exactly these (types and dimensions;
``content_hash`` is added to it); otherwise it is refused before anything is embedded. ``--long-inputs windows``
(``windowed.py``): ``window``, ``start``, ``end`` (``integer``) after ``id``, primary key (id, window); a document's
windows are written in the commit's transaction, an edited one's old windows deleted in it.

**Commits** are transactions: the rows since the last commit (binary ``COPY``; an id the table held before the run, a
re-indexed text, has its old row deleted first, in the same transaction; ``--prune``'s deletes too) and the manifest
row in ``embedq_index`` (keyed by the table's name: format, options, embedding-space fingerprint, row count, runs)
commit together, so a run killed at any point leaves the last commit, and the next run reads the committed ids (and
content hashes) from the table and embeds the rest. One writer per table: a session advisory lock, which the server
drops when the writer dies; a reader (``--reuse``: :meth:`Target.open_reader`) takes none and writes nothing. Rows are
read back by content hash in binary (``pgvector_rows.py``): the values as stored.

**The ANN index** (``--build-index``): HNSW (pgvector >= 0.5) on each vector column after the load, with
``vector_cosine_ops`` (``halfvec_cosine_ops``): embedq's models score by cosine (normalized vectors: cosine ranks as
inner product does), so ``ORDER BY embedding <=> $query LIMIT k`` uses it; on a sparse column ``sparsevec_ip_ops``
(SPLADE and BGE-M3's lexical weights score by inner product: ``ORDER BY embedding <#> $query``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from embedq import errors
from embedq.producers.index.idset import IdSet, digest
from embedq.producers.index.kinds import index_kind
from embedq.producers.index.sinks import contract, manifests
from embedq.producers.index.sinks import pgvector_names as names
from embedq.producers.index.sinks import pgvector_rows as rows
from embedq.producers.index.sinks.manifests import Ledger, Manifest, check_space, resume_or_start, utc_now
from embedq.producers.index.sinks.urls import database_errors_path, mask_url, split_param
from embedq.producers.index.windowed import WindowRows, per_window
from embedq.protocol import Fingerprint

MANIFEST_TABLE = "embedq_index"
_AUTH_FAILED = re.compile(r"password authentication failed|no password supplied|authentication failed", re.I)


def _psycopg() -> Any:
    import psycopg

    return psycopg


class Target(contract.Target):
    """A PostgreSQL table as an ``embedq index`` output (see the module's docstring)."""

    format = "postgresql"
    builds_index = True  # --build-index (build_index)
    stores_text = True  # --store-text
    stores_windows = True  # --long-inputs windows: integer window, start, end after id; primary key (id, window)

    def __init__(self, url: str, config: Any) -> None:
        self.url = url
        self.conninfo, table = split_param(url, "table")
        if not table:
            raise errors.InvalidOption(f"{mask_url(url)} names no table: add ?table=NAME (or schema.name)")
        self.table = table
        self.schema, self.name = names.split_table(table, mask_url(url))
        self.config = config
        self.conn: Any = None
        self.version: tuple[int, ...] = ()
        self.manifest: Manifest | None = None
        self.table_exists = False
        self._required: set[str] = set()  # the table's NOT NULL columns without a default (columns())
        self._checked = False

    # -- what the runner asks ----------------------------------------------------------------------
    def describe(self) -> str:
        return mask_url(self.url)

    def default_errors_path(self) -> Path:
        return database_errors_path(self.table, self.describe())

    def ident(self) -> Any:
        from psycopg import sql

        return sql.Identifier(*((self.schema, self.name) if self.schema is not None else (self.name,)))

    def check(self) -> None:
        """Connect, find pgvector (created when missing and allowed), check the table's schema (it exists, is not
        temporary, and this user may create the table there), that the kind's columns can be stored and that an
        existing table is embedq's or empty. Nothing of the table is written."""
        if self._checked:
            return
        psycopg = _psycopg()
        try:
            self._connect()
            self._plan_check()
            self._load_manifest()
            names.check_schema(self.conn, self.schema, where=self.describe(),
                         creates=not self.table_exists or self.config.overwrite)
        except psycopg.OperationalError as exc:
            raise errors.Unavailable(f"{self.describe()}: {names.first_line(exc)}") from None
        except psycopg.Error as exc:  # a server's refusal, named: never a traceback
            raise errors.InvalidOption(f"{self.describe()}: {names.first_line(exc)}") from None
        self._checked = True

    def _connect(self, *, reading: bool = False) -> None:
        """Connect and find pgvector's version (creating the extension where it is missing, unless ``reading``)."""
        psycopg = _psycopg()
        extra = {} if "connect_timeout" in self.conninfo else {"connect_timeout": 10}
        try:
            self.conn = psycopg.connect(self.conninfo, application_name="embedq index", **extra)
        except psycopg.OperationalError as exc:
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            if _AUTH_FAILED.search(str(exc)):
                raise errors.InvalidOption(f"PostgreSQL at {self.describe()} refused the login ({reason}); check the "
                                           "user and password (in the URL or PGPASSWORD)") from None
            raise errors.Unavailable(f"cannot reach PostgreSQL at {self.describe()}: {reason}") from None
        with self.conn.cursor() as cur:
            cur.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
            row = cur.fetchone()
            if row is None and reading:
                raise errors.InvalidOption(f"--reuse: {self.describe()} has no pgvector extension: no table of "
                                           "embedq index to read")
            if row is None:
                try:
                    cur.execute("CREATE EXTENSION IF NOT EXISTS vector")
                    self.conn.commit()
                except psycopg.Error as exc:
                    self.conn.rollback()
                    raise errors.OutputUnsupported(names.missing_extension(self.describe(), exc)) from None
                cur.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
                row = cur.fetchone()
            self.version = names.version_of(row[0])
        self.conn.commit()

    def refused_shapes(self) -> dict[str, str]:
        """The column shapes this server cannot store, and why (``IndexKind.fit``)."""
        refused = {"ragged": "pgvector has no multi-vector column an index can use (write it to Parquet or LanceDB)"}
        if self.version < (0, 7):
            refused["sparse"] = (f"sparse vectors need pgvector >= 0.7 (sparsevec); this server has pgvector "
                                 f"{'.'.join(map(str, self.version))}: upgrade the extension, or write Parquet")
        return refused

    def _plan_check(self) -> None:
        """The kind's columns against what this server's pgvector stores (before any text is embedded)."""
        have = ".".join(map(str, self.version))
        # a column shape this server cannot store (or an --outputs naming one) is refused here (IndexKind.fit)
        index_kind(self.config.kind, self.format).fit(self.config.outputs, self.refused_shapes(), "PostgreSQL")
        if self.config.vector_dtype == "float16" and self.version < (0, 7):
            raise errors.InvalidOption(f"--vector-dtype float16 needs pgvector >= 0.7 (halfvec); this server has "
                                       f"pgvector {have}")
        if self.config.ann_index and self.version < (0, 5):
            raise errors.InvalidOption(f"--build-index builds an HNSW index, which needs pgvector >= 0.5; this server "
                                       f"has pgvector {have}")

    def _load_manifest(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s)", (self.ident().as_string(self.conn),))
            exists = cur.fetchone()[0] is not None
            cur.execute("SELECT to_regclass(%s)", (MANIFEST_TABLE,))
            if cur.fetchone()[0] is not None:
                cur.execute(f"SELECT manifest FROM {MANIFEST_TABLE} WHERE name = %s", (self.table,))
                row = cur.fetchone()
                self.manifest = Manifest.model_validate(row[0]) if row and exists else None
            if exists and self.manifest is None and not self.config.overwrite:  # --overwrite drops it in open()
                cur.execute(self._sql("SELECT EXISTS (SELECT 1 FROM {t})"))
                if cur.fetchone()[0]:
                    raise errors.OutputMismatch(
                        f"table {self.table} at {self.describe()} holds rows that embedq index did not write (no "
                        f"record in {MANIFEST_TABLE}); choose another table")
        self.conn.commit()
        self.table_exists = exists

    def _sql(self, query: str, **idents: Any) -> Any:
        from psycopg import sql

        return sql.SQL(query).format(t=self.ident(), **idents)

    def lock(self) -> Target:
        return self

    def __enter__(self) -> Target:
        self.check()
        with self.conn.cursor() as cur:
            cur.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (f"embedq index {self.table}",))
            got = cur.fetchone()[0]
        self.conn.commit()
        if not got:
            raise errors.InvalidOption(f"another embedq index is writing table {self.table} at {self.describe()}; "
                                       "wait for it or stop it first")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()  # the advisory lock and any uncommitted transaction go with the session
            self.conn = None
            self._checked = False

    def exists(self) -> bool:
        return self.table_exists

    def open(self, *, vector_dtype: Any, options: dict[str, Any], shard_rows: int, overwrite: bool) -> PgvectorSink:
        self.check()
        if overwrite and (self.table_exists or self.manifest is not None):
            with self.conn.cursor() as cur:
                cur.execute(self._sql("DROP TABLE IF EXISTS {t}"))
                if self.manifest is not None:
                    cur.execute(f"DELETE FROM {MANIFEST_TABLE} WHERE name = %s", (self.table,))
            self.conn.commit()
            self.manifest, self.table_exists = None, False
        manifest = resume_or_start(self.manifest, format=self.format, vector_dtype=vector_dtype, options=options,
                                   where=f"table {self.table} at {self.describe()}", container="table")
        sink = PgvectorSink(self, manifest)
        sink.load_committed()
        return sink

    def open_reader(self, *, vector_dtype: Any, options: dict[str, Any]) -> PgvectorSink:
        """``--reuse``: the table opened read-only (its session too: ``read_only``), its manifest checked
        (``check_reusable``), its ids and content hashes loaded; no lock. Its sink's ``close`` closes the session."""
        psycopg = _psycopg()
        where = f"table {self.table} at {self.describe()}"
        try:
            self._connect(reading=True)
            self.conn.read_only = True  # a reader writes nothing, whatever a bug would try
            self._load_manifest()
            manifest = manifests.check_reusable(self.manifest, vector_dtype=vector_dtype, options=options,
                                                where=where, container="table")
            sink = PgvectorSink(self, manifest, reader=True)
            sink.load_committed()
        except psycopg.OperationalError as exc:
            self.close()
            raise errors.Unavailable(f"{self.describe()}: {names.first_line(exc)}") from None
        except psycopg.Error as exc:
            self.close()
            raise errors.InvalidOption(f"{self.describe()}: {names.first_line(exc)}") from None
        except BaseException:
            self.close()
            raise
        return sink

    def build_index(self) -> tuple[str, float]:
        """HNSW on every vector column (after the load); returns what was built and the seconds it took."""
        ops_of = {"vector": "vector_cosine_ops", "halfvec": "halfvec_cosine_ops", "sparsevec": "sparsevec_ip_ops"}
        cols = [(name, ops_of[pgtype.split("(")[0]]) for name, pgtype in self.columns()
                if pgtype.split("(")[0] in ops_of]
        built = []
        t0 = time.perf_counter()
        with self.conn.cursor() as cur:
            for name, ops in cols:
                index = names.index_name(self.name, name)
                from psycopg import sql

                cur.execute(self._sql("CREATE INDEX IF NOT EXISTS {i} ON {t} USING hnsw ({c} " + ops + ")",
                                      i=sql.Identifier(index), c=sql.Identifier(name)))
                built.append(f"hnsw {index} ({name} {ops})")
        self.conn.commit()
        return "; ".join(built), time.perf_counter() - t0

    def columns(self) -> list[tuple[str, str]]:
        """The table's columns as (name, type with its modifier: ``vector(384)``), in order."""
        with self.conn.cursor() as cur:
            cur.execute("SELECT attname, format_type(atttypid, atttypmod), attnotnull AND NOT atthasdef "
                        "FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped "
                        "ORDER BY attnum", (self.ident().as_string(self.conn),))
            rows = cur.fetchall()
        self._required = {name for name, _, required in rows if required}
        return [(name, pgtype) for name, pgtype, _ in rows]


class PgvectorSink(contract.Sink):
    """Rows into a PostgreSQL table, committed with the manifest in one transaction (see the module's docstring); or,
    opened by :meth:`Target.open_reader` (``reader``), an existing table read back for ``--reuse``."""

    arrow_columns = False  # the kind's columns as numpy arrays, mapped by shape in _plan
    container = "table"
    stores_hashes = True

    def __init__(self, target: Target, manifest: Manifest, *, reader: bool = False) -> None:
        existing = target.columns() if target.table_exists else []
        # an existing table (an adopted empty one too): one probe first checks its vector column's dimension before
        # any text is embedded
        super().__init__(Ledger(manifest), where=f"table {target.table} at {target.describe()}",
                         probe_first=bool(existing))
        self.target = target
        self.conn = target.conn
        self.cols: list[rows.Col] | None = None
        self.keys = rows.WINDOW_COLS if per_window(manifest.options) else []  # after id (windowed.py)
        self.broken = False  # a write failed: its transaction was rolled back, so nothing is committed any more
        self.existing = existing
        self.reader = reader
        #: an empty table without embedq's record, taken as it is: it gets the content-hash column with its first rows
        self.adopted = bool(existing) and target.manifest is None

    def load_committed(self) -> None:
        """The ids the table holds (with their content hashes where it keeps them), and their count as the
        manifest's rows (the manifest row commits with them)."""
        if not self.existing:
            return
        keeps = self.ledger.keeps_hashes
        if keeps and rows.HASH_COLUMN[0] not in dict(self.existing):  # its record says it has one: altered since
            raise errors.OutputMismatch(f"{self.where} has another schema: no column content_hash (bytea), which its "
                                        "record says it has. Write to another table, or pass --overwrite")
        with self.conn.cursor(name="embedq_ids", binary=True) as cur:
            cur.itersize = 50_000
            cur.execute(self.target._sql("SELECT id, {h}, {w} FROM {t}", h=rows.ident("content_hash") if keeps else
                                         rows.sql_null(), w=rows.ident("window") if self.keys else rows.sql_null()))
            self.ledger.take_rows(cur, where=self.where, container="table", windowed=bool(self.keys))
        self.conn.commit()

    # -- Sink's contract ---------------------------------------------------------------------------
    def accept(self, fingerprint: Fingerprint) -> None:
        check_space(self.manifest.fingerprint, fingerprint, where=self.where, container="table")
        plain = index_kind(self.target.config.kind, self.target.format).columns is None  # the dense ``vector`` path
        if self.existing and self.cols is None and plain:
            want = [("id", "text"), *self._key_types(), ("embedding", self._vector_type(fingerprint.dimensions))]
            self._compare(want + ([("text", "text")] if self.target.config.store_text else []) + self._hash_col())
        self.manifest.fingerprint = fingerprint

    def _key_types(self) -> list[tuple[str, str]]:
        return [(c.name, c.pgtype) for c in self.keys]

    def _vector_type(self, dim: int) -> str:
        return f"{'halfvec' if self.manifest.vector_dtype == 'float16' else 'vector'}({dim})"

    def _hash_col(self) -> list[tuple[str, str]]:
        """The content-hash column where the table must have it already (an adopted table gets it: :meth:`_plan`)."""
        return [rows.HASH_COLUMN] if self.ledger.keeps_hashes and not self.adopted else []

    def _compare(self, want: list[tuple[str, str]]) -> None:
        problems = rows.schema_problems(dict(self.existing), want, self.target._required)
        if problems:
            raise errors.OutputMismatch(f"{self.where} has another schema: {'; '.join(problems)}. Write to another "
                                        "table, or pass --overwrite to replace it")

    def _plan(self, ids: list[str], data: Any, texts: list[str] | None) -> None:
        self.cols = rows.plan_columns(data, self.manifest.vector_dtype, self.where)
        want = [("id", "text"), *self._key_types()] + [(c.name, c.pgtype) for c in self.cols]
        if texts is not None:
            want.append(("text", "text"))
        hashed = self.ledger.keeps_hashes
        if self.existing:
            self._compare(want + self._hash_col())
            if hashed and self.adopted and rows.HASH_COLUMN[0] not in dict(self.existing):
                self._create(["ALTER TABLE {t} ADD COLUMN content_hash bytea", _HASH_INDEX])
                self.existing = [*self.existing, rows.HASH_COLUMN]
            return
        from psycopg import sql

        want += [rows.HASH_COLUMN] if hashed else []
        body = sql.SQL(", ").join(sql.SQL("{} " + t).format(sql.Identifier(n)) for n, t in want[1:])
        key = "PRIMARY KEY (id, \"window\")" if self.keys else "PRIMARY KEY (id)"  # windowed.py: (id, window)
        self._create([f"CREATE TABLE {{t}} (id text, {{body}}, {key})"] + ([_HASH_INDEX] if hashed else []), body=body)
        self.existing = want

    def _create(self, statements: list[str], **parts: Any) -> None:
        """DDL in the first commit's transaction (the table, its content-hash column and index)."""
        hash_index = rows.ident(names.index_name(self.target.name, rows.HASH_COLUMN[0], "btree"))
        try:
            with self.conn.cursor() as cur:
                for statement in statements:
                    cur.execute(self.target._sql(statement, i=hash_index, **parts))
        except _psycopg().Error as exc:  # checked before the run; a change since (a schema dropped) is named
            self.conn.rollback()
            self.broken = True
            raise errors.InvalidOption(f"creating {self.where} failed: {names.first_line(exc)}") from None

    def write(self, ids: list[str], data: Any, texts: list[str] | None = None,
              hashes: list[bytes] | None = None, windows: WindowRows | None = None) -> contract.Refused:
        self._writable()
        if self.cols is None:
            self._plan(ids, data, texts)
        assert self.cols is not None
        keeps = self.ledger.keeps_hashes
        assert hashes is not None or not keeps, "an output that keeps content hashes is written with them"
        if isinstance(data, np.ndarray):
            fields = [self.cols[0].encode(data)]
        else:
            fields = [col.encode(arrays[0] if col.pgtype.startswith(("vector", "halfvec")) else arrays)
                      for col, (_, arrays, _) in zip(self.cols, data)]
        if self.keys:  # a windows table: window, start, end after id
            assert windows is not None, "a windows table is written with the rows' window columns"
            fields = [c.encode(windows.columns()[c.name]) for c in self.keys] + fields
        cols = rows.idents(rows.copy_columns(self.keys + self.cols, texts is not None, keeps))
        # an id committed before this run is replaced: its old rows deleted in the transaction that adds the new ones
        replaced = list(dict.fromkeys(doc_id for doc_id in ids if digest(doc_id) in self.ledger.committed))
        try:
            with self.conn.cursor() as cur:
                gone = rows.delete_ids(cur, self.target._sql(_DELETE), replaced)
                with cur.copy(self.target._sql("COPY {t} ({cols}) FROM STDIN WITH (FORMAT BINARY)", cols=cols)) as cp:
                    cp.write(rows.copy_rows(ids, fields, texts, hashes if keeps else None))
        except _psycopg().Error as exc:
            self._failed("writing to", exc)
        self.ledger.pending_rows += len(ids) - gone
        return []

    def _writable(self) -> None:
        if self.reader:
            raise errors.InvalidOption(f"{self.where} is opened to read rows back (--reuse), not to write")

    def _failed(self, doing: str, exc: Exception) -> None:
        self.conn.rollback()  # the rows since the last commit are gone: nothing more is committed by this run
        self.broken = True
        raise errors.Unavailable(f"{doing} {self.where} failed: {str(exc).strip()}; run again to continue from the "
                                 "last commit") from None

    def prune(self, keep: IdSet) -> int:
        """Delete the committed rows whose id is not in ``keep`` (in the open transaction: durable at the next
        commit); returns how many."""
        self._writable()
        committed = self.ledger.committed
        if not self.existing or not len(committed):
            return 0
        try:
            with self.conn.cursor(name="embedq_prune") as cur:
                cur.itersize = 50_000
                cur.execute(self.target._sql("SELECT id FROM {t}"))
                drop = list(dict.fromkeys(doc_id for (doc_id,) in cur
                                          if (key := digest(doc_id)) in committed and key not in keep))
            with self.conn.cursor() as cur:
                gone = rows.delete_ids(cur, self.target._sql(_DELETE), drop)  # a windows table: every window
        except _psycopg().Error as exc:
            self._failed("pruning", exc)
        self.ledger.pending_rows -= gone
        return len(drop)

    def rows_by_hash(self, hashes: list[bytes]) -> tuple[list[bytes], Any]:
        """Rows of these content hashes (one per hash found, by the btree index), read back in binary: as
        :meth:`write` takes them (the plain kind's matrix; other kinds' columns), the stored values exactly."""
        have = dict(self.existing)
        if not self.ledger.keeps_hashes or rows.HASH_COLUMN[0] not in have or not hashes or self.broken:
            return [], None
        shape = rows.readback(index_kind(self.target.config.kind, self.target.format).columns, have)
        if shape is None:
            return [], None
        query = self.target._sql("SELECT content_hash, {cols} FROM {t} WHERE content_hash = ANY(%s)",
                                 cols=rows.idents([name for name, _, _ in shape]))
        order, found = rows.by_hash(self.conn, query, hashes)
        if self.reader:
            self.conn.commit()  # a writer's transaction stays open: its rows commit at its next commit
        return (order, rows.assemble(shape, found)) if order else ([], None)

    def flush(self) -> None:
        """Nothing: COPY sent the rows in the commit's transaction, which :meth:`save_manifest` commits with the
        manifest row."""

    def save_manifest(self) -> None:
        if self.reader or self.manifest.fingerprint is None or not self.existing or self.broken:
            return  # nothing written: no table, no record
        self.manifest.updated = utc_now()
        psycopg = _psycopg()
        try:
            with self.conn.cursor() as cur:
                cur.execute(f"CREATE TABLE IF NOT EXISTS {MANIFEST_TABLE} (name text PRIMARY KEY, manifest jsonb "
                            "NOT NULL, updated timestamptz NOT NULL DEFAULT now())")
                cur.execute(f"INSERT INTO {MANIFEST_TABLE} (name, manifest) VALUES (%s, %s) ON CONFLICT (name) DO "
                            "UPDATE SET manifest = excluded.manifest, updated = now()",
                            (self.target.table, psycopg.types.json.Jsonb(self.manifest.model_dump(mode="json"))))
            self.conn.commit()
        except psycopg.Error as exc:
            raise errors.Unavailable(f"committing to {self.where} failed: {str(exc).strip()}; run again to continue "
                                     "from the last commit") from None

    def close(self) -> None:
        """Uncommitted rows are rolled back (the target keeps the connection: its lock, the ANN index); a reader's
        connection is closed."""
        if self.conn is not None and not self.conn.closed:
            self.conn.rollback()
        if self.reader:
            self.target.close()


_HASH_INDEX = "CREATE INDEX {i} ON {t} (content_hash)"
_DELETE = "DELETE FROM {t} WHERE id = ANY(%s)"
