"""Waiting for job results in asyncio: thousands of HTTP requests wait on one Redis connection, no thread each.

A job's outcome is the record :class:`embedq.results.ResultStore` writes: Celery's Redis-backend record under
``celery-task-meta-<id>``, published on a channel of the same name when it is stored. :class:`AsyncResults`
keeps one pub/sub connection subscribed to the channels of the jobs it waits for, reads the key once right
after subscribing (a job that finished before the subscription) and reads every waiting key again every
:data:`POLL_SECONDS` (a notification lost while Redis restarted; a waiter whose SUBSCRIBE fails while Redis restarts
waits on, read by the poller, which subscribes its key again once Redis answers). Records are named and read as every
reader reads them (:func:`embedq.results.record_key`, :func:`embedq.results.read_outcome`: the app's own result
backend decodes them), so a failed job raises its typed :class:`~embedq.errors.EmbedqError`, as ``JobHandle.result``
does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from celery import Celery
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from embedq import acl, errors
from embedq.results import as_key, read_outcome, record_key

log = logging.getLogger(__name__)

#: Seconds between reads of every waited key (notifications can be lost; a record is never missed for long).
POLL_SECONDS = 1.0
#: Redis connections of one gateway process's commands (the pub/sub connection is one of them); a command
#: waits for a free one (up to POOL_WAIT seconds) instead of failing when thousands of requests read at once.
MAX_CONNECTIONS = 32
POOL_WAIT = 30.0
#: Errors of a broker that is away (restarting, unreachable): a waiter rides them out (its job is sent again by the
#: client's epoch check where Redis lost it), as the poller does.
BROKER_AWAY = (RedisConnectionError, RedisTimeoutError, OSError)


class AsyncResults:
    """Outcomes of jobs by id, awaited on one pub/sub connection (see the module's docstring)."""

    def __init__(self, app: Celery, redis: Any, url: str = "") -> None:
        """``redis``: an asyncio redis-py client of the result store (``embedq.broker.async_redis_client``: its
        commands wait for one of :data:`MAX_CONNECTIONS` connections rather than fail); ``url``: its URL."""
        self.backend = app.backend  # used only to name, decode and delete records: no I/O through it
        self.redis = redis
        self.url = url  # named in a refusal
        self.pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        self._waiting: dict[bytes, set[asyncio.Future[bytes]]] = {}  # a key may have several waiters
        self._tasks: list[asyncio.Task[None]] = []
        self._subscribed = asyncio.Event()
        self._background: set[asyncio.Future[Any]] = set()
        # keys read (to delete) and keys no one waits for (to unsubscribe from), sent together once per turn of
        # the event loop: the results of one micro-batch arrive together, and their requests end together
        self._read: set[bytes] = set()
        self._unwatched: set[bytes] = set()
        self._tidy: asyncio.Future[Any] | None = None
        self._unsubscribed: set[bytes] = set()  # waited-for keys whose SUBSCRIBE failed (see _subscribe)
        self._connecting = asyncio.Lock()

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._listen(), name="embedq-results-listen"),
                       asyncio.create_task(self._poll(), name="embedq-results-poll")]

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=5)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self.pubsub.aclose()
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    def key(self, job_id: str) -> bytes:
        return record_key(self.backend, job_id)

    async def wait(self, job_id: str, timeout: float | None, *, forget: bool = True) -> dict[str, Any]:
        """The job's result payload (the dict its worker stored), deleted from Redis once read unless not
        ``forget``; raises the job's typed error, or :class:`~embedq.errors.JobTimeout` after ``timeout``
        seconds."""
        key = self.key(job_id)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        waiters = self._waiting.setdefault(key, set())
        waiters.add(future)
        try:
            if len(waiters) == 1:
                await self._subscribe(key)
            try:
                stored = await self.redis.get(key)  # stored before the subscription took effect
            except acl.CAUGHT as exc:  # refused (the gateway's user may not read results): no wait would end
                if acl.refusal(exc) is None:
                    raise
                raise acl.forbidden(exc, self.url) from None
            except BROKER_AWAY as exc:  # Redis went away just now: the poller reads the key once it is back
                log.info("result of job %s: waiting for the broker (%s: %s)", job_id, type(exc).__name__, exc)
                stored = None
            if stored is not None and not future.done():
                future.set_result(stored)
            try:
                raw = await asyncio.wait_for(future, timeout)
            except asyncio.TimeoutError:
                raise errors.JobTimeout(f"job {job_id} has no result after {timeout}s") from None
        finally:
            waiters.discard(future)
            if not waiters and self._waiting.get(key) is waiters:
                del self._waiting[key]
                self._unwatched.add(key)
                self._schedule_tidy()
        if forget:  # read once: it does not stay in Redis for its TTL (off the answer's path)
            self._read.add(key)
            self._schedule_tidy()
        return self.decode(raw)

    async def _subscribe(self, *keys: bytes) -> None:
        """SUBSCRIBE to ``keys``; where that fails, the poller reads them and subscribes them again later.

        Any error counts, not just :data:`BROKER_AWAY`: redis-py's pub/sub connection is shared with the listener,
        which disconnects and reconnects it when Redis restarts, and a SUBSCRIBE sent in between fails on the
        half-reconnected connection (``AttributeError: 'NoneType' object has no attribute 'writelines'``, redis-py
        8.1). A notification only makes an answer earlier; the poller's read makes it certain."""
        try:
            if self.pubsub.connection is None:
                # One connection, not one each: redis-py's PubSub takes a connection from the pool for every
                # SUBSCRIBE that finds it unconnected, so the first 40 requests of a fresh gateway took all 32 of
                # the pool's connections (the requests' GETs then waited POOL_WAIT for one) and leaked all but one.
                async with self._connecting:
                    if self.pubsub.connection is None:
                        await self.pubsub.connect()
            await self.pubsub.subscribe(*keys)
        except Exception as exc:
            log.info("cannot subscribe to %d result channel(s) now (%s: %s); polling them", len(keys),
                     type(exc).__name__, exc)
            self._unsubscribed.update(keys)
            return
        self._unsubscribed.difference_update(keys)
        self._subscribed.set()

    def _schedule_tidy(self) -> None:
        if self._tidy is None:
            self._tidy = asyncio.ensure_future(self._tidy_up())
            self._background.add(self._tidy)
            self._tidy.add_done_callback(self._done)

    async def _tidy_up(self) -> None:
        """One UNSUBSCRIBE and one DEL for the keys of every request that ended in this turn of the loop."""
        await asyncio.sleep(0)
        self._tidy = None
        read, self._read = self._read, set()
        unwatched = [k for k in self._unwatched if k not in self._waiting]  # not waited for again meanwhile
        self._unwatched = set()
        if unwatched:
            await self.pubsub.unsubscribe(*unwatched)
        if read:
            await self.redis.delete(*read)

    def _done(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("cannot delete read results or unsubscribe (%s)", task.exception())

    def decode(self, raw: bytes) -> dict[str, Any]:
        """A stored record's result payload; raises the job's error, or :class:`~embedq.errors.BackendError` for a
        record with no outcome (a state that is not final: embedq stores only final ones)."""
        outcome = read_outcome(self.backend, raw)
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is None:
            raise errors.BackendError("the job's stored record holds no outcome")
        return outcome

    def _deliver(self, key: bytes, raw: bytes) -> None:
        for future in self._waiting.get(key, ()):
            if not future.done():
                future.set_result(raw)

    async def _listen(self) -> None:
        while True:
            if not self.pubsub.subscribed:
                self._subscribed.clear()
                await self._subscribed.wait()
            try:
                message = await self.pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the connection dropped: the poller covers the gap; pub/sub reconnects
                log.warning("result notifications interrupted (%s: %s)", type(exc).__name__, exc)
                await asyncio.sleep(0.5)
                continue
            if message and message.get("type") == "message":
                self._deliver(as_key(message["channel"]), message["data"])

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            keys = list(self._waiting)
            if not keys:
                continue
            try:
                values = await self.redis.mget(keys)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cannot read job results (%s: %s)", type(exc).__name__, exc)
                continue
            for key, raw in zip(keys, values):
                if raw is not None:
                    self._deliver(key, raw)
            # Redis answers again: subscribe the keys whose SUBSCRIBE failed and that are still waited for
            self._unsubscribed.intersection_update(self._waiting)
            if self._unsubscribed:
                await self._subscribe(*self._unsubscribed)
