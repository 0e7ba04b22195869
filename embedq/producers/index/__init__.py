"""``embedq index``: embed a file (or stdin) into a resumable output: a Parquet, NPY or JSONL file, or a database
(``sinks/``). The names below are imported when first used (the CLI reads the sinks' scheme table for its help
without importing the runner)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562): each name of ``homes`` imported from its module (``homes[name]``, under
    ``package``) when first used."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home}"), name)

    return __getattr__


_HOMES = {
    "IndexConfig": "config", "Indexer": "runner", "run_index": "runner",
    "Manifest": "sinks.manifests", "OUTPUT_FORMATS": "sinks.files", "open_sink": "sinks.files",
    "FORMATS": "sources", "Record": "sources", "Source": "sources",
    "Summary": "summary",
}

__all__ = sorted(_HOMES)
__getattr__ = lazy_names(__name__, _HOMES)
