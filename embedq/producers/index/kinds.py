"""What ``embedq index --kind`` makes: any kind of the kinds table (``embedq/kinds.py``) with index outputs, under its
own name or an alias, stored in the columns its spec's :class:`~embedq.kinds.Column` entries name. The built-ins:

* ``embed`` (default): ``vector`` — a fixed-size list (every output format);
* ``embed_sparse`` (alias ``sparse``; a SPLADE model): ``indices`` list<int32> and ``values`` list<float32>, ids
  ascending: what vector databases take as a sparse vector;
* ``embed_all`` (alias ``multi``; per-token embeddings of any embedding model, TEI's ``/embed_all``): ``vectors``, a
  list of fixed-size vectors;
* ``embed_hybrid`` (alias ``bge-m3``; a BGE-M3 model): ``dense`` (fixed-size), ``lexical_indices``/``lexical_values``
  and ``colbert`` (a list of fixed-size vectors), from one forward pass.

Each of the four column shapes maps to Parquet here (dense: fixed-size list; sparse: two lists; ragged: a list of
fixed-size lists; scalar: one value), so a kind from a plugin is indexed with no edit of this module. The kind and
its outputs are in every result's fingerprint and in the output's manifest, so an output is never continued with
another kind. Kinds other than ``embed`` write Parquet or a database (whose sink maps the shapes it can store and
leaves out or refuses the others: :meth:`IndexKind.fit`, ``pgvector.py``, ``milvus.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from embedq import errors
from embedq.kinds import EMBED, KINDS, Column, TaskSpec, kind_names
from embedq.protocol import Fingerprint, JobOptions, decode_array

#: The names the manifests of outputs made before the kinds table record for these kinds (kept: they resume).
MANIFEST_NAMES = {"embed_sparse": "sparse", "embed_all": "multi", "embed_hybrid": "bge-m3"}


def _ragged(pa: Any, offsets: np.ndarray, values: Any) -> Any:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), pa.int32()), values)


def _vectors(pa: Any, rows: np.ndarray, dtype: str) -> Any:
    value_type = pa.float16() if dtype == "float16" else pa.float32()
    flat = np.ascontiguousarray(rows, dtype=np.float16 if dtype == "float16" else np.float32).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, value_type), int(rows.shape[1]))


def _column(pa: Any, column: Column, payload: dict[str, Any], dtype: str) -> dict[str, Any]:
    """One :class:`~embedq.kinds.Column` of a result as pyarrow arrays, one row per text. Sparse weights stay
    float32 whatever the vector dtype (a float16 weight loses the ranking's small differences)."""
    arrays = [decode_array(payload[name]) for name in column.arrays]
    if column.shape == "dense":
        return {column.name: _vectors(pa, arrays[0], dtype)}
    if column.shape == "sparse":
        offsets, indices, values = arrays
        return {f"{column.name}indices": _ragged(pa, offsets, pa.array(indices, pa.int32())),
                f"{column.name}values": _ragged(pa, offsets, pa.array(values, pa.float32()))}
    if column.shape == "ragged":
        return {column.name: _ragged(pa, arrays[0], _vectors(pa, arrays[1], dtype))}
    return {column.name: pa.array(arrays[0])}


class ColumnArrays(NamedTuple):
    """One column of a result, as a database sink takes it."""

    column: Column
    arrays: list[np.ndarray]  # in the order :attr:`Column.arrays` names them
    dimensions: int | None  # a dense column's width, a sparse one's id bound (a vocabulary size); None: unknown


def _dimensions(column: Column, arrays: list[np.ndarray], payload: dict[str, Any], fingerprint: Fingerprint,
                n_columns: int) -> int | None:
    """A column's dimension: a dense one's width; for a sparse one, the result's ``<name>dimensions`` (BGE-M3's
    ``lexical_dimensions``), else the fingerprint's when it is the kind's only column (SPLADE: the vocabulary)."""
    if column.shape in ("dense", "ragged"):
        return int(arrays[-1].shape[1]) if arrays[-1].ndim == 2 else None
    if column.shape != "sparse":
        return None
    named = payload.get(f"{column.name}dimensions")
    if named is not None:
        return int(named)
    return int(fingerprint.dimensions) if n_columns == 1 else None


@dataclass(frozen=True)
class IndexKind:
    name: str  # as the output's manifest records it
    job_kind: str  # the kind of a chunk's job (``Client.submit_many``'s ``kind``)
    options: type[JobOptions]
    columns: tuple[Column, ...] | None  # None: the dense ``vector`` path (every output format)
    fixed: dict[str, Any] = field(default_factory=dict)  # options the kind always sends
    wire_dtype: bool = True  # results cross Redis in the output's vector dtype (sparse weights stay float32)

    @classmethod
    def of(cls, spec: TaskSpec) -> IndexKind:
        dense_path = spec.columns == EMBED.columns
        return cls(MANIFEST_NAMES.get(spec.kind, spec.kind), spec.kind, spec.options,
                   None if dense_path else spec.columns, dict(spec.index_options), spec.index_dtype)

    @property
    def outputs(self) -> list[str] | None:
        """The outputs a run may choose (``--outputs``): a kind whose options take ``outputs`` (BGE-M3's ``dense``,
        ``lexical``, ``colbert``); None for a kind that makes one thing."""
        chosen = self.fixed.get("outputs")
        return list(chosen) if isinstance(chosen, list) else None

    def select(self, outputs: list[str]) -> IndexKind:
        """This kind computing and storing only ``outputs`` (each a column's name, a sparse one without its
        trailing ``_``), in the kind's order: the jobs ask for them alone, and the manifest records them."""
        have = self.outputs
        if have is None or self.columns is None:
            raise errors.InvalidOption(f"--outputs is for a kind with several outputs (bge-m3); {self.name} makes "
                                       "one")
        unknown = [o for o in outputs if o not in have]
        if unknown or not outputs:
            raise errors.InvalidOption(f"--outputs {','.join(outputs)}: {self.name}'s outputs are {', '.join(have)}")
        keep = [o for o in have if o in outputs]
        columns = tuple(c for c in self.columns if c.name.rstrip("_") in keep)
        return replace(self, columns=columns, fixed={**self.fixed, "outputs": keep})

    def fit(self, outputs: list[str] | None, refused: dict[str, str], where: str) -> tuple[IndexKind, list[str]]:
        """This kind as ``where`` can store it: ``refused`` maps a column shape the target cannot store to why. A
        kind with outputs to choose leaves those out, unless ``outputs`` asks for one (then, as for a kind with
        nothing else to store, the run is refused saying why); returns the kind and a note per output left out."""
        kind = self.select(outputs) if outputs is not None else self
        bad = [c for c in kind.columns or () if c.shape in refused]
        if not bad:
            return kind, []
        if outputs is not None or kind.outputs is None or len(bad) == len(kind.columns or ()):
            c = bad[0]
            name = c.name.rstrip("_") or kind.name
            raise errors.InvalidOption(f"--kind {self.name}: {name} ({c.shape}) cannot be stored in {where}: "
                                       f"{refused[c.shape]}")
        dropped = [c.name.rstrip("_") for c in bad]
        notes = [f"{name} is not written to {where}: {refused[c.shape]} (the other outputs are; --outputs chooses)"
                 for name, c in zip(dropped, bad)]
        return kind.select([o for o in kind.outputs or () if o not in dropped]), notes

    def job_options(self, options: dict[str, Any], vector_dtype: str) -> dict[str, Any]:
        """The chunk jobs' options: the user's, checked by the kind's options model, with the storage dtype."""
        wire = self.options.parse({**options, **self.fixed}).wire()
        if self.wire_dtype and "encoding" in self.options.model_fields:
            wire["encoding"] = vector_dtype
        return wire

    def arrays(self, payload: dict[str, Any]) -> tuple[Fingerprint, list[ColumnArrays]]:
        """A non-dense result as (its fingerprint, each column with its decoded arrays, in the order
        :attr:`Column.arrays` names them, and its dimension): what a database sink maps by shape."""
        assert self.columns is not None
        fingerprint = Fingerprint.model_validate(payload["fingerprint"])
        out = []
        for c in self.columns:
            arrays = [decode_array(payload[name]) for name in c.arrays]
            out.append(ColumnArrays(c, arrays, _dimensions(c, arrays, payload, fingerprint, len(self.columns))))
        return fingerprint, out

    def table(self, payload: dict[str, Any], vector_dtype: str) -> tuple[Fingerprint, Any]:
        """A non-dense result as (its fingerprint, a pyarrow table of its columns, one row per text)."""
        import pyarrow as pa

        assert self.columns is not None
        data: dict[str, Any] = {}
        for column in self.columns:
            data.update(_column(pa, column, payload, vector_dtype))
        return Fingerprint.model_validate(payload["fingerprint"]), pa.table(data)


#: The built-in kinds' index outputs (``embedq.index.kinds.index_kind`` also finds plugins' kinds).
INDEX_KINDS: dict[str, IndexKind] = {"embed": IndexKind.of(EMBED)}


def index_kind(name: str, output_format: str) -> IndexKind:
    """The index outputs of the kind ``name`` (its own name, an alias, or the name an older manifest records)."""
    spec = KINDS.get(name)  # the names older manifests record are the built-ins' aliases
    if spec is None or not spec.columns:
        indexable = [k for k in kind_names() if KINDS[k].columns]
        raise errors.InvalidOption(f"unknown index kind {name!r}; use one of {', '.join(indexable)} "
                                   f"(or an alias: {', '.join(MANIFEST_NAMES.values())})")
    kind = IndexKind.of(spec)
    if kind.columns is not None and output_format in ("npy", "jsonl"):  # a database sink checks its own columns
        raise errors.InvalidOption(f"--kind {name} writes Parquet (list columns) or a database; name the output "
                                   ".parquet")
    return kind
