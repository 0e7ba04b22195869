"""Re-indexing a corpus that changed (issue 57, acceptance b), for every output the tests index into.

:func:`versions` makes two versions of the corpus: the first (4,000 texts, ids ``doc-N``) and the second, with 10 % of
the texts edited, 5 % of the ids removed and 5 % new ids. :func:`index` runs ``embedq index`` as a user does (the CLI,
in a process of its own: ``indexdb.run``), :func:`fake_worker` is a module fixture's gated fake-model worker, and
:func:`reindex_case` runs the whole scenario against one output: the first version indexed, the second indexed into
the same output with ``--prune`` (the worker's ``items`` counter says how many texts reached the model), and a fresh
full run on the second version into another output; a test then compares the two outputs with its database's reader
(same ids, vectors within 1e-6).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import FAKE, WorkerHandle, gated_handle, load_corpus
from indexdb import run

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


def index(settings: Settings, src: Path, out: str, *extra: str) -> dict[str, Any]:
    """Run ``embedq index SRC -o OUT`` to its end (``indexdb.run``); its JSON summary (a failed run fails the test)."""
    code, summary, out_text = run(settings, src, out, *extra)
    assert code == 0, out_text
    return summary


def fake_worker(redis_server: Any, root: Path, queue: str) -> Iterator[WorkerHandle]:
    """A module's fixture body: a gated worker of the fake model on a queue of its own (its gate open unless a test
    closes it), stopped after the module."""
    handle = gated_handle(Settings(broker_url=redis_server.url, queue=queue, **FAKE), root / "worker.log")
    yield handle
    handle.stop()


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
