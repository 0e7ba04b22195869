"""Many results per round trip (:meth:`Collecting.collect`, mixed into the :class:`~embedq.producers.client.Client`):
stored records read with MGET, the jobs still running awaited on one subscription of their result channels, and
the records read deleted in one round trip."""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from collections.abc import Iterable
from typing import Any

from celery import Celery

from embedq import errors
from embedq.broker import BROKER_ERRORS
from embedq.producers.handle import DEADLINE_GRACE, DEFAULT_RESULT_TIMEOUT, WAIT_SLICE, JobHandle, ride_out

log = logging.getLogger(__name__)

#: Keys per MGET, DEL or SUBSCRIBE command of :meth:`Collecting.collect`.
COLLECT_KEYS = 1000


class Collecting:
    """The client's collect: uses its ``app``, ``settings``, ``epoch()``, its per-thread notification connection
    (``_listeners``) and the list of every such connection (``_all_listeners``, under ``_resend_lock``)."""

    app: Celery
    settings: Any
    _listeners: Any
    _all_listeners: list[Any]
    _resend_lock: Any

    def epoch(self, *, refresh: bool = False) -> str: ...

    def collect(self, handles: Iterable[JobHandle], timeout: float | None = DEFAULT_RESULT_TIMEOUT, *,
                return_exceptions: bool = False, forget: bool = True, decode: bool = True) -> list[Any]:
        """The results of many jobs, in the order of ``handles``: each what ``handle.result()`` returns (with
        ``decode=False``, what ``handle.payload()`` returns, for a caller that decodes payloads itself).

        Stored records are read many per round trip (MGET); the jobs still running are awaited on their
        result channels, all on one subscription, not polled. A failed job raises its typed error, as
        ``handle.result()`` does, as soon as it is read (the first in ``handles``' order of those read);
        the jobs still running go on and can be collected later. With ``return_exceptions=True`` (as in
        ``asyncio.gather``) each job's error takes its place in the list instead, and the jobs with no result
        after ``timeout`` seconds get :class:`~embedq.errors.JobTimeout` (else it is raised). As with
        ``handle.result()``: a job past its deadline ends :class:`~embedq.errors.Expired`, a broker that stays
        away ``broker_timeout`` raises :class:`~embedq.errors.BrokerUnavailable`, and jobs Redis lost, or
        with no result long after sending, are sent again. Every handle keeps its outcome. With ``forget``
        (the default) the records read are deleted from Redis, in one round trip.
        """
        handles = list(handles)
        try:
            unkept = self._gather(handles, timeout, fail_fast=not return_exceptions)
        finally:
            if forget:
                self._forget([h for h in handles if h._collected])
        if not return_exceptions:
            for handle in handles:
                error = handle._error if handle._error is not None else unkept.get(handle)
                if error is not None:
                    raise error
        out: list[Any] = []
        for handle in handles:
            error = handle._error if handle._error is not None else unkept.get(handle)
            if error is not None:
                out.append(error)
            else:
                assert handle._payload is not None
                out.append(handle._output(handle._payload) if decode else handle._payload)
        return out

    def _gather(self, handles: list[JobHandle], timeout: float | None, *,
                fail_fast: bool) -> dict[JobHandle, BaseException]:
        """Wait until every handle has its outcome (kept on the handle), ``timeout`` passes or, with
        ``fail_fast``, a job failed. Returns the errors a handle does not keep (a timeout, an error that is not
        embedq's): the same steps as :meth:`JobHandle._wait`, for many jobs at once."""
        backend = self.app.backend
        unkept: dict[JobHandle, BaseException] = {}
        waiting: dict[bytes, list[JobHandle]] = {}  # record key -> its handles without an outcome
        for handle in handles:
            if not handle._collected and handle not in unkept:
                waiting.setdefault(_key_bytes(backend.get_key_for_task(handle.id)), []).append(handle)
        if not waiting:
            return unkept
        start, wall = time.monotonic(), time.time()
        limit = math.inf if timeout is None else start + timeout
        expiry = {}  # past a job's deadline (and a grace for a job that started in time) nothing will come
        for key, some in waiting.items():
            ends = [start + (h.deadline.timestamp() - wall) + DEADLINE_GRACE for h in some if h.deadline is not None]
            if ends:
                expiry[key] = min(ends)
        failed = False

        def done(handle: JobHandle) -> None:
            if handle._client is not None:
                handle._client.pending.discard(handle)

        def take(key: bytes, raw: Any) -> None:
            """A job's stored record (from MGET or its notification)."""
            nonlocal failed
            some = waiting.get(key)
            if some is None or raw is None:
                return
            meta = backend.decode_result(raw)
            left = []
            for handle in some:
                try:
                    payload = handle._settle(backend, meta)
                except Exception as exc:  # the job's own error: a typed one is kept on the handle
                    if handle._error is None:
                        unkept[handle] = exc
                    failed = True
                    done(handle)
                    continue
                if payload is None:
                    left.append(handle)
                else:
                    handle._payload = payload
                    done(handle)
            if left:
                waiting[key] = left
            else:
                del waiting[key]
                expiry.pop(key, None)

        def read(keys: list[bytes]) -> None:
            if not keys:
                return
            pipe = backend.client.pipeline(transaction=False)
            for i in range(0, len(keys), COLLECT_KEYS):
                pipe.mget(keys[i:i + COLLECT_KEYS])
            for key, raw in zip(keys, (raw for chunk in pipe.execute() for raw in chunk)):
                take(key, raw)

        def listen(pubsub: Any, until: float, pong: str | None = None) -> bool:
            """Take the records published until ``until`` (or, with ``pong``, until that ping's answer)."""
            while True:
                left = until - time.monotonic()
                message = pubsub.get_message(timeout=max(left, 0.0))
                if message is None:
                    if left <= 0:
                        return False
                    continue
                if message["type"] == "message":
                    take(_key_bytes(message["channel"]), message["data"])
                    if pong is None and (not waiting or (fail_fast and failed)):
                        return True
                elif message["type"] == "pong" and pong is not None and _key_bytes(message["data"]) == pong.encode():
                    return True

        subscribed: list[bytes] = []

        def subscribe() -> Any:
            """This thread's result connection, subscribed to every waiting job's channel before this returns."""
            pubsub = self._listener(backend)
            keys = list(waiting)
            try:
                for i in range(0, len(keys), COLLECT_KEYS):
                    pubsub.subscribe(*keys[i:i + COLLECT_KEYS])
                token = uuid.uuid4().hex
                pubsub.ping(token)  # answered after every subscription took hold
                if not listen(pubsub, time.monotonic() + self.settings.broker_timeout, pong=token):
                    raise OSError("the result channels were not subscribed in time")
            except BaseException:
                self._drop_listener()  # its subscriptions are unknown now
                raise
            subscribed.extend(keys)
            return pubsub

        def check_lost(refresh: bool) -> None:
            """Has Redis lost jobs since they were sent (then every waiting job of this client is sent again),
            or has a job had no result long after sending (then it is)?"""
            if refresh:
                self.epoch(refresh=True)
            for some in list(waiting.values()):
                for handle in some:
                    if handle._client is not None:
                        handle._check_broker()
                        handle._maybe_resend()

        broker_timeout = self.settings.broker_timeout
        pubsub: Any = None
        down_since: float | None = None
        outage = False  # the broker did not answer: compare its epoch as soon as it answers again
        checked = start
        try:
            while waiting and not (fail_fast and failed):
                now = time.monotonic()
                if now >= limit:
                    for some in waiting.values():
                        for handle in some:
                            unkept[handle] = errors.JobTimeout(f"job {handle.id} has no result after {timeout}s")
                    break
                try:
                    if outage:
                        # Before taking any result: a restart may have lost jobs that a result arriving now
                        # would hide until the next check.
                        check_lost(refresh=True)
                        outage = False
                    overdue = [key for key, at in expiry.items() if at <= now]
                    if overdue:
                        read(overdue)
                        for key in overdue:
                            for handle in waiting.pop(key, ()):
                                handle._expire()
                                done(handle)
                                failed = True
                            expiry.pop(key, None)
                        continue
                    if pubsub is None:
                        read(list(waiting))
                        if not waiting or (fail_fast and failed):
                            break
                        pubsub = subscribe()
                        read(list(waiting))  # stored before the subscriptions took hold
                        checked = time.monotonic()
                        continue
                    listen(pubsub, min(checked + WAIT_SLICE, limit, min(expiry.values(), default=math.inf)))
                    if waiting and time.monotonic() >= checked + WAIT_SLICE:
                        read(list(waiting))  # a notification is lost while Redis restarts
                        check_lost(refresh=False)
                        checked = time.monotonic()
                    down_since = None
                except BROKER_ERRORS as exc:
                    self._drop_listener()
                    pubsub = None
                    outage = True
                    down_since = ride_out(down_since, broker_timeout, exc,
                                           f"{sum(map(len, waiting.values()))} jobs")
        finally:
            if pubsub is not None and subscribed:
                try:  # not waited for: the answers are read (and ignored) by the next collect on this thread
                    for i in range(0, len(subscribed), COLLECT_KEYS):
                        pubsub.unsubscribe(*subscribed[i:i + COLLECT_KEYS])
                except Exception:
                    self._drop_listener()
        return unkept

    def _listener(self, backend: Any) -> Any:
        """This thread's connection for result notifications (made once, like Celery's result consumer): a
        collect subscribes its jobs' channels on it and unsubscribes them when it returns."""
        pubsub = getattr(self._listeners, "pubsub", None)
        if pubsub is None:
            pubsub = backend.client.pubsub(ignore_subscribe_messages=True)
            self._listeners.pubsub = pubsub
            with self._resend_lock:
                self._all_listeners.append(pubsub)
        return pubsub

    def _drop_listener(self) -> None:
        """Close this thread's notification connection (after a broker error: the next collect makes another)."""
        pubsub = getattr(self._listeners, "pubsub", None)
        self._listeners.pubsub = None
        if pubsub is not None:
            with self._resend_lock:
                if pubsub in self._all_listeners:
                    self._all_listeners.remove(pubsub)
            with contextlib.suppress(Exception):
                pubsub.close()

    def _forget(self, handles: list[JobHandle]) -> None:
        """Delete the stored records of ``handles`` in one round trip (``result(forget=True)`` for many)."""
        handles = [h for h in handles if not h._forgotten]
        if not handles:
            return
        backend = self.app.backend
        keys = [backend.get_key_for_task(h.id) for h in handles]
        try:
            pipe = backend.client.pipeline(transaction=False)
            for i in range(0, len(keys), COLLECT_KEYS):
                pipe.delete(*keys[i:i + COLLECT_KEYS])
            pipe.execute()
        except BROKER_ERRORS as exc:
            log.warning("could not delete %d collected results (%s: %s); they expire after EMBEDQ_RESULT_TTL",
                        len(keys), type(exc).__name__, exc)
        else:
            for handle in handles:
                handle._forgotten = True
        # a handle that waited through Celery (JobHandle.result) is subscribed there: unsubscribe it, as forget does
        consumer = getattr(backend, "result_consumer", None)
        subscribed = getattr(consumer, "subscribed_to", None)
        if subscribed:
            for handle, key in zip(handles, keys):
                if key in subscribed:
                    consumer.cancel_for(handle.id)


def _key_bytes(value: Any) -> bytes:
    """A Redis key or channel name as bytes (redis-py answers bytes unless it decodes responses)."""
    return value if isinstance(value, bytes) else str(value).encode()
