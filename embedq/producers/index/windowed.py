"""Documents longer than the model, indexed one row per window (issue 58: ``embedq index --long-inputs windows``).

A run with windows sends its jobs with ``long_inputs="windows", pool_windows=False`` (:func:`window_options`): the
worker cuts each text into windows of the model's length and answers one output per window, with its character span
(``embedq/windows.py``). The indexer writes one row per window: the document's ``id``, the window's number
``window`` (0, 1, ... within its document), its characters ``[start, end)`` in the document's text, the kind's
columns, and with ``--store-text`` the window's text (``text[start:end]``). The key of a row is (id, window).

What holds whatever the sink (each stores the key its own way: ``docs/INDEXING.md``):

* a document's windows are written together and committed together (or, where the database has no transaction,
  a document whose windows are not all there is removed by the next run before it is embedded again): a resumed run
  sees each document whole or not at all, and skips it by its id and content hash as it skips a text;
* an edited document has *all* its old windows replaced (its window count may change); ``--prune`` removes every
  window of an id the input no longer has;
* a text that needs more windows than the worker's ``max_windows`` fails alone (the result's ``failed`` list): it
  goes to the errors file, its job-mates are written;
* rows are not read back by content hash (``--reuse`` is refused; a repeated text rides with the job that carries
  it, or is embedded again).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from embedq import errors
from embedq.protocol import decode_array

#: The columns a windows output adds after ``id``, in order (int32 each).
COLUMNS = ("window", "start", "end")
#: What ``--long-inputs`` takes: the job option ``long_inputs`` (``error`` is ``--no-truncate``).
LONG_INPUTS = ("truncate", "error", "windows")


def window_options(long_inputs: str, overlap: int | None) -> dict[str, Any]:
    """The job options of ``--long-inputs`` and ``--window-overlap``: ``truncate`` none (the default), ``error`` the
    options of ``--no-truncate`` (so an output made with it continues), ``windows`` per-window outputs."""
    if overlap is not None and long_inputs != "windows":
        raise errors.InvalidOption("--window-overlap applies only with --long-inputs windows")
    if long_inputs == "error":
        return {"truncate": False}
    if long_inputs == "windows":
        return {"long_inputs": "windows", "pool_windows": False, **({"window_overlap": overlap} if overlap else {})}
    return {}


def per_window(options: dict[str, Any]) -> bool:
    """Whether an output of these (storage or job) options holds one row per window."""
    return options.get("long_inputs") == "windows" and options.get("pool_windows", True) is False


@dataclass(frozen=True)
class WindowRows:
    """The window columns of the rows a sink writes (one entry per row): the window's number in its document, its
    characters ``[start, end)``, and how many windows its document has (``count``: what tells a sink without
    transactions a whole document from a part of one)."""

    window: np.ndarray
    start: np.ndarray
    end: np.ndarray
    count: np.ndarray

    def __len__(self) -> int:
        return len(self.window)

    def take(self, index: Any) -> WindowRows:
        return WindowRows(self.window[index], self.start[index], self.end[index], self.count[index])

    def columns(self) -> dict[str, np.ndarray]:
        """:data:`COLUMNS` as int32 arrays."""
        return {"window": self.window, "start": self.start, "end": self.end}

    def arrow(self) -> dict[str, Any]:
        """:data:`COLUMNS` as pyarrow int32 arrays."""
        import pyarrow as pa

        return {name: pa.array(values, pa.int32()) for name, values in self.columns().items()}

    def keys(self, ids: list[str]) -> list[str]:
        """Each row's key as one string, ``id#window`` (Milvus's primary key)."""
        return [f"{doc_id}#{w}" for doc_id, w in zip(ids, self.window.tolist())]


@dataclass
class Expanded:
    """Documents' rows, ready for ``Sink.write``: per row its document's id, hash and text (the window's, where texts
    are stored), the rows of the result's data to take, and the window columns."""

    ids: list[str]
    rows: list[int]
    texts: list[str]
    hashes: list[bytes]
    windows: WindowRows


def groups(payload: dict[str, Any]) -> tuple[list[range], np.ndarray]:
    """A per-window result's rows per input (a failed text: none), and every window's span (windows x 2)."""
    offsets = decode_array(payload["window_offsets"]).tolist()
    spans = decode_array(payload["window_spans"]).reshape(-1, 2).astype(np.int32)
    return [range(a, b) for a, b in itertools.pairwise(offsets)], spans


def expand(docs: list[tuple[str, str, bytes, int]], rows_of: list[range], spans: np.ndarray) -> Expanded:
    """``docs`` (id, text, content hash, its input's index in the result) as one row per window."""
    ids: list[str] = []
    rows: list[int] = []
    texts: list[str] = []
    hashes: list[bytes] = []
    number: list[int] = []
    count: list[int] = []
    for doc_id, text, content_hash, i in docs:
        group = rows_of[i]
        n = len(group)
        ids += [doc_id] * n
        hashes += [content_hash] * n
        rows += group
        number += range(n)
        count += [n] * n
        texts += [text[int(spans[k, 0]):int(spans[k, 1])] for k in group]
    at = np.asarray(rows, dtype=np.int64)
    windows = WindowRows(np.asarray(number, np.int32), spans[at, 0] if len(at) else np.zeros(0, np.int32),
                         spans[at, 1] if len(at) else np.zeros(0, np.int32), np.asarray(count, np.int32))
    return Expanded(ids, rows, texts, hashes, windows)


def documents(ids: list[str]) -> list[str]:
    """The distinct document ids of rows, in order."""
    return list(dict.fromkeys(ids))


def whole_documents(rows: list[tuple[str, int, int]]) -> tuple[set[str], set[str]]:
    """Rows ``(id, window, count)`` as a sink without transactions holds them: the ids whose windows are all there
    (0 .. count-1, once each) and those with only a part of them (a run killed while it was writing them)."""
    seen: dict[str, tuple[set[int], int]] = {}
    for doc_id, window, count in rows:
        have, want = seen.setdefault(doc_id, (set(), int(count)))
        have.add(int(window))
        if int(count) != want:
            seen[doc_id] = (have, -1)
    whole = {doc_id for doc_id, (have, want) in seen.items() if want >= 0 and have == set(range(want))}
    return whole, set(seen) - whole
