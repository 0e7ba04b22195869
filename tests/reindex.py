"""Re-indexing a corpus that changed (issue 57, acceptance b), for every output the tests index into.

:func:`versions` makes two versions of the corpus: the first (4,000 texts, ids ``doc-N``) and the second, with 10 % of
the texts edited, 5 % of the ids removed and 5 % new ids. :func:`index` runs ``embedq index`` as a user does (the CLI,
in a process of its own), and :func:`reindex_case` the whole scenario against one output: the first version indexed,
the second indexed into the same output with ``--prune`` (the worker's ``items`` counter says how many texts reached
the model), and a fresh full run on the second version into another output; a test then compares the two outputs
with its database's reader (same ids, vectors within 1e-6).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import load_corpus

from embedq.settings import Settings

EDITED, REMOVED, ADDED = 0.10, 0.05, 0.05


def versions(n: int = 4000, seed: int = 57) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The first version (``n`` corpus texts) and the second (10 % edited, 5 % removed, 5 % new ids), each a list of
    (id, text) in input order."""
    texts = load_corpus(n)
    first = [(f"doc-{i}", text) for i, text in enumerate(texts)]
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    edited = set(order[: int(n * EDITED)])
    removed = set(order[int(n * EDITED): int(n * (EDITED + REMOVED))])
    second = [(doc_id, f"{text} (revised {i})" if i in edited else text)
              for i, (doc_id, text) in enumerate(first) if i not in removed]
    second += [(f"new-{k}", f"{texts[rng.randrange(n)]} (a new document, {k})") for k in range(int(n * ADDED))]
    return first, second


def write_jsonl(path: Path, pairs: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in pairs))
    return path


def env(settings: Settings) -> dict[str, str]:
    """The environment of an ``embedq index`` process on ``settings``' broker and queue (the suite's caches kept)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith(("_CACHE", "_MAX_WAIT"))}
    return {**base, "EMBEDQ_BROKER_URL": settings.broker_url, "EMBEDQ_QUEUE": settings.queue_name}


def index_cmd(src: Path, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "embedq", "index", str(src), "-o", out, "-q", "--json", *extra]


def index(settings: Settings, src: Path, out: str, *extra: str, timeout: float = 900) -> dict[str, Any]:
    """Run ``embedq index SRC -o OUT`` to its end; its JSON summary (a failed run fails the test)."""
    proc = subprocess.run(index_cmd(src, out, *extra), env=env(settings), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@dataclass
class Reindexed:
    first: list[tuple[str, str]]
    second: list[tuple[str, str]]
    summary: dict[str, Any]  # the re-index run's
    model_items: int  # items that reached the model during the re-index run (the worker's counter)


def reindex_case(worker: Any, tmp: Path, target: str, fresh: str, *extra: str) -> Reindexed:
    """Index the first version into ``target``, then the second into ``target`` with ``--prune`` (counting the items
    the worker's model runs meanwhile), and the second afresh into ``fresh``."""
    first, second = versions()
    v1, v2 = write_jsonl(tmp / "v1.jsonl", first), write_jsonl(tmp / "v2.jsonl", second)
    index(worker.settings, v1, target, *extra)
    worker.settle()
    before = worker.stats()["items"]
    summary = index(worker.settings, v2, target, "--prune", *extra)
    worker.settle()
    items = worker.stats()["items"] - before
    index(worker.settings, v2, fresh, *extra)
    return Reindexed(first, second, summary, items)
