"""Before ``embedq index`` starts a private broker and worker (the embedded default, 15 s or more): is anything
missing at all? (Issue 51, item 4: a rerun with nothing left to embed paid for a whole start.)"""

from __future__ import annotations

import time
from pathlib import Path

from embedq import errors
from embedq.producers.index.config import IndexConfig, storage_options
from embedq.producers.index.content import ContentHasher
from embedq.producers.index.idset import IdSet, digest
from embedq.producers.index.kinds import index_kind
from embedq.producers.index.sinks.contract import Target
from embedq.producers.index.sinks.registry import output_target
from embedq.producers.index.sources import Source, record_text
from embedq.producers.index.summary import Summary


def nothing_to_embed(source: Source, output: Path | str | Target, output_format: str | None, config: IndexConfig,
                     model: str, max_chars: int) -> Summary | None:
    """Before a private broker and worker are started for a run (the embedded default, 15 s or more): the summary of
    a run that would embed nothing, decided from the input and the output alone, or None when something is missing
    or cannot be told without a worker (issue 51, item 4). Nothing is missing when the output exists, was made with
    this run's options and model, and holds every id of the input with its text (the same content hash, where the
    output keeps them), each of whose records is usable, and, with ``--prune``, no other id. Read under the
    output's lock; nothing is written."""
    target = output_target(output, output_format, config)
    if config.overwrite or not target.precheck or not target.exists() or config.outputs is not None:
        return None
    kind = index_kind(config.kind, target.format)
    t0 = time.perf_counter()
    with target.lock():
        try:
            options = storage_options(config.options, kind)
            sink = target.open(vector_dtype=config.vector_dtype, options=options, shard_rows=config.shard_rows,
                               overwrite=False)
        except errors.EmbedqError:
            return None  # another pipeline's output, or none readable: the run itself says why
        try:
            fingerprint = sink.manifest.fingerprint
            if fingerprint is None or fingerprint.model != model or fingerprint.kind != kind.name:
                return None
            seen = IdSet()
            count = 0
            hasher = ContentHasher(options, config.vector_dtype) if sink.ledger.keeps_hashes else None
            for rec in source:
                key = digest(rec.id)
                if rec.error is not None or key in seen or key not in sink.committed:
                    return None
                record_text(rec.text, max_chars)
                if hasher is not None and sink.ledger.hashes.get(key) != hasher(rec.text):
                    return None  # its text changed: re-embedded
                seen.add(key)
                count += 1
            if config.prune and sink.manifest.rows > count:
                return None  # ids to remove
            summary = Summary(input=source.describe(), output=target.describe(), skipped=count,
                              rows=sink.manifest.rows, fingerprint=fingerprint,
                              seconds=time.perf_counter() - t0)
            summary.notes.append("nothing to embed: every record of the input is in the output (no broker or "
                                 "worker was started)")
            return summary
        except errors.EmbedqError:
            return None
        finally:
            sink.close()
