"""Where ``embedq index`` writes: the sink contract and every sink.

* ``contract.py``: :class:`Target` and :class:`Sink`, every call the runner makes on an output (the ABCs a sink
  subclasses); ``manifests.py``: the :class:`Ledger` every sink keeps (its manifest, committed ids, pending rows);
* ``registry.py``: the scheme table (``-o scheme://...`` -> its sink; plugins: ``EMBEDQ_SINKS``, entry points
  ``embedq.sinks``); ``urls.py``: what the database sinks share of their URLs; ``locks.py``: one writer per output;
* the sinks: ``files.py`` + ``fileformats.py`` (Parquet, NPY, JSONL), ``pgvector.py`` (+ ``pgvector_names.py``),
  ``lancedb.py``, ``milvus.py``.

The names below are importable from here; each is imported when first used (the CLI reads the scheme table for its
help without importing a sink).
"""

from __future__ import annotations

from embedq.producers.index import lazy_names

_HOMES = {
    "Refused": "contract", "Sink": "contract", "Target": "contract",
    "Ledger": "manifests", "Manifest": "manifests", "VectorDtype": "manifests", "check_manifest": "manifests",
    "check_space": "manifests",
    "OutputLock": "locks",
    "SCHEMES": "registry", "SinkScheme": "registry", "load_sinks": "registry", "output_target": "registry",
    "register_sink": "registry", "sink_schemes": "registry",
    "database_errors_path": "urls", "mask_url": "urls", "split_param": "urls",
    "OUTPUT_FORMATS": "files", "FileTarget": "files", "open_sink": "files",
}

__all__ = sorted(_HOMES)
__getattr__ = lazy_names(__name__, _HOMES)
