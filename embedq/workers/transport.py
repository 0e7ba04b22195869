"""kombu's Redis transport, hardened for a worker that consumes queues anyone with Redis access can write.

A queue is a plain Redis list. An entry that is not a kombu envelope (``LPUSH embedq.x garbage``) makes
kombu's ``_brpop_read`` raise inside the event loop, which Celery treats as an unrecoverable error: one
bad entry would stop every worker of the queue in turn. This channel drops such an entry with a warning
that names only the reason (the entry may hold users' texts) and goes on. It carries no job id, so there
is no one to answer; well-formed messages with bad contents are answered with typed errors by
:mod:`embedq.workers.consumer`.
"""

from __future__ import annotations

import logging
from queue import Empty
from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)

_UNREADABLE = (ValueError, TypeError, KeyError, AttributeError, IndexError)  # JSON, UTF-8 and envelope errors


class Channel(kombu_redis.Channel):
    def _brpop_read(self, **options: Any) -> Any:
        try:
            return super()._brpop_read(**options)
        except _UNREADABLE as exc:
            log.warning("dropped a queue entry that is not a task message (%s)", type(exc).__name__)
            raise Empty() from None


class Transport(kombu_redis.Transport):
    Channel = Channel


def install() -> None:
    """Make ``redis://`` and ``rediss://`` URLs use this transport in this process (workers only)."""
    for scheme in ("redis", "rediss"):
        TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
