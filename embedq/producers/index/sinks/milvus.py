"""``embedq index -o milvus://host:19530?collection=docs``: a Milvus collection (``pymilvus``'s ``MilvusClient``).

Two URL forms (``collection`` is embedq's parameter, required):

* ``milvus://[user[:password]@]host[:port][/database]?collection=NAME[&secure=true]``: a Milvus server (port 19530
  by default; ``secure=true``: TLS). The credentials come from the URL, else from ``MILVUS_TOKEN`` (``user:password``
  or an API key) or ``MILVUS_USER`` / ``MILVUS_PASSWORD``; every message shows the URL with ``***``.
* ``milvus:///absolute/path/file.db?collection=NAME``: Milvus Lite's local database (the ``milvus``
  extra brings it; the file's folder must exist), no server.

**The collection** is created by the first commit: ``id`` (``VARCHAR`` primary key), ``content_hash`` (``VARCHAR(32)``:
each row's content hash in hex, Milvus has no binary scalar; an ``INVERTED`` index on it; absent from a collection
made before content hashes or adopted without it, continued by id alone), then one field per output of the
kind, by its shape (``embedq/kinds.py`` :class:`~embedq.kinds.Column`; no kind is named here): ``dense`` ->
``FLOAT_VECTOR(dim)``, named ``vector`` for the plain ``embed`` kind (Milvus's default vector field) and by the
column's name otherwise; ``sparse`` -> ``SPARSE_FLOAT_VECTOR`` (``lexical`` for BGE-M3, ``sparse`` for a SPLADE
kind), so one collection serves a hybrid search; ``scalar`` -> ``DOUBLE``; ``ragged`` (a list of vectors per text:
``--kind multi``, BGE-M3's ColBERT) has no Milvus field of that shape: ``--kind multi`` is refused, ``--kind bge-m3``
writes dense + lexical and says that ColBERT is left out (asking for it with ``--outputs`` is refused).
``--store-text`` adds ``text`` (``VARCHAR``). Vectors are float32 (``--vector-dtype float16`` is refused: Milvus
Lite has no ``FLOAT16_VECTOR``). An existing collection without embedq's record is used only when it is empty and
its fields are exactly these; otherwise it is refused before anything is embedded. ``--long-inputs windows``
(``windowed.py``): ``key`` (``id#window``, the primary key), ``id``, ``window``, ``start``, ``end`` and ``windows`` (the
document's window count) first (``milvus_rows.py``).

**The record** (format, options, embedding-space fingerprint, row count, runs) is the collection's property
``embedq.manifest``: set when the collection is created, before any row, and updated after each commit. It is read
and compared before anything is embedded, and the fingerprint against the workers' one-text probe before anything
is written.

**Commits**: rows are buffered and sent at each checkpoint by ``upsert`` (a re-sent id replaces its row: Milvus does
not enforce a primary key on ``insert``), then the row count is checked (``count(*)``, strong consistency: the count
before plus the batch, or the run stops: another writer) and the record updated. A run killed mid-commit leaves
whole rows of that commit (each row is all its fields or absent); the next run reads the ids the collection holds and
embeds the rest (a windows collection: a document only some of whose windows are there is deleted first, and
embedded again; an edited one's old windows are deleted before its new ones are sent). Re-indexing: the upsert
replaces an id written again (never twice); ``--prune`` deletes at once; ``rows_by_hash`` (and ``--reuse``:
``open_reader``, no lock, nothing written) reads the plain kind's vectors back by ``content_hash in [...]`` (a kind's
fields are not read back: their texts are embedded again). ``milvus_rows.py``
makes the rows and reads them. A row Milvus cannot take is that record's error (errors file), not the run's: an
empty sparse vector (Milvus refuses one), an id or text over ``VARCHAR``'s 65,535 bytes. One writer per collection:
an ``flock`` beside a Milvus Lite file, or in the temp folder for a server (writers on other machines are caught by
the count check).

**Indexes**: Milvus loads (and so queries, and lists the ids to resume from) only a collection whose vector fields
are indexed, so the collection is created with exact ones: ``FLAT`` (cosine) on dense fields and
``SPARSE_INVERTED_INDEX`` (inner product: SPLADE and BGE-M3's lexical weights score by it) on sparse ones.
``--build-index`` replaces each dense field's index by HNSW (cosine, M=16, efConstruction=200) after the load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import numpy as np

from embedq import errors
from embedq.producers.index import idset
from embedq.producers.index.kinds import index_kind
from embedq.producers.index.sinks import contract, milvus_rows
from embedq.producers.index.sinks.locks import OutputLock
from embedq.producers.index.sinks.manifests import (
    Ledger,
    Manifest,
    check_reusable,
    check_space,
    resume_or_start,
    utc_now,
)
from embedq.producers.index.sinks.milvus_rows import HASH, MAX_VARCHAR, WORK_TIMEOUT, reason
from embedq.producers.index.sinks.urls import database_errors_path, mask_url, split_param
from embedq.producers.index.windowed import WindowRows, per_window
from embedq.protocol import Fingerprint

MANIFEST_KEY = "embedq.manifest"
CONNECT_TIMEOUT = 10.0  # seconds to reach the server (and the default of quick calls: describe, has_collection)
ROWS_PER_REQUEST = 2_000  # rows per upsert (a gRPC message stays far under Milvus's 64 MiB)
ROWS_PER_FLUSH = 65_536  # rows buffered before they are sent even between checkpoints (bounds this process's memory)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,254}$")  # Milvus's collection names
_AUTH = re.compile(r"auth|credential|password|token|unauthenticated|permission", re.I)
REFUSED = {"ragged": "Milvus has no field for a list of vectors per text (ColBERT's, --kind multi's); write it to "
                     "LanceDB or Parquet"}


def _pymilvus() -> Any:
    import pymilvus

    logging.getLogger("pymilvus").setLevel(logging.CRITICAL)  # its RPC errors become embedq's own, said once
    return pymilvus


class Target(contract.Target):
    """A Milvus collection as an ``embedq index`` output (see the module's docstring)."""

    format = "milvus"
    builds_index = True  # --build-index (build_index)
    stores_text = True  # --store-text
    stores_windows = True  # --long-inputs windows: key (id#window), id, window, start, end, windows (milvus_rows.py)

    def __init__(self, url: str, config: Any) -> None:
        self.url = url
        rest, collection = split_param(url, "collection")
        if not collection:
            raise errors.InvalidOption(f"{mask_url(url)} names no collection: add ?collection=NAME")
        if not _NAME.match(collection):
            raise errors.InvalidOption(f"{mask_url(url)}: a Milvus collection name has letters, digits and _, and "
                                       "starts with a letter or _")
        parts = urlsplit(rest)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        secure = query.pop("secure", "false").lower() in ("1", "true", "yes")
        if query:
            raise errors.InvalidOption(f"{mask_url(url)}: a milvus:// output takes only ?collection= and ?secure= "
                                       f"(not {', '.join(sorted(query))})")
        self.collection = collection
        self.config = config
        self.lite = parts.netloc in ("", "localhost") and parts.path.startswith("/") and parts.path.endswith(".db")
        if self.lite:
            self.path = Path(unquote(parts.path))
            self.connect = {"uri": str(self.path)}
        elif not parts.hostname:
            raise errors.InvalidOption(f"{mask_url(url)}: use milvus://host:19530?collection=NAME for a server, or "
                                       "milvus:///absolute/path/file.db?collection=NAME for Milvus Lite's file")
        else:
            scheme = "https" if secure else "http"
            db = unquote(parts.path.strip("/"))
            self.connect = {"uri": f"{scheme}://{parts.hostname}:{parts.port or 19530}", **({"db_name": db} if db
                                                                                         else {})}
            user = unquote(parts.username or "") or os.environ.get("MILVUS_USER", "")
            password = unquote(parts.password or "") if parts.password is not None else \
                os.environ.get("MILVUS_PASSWORD", "")
            token = f"{user}:{password}" if user else os.environ.get("MILVUS_TOKEN", "")
            if token:
                self.connect["token"] = token
        self.client: Any = None
        self.manifest: Manifest | None = None
        self.fields: dict[str, Any] | None = None  # an existing collection's fields: name -> (type, dim)
        self._checked = False

    # -- what the runner asks ----------------------------------------------------------------------
    def describe(self) -> str:
        return mask_url(self.url)

    def where(self) -> str:
        return f"collection {self.collection} at {self.describe()}"

    def default_errors_path(self) -> Path:
        return database_errors_path(self.collection, self.describe())

    def refused_shapes(self) -> dict[str, str]:
        return REFUSED

    def check(self) -> None:
        """Connect, check the options and an existing collection (embedq's, or empty). Nothing is written."""
        if self._checked:
            return
        if self.config.vector_dtype == "float16":
            raise errors.InvalidOption("--vector-dtype float16: the Milvus sink writes FLOAT_VECTOR (float32) fields "
                                       "(Milvus Lite has no FLOAT16_VECTOR)")
        index_kind(self.config.kind, self.format).fit(self.config.outputs, REFUSED, "Milvus")
        if self.lite and not self.path.parent.is_dir():
            raise errors.InvalidOption(f"cannot write the Milvus Lite database {self.path}: its folder "
                                       f"{self.path.parent} does not exist")
        self._connect()
        self.manifest, self.fields = None, None
        if self.client.has_collection(self.collection):
            self._describe()
            if self.manifest is None and not self.config.overwrite and self.count():
                raise errors.OutputMismatch(f"{self.where()} holds rows that embedq index did not write (no "
                                            f"{MANIFEST_KEY} property); choose another collection")
        self._checked = True

    def _describe(self) -> None:
        """An existing collection's fields and record."""
        info = self.client.describe_collection(self.collection)
        self.fields = {f["name"]: (f["type"], (f.get("params") or {}).get("dim")) for f in info["fields"]}
        raw = (info.get("properties") or {}).get(MANIFEST_KEY)
        if raw is not None:
            try:
                self.manifest = Manifest.model_validate_json(raw)
            except ValueError as exc:
                raise errors.InvalidOption(f"{self.where()}: its {MANIFEST_KEY} is not a readable embedq record "
                                           f"({exc}); pass --overwrite to start afresh") from None

    def open_reader(self, *, vector_dtype: Any, options: dict[str, Any]) -> MilvusSink:
        """``--reuse``: the collection opened to read rows back by content hash; nothing is created, written or
        locked (a Milvus Lite file's folder is not made)."""
        if self.lite and not self.path.is_file():
            raise errors.InvalidOption(f"--reuse: {self.where()} does not exist")
        self._connect()
        if not self.client.has_collection(self.collection):
            raise errors.InvalidOption(f"--reuse: {self.where()} does not exist")
        self._describe()
        manifest = check_reusable(self.manifest, vector_dtype=vector_dtype, options=options, where=self.where(),
                                  container="collection")
        sink = MilvusSink(self, manifest, reader=True)
        sink.load_committed()
        return sink

    def _connect(self) -> None:
        if self.client is not None:
            return
        pymilvus = _pymilvus()
        try:
            self.client = pymilvus.MilvusClient(**self.connect, timeout=CONNECT_TIMEOUT)
        except Exception as exc:  # pymilvus raises MilvusException, grpc's errors and plain ones alike
            why = reason(exc)
            if not self.lite and _AUTH.search(why):
                raise errors.InvalidOption(f"Milvus at {self.describe()} refused the login ({why}); check the "
                                           "user and password (in the URL, MILVUS_TOKEN or MILVUS_USER / "
                                           "MILVUS_PASSWORD)") from None
            what = f"open the Milvus Lite database {self.path}" if self.lite else f"reach Milvus at {self.describe()}"
            raise errors.Unavailable(f"cannot {what}: {why}") from None

    def count(self) -> int:
        """The rows the collection holds now (strong consistency: every acknowledged write)."""
        rows = self.client.query(self.collection, filter="", output_fields=["count(*)"], consistency_level="Strong",
                                 timeout=WORK_TIMEOUT)
        return int(rows[0]["count(*)"])

    def lock(self) -> OutputLock:
        if self.lite:
            return OutputLock(self.path.with_name(f"{self.path.name}.{self.collection}"), self.where())
        key = hashlib.sha256(f"{self.connect['uri']} {self.connect.get('db_name', '')}".encode()).hexdigest()[:16]
        return OutputLock(Path(tempfile.gettempdir()) / f"embedq-milvus-{key}.{self.collection}", self.where())

    def exists(self) -> bool:
        return self.fields is not None

    def open(self, *, vector_dtype: Any, options: dict[str, Any], shard_rows: int, overwrite: bool) -> MilvusSink:
        self._checked = False  # read again under the lock
        self.check()
        if overwrite and self.fields is not None:
            self.client.drop_collection(self.collection, timeout=WORK_TIMEOUT)
            self.manifest, self.fields = None, None
        manifest = resume_or_start(self.manifest, format=self.format, vector_dtype=vector_dtype, options=options,
                                   where=self.where(), container="collection")
        sink = MilvusSink(self, manifest)
        sink.load_committed()
        return sink

    def build_index(self) -> tuple[str, float]:
        """HNSW (cosine) on every dense field, replacing the exact FLAT one, after the load."""
        pymilvus = _pymilvus()
        if self.fields is None:
            return "none (no collection)", 0.0
        dense = [name for name, (ftype, _) in self.fields.items() if ftype == pymilvus.DataType.FLOAT_VECTOR]
        t0 = time.perf_counter()
        self.client.release_collection(self.collection, timeout=WORK_TIMEOUT)
        params = self.client.prepare_index_params()
        for name in dense:
            self.client.drop_index(self.collection, index_name=name, timeout=WORK_TIMEOUT)
            params.add_index(field_name=name, index_name=name, index_type="HNSW", metric_type="COSINE",
                             params={"M": 16, "efConstruction": 200})
        self.client.create_index(self.collection, params, timeout=WORK_TIMEOUT)
        self.client.load_collection(self.collection, timeout=WORK_TIMEOUT)
        built = [f"HNSW {name} (COSINE, M=16, efConstruction=200)" for name in dense]
        return "; ".join(built) or "none (no dense field)", time.perf_counter() - t0


class MilvusSink(contract.Sink):
    """Rows upserted into a Milvus collection at each commit, the record in its properties (the module's
    docstring)."""

    arrow_columns = False  # the kind's columns as numpy arrays, mapped by shape
    container = "collection"
    stores_hashes = True

    def __init__(self, target: Target, manifest: Manifest, *, reader: bool = False) -> None:
        adopted = target.fields is not None and target.manifest is None  # an empty collection of someone else's
        # its vector field checked against the space before any text is embedded
        super().__init__(Ledger(manifest), where=target.where(), probe_first=adopted)
        self.target = target
        self.client = target.client
        self.adopted = adopted
        self.reader = reader  # opened by ``--reuse``: read back, never written
        self.schema: milvus_rows.Plan | None = None  # (field, DataType, dim) this run writes
        self._rows: list[dict[str, Any]] = []
        self._new = 0  # of the buffered rows, those of ids the collection does not hold
        self._count = 0  # rows the collection holds (committed)
        self.windowed = per_window(manifest.options)  # one row per window (windowed.py)
        self._dropping: list[str] = []  # windowed: edited documents whose old windows go before the new ones come

    def load_committed(self) -> None:
        if self.target.fields is None:
            return
        try:
            # Milvus answers queries on a loaded collection only
            self.client.load_collection(self.target.collection, timeout=WORK_TIMEOUT)
        except Exception as exc:
            raise errors.Unavailable(f"cannot load {self.where} ({reason(exc)}): Milvus loads a collection whose "
                                     "vector fields are indexed") from None
        hashes = self.ledger.keeps_hashes
        if hashes and HASH not in self.target.fields:
            raise errors.OutputMismatch(f"{self.where} has no {HASH} field, though its record keeps content hashes "
                                        "(changed outside embedq index); pass --overwrite to start afresh")
        if self.windowed:  # a document a killed run left a part of is deleted: embedded again
            rows, partial = milvus_rows.windows_committed(self.client, self.target.collection, hashes)
            if partial and not self.reader:
                milvus_rows.delete(self.client, self.target.collection, partial)
        else:
            rows = ((doc_id, h, None) for doc_id, h in milvus_rows.committed(self.client, self.target.collection,
                                                                             hashes))  # type: ignore[assignment]
        self._count = self.ledger.take_rows(rows, where=self.where, container="collection", windowed=self.windowed)

    # -- Sink's contract ---------------------------------------------------------------------------
    def accept(self, fingerprint: Fingerprint) -> None:
        check_space(self.manifest.fingerprint, fingerprint, where=self.where, container="collection")
        plain = index_kind(self.target.config.kind, self.target.format).columns is None  # the dense ``vector`` path
        if self.adopted and self.schema is None and plain:
            self._compare(self._plan_dense(fingerprint.dimensions))  # a kind's fields: at its first write
        self.manifest.fingerprint = fingerprint

    def _plan_dense(self, dim: int) -> milvus_rows.Plan:
        dtype = _pymilvus().DataType
        return self._with_text([*self._keys(), ("vector", dtype.FLOAT_VECTOR, dim)])

    def _keys(self) -> milvus_rows.Plan:
        return milvus_rows.key_fields(_pymilvus().DataType, hashes=self.ledger.keeps_hashes, windowed=self.windowed)

    def _with_text(self, fields: milvus_rows.Plan) -> milvus_rows.Plan:
        return fields + ([("text", _pymilvus().DataType.VARCHAR, None)] if self.target.config.store_text else [])

    def _plan(self, data: Any) -> milvus_rows.Plan:
        """The fields this run writes, from its first result."""
        if isinstance(data, np.ndarray):
            return self._plan_dense(int(data.shape[1]))
        return self._with_text(self._keys() + milvus_rows.kind_fields(_pymilvus().DataType, data))

    def _compare(self, want: milvus_rows.Plan) -> None:
        have = self.target.fields or {}
        if HASH not in have and any(w[0] == HASH for w in want):
            # an adopted empty collection made without it (Milvus Lite cannot add a field): continued by id alone
            self.manifest.content_hash = None
            want = [w for w in want if w[0] != HASH]
        problems = []
        for name, ftype, dim in want:
            if name not in have:
                problems.append(f"no field {name} ({ftype.name})")
            elif have[name][0] != ftype or (dim is not None and int(have[name][1] or 0) != dim):
                got = have[name][0].name + (f"({have[name][1]})" if have[name][1] else "")
                problems.append(f"{name} is {got}, this run writes {ftype.name}" + (f"({dim})" if dim else ""))
        problems += [f"field {name} is not written by this run" for name in have if name not in {w[0] for w in want}]
        if problems:
            raise errors.OutputMismatch(f"{self.where} has another schema: {'; '.join(problems)}. Write to another "
                                        "collection, or pass --overwrite to replace it")

    def write(self, ids: list[str], data: Any, texts: list[str] | None = None,
              hashes: list[bytes] | None = None, windows: WindowRows | None = None) -> contract.Refused:
        """Buffer the rows; returns those Milvus cannot take, each with its error (they are not written; a document's
        windows: all of them). An id committed before this run replaces its row (``upsert`` on the primary key; a
        document: its old windows deleted at the send, before its new ones)."""
        if self.reader:
            raise errors.InvalidOption(f"--reuse: {self.where} is opened to read rows back, not to write")
        if self.schema is None:
            self.schema = self._plan(data)
            if self.adopted:
                self._compare(self.schema)
            if not self.ledger.keeps_hashes:  # an adopted collection without the field (_compare)
                self.schema = [f for f in self.schema if f[0] != HASH]
        if self.ledger.keeps_hashes and hashes is None:
            raise ValueError(f"{self.where} keeps content hashes: write needs each row's")
        rows = milvus_rows.to_rows(self.schema, ids, data, texts, hashes if self.ledger.keeps_hashes else None,
                                   windows if self.windowed else None)
        refused = [(row["id"], errors.InvalidRecord(f"{self.where} cannot store this record: {why}"))
                   for row in rows if (why := milvus_rows.refuse(row)) is not None]
        bad = {doc_id for doc_id, _ in refused}
        kept = [row for row in rows if row["id"] not in bad]
        self._rows += kept
        new = sum(idset.digest(row["id"]) not in self.committed for row in kept) if len(self.committed) else len(kept)
        if self.windowed and new < len(kept):  # edited documents: every old window goes first (_send)
            self._dropping += dict.fromkeys(r["id"] for r in kept if idset.digest(r["id"]) in self.committed)
            new = len(kept)
        self._new += new
        self.ledger.pending_rows += new  # a replaced row is counted once, before this run
        if len(self._rows) >= ROWS_PER_FLUSH:
            self._send()
        return refused

    def _create(self) -> None:
        """The collection with this run's fields, its exact indexes and the record, before any row."""
        assert self.schema is not None
        pymilvus = _pymilvus()
        schema = pymilvus.MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        params = pymilvus.MilvusClient.prepare_index_params()
        for name, ftype, dim in self.schema:
            kwargs: dict[str, Any] = {"is_primary": True} if name == self.schema[0][0] else {}
            if ftype == pymilvus.DataType.VARCHAR:
                kwargs["max_length"] = milvus_rows.HASH_LENGTH if name == HASH else MAX_VARCHAR
            if dim is not None:
                kwargs["dim"] = dim
            schema.add_field(name, ftype, **kwargs)
            if ftype == pymilvus.DataType.FLOAT_VECTOR:
                params.add_index(field_name=name, index_name=name, index_type="FLAT", metric_type="COSINE")
            elif ftype == pymilvus.DataType.SPARSE_FLOAT_VECTOR:
                params.add_index(field_name=name, index_name=name, index_type="SPARSE_INVERTED_INDEX",
                                 metric_type="IP")
            elif name == HASH:  # rows_by_hash a lookup
                params.add_index(field_name=name, index_name=name, index_type="INVERTED")
        self.manifest.updated = utc_now()
        record = self.ledger.record()
        self.client.create_collection(self.target.collection, schema=schema, index_params=params,
                                      properties={MANIFEST_KEY: record}, consistency_level="Strong",
                                      timeout=WORK_TIMEOUT)
        self.ledger.stored(record)
        info = self.client.describe_collection(self.target.collection)
        self.target.fields = {f["name"]: (f["type"], (f.get("params") or {}).get("dim")) for f in info["fields"]}

    def _send(self) -> None:
        """The buffered rows, upserted in requests of ROWS_PER_REQUEST, then the count checked."""
        if not self._rows:
            return
        n, new = len(self._rows), self._new
        try:
            if self.target.fields is None:
                self._create()
            elif self.adopted and self.target.manifest is None:  # the record before the rows: never rows without
                self.ledger.save(self._store_record, force=True)
                self.target.manifest = self.manifest
            if self._dropping:  # a kill from here to the upserts' end leaves those documents absent or partial
                milvus_rows.delete(self.client, self.target.collection, self._dropping)
                self._dropping, count = [], self.target.count()
                self.ledger.pending_rows -= self._count - count
                self._count = count
            for i in range(0, n, ROWS_PER_REQUEST):
                self.client.upsert(self.target.collection, self._rows[i:i + ROWS_PER_REQUEST], timeout=WORK_TIMEOUT)
            count = self.target.count()
        except errors.EmbedqError:
            raise
        except Exception as exc:  # pymilvus's MilvusException, grpc's RpcError
            raise errors.Unavailable(f"writing to {self.where} failed: {reason(exc)}; run again to continue from "
                                     "the last commit") from None
        self._rows, self._new = [], 0
        if count != self._count + new:
            raise errors.Unavailable(f"{self.where} holds {count} rows after adding {new} new of {n} to "
                                     f"{self._count}: another writer went around embedq's lock; stop it, then run "
                                     "again")
        self._count = count

    def flush(self) -> None:
        """At a commit: the rows since the last one (then :meth:`save_manifest`)."""
        self._send()

    def save_manifest(self) -> None:
        """The record into the collection's properties, when it changed (an RPC); none before the collection
        exists."""
        if self.target.fields is not None and not self.reader:
            self.ledger.save(self._store_record)

    def _store_record(self, record: str) -> None:
        try:
            self.client.alter_collection_properties(self.target.collection, properties={MANIFEST_KEY: record},
                                                    timeout=WORK_TIMEOUT)
        except Exception as exc:
            raise errors.Unavailable(f"committing to {self.where} failed: {reason(exc)}; run again to continue "
                                     "from the last commit") from None

    def prune(self, keep: idset.IdSet) -> int:
        """Delete the rows whose id is not in ``keep``, at once (Milvus has no transaction: a kill leaves the rest to
        the next ``--prune`` run); returns how many."""
        if self.target.fields is None or self.reader:
            return 0
        collection = self.target.collection
        try:
            gone = list(dict.fromkeys(doc_id for doc_id, _ in milvus_rows.committed(self.client, collection, False)
                                      if idset.digest(doc_id) not in keep))
            milvus_rows.delete(self.client, collection, gone)
            deleted = self._count - self.target.count()  # a windows collection: every window of those ids
        except Exception as exc:  # pymilvus's MilvusException, grpc's RpcError
            raise errors.Unavailable(f"pruning {self.where} failed: {reason(exc)}; run again to finish it") from None
        self._count -= deleted
        self.manifest.rows -= deleted
        return len(gone)

    def rows_by_hash(self, hashes: list[bytes]) -> tuple[list[bytes], Any]:
        """The rows of these content hashes the collection holds (one per hash, in the order asked), for the plain
        ``embed`` kind (a float32 matrix); a kind's fields are not read back (none found: the runner embeds them)."""
        plain = index_kind(self.manifest.options.get("kind", "embed"), self.target.format).columns is None
        if self.target.fields is None or not self.ledger.keeps_hashes or not plain or not hashes:
            return [], None
        try:
            return milvus_rows.by_hash(self.client, self.target.collection, hashes)
        except Exception as exc:
            raise errors.Unavailable(f"reading {self.where} failed: {reason(exc)}") from None

    def close(self) -> None:
        """Rows not sent yet are dropped (the next run embeds them again); the client stays the target's (the ANN
        index is built after the run), but a reader's is closed."""
        self._rows, self._new, self._dropping = [], 0, []
        if self.reader and self.target.client is not None:
            self.target.client.close()
            self.target.client = self.client = None
