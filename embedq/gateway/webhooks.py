"""Webhooks of async jobs: ``POST /jobs`` with ``"webhook": "<url>"`` calls that URL once the job is done.

The call is a ``POST`` of the same JSON ``GET /jobs/{id}`` answers then (``status`` ``done`` with its
``result``, or ``failed`` with its ``error``), with the headers ``X-Embedq-Job: <id>`` and, when
``EMBEDQ_WEBHOOK_SECRET`` is set, ``X-Embedq-Signature: t=<unix time>,v1=<hex>``: HMAC-SHA256 of
``"<t>." + body`` under the secret (verify it, and refuse an old ``t``, to know the call is the gateway's).

Safe by default: a webhook is refused unless its URL is under a prefix of ``EMBEDQ_WEBHOOK_ALLOW`` (same scheme
and host, the path under the prefix's), so no caller can make the gateway call an address of its choosing;
redirects are not followed. A network error, a 5xx or a 429 is tried again (``EMBEDQ_WEBHOOK_ATTEMPTS`` calls,
pauses doubling from 1 s); another status ends it. The outcome is kept in the job's record (``webhook`` in
``GET /jobs/{id}``).

The gateway keeps no state of its own: a webhook owed is the job's id in the Redis set :data:`PENDING_KEY`,
and the replica delivering it holds a lease (:data:`LEASE_KEY`, renewed while it works). A replica that stops
or dies leaves the id in the set and its lease lapses; any replica's sweep (three a lease) claims it and
delivers it. A call can therefore come twice (a replica killed between the call and its record):
receivers should treat ``X-Embedq-Job`` as an idempotency key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import orjson

from embedq import __version__, errors

log = logging.getLogger(__name__)

#: Redis set of the async jobs whose webhook is owed.
PENDING_KEY = "embedq.gateway.webhooks"
#: A replica's claim on delivering one job's webhook (``EMBEDQ_WEBHOOK_LEASE`` seconds unless renewed).
LEASE_KEY = "embedq.gateway.webhook.lease.{}"
#: Seconds one call of a webhook may take.
CALL_TIMEOUT = 10.0


def allowed(url: str, prefixes: str | None) -> bool:
    """Whether ``url`` may be called: http(s), and under one of the comma-separated ``prefixes`` (same scheme,
    same host and port, its path under the prefix's path); ``*`` allows any http(s) URL."""
    try:
        parts = urlsplit(url)
        where = (parts.scheme, parts.hostname, parts.port)  # .port raises on a port that is not a number
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    for prefix in (p.strip() for p in (prefixes or "").split(",") if p.strip()):
        if prefix == "*":
            return True
        try:
            want = urlsplit(prefix)
            allowed_where = (want.scheme, want.hostname, want.port)
        except ValueError:
            continue
        if allowed_where == where and (parts.path or "/").startswith(want.path or "/"):
            return True
    return False


def signature(secret: bytes, timestamp: int, body: bytes) -> str:
    """``X-Embedq-Signature``'s value for ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


class Webhooks:
    """Delivery of the webhooks owed (see the module's docstring).

    ``record(id)`` reads a job's record (None once deleted or expired), ``wait(record)`` returns once every
    embedq job of it has an outcome, ``state(id, record)`` is the JSON ``GET /jobs/{id}`` answers, and
    ``save(id, record)`` stores the record again (its TTL kept)."""

    def __init__(self, redis: Any, *, secret: bytes | None, attempts: int, lease: float,
                 record: Callable[[str], Awaitable[dict[str, Any] | None]],
                 wait: Callable[[dict[str, Any]], Awaitable[None]],
                 state: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]],
                 save: Callable[[str, dict[str, Any]], Awaitable[None]],
                 on_outcome: Callable[[str], None] = lambda outcome: None) -> None:
        self.redis = redis
        self.secret = secret
        self.attempts = attempts
        self.lease_ms = max(1, int(lease * 1000))
        self._record, self._wait, self._state, self._save = record, wait, state, save
        self._on_outcome = on_outcome
        self.owner = uuid.uuid4().hex  # this replica, as its leases name it
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loop: asyncio.Task[None] | None = None
        self._http: Any = None

    async def start(self) -> None:
        import httpx

        self._http = httpx.AsyncClient(timeout=CALL_TIMEOUT, follow_redirects=False,
                                       headers={"User-Agent": f"embedq-gateway/{__version__}"})
        self._loop = asyncio.create_task(self._sweep_and_renew(), name="embedq-webhooks")

    async def close(self) -> None:
        """Stop: webhooks not yet delivered stay owed (their leases lapse; another replica takes them)."""
        tasks = [*self._tasks.values(), *([self._loop] if self._loop else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._http is not None:
            await self._http.aclose()

    async def owe(self, job_id: str) -> None:
        """Record that ``job_id``'s webhook is owed and start delivering it from this replica."""
        await self.redis.sadd(PENDING_KEY, job_id)
        if await self.redis.set(LEASE_KEY.format(job_id), self.owner, nx=True, px=self.lease_ms):
            self._start(job_id)

    def cancel(self, job_id: str) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    def _start(self, job_id: str) -> None:
        task = asyncio.create_task(self._deliver(job_id), name=f"embedq-webhook-{job_id}")
        self._tasks[job_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job_id, None))

    async def _sweep_and_renew(self) -> None:
        while True:
            try:
                await self._sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the next sweep tries again
                log.warning("cannot look at the owed webhooks (%s: %s)", type(exc).__name__, exc)
            await asyncio.sleep(self.lease_ms / 3000)

    async def _sweep(self) -> None:
        for job_id in list(self._tasks):  # leases of the deliveries under way: renewed
            await self.redis.pexpire(LEASE_KEY.format(job_id), self.lease_ms)
        for raw in await self.redis.smembers(PENDING_KEY):
            job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            if job_id in self._tasks:
                continue
            if await self.redis.set(LEASE_KEY.format(job_id), self.owner, nx=True, px=self.lease_ms):
                log.info("delivering the webhook of job %s (owed, no replica held it)", job_id)
                self._start(job_id)

    async def _deliver(self, job_id: str) -> None:
        try:
            record = await self._record(job_id)
            if record is None or "webhook" not in record:  # deleted or expired: nothing is owed any more
                await self.settle(job_id)
                return
            await self._wait(record)
            record = await self._record(job_id)
            if record is None:
                await self.settle(job_id)
                return
            outcome, detail = await self._call(job_id, record["webhook"]["url"], await self._state(job_id, record))
            record["webhook"].update(state=outcome, **detail)
            await self._save(job_id, record)
            self._on_outcome(outcome)
            await self.settle(job_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the lease lapses and a sweep tries again
            log.warning("webhook of job %s not delivered (%s: %s); it stays owed", job_id, type(exc).__name__, exc)

    async def settle(self, job_id: str) -> None:
        """Nothing is owed for ``job_id`` any more."""
        await self.redis.srem(PENDING_KEY, job_id)
        await self.redis.delete(LEASE_KEY.format(job_id))

    async def _call(self, job_id: str, url: str, state: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        import httpx

        body = orjson.dumps(state, option=orjson.OPT_SERIALIZE_NUMPY)
        pause, last = 1.0, ""
        for attempt in range(1, self.attempts + 1):
            headers = {"Content-Type": "application/json", "X-Embedq-Job": job_id}
            if self.secret is not None:
                headers["X-Embedq-Signature"] = signature(self.secret, int(time.time()), body)
            try:
                response = await self._http.post(url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 300:
                    return "delivered", {"attempts": attempt, "status_code": response.status_code}
                last = f"HTTP {response.status_code}"
                if response.status_code < 500 and response.status_code != 429:
                    return "failed", {"attempts": attempt, "status_code": response.status_code, "error": last}
            if attempt < self.attempts:
                await asyncio.sleep(pause)
                pause = min(pause * 2, 60.0)
        log.warning("webhook of job %s given up after %d calls (%s)", job_id, self.attempts, last)
        return "failed", {"attempts": self.attempts, "error": last}


def check_url(url: str, prefixes: str | None) -> str:
    """``url`` if it may be called, else the 422 that says why."""
    if not prefixes:
        raise errors.InvalidOption("webhooks are off on this gateway (EMBEDQ_WEBHOOK_ALLOW is not set)")
    if not allowed(url, prefixes):
        raise errors.InvalidOption(f"webhook {url!r} is not under an allowed prefix (EMBEDQ_WEBHOOK_ALLOW)")
    return url
