"""What ``embedq index --kind`` makes, and the Parquet columns it writes for each kind.

* ``embed`` (default): ``vector`` — a fixed-size list (every output format);
* ``sparse`` (a SPLADE model): ``indices`` list<int32> and ``values`` list<float32>, ids ascending: what vector
  databases take as a sparse vector;
* ``multi`` (per-token embeddings of any embedding model, TEI's ``/embed_all``): ``vectors``, a list of
  fixed-size vectors;
* ``bge-m3`` (a BGE-M3 model): ``dense`` (fixed-size), ``lexical_indices``/``lexical_values`` and ``colbert``
  (a list of fixed-size vectors), from one forward pass.

The kind and its outputs are in every result's fingerprint and in the output's manifest, so an output is never
continued with another kind. Kinds other than ``embed`` write Parquet only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedq import errors
from embedq.protocol import (
    EmbedAllOptions,
    EmbedOptions,
    Fingerprint,
    HybridOptions,
    JobOptions,
    SparseOptions,
    decode_array,
)


def _ragged(pa: Any, offsets: np.ndarray, values: Any) -> Any:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), pa.int32()), values)


def _vectors(pa: Any, rows: np.ndarray, dtype: str) -> Any:
    value_type = pa.float16() if dtype == "float16" else pa.float32()
    flat = np.ascontiguousarray(rows, dtype=np.float16 if dtype == "float16" else np.float32).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, value_type), int(rows.shape[1]))


def _sparse(pa: Any, payload: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Weights stay float32 whatever the vector dtype (a float16 weight loses the ranking's small differences)."""
    offsets = decode_array(payload["offsets"])
    return {"indices": _ragged(pa, offsets, pa.array(decode_array(payload["indices"]), pa.int32())),
            "values": _ragged(pa, offsets, pa.array(decode_array(payload["values"]), pa.float32()))}


def _multi(pa: Any, payload: dict[str, Any], dtype: str) -> dict[str, Any]:
    offsets, tokens = decode_array(payload["offsets"]), decode_array(payload["tokens"])
    return {"vectors": _ragged(pa, offsets, _vectors(pa, tokens, dtype))}


def _m3(pa: Any, payload: dict[str, Any], dtype: str) -> dict[str, Any]:
    lexical = {"offsets": payload["lexical_offsets"], "indices": payload["lexical_indices"],
               "values": payload["lexical_values"]}
    columns = {"dense": _vectors(pa, decode_array(payload["dense"]), dtype)}
    columns.update({f"lexical_{k}": v for k, v in _sparse(pa, lexical, dtype).items()})
    colbert = decode_array(payload["colbert"])
    columns["colbert"] = _ragged(pa, decode_array(payload["colbert_offsets"]), _vectors(pa, colbert, dtype))
    return columns


@dataclass(frozen=True)
class IndexKind:
    name: str
    job_kind: str  # the kind of a chunk's job (``Client.submit_many``'s ``kind``)
    options: type[JobOptions]
    columns: Callable[[Any, dict[str, Any], str], dict[str, Any]] | None  # None: the dense ``vector`` path
    fixed: dict[str, Any] = field(default_factory=dict)  # options the kind always sends
    wire_dtype: bool = True  # results cross Redis in the output's vector dtype (sparse weights stay float32)

    def job_options(self, options: dict[str, Any], vector_dtype: str) -> dict[str, Any]:
        """The chunk jobs' options: the user's, checked by the kind's options model, with the storage dtype."""
        wire = self.options.parse({**options, **self.fixed}).wire()
        if self.wire_dtype:
            wire["encoding"] = vector_dtype
        return wire

    def table(self, payload: dict[str, Any], vector_dtype: str) -> tuple[Fingerprint, Any]:
        """A non-dense result as (its fingerprint, a pyarrow table of its columns, one row per text)."""
        import pyarrow as pa

        assert self.columns is not None
        return Fingerprint.model_validate(payload["fingerprint"]), pa.table(self.columns(pa, payload, vector_dtype))


INDEX_KINDS: dict[str, IndexKind] = {
    "embed": IndexKind("embed", "embed", EmbedOptions, None),
    "sparse": IndexKind("sparse", "embed_sparse", SparseOptions, _sparse, wire_dtype=False),
    "multi": IndexKind("multi", "embed_all", EmbedAllOptions, _multi),
    "bge-m3": IndexKind("bge-m3", "embed_hybrid", HybridOptions, _m3,
                        {"outputs": ["dense", "lexical", "colbert"]}),
}


def index_kind(name: str, output_format: str) -> IndexKind:
    kind = INDEX_KINDS.get(name)
    if kind is None:
        raise errors.InvalidOption(f"unknown index kind {name!r}; use one of {', '.join(INDEX_KINDS)}")
    if kind.columns is not None and output_format != "parquet":
        raise errors.InvalidOption(f"--kind {name} writes Parquet only (list columns); name the output .parquet")
    return kind
