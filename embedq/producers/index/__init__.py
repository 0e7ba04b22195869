"""``embedq index``: embed a file (or stdin) into a resumable Parquet, NPY or JSONL output."""

from embedq.producers.index.manifests import Manifest
from embedq.producers.index.runner import IndexConfig, Indexer, run_index
from embedq.producers.index.sinks import OUTPUT_FORMATS, open_sink
from embedq.producers.index.sources import FORMATS, Record, Source
from embedq.producers.index.summary import Summary

__all__ = ["FORMATS", "OUTPUT_FORMATS", "IndexConfig", "Indexer", "Manifest", "Record", "Source", "Summary",
           "open_sink", "run_index"]
