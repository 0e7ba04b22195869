"""The rows of a Milvus collection as ``embedq index`` writes and reads them (``milvus.py``'s sink): a result's
columns made into Milvus's row dicts and back, and the queries that read ids, content hashes and rows by hash.

A collection's fields are the sink's plan, ``(name, DataType, dim)`` each: ``id``, ``content_hash`` where the output
keeps content hashes (``VARCHAR(32)``: the 16-byte hash in hex, Milvus has no binary scalar field), then the kind's
fields, then ``text`` with ``--store-text``. A windows collection (``--long-inputs windows``, ``windowed.py``) starts
with ``key`` (``VARCHAR``, the primary key: ``id#window``), then ``id`` (``VARCHAR``), ``window``, ``start``,
``end`` and ``windows`` (``INT32``: the document's window count, what tells a whole document from a part of one a run
killed mid-send left: :func:`windows_committed`), then ``content_hash``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from embedq.producers.index.windowed import WindowRows, whole_documents

HASH = "content_hash"
HASH_LENGTH = 32  # the 16-byte content hash in hex
MAX_VARCHAR = 65_535  # bytes: Milvus's largest VARCHAR (the id and the text)
WORK_TIMEOUT = 3_600.0  # seconds for the calls that do work: upsert, count, load, index builds, queries
HASHES_PER_QUERY = 1_024  # content hashes in one ``content_hash in [...]`` filter
IDS_PER_DELETE = 2_000  # ids in one delete request (``--prune``)

Plan = list[tuple[str, Any, int | None]]
#: a windows collection's fields before ``content_hash`` (the INT32 ones after ``key`` and ``id``)
WINDOW_INTS = ("window", "start", "end", "windows")
#: the fields that are not a kind's
NOT_KIND = frozenset({"key", "id", *WINDOW_INTS, HASH, "text"})


def reason(exc: BaseException) -> str:
    """One line saying why (a MilvusException's own message, without its code)."""
    text = str(getattr(exc, "message", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def key_fields(dtype: Any, *, hashes: bool, windowed: bool) -> Plan:
    """The fields before the kind's: ``id`` (a windows collection: ``key``, ``id`` and the window's), then
    ``content_hash`` where the output keeps content hashes. The first is the primary key."""
    keys: Plan = [("id", dtype.VARCHAR, None)]
    if windowed:
        keys = [("key", dtype.VARCHAR, None), *keys, *((name, dtype.INT32, None) for name in WINDOW_INTS)]
    return keys + ([(HASH, dtype.VARCHAR, None)] if hashes else [])


def kind_fields(dtype: Any, data: Any) -> Plan:
    """A kind's fields (its :class:`~embedq.producers.index.kinds.ColumnArrays`), by shape."""
    fields: Plan = []
    for column, arrays, _ in data:
        if column.shape == "dense":
            fields.append((column.name, dtype.FLOAT_VECTOR, int(arrays[0].shape[1])))
        elif column.shape == "sparse":  # a sparse column's name is a prefix in Parquet (``lexical_``; SPLADE's: "")
            fields.append((column.name.rstrip("_") or "sparse", dtype.SPARSE_FLOAT_VECTOR, None))
        else:
            fields.append((column.name, dtype.DOUBLE, None))
    return fields


def to_rows(plan: Plan, ids: list[str], data: Any, texts: list[str] | None, hashes: list[bytes] | None,
            windows: WindowRows | None = None) -> list[dict[str, Any]]:
    """One row dict per id: the plain ``embed`` kind's float matrix as ``vector``, a kind's ``ColumnArrays`` by the
    plan's fields (the ones after the keys and ``content_hash``, in order); ``windows``: a windows collection's."""
    rows: list[dict[str, Any]] = [{"id": doc_id} for doc_id in ids]
    if windows is not None:
        columns = [windows.window.tolist(), windows.start.tolist(), windows.end.tolist(), windows.count.tolist()]
        for row, key, *values in zip(rows, windows.keys(ids), *columns):
            row["key"] = key
            row.update(zip(WINDOW_INTS, values))
    if hashes is not None:
        for row, content_hash in zip(rows, hashes):
            row[HASH] = bytes(content_hash).hex()
    fields = [f for f in plan if f[0] not in NOT_KIND]
    columns = [("vector", [data])] if isinstance(data, np.ndarray) else \
        [(name, arrays) for (name, _, _), (_, arrays, _) in zip(fields, data)]
    for (name, arrays), (_, ftype, _) in zip(columns, fields):
        if ftype.name == "SPARSE_FLOAT_VECTOR":
            offsets, indices, values = arrays
            for row, a, b in zip(rows, offsets[:-1].tolist(), offsets[1:].tolist()):
                row[name] = dict(zip(indices[a:b].tolist(), values[a:b].tolist()))
        elif ftype.name == "FLOAT_VECTOR":
            for row, vector in zip(rows, np.asarray(arrays[0], np.float32)):
                row[name] = vector
        else:
            for row, value in zip(rows, np.asarray(arrays[0]).reshape(-1).tolist()):
                row[name] = value
    if texts is not None:
        for row, text in zip(rows, texts):
            row["text"] = text
    return rows


def refuse(row: dict[str, Any]) -> str | None:
    """Why Milvus cannot store a row (None: it can)."""
    if len(row.get("key", row["id"]).encode("utf-8")) > MAX_VARCHAR:
        return f"its id is over {MAX_VARCHAR:,} bytes (Milvus's largest VARCHAR)"
    if "text" in row and len(row["text"].encode("utf-8")) > MAX_VARCHAR:
        return f"its text is over {MAX_VARCHAR:,} bytes (Milvus's largest VARCHAR; --store-text)"
    for name, value in row.items():
        if isinstance(value, dict) and not any(value.values()):
            return f"its sparse vector {name} has no nonzero weight, and Milvus refuses an empty sparse vector"
    return None


def scan(client: Any, collection: str, fields: list[str], filter: str = "") -> Iterator[dict[str, Any]]:
    """Every row of a loaded collection (matching ``filter``) with these fields (strong consistency)."""
    it = client.query_iterator(collection, batch_size=16_384, output_fields=fields, filter=filter,
                               consistency_level="Strong", timeout=WORK_TIMEOUT)
    try:
        while batch := it.next():
            yield from batch
    finally:
        it.close()


def committed(client: Any, collection: str, hashes: bool) -> Iterator[tuple[str, bytes | None]]:
    """Each row's id, and its content hash where the collection keeps them."""
    for row in scan(client, collection, ["id", HASH] if hashes else ["id"]):
        yield row["id"], bytes.fromhex(row[HASH]) if hashes else None


def windows_committed(client: Any, collection: str, hashes: bool) -> tuple[list[tuple[str, bytes | None, int]],
                                                                          list[str]]:
    """A windows collection's rows (id, content hash, window) of whole documents, and the ids of documents only a part
    of whose windows is there (to delete before they are embedded again)."""
    rows = [(r["id"], bytes.fromhex(r[HASH]) if hashes else None, r["window"], r["windows"])
            for r in scan(client, collection, ["id", "window", "windows", *([HASH] if hashes else [])])]
    whole, partial = whole_documents([(doc_id, window, count) for doc_id, _, window, count in rows])
    return [(doc_id, h, window) for doc_id, h, window, _ in rows if doc_id in whole], sorted(partial)


def by_hash(client: Any, collection: str, hashes: list[bytes]) -> tuple[list[bytes], np.ndarray | None]:
    """The ``vector`` of one row per content hash the collection holds, in the order asked: (hashes found, float32
    matrix)."""
    wanted = list(dict.fromkeys(bytes(h) for h in hashes))
    first: dict[bytes, Any] = {}
    for i in range(0, len(wanted), HASHES_PER_QUERY):
        names = ", ".join(f'"{h.hex()}"' for h in wanted[i:i + HASHES_PER_QUERY])
        for row in scan(client, collection, [HASH, "vector"], filter=f"{HASH} in [{names}]"):
            first.setdefault(bytes.fromhex(row[HASH]), row["vector"])
    found = [h for h in wanted if h in first]
    if not found:
        return [], None
    return found, np.asarray([first[h] for h in found], np.float32)


def delete(client: Any, collection: str, ids: list[str]) -> int:
    """Delete these ids' rows (each request at once: Milvus has no transaction); returns how many ids."""
    for i in range(0, len(ids), IDS_PER_DELETE):
        # a filter of its own: pymilvus's ``ids=`` quotes an id with ' in it into an expression Milvus cannot parse
        names = ", ".join(json.dumps(doc_id, ensure_ascii=False) for doc_id in ids[i:i + IDS_PER_DELETE])
        client.delete(collection, filter=f"id in [{names}]", timeout=WORK_TIMEOUT)
    return len(ids)
