"""Online admission at the gateway: who sent a request (its identity, by which workers share their time), what each
identity has in flight here, and the decision to answer 429 at once, taken on the event loop.

* **Identity**: the request's bearer token, hashed (``key:`` and 16 hex digits of its SHA-256: never the key
  itself, in no message and no log), else its peer address (``addr:<host>``). It goes with every job of the request
  as the Client's ``client=`` (message header ``embedq_client``).
* **In flight**: the texts of each identity's synchronous requests on each queue, from admission to their end
  (answered, failed, or abandoned by a client that disconnected): exact, as this process sees every request end.
  They are each identity's own backlog in the admission model (:mod:`embedq.admission`).
* **The decision** runs on the event loop from the last reads of the registry and the queue's length, refreshed in
  a thread when older than :data:`REFRESH` seconds (awaited only when older than :data:`STALE`): a refused request
  costs no Redis round trip and no thread, so its 429 goes out at once. An admitted request reserves its texts
  before anything else awaits, so requests racing each other all see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

from fastapi import Request

from embedq.producers.client import Client

#: Seconds after which the reads admission decides on are refreshed (in a thread, not awaited).
REFRESH = 0.05
#: Seconds after which a request awaits the refresh before the decision.
STALE = 1.0


def identity(request: Request) -> str:
    """Who sent ``request``: ``key:<hash of its bearer token>``, else ``addr:<peer host>``."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    peer = request.client
    return f"addr:{peer.host if peer is not None else '?'}"


class GatewayAdmission:
    """The in-flight table and the event-loop decision of one gateway process (one event loop: no locks)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.admission = client.admission
        #: queue -> identity -> texts of its synchronous requests in flight
        self.inflight: dict[str, dict[str, int]] = {}
        self.admission.outstanding = self.outstanding
        self._refreshing: dict[str, asyncio.Future[Any]] = {}

    def outstanding(self, queue: str) -> dict[str, int]:
        return self.inflight.get(queue, {})

    def _refresh(self, queue: str) -> asyncio.Future[Any]:
        running = self._refreshing.get(queue)
        if running is None:
            running = asyncio.ensure_future(asyncio.to_thread(self.admission.refresh, self.client.redis(), queue))
            self._refreshing[queue] = running
            running.add_done_callback(lambda _f: self._refreshing.pop(queue, None))
        return running

    async def admit(self, queue: str, jobs: int, texts: int, who: str) -> None:
        """Admit (and reserve) ``texts`` texts of ``who`` on ``queue``, or raise Overloaded at once."""
        if not self.admission.enabled:
            self._reserve(queue, who, texts)
            return
        age = self.admission.age(queue)
        if age > REFRESH:
            refreshing = self._refresh(queue)
            if age > STALE:
                await asyncio.shield(refreshing)
        self.admission.decide_cached(queue, jobs, texts, who)  # raises Overloaded: nothing reserved, nothing sent
        self._reserve(queue, who, texts)

    def _reserve(self, queue: str, who: str, texts: int) -> None:
        table = self.inflight.setdefault(queue, {})
        table[who] = table.get(who, 0) + texts

    def release(self, queue: str, who: str, texts: int) -> None:
        table = self.inflight.get(queue, {})
        left = table.get(who, 0) - texts
        if left > 0:
            table[who] = left
        else:
            table.pop(who, None)

    @contextlib.contextmanager
    def held(self, queue: str, who: str, texts: int) -> Iterator[None]:
        """Releases the reservation of an admitted request when it ends, however it ends."""
        try:
            yield
        finally:
            self.release(queue, who, texts)
