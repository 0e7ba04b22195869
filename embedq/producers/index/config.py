"""What an ``embedq index`` run is asked to do (:class:`IndexConfig`, from the CLI's flags) and the options an output is
made with (:func:`storage_options`, what its manifest records and compares and content hashes are keyed by)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedq.producers.index.kinds import INDEX_KINDS, IndexKind
from embedq.producers.index.sinks.manifests import VectorDtype


@dataclass
class IndexConfig:
    chunk_size: int = 64
    max_in_flight: int = 32
    options: dict[str, Any] = field(default_factory=dict)
    vector_dtype: VectorDtype = "float32"
    job_timeout: float = 600.0
    max_attempts: int = 5
    checkpoint_seconds: float = 60.0
    shard_rows: int = 100_000
    kind: str = "embed"  # embed | sparse | multi | bge-m3 (producers/index/kinds.py)
    outputs: list[str] | None = None  # a kind with several outputs (bge-m3): which to make (default: what fits)
    broker_timeout: float = 300.0  # riding out a broker that went away mid-run (first contact: connect_timeout)
    connect_timeout: float = 30.0  # reaching the broker at all (EMBEDQ_BROKER_TIMEOUT from the CLI)
    wait_for_worker: float = 10.0  # seconds to wait for a live worker on the queue before refusing (inf: forever)
    overwrite: bool = False
    progress: bool = True
    errors_file: Path | None = None  # default: beside a file output; a database's: <table>.errors.jsonl here
    ann_index: bool = False  # a database output: build its ANN index after a complete run (timed on its own)
    store_text: bool = False  # a database output: a ``text`` column beside the vectors
    prune: bool = False  # after a complete run, remove the ids the output holds that the input no longer has
    reuse: list[str] = field(default_factory=list)  # outputs of the same space to take stored rows from by content


def storage_options(options: dict[str, Any], kind: IndexKind = INDEX_KINDS["embed"]) -> dict[str, Any]:
    """The options an output is made with, as the manifest records and compares them (with its kind, unless
    it is the default ``embed``, so outputs made before kinds existed continue as they were)."""
    wire = kind.options.parse({**options, **kind.fixed}).wire()
    wire.pop("encoding", None)  # the output's vector dtype decides it
    wire.pop("model", None)  # the embedding-space fingerprint identifies the model
    if kind.name != "embed":
        wire["kind"] = kind.name
    return wire
