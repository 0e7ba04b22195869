"""The record every ``embedq index`` output keeps beside its rows, and the check a run makes against it.

A :class:`Manifest` says how an output was made (format, vector dtype, embedding options, the embedding-space
fingerprint) and what it has committed. Each sink stores it in its own place (a JSON file beside or inside the file
outputs, a table of its own in PostgreSQL, a field's metadata in LanceDB, a collection's properties in Milvus);
:func:`check_manifest` is the one comparison of a stored record with a new run's settings, made before anything is
embedded. A sink keeps its manifest in a :class:`Ledger`, with the ids committed before the run and the rows written
since the last commit: what the runner reads to resume, whatever the sink.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from embedq import errors
from embedq.producers.index.idset import IdMap, IdSet, digest
from embedq.protocol import Fingerprint

VectorDtype = Literal["float32", "float16"]
MANIFEST_VERSION = 1


def utc_now() -> str:
    """The current UTC time in ISO 8601, to the second (the manifest's ``created`` and ``updated``)."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Part(BaseModel):
    file: str
    rows: int


class Manifest(BaseModel):
    """What an output holds and how it was made; replaced atomically at each commit."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    embedq_index: int = MANIFEST_VERSION
    format: str
    vector_dtype: VectorDtype
    options: dict[str, Any] = Field(description="Embedding options every row was made with (wire form).")
    fingerprint: Fingerprint | None = None
    rows: int = 0
    parts: list[Part] = Field(default_factory=list)  # parquet
    data_bytes: int = 0  # npy (header included) / jsonl
    ids_bytes: int = 0  # npy
    complete: bool = False
    #: the content-hash scheme of its rows (``content.SCHEME``); None: an output made before content hashes (or by a
    #: sink that keeps none), continued by id alone
    content_hash: str | None = None
    created: str = Field(default_factory=utc_now)
    updated: str = Field(default_factory=utc_now)
    runs: list[dict[str, Any]] = Field(default_factory=list)


def check_manifest(manifest: Manifest, *, format: str, vector_dtype: str, options: dict[str, Any], where: str,
                   container: str = "output") -> None:
    """Raise :class:`~embedq.errors.OutputMismatch` when ``manifest`` was made with another format, vector dtype or
    options than this run asks for (the first that differs is named).

    ``where`` names the target in the message (a path; ``table docs of /db``); ``container`` is what it is (``output``,
    ``table``, ``collection``), in "must not share a table".
    """
    wanted = {"format": format, "vector_dtype": vector_dtype, "options": options}
    for key, value in wanted.items():
        have = getattr(manifest, key)
        if have != value:
            article = "an" if container[:1].lower() in "aeiou" else "a"
            raise errors.OutputMismatch(
                f"{where} was written with {key} {have!r}; this run asks for {value!r}. Vectors made by different "
                f"pipelines must not share {article} {container}: write to another one, or pass --overwrite")


def resume_or_start(manifest: Manifest | None, *, format: str, vector_dtype: str, options: dict[str, Any], where: str,
                    container: str) -> Manifest:
    """A database target's manifest for this run: the one it keeps, checked against the run (:func:`check_manifest`),
    or a new one where it keeps none."""
    if manifest is None:
        return Manifest(format=format, vector_dtype=vector_dtype, options=options)
    check_manifest(manifest, format=format, vector_dtype=vector_dtype, options=options, where=where,
                   container=container)
    return manifest


def check_reusable(manifest: Manifest | None, *, vector_dtype: str, options: dict[str, Any], where: str,
                   container: str = "output") -> Manifest:
    """``--reuse``: an output's manifest checked as a source of rows for this run: it exists and holds rows of one
    space, was made with this run's vector dtype and options (any format), and keeps content hashes of this scheme
    (the run's own output's space is compared with it once known: :func:`check_space`)."""
    from embedq.producers.index.content import SCHEME

    if manifest is None or manifest.fingerprint is None:
        raise errors.InvalidOption(f"--reuse: {where} holds no rows of embedq index")
    check_manifest(manifest, format=manifest.format, vector_dtype=vector_dtype, options=options, where=where,
                   container=container)
    if manifest.content_hash != SCHEME:
        raise errors.InvalidOption(f"--reuse: {where} keeps no content hashes of this embedq "
                                   f"({manifest.content_hash or 'made before content hashes'}); it cannot be reused")
    return manifest


def check_space(have: Fingerprint | None, fingerprint: Fingerprint, *, where: str, container: str = "output") -> None:
    """Raise :class:`~embedq.errors.OutputMismatch` when ``where`` holds vectors of another embedding space than a
    result's (``have``: the record's fingerprint, None before the first result)."""
    if have is not None and not have.same_space(fingerprint):
        article = "an" if container[:1].lower() in "aeiou" else "a"
        raise errors.OutputMismatch(
            f"{where} holds vectors of another embedding space: it has [{have.describe()}], this run makes "
            f"[{fingerprint.describe()}]. Vectors of different spaces must not share {article} {container}: write to "
            "another one, or pass --overwrite")


class Ledger:
    """What every output keeps beside its rows, whatever stores them: the :class:`Manifest`, the ids committed before
    this run, the rows written since the last commit, and the record as the target last stored it. A sink owns one,
    handed to it by its target's ``open``, and says where the record lives (:meth:`save`'s ``store``)."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.committed = IdSet()  # ids committed before this run
        #: the content hash of each committed id (id digest -> hash), where the output keeps hashes
        self.hashes = IdMap()
        self._contents: IdSet | None = None
        self.pending_rows = 0  # written since the last commit
        self._stored: str | None = None  # the record as the target holds it (None: none read or stored yet)

    @property
    def dimension(self) -> int | None:
        fp = self.manifest.fingerprint
        return fp.dimensions if fp is not None else None

    def accept(self, fingerprint: Fingerprint, *, where: str, container: str = "output") -> None:
        """A result's embedding space checked against the output's (:func:`check_space`), then the output's."""
        check_space(self.manifest.fingerprint, fingerprint, where=where, container=container)
        self.manifest.fingerprint = fingerprint

    def commit_rows(self) -> None:
        """The rows written since the last commit are committed (counted in the manifest)."""
        self.manifest.rows += self.pending_rows
        self.pending_rows = 0

    @property
    def keeps_hashes(self) -> bool:
        """Whether the output's rows carry content hashes (``content.py``)."""
        return self.manifest.content_hash is not None

    def contents(self) -> IdSet:
        """The content hashes of the committed rows (made once, when first asked)."""
        if self._contents is None:
            self._contents = self.hashes.values()
        return self._contents

    def take(self, doc_id: str, content_hash: bytes | None = None) -> bytes:
        """One committed row's id (and its content hash, where the output keeps them); returns the id's digest."""
        key = digest(doc_id)
        self.committed.add(key)
        if content_hash is not None:
            self.hashes[key] = bytes(content_hash)
        return key

    def take_committed(self, ids: Iterable[str], *, where: str, container: str,
                       hashes: Iterable[bytes | None] | None = None) -> int:
        """The ids a database target holds into ``committed`` (with their content hashes, ``hashes``, in the same
        order), and their count as the record's rows (the stored record's own may lag by the last commit); refused
        when an id is there twice (written outside embedq index). The record read with them is the one the target
        holds."""
        pairs = zip(ids, hashes) if hashes is not None else ((doc_id, None) for doc_id in ids)
        return self.take_rows(((doc_id, h, None) for doc_id, h in pairs), where=where, container=container)

    def take_rows(self, rows: Iterable[tuple[str, bytes | None, int | None]], *, where: str, container: str,
                  windowed: bool = False) -> int:
        """:meth:`take_committed` of rows (id, content hash or None, window or None); ``windowed``: a windows output
        (``windowed.py``), whose key is (id, window): an id is there once per window."""
        rows_n = dups = 0
        keys = IdSet() if windowed else self.committed
        for doc_id, content_hash, window in rows:
            key = digest(f"{doc_id}\0{window}") if windowed else digest(doc_id)
            dups += key in keys
            if windowed:
                keys.add(key)
            self.take(doc_id, content_hash)
            rows_n += 1
        if dups:
            what = "(id, window) keys" if windowed else "ids"
            raise errors.OutputMismatch(f"{where} holds {dups} {what} more than once: it was written outside "
                                        f"embedq index; write to another {container}, or pass --overwrite")
        self.manifest.rows = rows_n
        self._stored = self.record()
        return rows_n

    def record(self) -> str:
        """The manifest as stored (JSON)."""
        return self.manifest.model_dump_json()

    def stored(self, record: str) -> None:
        """The target holds ``record`` now (stored by the sink itself, e.g. with the rows that created the table)."""
        self._stored = record

    def save(self, store: Callable[[str], None], *, force: bool = False) -> None:
        """Hand the record to ``store`` when it changed beyond its timestamp since the target last held it, or when
        ``force``d (each store is a database write: a table version, an RPC); never before a result was accepted
        (nothing written: no record)."""
        if self.manifest.fingerprint is None:
            return
        stamp = {"updated": None}
        unchanged = json.loads(self._stored or "{}") | stamp == json.loads(self.record()) | stamp
        if unchanged and not force:
            return
        self.manifest.updated = utc_now()
        record = self.record()
        store(record)
        self._stored = record
