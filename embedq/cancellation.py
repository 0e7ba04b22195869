"""Cancelling jobs: producers announce a cancelled job id on a Redis stream; every worker follows it.

A stream (not a remote-control broadcast) because a cancelled job may still wait in a queue when the
worker that will receive it starts: a worker reads the last :data:`RETENTION` seconds of announcements
when it starts and then follows new ones, so it drops a cancelled job whenever it meets it — in its
buffer (before its first micro-batch) or on delivery. Entry ids are Redis's own clock, so producers'
clocks do not matter. Imports no torch (producers use it).
"""

from __future__ import annotations

import time
from typing import Any

from celery.utils.collections import LimitedSet

from embedq.keys import CANCELLED_STREAM

RETENTION = 24 * 3600  # seconds a cancellation is remembered (by the stream and by each worker)
MAXLEN = 100_000  # announcements kept at most (approximate trimming)
READ_COUNT = 1000


def announce(client: Any, job_id: str) -> None:
    """Producer side: every worker drops ``job_id`` if it has not started it."""
    client.xadd(CANCELLED_STREAM, {"id": job_id}, maxlen=MAXLEN, approximate=True)


class CancelFeed:
    """Worker side: the ids cancelled in the last RETENTION seconds, kept current by :meth:`poll`."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.cancelled = LimitedSet(maxlen=MAXLEN, expires=RETENTION)
        self.last_id: str | None = None
        self.synced = 0.0  # monotonic time of the last successful read

    def poll(self) -> list[str]:
        """Read the announcements since the last call (at the first call, those of the last RETENTION
        seconds); returns the new ids. Raises the broker's errors."""
        if self.last_id is None:
            seconds, micros = self.client.time()
            self.last_id = f"{max(int(seconds * 1000 + micros // 1000) - RETENTION * 1000, 0)}-0"
        started = time.monotonic()
        new: list[str] = []
        while True:
            reply = self.client.xread({CANCELLED_STREAM: self.last_id}, count=READ_COUNT)
            entries = reply[0][1] if reply else []
            for entry_id, fields in entries:
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                job_id = fields.get(b"id", fields.get("id"))
                if job_id is None:
                    continue
                job_id = job_id.decode() if isinstance(job_id, bytes) else str(job_id)
                self.cancelled.add(job_id)
                new.append(job_id)
            if len(entries) < READ_COUNT:
                break
        self.synced = started
        return new

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.cancelled
