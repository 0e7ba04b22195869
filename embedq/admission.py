"""Online admission by expected wait: a producer refuses an online job at once (:class:`~embedq.errors.Overloaded`,
retryable, with ``retry_after`` seconds; the gateway's 429 + Retry-After) when it would wait longer than
``online_max_wait`` before it starts, instead of queueing it for a minute.

The model (issue 50). Texts ahead of the queue, ``T``: the online texts the live workers buffer and have not started
(their registry records' ``backlog``, projected to now by their ``throughput`` since the record was written) plus the
messages waiting in the queue's Redis list times the texts per online message this producer sends lately; never less
than what this producer itself has outstanding on the queue (exact at the gateway). Workers share their time between
clients (deficit round robin per client), so client K, with ``O`` texts outstanding of its own among ``n`` active
clients, waits about

    wait_K = (O + min(T - O, (n - 1) * (O + s))) / rate          (s: the new job's texts)

its own backlog, plus what the others run while K's backlog and the new job drain at 1/n of the worker: a client with
nothing outstanding waits for ``(n - 1) * s`` texts, however much another floods, and a client that floods waits
for everything ahead (with one client, ``wait = T / rate``: first come, first served). ``rate`` is the sum of the live
workers' measured texts/s while busy; unknown (no worker has run under load yet), only the hard cap applies:
the texts before the job's end as the fair share sees them (``texts_before(s) + s``) over ``online_queue_texts``
refuse. A job that finds nothing ahead is always admitted, however large.

Reads cost a producer no round trip per job mostly: the registry is re-read at most once a second (shared with
``require_worker``), the queue's list length at most every :data:`DEPTH_REUSE` seconds while it is well under the
job cap. Imports settings, errors and monitor only (the layer of :mod:`embedq.monitor`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from embedq import errors, monitor
from embedq.settings import Settings

#: Seconds a queue's list length read for admission is reused, while under this share of the job cap.
DEPTH_REUSE = 0.05
DEPTH_REUSE_SHARE = 0.5
#: The longest Retry-After a refusal gives (seconds): past it a client should rather look again.
MAX_RETRY_AFTER = 60
#: How fast this producer's texts-per-message figure follows what it sends (weight of the newest job).
PER_MESSAGE_WEIGHT = 0.05


@dataclass(frozen=True)
class Backlog:
    """What the live, ready workers of a queue report: online texts buffered and not started (projected to now),
    and their texts/s together (None: none has measured it yet)."""

    buffered: int
    rate: float | None
    workers: int


def backlog(records: list[dict[str, Any]], queue: str, now: float | None = None) -> Backlog:
    """:class:`Backlog` of ``queue`` from the registry's records (each worker's texts projected to ``now``, wall
    clock, by its own throughput since it reported)."""
    now = time.time() if now is None else now
    buffered, rates = 0.0, []
    ready = monitor.serving(records, queue).ready
    for record in ready:
        held = record.get("backlog")
        texts = held.get("online", 0) if isinstance(held, dict) else 0
        rate = record.get("throughput")
        texts = float(texts) if isinstance(texts, (int, float)) and texts > 0 else 0.0
        if isinstance(rate, (int, float)) and rate >= 0:
            rates.append(float(rate))
            age = now - float(record.get("reported_at") or now)
            texts = max(texts - rate * max(age, 0.0), 0.0)
        buffered += texts
    return Backlog(int(buffered), sum(rates) if rates else None, len(ready))


@dataclass(frozen=True)
class Estimate:
    """The texts ahead of a new online job of client K on a queue, as the admission model sees them."""

    ahead: int  # T: texts ahead on the queue, every client's
    own: int  # O: K's own outstanding texts
    active: int  # n: clients with work outstanding, K included
    rate: float | None  # texts/s of the queue's live workers together
    waiting_messages: int  # messages in the queue's Redis list

    def texts_before(self, texts: int) -> float:
        """Texts run before K's new job of ``texts`` texts is done with, beyond its own (see the module)."""
        own = min(self.own, self.ahead)
        return own + min(self.ahead - own, (self.active - 1) * (own + texts))

    def wait(self, texts: int) -> float | None:
        """Expected seconds before the job starts (None: throughput unknown)."""
        if self.rate is None:
            return None
        before = self.texts_before(texts)
        if before <= 0:
            return 0.0
        return before / self.rate if self.rate > 0 else math.inf

    def refusal(self, queue: str, texts: int, settings: Settings) -> errors.Overloaded | None:
        """The error refusing the job, or None: it is admitted."""
        limit = settings.online_queue_limit
        if limit and self.waiting_messages >= limit:
            return overloaded(f"queue {queue} has {self.waiting_messages} online jobs waiting (limit {limit}, "
                              "EMBEDQ_ONLINE_QUEUE_LIMIT); try again shortly", 1.0)
        if self.ahead <= 0:
            return None  # nothing ahead: admitted, however large
        cap = settings.online_queue_texts
        before = self.texts_before(texts)  # as the fair share sees them: another client's flood is not K's wait
        if cap and before + texts > cap:
            over = before + texts - cap
            return overloaded(f"queue {queue} has {self.ahead} online texts waiting ({self.own} of them this "
                              f"client's); {texts} more would pass the cap of {cap} (EMBEDQ_ONLINE_QUEUE_TEXTS) for "
                              "this client's share; try again shortly", over / self.rate if self.rate else 1.0)
        wait, bound = self.wait(texts), settings.online_max_wait
        if bound and wait is not None and wait > bound:
            rate = f"{self.rate:.0f}" if self.rate is not None else "?"
            return overloaded(f"queue {queue}: a job of {texts} texts would wait about {min(wait, 1e6):.1f}s to start "
                              f"({self.ahead} online texts ahead at {rate} texts/s, {self.own} of them this client's, "
                              f"{self.active} clients active), more than {bound:g}s (EMBEDQ_ONLINE_MAX_WAIT)",
                              wait - bound)
        return None


