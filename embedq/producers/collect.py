"""A client's one synchronous waiter (:class:`Collector`, the :class:`~embedq.producers.client.Client`'s
``collector``): ``Client.collect`` for many jobs and ``JobHandle.result`` for one. Stored records are read with MGET,
the jobs still running awaited on one subscription of their result channels, and the records read deleted in one
round trip. Records are read as every reader reads them (:func:`embedq.results.read_outcome`)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from celery import Celery

from embedq import acl, errors
from embedq.broker import BROKER_ERRORS
from embedq.producers.handle import DEADLINE_GRACE, DEFAULT_RESULT_TIMEOUT, JobHandle
from embedq.producers.pending import Pending
from embedq.results import as_key, read_outcome, record_key

log = logging.getLogger(__name__)

#: Keys per MGET, DEL or SUBSCRIBE command of :meth:`Collector.collect`.
COLLECT_KEYS = 1000
#: Seconds between checks, while a producer waits, that the broker is there and still holds its jobs.
WAIT_SLICE = 2.0


class Listeners:
    """Each thread's connection for result notifications (made once, like Celery's result consumer): a wait
    subscribes its jobs' channels on it and unsubscribes them when it returns."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()

    def get(self, backend: Any) -> Any:
        pubsub = getattr(self._local, "pubsub", None)
        if pubsub is None:
            pubsub = backend.client.pubsub(ignore_subscribe_messages=True)
            self._local.pubsub = pubsub
            with self._lock:
                self._all.append(pubsub)
        return pubsub

    def drop(self) -> None:
        """Close this thread's connection (after a broker error: the next wait makes another)."""
        pubsub = getattr(self._local, "pubsub", None)
        self._local.pubsub = None
        if pubsub is not None:
            with self._lock:
                if pubsub in self._all:
                    self._all.remove(pubsub)
            with contextlib.suppress(Exception):
                pubsub.close()

    def close(self) -> None:
        """Close every thread's connection."""
        with self._lock:
            listeners, self._all = self._all, []
        for pubsub in listeners:
            with contextlib.suppress(Exception):
                pubsub.close()


class Collector:
    """Waits for the outcomes of a client's jobs, many per round trip, and deletes the records it read."""

    def __init__(self, app: Celery, pending: Pending, *, broker_timeout: float) -> None:
        """``app``: its result backend names and decodes records (thread-local, as Celery keeps it); ``pending``: the
        client's jobs not collected yet (those collected leave it; those waited for are sent again when lost);
        ``broker_timeout``: seconds a wait rides out a broker that does not answer."""
        self.app = app
        self.pending = pending
        self.broker_timeout = broker_timeout
        self.listeners = Listeners()

    def collect(self, handles: Iterable[JobHandle], timeout: float | None = DEFAULT_RESULT_TIMEOUT, *,
                return_exceptions: bool = False, forget: bool = True, decode: bool = True) -> list[Any]:
        """``Client.collect`` (see there)."""
        handles = list(handles)
        wait = _Wait(self, handles, timeout, fail_fast=not return_exceptions)
        try:
            unkept = wait.run()
        finally:
            collected = [h for h in handles if h.collected]
            self.pending.discard_all([*collected, *wait.ended])  # nothing to send again
            if forget:
                self.forget(collected)
        found: list[BaseException | None] = []  # each handle's error (kept on it, or not)
        for handle in handles:
            error: BaseException | None = handle.error
            found.append(unkept.get(handle) if error is None and unkept else error)
        if not return_exceptions:  # the first error in the handles' order, before any result is decoded
            for error in found:
                if error is not None:
                    raise error
        return [handle.output(decode=decode) if error is None else error for handle, error in zip(handles, found)]

    def forget(self, handles: Iterable[JobHandle]) -> None:
        """Delete the stored records of ``handles`` in one round trip; a broker that does not answer is logged (the
        records expire after ``EMBEDQ_RESULT_TTL``)."""
        handles = [h for h in handles if not h.forgotten]
        if not handles:
            return
        backend = self.app.backend
        keys = [record_key(backend, h.id) for h in handles]
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
                handle.forgotten = True

    def close(self) -> None:
        self.listeners.close()


