"""The record every ``embedq index`` output keeps beside its rows, and the check a run makes against it.

A :class:`Manifest` says how an output was made (format, vector dtype, embedding options, the embedding-space
fingerprint) and what it has committed. Each sink stores it in its own place (a JSON file beside or inside the file
outputs, a table of its own in PostgreSQL, a field's metadata in LanceDB, a collection's properties in Milvus;
:class:`KeptRecord` for the last two); :func:`check_manifest` is the one comparison of a stored record with a new
run's settings, made before anything is embedded.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from embedq import errors
from embedq.producers.index.idset import digest
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


def check_space(have: Fingerprint | None, fingerprint: Fingerprint, *, where: str, container: str = "output") -> None:
    """Raise :class:`~embedq.errors.OutputMismatch` when ``where`` holds vectors of another embedding space than a
    result's (``have``: the record's fingerprint, None before the first result)."""
    if have is not None and not have.same_space(fingerprint):
        article = "an" if container[:1].lower() in "aeiou" else "a"
        raise errors.OutputMismatch(
            f"{where} holds vectors of another embedding space: it has [{have.describe()}], this run makes "
            f"[{fingerprint.describe()}]. Vectors of different spaces must not share {article} {container}: write to "
            "another one, or pass --overwrite")


class KeptRecord:
    """For a database sink whose record lives in the database's own metadata (LanceDB's ``id`` field metadata,
    Milvus's collection properties): the record as the last commit stored it (``_saved``), and :meth:`_save`, which
    stores it again only when it changed beyond its timestamp (each store is a database write: a table version, an
    RPC). A sink says where by :meth:`_store_record` and whether the target exists yet by :meth:`_record_target`."""

    manifest: Manifest
    committed: Any  # Sink's IdSet
    where: str
    _saved: str | None = None

    def _take_committed(self, ids: Iterable[str], container: str) -> int:
        """The ids the target holds into ``committed``, and their count as the record's rows (the record's own may
        lag by the last commit); refused when an id is there twice (written outside embedq index)."""
        rows = dups = 0
        for doc_id in ids:
            key = digest(doc_id)
            dups += key in self.committed
            self.committed.add(key)
            rows += 1
        if dups:
            raise errors.OutputMismatch(f"{self.where} holds {dups} ids more than once: it was written outside "
                                        f"embedq index; write to another {container}, or pass --overwrite")
        self.manifest.rows = rows
        self._saved = self._record()
        return rows

    def _record(self) -> str:
        return self.manifest.model_dump_json()

    def _record_target(self) -> bool:
        raise NotImplementedError

    def _store_record(self, record: str) -> None:
        raise NotImplementedError

    def save_manifest(self) -> None:
        self._save()

    def _save(self, force: bool = False) -> None:
        if not self._record_target() or self.manifest.fingerprint is None:
            return  # nothing written: no table, no record
        unchanged = json.loads(self._saved or "{}") | {"updated": None} == \
            json.loads(self._record()) | {"updated": None}
        if unchanged and not force:
            return
        self.manifest.updated = utc_now()
        record = self._record()
        self._store_record(record)
        self._saved = record