def overloaded(message: str, retry_after: float) -> errors.Overloaded:
    """:class:`~embedq.errors.Overloaded` with ``retry_after``: whole seconds, 1 to :data:`MAX_RETRY_AFTER`."""
    exc = errors.Overloaded(message)
    exc.retry_after = int(min(max(math.ceil(retry_after) if math.isfinite(retry_after) else MAX_RETRY_AFTER, 1),
                              MAX_RETRY_AFTER))
    return exc


#: A producer's own outstanding online texts on a queue, by client identity.
Outstanding = Callable[[str], Mapping[str, int]]
#: Set (see :func:`admitted`) where the caller has admitted the jobs itself (the gateway, on its event loop, with
#: its exact in-flight table): the Client's check then passes. ``asyncio.to_thread`` carries it into the thread.
_ADMITTED: contextvars.ContextVar[bool] = contextvars.ContextVar("embedq_admitted", default=False)


@contextlib.contextmanager
def admitted() -> Iterator[None]:
    """Inside the block the Client's online admission passes: its caller has admitted the jobs already."""
    token = _ADMITTED.set(True)
    try:
        yield
    finally:
        _ADMITTED.reset(token)


class Admission:
    """One producer's online admission (thread-safe enough: its caches are replaced whole). ``outstanding``: this
    producer's own outstanding texts per client on a queue (the gateway's exact in-flight table; a plain
    :class:`~embedq.producers.client.Client` counts its uncollected handles)."""

    def __init__(self, settings: Settings, registry: monitor.Registry, outstanding: Outstanding) -> None:
        self.settings = settings
        self.registry = registry
        self.outstanding = outstanding
        #: queue -> (when its list length was read, that length plus the jobs admitted since)
        self._depths: dict[str, tuple[float, int]] = {}
        self._per_message: dict[str, float] = {}  # queue -> texts per online message this producer sent lately
        self._lock = threading.Lock()

    def _waiting(self, redis: Any, queue: str, jobs: int) -> int:
        """Messages in ``queue``'s list (a read less than DEPTH_REUSE s old, plus the jobs admitted since, stands in
        for a new one while well under the job cap: a busy producer saves a round trip per job)."""
        now = time.monotonic()
        read_at, counted = self._depths.get(queue, (-math.inf, 0))
        limit = self.settings.online_queue_limit or math.inf
        if now - read_at < DEPTH_REUSE and counted + jobs - 1 < limit * DEPTH_REUSE_SHARE:
            return counted
        depth = monitor.waiting(redis, queue)
        self._depths[queue] = (now, depth)
        return depth

    def estimate(self, records: list[dict[str, Any]], queue: str, waiting_messages: int,
                 client: str) -> Estimate:
        """The :class:`Estimate` for a new job of ``client`` on ``queue`` from these reads."""
        mine = {k: int(v) for k, v in self.outstanding(queue).items() if v > 0}
        found = backlog(records, queue)
        queued = waiting_messages * self._per_message.get(queue, 1.0)
        ahead = max(int(found.buffered + queued), sum(mine.values()))
        active = len(mine) + (client not in mine) + (ahead > sum(mine.values()))  # others: at least one more
        return Estimate(ahead, mine.get(client, 0), active, found.rate, waiting_messages)

    def check(self, redis: Any, queue: str, jobs: int, texts: int, client: str) -> None:
        """Admit ``jobs`` online jobs of ``texts`` texts in all from ``client``, or raise
        :class:`~embedq.errors.Overloaded` (nothing sent). Reads Redis at most as the caches allow."""
        if _ADMITTED.get() or not self.enabled:
            return
        records = self.registry.records(redis)
        waiting = self._waiting(redis, queue, jobs)
        self.decide(records, queue, waiting, jobs, texts, client)

    @property
    def enabled(self) -> bool:
        settings = self.settings
        return bool(settings.online_max_wait or settings.online_queue_texts or settings.online_queue_limit)

    # -- for an event loop (the gateway): reads in a thread now and then, decisions on the loop ----------------
    def refresh(self, redis: Any, queue: str) -> None:
        """Read the registry (unless read within a second) and ``queue``'s list length (blocking: run in a thread)."""
        self.registry.records(redis)
        depth = monitor.waiting(redis, queue)
        with self._lock:
            self._depths[queue] = (time.monotonic(), depth)

    def age(self, queue: str) -> float:
        """Seconds since the older of the two reads :meth:`decide_cached` uses (inf: never read)."""
        read_at = self._depths.get(queue, (-math.inf, 0))[0]
        return math.inf if self.registry.fresh() is None else time.monotonic() - read_at

    def decide_cached(self, queue: str, jobs: int, texts: int, client: str) -> None:
        """:meth:`decide` on the last reads (:meth:`refresh`), without I/O: raises Overloaded or admits."""
        records = self.registry.fresh()
        if records is None:
            records = self.registry.last()  # a second old or more: still the best there is; a refresh is under way
        self.decide(records, queue, self._depths.get(queue, (-math.inf, 0))[1], jobs, texts, client)

    def decide(self, records: list[dict[str, Any]], queue: str, waiting: int, jobs: int, texts: int,
               client: str) -> None:
        refusal = self.estimate(records, queue, waiting, client).refusal(queue, texts, self.settings)
        if refusal is not None:
            raise refusal
        with self._lock:  # admitted: the list holds these jobs too, until the next read
            read_at, counted = self._depths.get(queue, (-math.inf, 0))
            self._depths[queue] = (read_at, counted + jobs)
            per = self._per_message.get(queue)
            size = texts / max(jobs, 1)
            self._per_message[queue] = size if per is None else per + PER_MESSAGE_WEIGHT * (size - per)
