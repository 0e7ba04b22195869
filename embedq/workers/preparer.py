"""Bulk jobs of long texts in windows, tokenized off the consumer thread (issue 58).

A job with ``long_inputs="windows"`` is tokenized whole: every character of every text, however long (the character
limit applies first). On the consumer thread that would hold up every message behind it — a bulk fetch of long
documents, up to ``max_message_bytes`` each, takes seconds to tokenize, and an online job that arrives meanwhile
would wait in Redis for it. So the consumer hands a *heavy* job (bulk, in windows, more than :data:`HEAVY_CHARS`
characters) to the :class:`Preparer`'s thread, which tokenizes it (the tokenizer releases the GIL; the windows have
a tokenizer copy and a lock of their own: :class:`~embedq.backends.windowing.Windower`) and puts it into the
scheduler, while the consumer goes on reading messages. Online jobs, and bulk jobs of short texts, are tokenized on
the consumer thread as before. A job cancelled while it waits here is dropped when its turn comes; one still here
when the worker stops is never finished, and its message is handed back as a buffered job's is.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from embedq.batching.traffic import BULK

log = logging.getLogger(__name__)

#: Characters of a bulk windows job above which it is tokenized on the preparer's thread (~30 ms of tokenizing).
HEAVY_CHARS = 65_536


def _chars(texts: Any) -> int:
    if isinstance(texts, (list, tuple)):
        return sum(len(t) if isinstance(t, str) else 1 for t in texts)
    return 0


def heavy(job: Any) -> bool:
    """A bulk job in windows whose texts are long enough to tokenize off the consumer thread."""
    return (job.traffic_class == BULK and getattr(job.options, "windows", False)
            and _chars(job.texts) > HEAVY_CHARS)


class Preparer:
    """One thread that runs ``prepare(kind, jobs)`` for the heavy jobs handed to it, in order; started with the
    first of them. ``preparing`` counts the jobs handed over and not yet prepared."""

    def __init__(self, prepare: Callable[[str, list[Any]], None]) -> None:
        self._prepare = prepare
        self._queue: queue.SimpleQueue[tuple[str, list[Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.preparing = 0

    def put(self, kind: str, jobs: list[Any]) -> None:
        with self._lock:
            self.preparing += len(jobs)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="embedq-preparer", daemon=True)
                self._thread.start()
        self._queue.put((kind, jobs))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, jobs = item
            try:
                self._prepare(kind, jobs)
            except Exception:  # a job it could not prepare is failed by prepare itself; nothing may stop the thread
                log.exception("preparing %d heavy job(s) failed", len(jobs))
            finally:
                with self._lock:
                    self.preparing -= len(jobs)

    def close(self) -> None:
        """Stop the thread after the jobs handed to it so far (the caller does not wait)."""
        if self._thread is not None:
            self._queue.put(None)
