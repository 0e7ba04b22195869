"""kombu's Redis transport, hardened for a worker that consumes queues anyone with Redis access can write.

A queue is a plain Redis list. An entry that is not a kombu envelope (``LPUSH embedq.x garbage``) makes
kombu's ``_brpop_read`` raise inside the event loop, which Celery treats as an unrecoverable error: one
bad entry would stop every worker of the queue in turn. This channel drops such an entry with a warning
that names only the reason (the entry may hold users' texts) and goes on. It carries no job id, so there
is no one to answer; well-formed messages with bad contents are answered with typed errors by
:mod:`embedq.workers.consumer`.

It also decides which of its queues a BRPOP asks, and in which order: :data:`fetch_order` (set by the
worker) names the queues the prefetch window admits now, online before bulk. kombu's own order is a
round robin, under which a worker saturated with bulk jobs would take an online job only every other
fetch, and only once a bulk job freed room.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from queue import Empty
from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)

_UNREADABLE = (ValueError, TypeError, KeyError, AttributeError, IndexError)  # JSON, UTF-8 and envelope errors


#: Set by the worker: given a channel's queues, those to fetch from now, in the order to ask them.
fetch_order: Callable[[list[str]], list[str]] | None = None


class _FetchOrder:
    """Stands in for kombu's queue cycle: ``consume`` returns what :data:`fetch_order` admits now."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def update(self, queues: Any) -> None:
        pass

    def consume(self, n: int) -> list[str]:
        return self.channel.fetchable()

    def rotate(self, last_used: Any) -> None:
        pass


class QoS(kombu_redis.QoS):
    def can_consume(self) -> bool:
        if not super().can_consume():
            return False
        channel = self.channel
        return not channel.active_queues or bool(channel.fetchable())


class Channel(kombu_redis.Channel):
    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queue_cycle = _FetchOrder(self)

    def fetchable(self) -> list[str]:
        queues = self.active_queues
        return queues if fetch_order is None or not queues else fetch_order(queues)

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