class _Wait:
    """One wait of :meth:`Collector.collect`: until every handle has its outcome (kept on the handle), the timeout
    passes or, with ``fail_fast``, a job failed. Its state: the handles still waiting by record key, when each key's
    jobs expire, the errors no handle keeps (a timeout, an error that is not embedq's), whether a job failed, and
    the notification connection with the channels it subscribed."""

    def __init__(self, collector: Collector, handles: list[JobHandle], timeout: float | None, *,
                 fail_fast: bool) -> None:
        self.backend = collector.app.backend
        self.url = collector.app.conf.result_backend or collector.app.conf.broker_url  # named in a refusal
        self.pending = collector.pending
        self.listeners = collector.listeners
        self.broker_timeout = collector.broker_timeout
        self.timeout = timeout
        self.fail_fast = fail_fast
        self.unkept: dict[JobHandle, BaseException] = {}
        self.ended: list[JobHandle] = []  # the handles whose record holds an error they do not keep
        self.failed = False
        self.waiting: dict[bytes, list[JobHandle]] = {}  # record key -> its handles without an outcome
        for handle in handles:
            if not handle.collected:
                self.waiting.setdefault(record_key(self.backend, handle.id), []).append(handle)
        self.start, wall = time.monotonic(), time.time()
        self.limit = math.inf if timeout is None else self.start + timeout
        self.expiry: dict[bytes, float] = {}  # past a job's deadline (and a grace for one started in time): nothing
        for key, some in self.waiting.items():
            ends = [self.start + (h.deadline.timestamp() - wall) + DEADLINE_GRACE for h in some
                    if h.deadline is not None]
            if ends:
                self.expiry[key] = min(ends)
        self.pubsub: Any = None
        self.subscribed: list[bytes] = []

    @property
    def over(self) -> bool:
        return not self.waiting or (self.fail_fast and self.failed)

    def run(self) -> dict[JobHandle, BaseException]:
        """Wait; the errors no handle keeps."""
        down_since: float | None = None
        outage = False  # the broker did not answer: compare its epoch as soon as it answers again
        checked = self.start
        try:
            while not self.over:
                if time.monotonic() >= self.limit:
                    for handle in self.handles():
                        self.unkept[handle] = errors.JobTimeout(f"job {handle.id} has no result after {self.timeout}s")
                    break
                try:
                    if outage:
                        # Before taking any result: a restart may have lost jobs that a result arriving now
                        # would hide until the next check.
                        self.pending.check(self.handles(), refresh=True)
                        outage = False
                    if self.expire():
                        continue
                    if self.pubsub is None:
                        self.read(list(self.waiting))
                        if self.over:
                            break
                        self.subscribe()
                        self.read(list(self.waiting))  # stored before the subscriptions took hold
                        if self.waiting:  # a job sent long ago may have been lost
                            self.pending.check(self.handles())
                        checked = time.monotonic()
                        continue
                    self.listen(min(checked + WAIT_SLICE, self.limit, min(self.expiry.values(), default=math.inf)))
                    if self.waiting and time.monotonic() >= checked + WAIT_SLICE:
                        self.read(list(self.waiting))  # a notification is lost while Redis restarts
                        self.pending.check(self.handles())
                        checked = time.monotonic()
                    down_since = None
                except acl.CAUGHT as exc:  # refused: not an outage, waiting changes nothing
                    if acl.refusal(exc) is None:
                        raise
                    raise acl.forbidden(exc, self.url) from None
                except BROKER_ERRORS as exc:
                    self.drop()
                    outage = True
                    waiting = self.handles()
                    down_since = ride_out(down_since, self.broker_timeout, exc,
                                          f"job {waiting[0].id}" if len(waiting) == 1 else f"{len(waiting)} jobs")
        finally:
            self.unsubscribe()
        return self.unkept

    def handles(self) -> list[JobHandle]:
        """The handles still waiting."""
        return [handle for some in self.waiting.values() for handle in some]

    def take(self, key: bytes, raw: Any) -> None:
        """A job's stored record (from MGET or its notification)."""
        some = self.waiting.get(key)
        if some is None or raw is None:
            return
        outcome = read_outcome(self.backend, raw)
        if outcome is None:
            return
        del self.waiting[key]
        self.expiry.pop(key, None)
        for handle in some:
            handle.keep(outcome)  # a typed error stays on the handle, as a result does
        if isinstance(outcome, BaseException):
            self.failed = True
            for handle in some:
                if handle.error is None:
                    self.unkept[handle] = outcome
                    self.ended.append(handle)

    def read(self, keys: list[bytes]) -> None:
        if not keys:
            return
        pipe = self.backend.client.pipeline(transaction=False)
        for i in range(0, len(keys), COLLECT_KEYS):
            pipe.mget(keys[i:i + COLLECT_KEYS])
        for key, raw in zip(keys, (raw for chunk in pipe.execute() for raw in chunk)):
            self.take(key, raw)

    def expire(self) -> bool:
        """The jobs past their deadline (and its grace) end ``expired``, unless their record is there now."""
        now = time.monotonic()
        overdue = [key for key, at in self.expiry.items() if at <= now]
        if not overdue:
            return False
        self.read(overdue)
        for key in overdue:
            for handle in self.waiting.pop(key, ()):
                handle.expire()
                self.failed = True
            self.expiry.pop(key, None)
        return True

    def listen(self, until: float, pong: str | None = None) -> bool:
        """Take the records published until ``until`` (or, with ``pong``, until that ping's answer)."""
        while True:
            left = until - time.monotonic()
            message = self.pubsub.get_message(timeout=max(left, 0.0))
            if message is None:
                if left <= 0:
                    return False
                continue
            if message["type"] == "message":
                self.take(as_key(message["channel"]), message["data"])
                if pong is None and self.over:
                    return True
            elif message["type"] == "pong" and pong is not None and as_key(message["data"]) == pong.encode():
                return True

    def subscribe(self) -> None:
        """This thread's notification connection, subscribed to every waiting job's channel before this returns."""
        self.pubsub = self.listeners.get(self.backend)
        keys = list(self.waiting)
        try:
            for i in range(0, len(keys), COLLECT_KEYS):
                self.pubsub.subscribe(*keys[i:i + COLLECT_KEYS])
            token = uuid.uuid4().hex
            self.pubsub.ping(token)  # answered after every subscription took hold
            if not self.listen(time.monotonic() + self.broker_timeout, pong=token):
                raise OSError("the result channels were not subscribed in time")
        except BaseException:
            self.drop()  # its subscriptions are unknown now
            raise
        self.subscribed.extend(keys)

    def drop(self) -> None:
        """Close the notification connection (after a broker error: the next look subscribes on a new one)."""
        self.listeners.drop()
        self.pubsub = None
        self.subscribed = []

    def unsubscribe(self) -> None:
        """Not waited for: the answers are read (and ignored) by the next wait on this thread."""
        if self.pubsub is None or not self.subscribed:
            return
        try:
            for i in range(0, len(self.subscribed), COLLECT_KEYS):
                self.pubsub.unsubscribe(*self.subscribed[i:i + COLLECT_KEYS])
        except Exception:
            self.drop()


def ride_out(down_since: float | None, broker_timeout: float, exc: BaseException, waiting_for: str) -> float:
    """A wait's read failed because the broker is away: raise :class:`~embedq.errors.BrokerUnavailable` once it has
    been away ``broker_timeout`` seconds, else pause before the next try. Returns when the outage began."""
    now = time.monotonic()
    down_since = down_since or now
    if now - down_since >= broker_timeout:
        raise errors.BrokerUnavailable(f"the broker has not answered for {now - down_since:.0f}s while waiting for "
                                       f"{waiting_for} ({type(exc).__name__})") from None
    time.sleep(min(0.5, broker_timeout / 10))
    return down_since
