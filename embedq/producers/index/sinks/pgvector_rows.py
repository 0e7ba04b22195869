"""How rows travel between embedq and a pgvector table (``pgvector.py``): each column's binary ``COPY`` encoding
(:class:`Col`, :func:`copy_rows`) and the binary form a ``SELECT`` reads back (:func:`read_column`), so a row reused by
its content hash is the row as stored, bit for bit.

pgvector's binary forms (its ``*_send``/``*_recv``): ``vector`` is int16 dim, int16 unused, float4 x dim; ``halfvec``
the same with float2; ``sparsevec`` int32 dim, int32 nnz, int32 unused, int32 indices (0-based) x nnz, float4 values x
nnz; all big-endian. ``double precision`` and ``bytea`` are PostgreSQL's own (psycopg loads them).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from embedq import errors
from embedq.producers.index.kinds import ColumnArrays
from embedq.producers.index.windowed import COLUMNS

COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)
COPY_TRAILER = struct.pack("!h", -1)
#: The content-hash column (``content.py``) and its type: 16 bytes a row, with a btree index made with the table.
HASH_COLUMN = ("content_hash", "bytea")
#: ids or hashes per statement (a DELETE of replaced or pruned ids, a lookup of content hashes)
BATCH = 5_000


class Col:
    """One column this run writes: its SQL type and how a batch of rows is encoded for binary COPY."""

    def __init__(self, name: str, pgtype: str, encode: Callable[[Any], list[bytes]]) -> None:
        self.name, self.pgtype, self.encode = name, pgtype, encode


def dense(name: str, rows: np.ndarray, dtype: str) -> Col:
    half = dtype == "float16"
    dim = int(rows.shape[1])
    width = 2 if half else 4
    prefix = struct.pack("!ihh", 4 + width * dim, dim, 0)

    def encode(values: np.ndarray) -> list[bytes]:
        big = np.ascontiguousarray(values, dtype=">f2" if half else ">f4")
        return [prefix + row.tobytes() for row in big]

    return Col(name, f"{'halfvec' if half else 'vector'}({dim})", encode)


def sparse(name: str, dim: int) -> Col:
    def encode(arrays: list[np.ndarray]) -> list[bytes]:
        offsets, indices, values = arrays
        out = []
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            body = (struct.pack("!iii", dim, b - a, 0) + np.asarray(indices[a:b], ">i4").tobytes()
                    + np.asarray(values[a:b], ">f4").tobytes())
            out.append(struct.pack("!i", len(body)) + body)
        return out

    return Col(name, f"sparsevec({dim})", encode)


def scalar(name: str) -> Col:
    return Col(name, "double precision",
               lambda arrays: [struct.pack("!id", 8, float(v)) for v in np.asarray(arrays[0]).reshape(-1)])


def integer(name: str) -> Col:
    """An ``integer`` column (a windows table's ``window``, ``start``, ``end``: ``windowed.py``)."""
    return Col(name, "integer", lambda values: [struct.pack("!ii", 4, int(v)) for v in np.asarray(values).tolist()])


#: A windows table's key columns after ``id`` (its primary key is (id, window)).
WINDOW_COLS = [integer(name) for name in COLUMNS]


def schema_problems(have: dict[str, str], want: list[tuple[str, str]], required: set[str]) -> list[str]:
    """How an existing table's columns (``have``: name -> type) differ from those a run writes (``want``), and its
    NOT NULL columns without a default (``required``) the run leaves empty."""
    problems = [f"{name} is {have[name]}, this run writes {pgtype}" if name in have else f"no column {name} "
                f"({pgtype})" for name, pgtype in want if have.get(name) != pgtype]
    return problems + [f"column {name} is NOT NULL without a default"
                       for name in sorted(required - {n for n, _ in want})]


def _cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def plan_columns(data: Any, dtype: str, where: str) -> list[Col]:
    """The columns a run's first rows go to: the plain kind's matrix (``embedding``), or each of a kind's columns by
    its shape (:class:`~embedq.producers.index.kinds.ColumnArrays`; ragged ones never reach a pgvector sink)."""
    if isinstance(data, np.ndarray):
        return [dense("embedding", data, dtype)]
    cols = []
    for column, arrays, dim in data:
        # a sparse column's name is a prefix in Parquet (``lexical_`` -> lexical_indices, lexical_values; a SPLADE
        # kind's is empty): here it names one column, the kind's only output being ``embedding``
        name = column_name(column)
        if column.shape == "dense":
            cols.append(dense(name, arrays[0], dtype))
        elif column.shape == "sparse":
            if dim is None:  # sparsevec's dimension bounds the ids (and HNSW needs it)
                raise errors.InvalidOption(f"{where}: the result does not say the id range of its sparse column "
                                           f"{name} (a worker older than this indexer?)")
            cols.append(sparse(name, dim))
        else:
            cols.append(scalar(name))
    return cols


def column_name(column: Any) -> str:
    """The table column of a kind's :class:`~embedq.kinds.Column`."""
    return column.name.rstrip("_") or "embedding"


def _field(raw: bytes) -> bytes:
    return struct.pack("!i", len(raw)) + raw


def copy_rows(ids: list[str], fields: list[list[bytes]], texts: list[str] | None,
              hashes: list[bytes] | None) -> bytes:
    """The binary COPY body of these rows: id, each column's encoded field (``fields``, one list per column), then the
    text and the content hash where given (the column order :func:`copy_columns` names)."""
    count = struct.pack("!h", 1 + len(fields) + (texts is not None) + (hashes is not None))
    rows = []
    for i, doc_id in enumerate(ids):
        parts = [count, _field(doc_id.encode("utf-8")), *(f[i] for f in fields)]
        if texts is not None:
            parts.append(_field(texts[i].encode("utf-8")))
        if hashes is not None:
            parts.append(_field(bytes(hashes[i])))
        rows.append(b"".join(parts))
    return COPY_HEADER + b"".join(rows) + COPY_TRAILER


def copy_columns(cols: list[Col], texts: bool, hashes: bool) -> list[str]:
    """The columns :func:`copy_rows` fills, in its order."""
    return ["id", *(c.name for c in cols)] + (["text"] if texts else []) + ([HASH_COLUMN[0]] if hashes else [])


def read_column(pgtype: str, values: list[Any]) -> list[np.ndarray] | None:
    """A column's values as a binary ``SELECT`` returns them (one per row), as ``write`` takes them: a dense column
    ``[rows x dim]`` (float32 for ``vector``, float16 for ``halfvec``: the stored values, exactly), a sparse one
    ``[offsets, indices, values]``, a scalar one ``[values]``; None for a type it does not read."""
    base = pgtype.split("(")[0]
    n = len(values)
    if base in ("vector", "halfvec"):
        dim = int(pgtype[len(base) + 1:-1])
        # the 4-byte header (dim, unused) is one float4 slot, or two float2 slots, before each row's values
        head, dtype = (1, ">f4") if base == "vector" else (2, ">f2")
        flat = np.frombuffer(b"".join(values), dtype=dtype).reshape(n, head + dim)
        out = flat[:, head:].astype(np.float16 if base == "halfvec" else np.float32)
        return [out]
    if base == "sparsevec":
        offsets = np.zeros(n + 1, dtype=np.int64)
        indices, weights = [], []
        for k, raw in enumerate(values):
            _, nnz, _ = struct.unpack_from("!iii", raw)
            indices.append(np.frombuffer(raw, ">i4", nnz, 12))
            weights.append(np.frombuffer(raw, ">f4", nnz, 12 + 4 * nnz))
            offsets[k + 1] = offsets[k] + nnz
        return [offsets, _cat(indices, np.int32), _cat(weights, np.float32)]
    if pgtype == "double precision":
        return [np.asarray(values, dtype=np.float64)]
    return None


#: What a row is read back from: (table column, its type, the kind's Column; None for the plain kind's ``embedding``).
Shape = list[tuple[str, str, Any]]


def readback(kind_columns: tuple[Any, ...] | None, have: dict[str, str]) -> Shape | None:
    """The columns of ``have`` (the table's, name -> type) a row of the kind is read back from (the plain kind:
    ``embedding``; another: each of its columns the table has, in the kind's order, as ``write`` takes them); None
    where one is missing or of a type :func:`read_column` does not read."""
    if kind_columns is None:
        shape = [("embedding", have.get("embedding", ""), None)]
    else:
        shape = [(column_name(c), have[column_name(c)], c) for c in kind_columns if column_name(c) in have]
    if not shape or any(read_column(pgtype, []) is None for _, pgtype, _ in shape):
        return None
    return shape


def assemble(shape: Shape, found: list[tuple[Any, ...]]) -> Any:
    """Rows read in binary (each a tuple of ``shape``'s columns) as ``write`` takes them: the plain kind's matrix, or
    a list of :class:`~embedq.producers.index.kinds.ColumnArrays`."""
    columns = []
    for k, (_, pgtype, column) in enumerate(shape):
        arrays = read_column(pgtype, [row[k] for row in found])
        dim = re.search(r"\((\d+)\)", pgtype)
        columns.append(ColumnArrays(column, arrays or [], int(dim.group(1)) if dim else None))
    return columns[0].arrays[0] if shape[0][2] is None else columns


def ident(name: str) -> Any:
    from psycopg import sql

    return sql.Identifier(name)


def sql_null() -> Any:
    from psycopg import sql

    return sql.SQL("NULL")


def idents(names: list[str]) -> Any:
    from psycopg import sql

    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


def delete_ids(cur: Any, query: Any, ids: list[str]) -> int:
    """``query`` (a ``DELETE ... WHERE id = ANY(%s)``) for ``ids``, :data:`BATCH` at a time; returns the rows gone."""
    gone = 0
    for start in range(0, len(ids), BATCH):
        cur.execute(query, (ids[start:start + BATCH],))
        gone += cur.rowcount
    return gone


def by_hash(conn: Any, query: Any, hashes: list[bytes]) -> tuple[list[bytes], list[tuple[Any, ...]]]:
    """``query`` (``SELECT content_hash, <columns> ... WHERE content_hash = ANY(%s)``, read in binary) for
    ``hashes``, :data:`BATCH` at a time: the hashes found (in the order asked, each once) and one row of each."""
    found: dict[bytes, tuple[Any, ...]] = {}
    wanted = list(dict.fromkeys(bytes(h) for h in hashes))
    with conn.cursor(binary=True) as cur:
        for start in range(0, len(wanted), BATCH):
            cur.execute(query, (wanted[start:start + BATCH],))
            for row in cur:
                found.setdefault(bytes(row[0]), row[1:])
    order = [h for h in wanted if h in found]
    return order, [found[h] for h in order]
