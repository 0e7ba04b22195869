"""What an operator sees without asking the workers: queue depths and the live-worker registry, read
straight from Redis (no torch, no remote-control broadcast).

* **Queue depth** is what waits in the queue's Redis list *plus* what workers have received and not yet
  acknowledged (kombu's ``unacked`` hash, which holds the messages a worker buffers and those of a dead
  worker until they are restored). Flower shows neither. The unacked entries are counted per queue by
  a server-side script that reads only the tail of each entry (its routing key), so a scrape moves a few
  bytes, not the buffered texts.
* **Live workers** publish a small JSON record under :data:`WORKER_KEY` every
  :data:`REPORT_INTERVAL` seconds with a TTL of :data:`WORKER_TTL` seconds, so a worker that died disappears
  within that time. The record carries the model, device, dtype, queues, counters, recent rates, the texts
  buffered and not started (``backlog``) and the texts/s it runs while busy (``throughput``). Reading it
  never depends on a worker answering a broadcast, so ``embedq status``
  cannot hang on a dead worker's mailbox.

Keys are declared here once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from embedq.keys import DEAD_LETTERS, DEPTHS_KEY, KOMBU_BINDINGS, KOMBU_SEP, KOMBU_UNACKED, WORKER_KEY

DEPTHS_TTL = 5.0
#: Seconds between two records of a worker: often, as producers admit online jobs by the backlog it carries.
REPORT_INTERVAL = 1.0
WORKER_TTL = 15  # seconds a record lives: a loaded worker that misses a few reports stays registered
#: The ``state`` of a worker's record from its process's start until its model is loaded (``ready`` false).
STARTING = "starting"
#: Celery's own exchanges (remote control, replies, events): their queues are not job queues.
CELERY_EXCHANGES = frozenset({"celery.pidbox", "reply.celery.pidbox", "celeryev"})
KOMBU_PRIORITY_STEPS = (3, 6, 9)  # kombu keeps priority messages in lists "<queue>\x06\x16<n>"

#: Counts kombu's unacked hash per routing key (the last element of each JSON entry). Only each
#: entry's last 512 bytes are matched.
_UNACKED_BY_QUEUE = """
local counts = {}
for _, entry in ipairs(redis.call('HVALS', KEYS[1])) do
  local rk = string.match(string.sub(entry, -512), '"([^"]*)"%]%s*$')
  if rk then counts[rk] = (counts[rk] or 0) + 1 end
end
local out = {}
for rk, n in pairs(counts) do out[#out + 1] = rk; out[#out + 1] = n end
return out
"""


@dataclass(frozen=True)
class QueueDepth:
    queue: str
    waiting: int  # in the Redis list(s): not yet received by any worker
    unacked: int  # received by a worker and not yet acknowledged (buffered, running, or a dead worker's)

    @property
    def depth(self) -> int:
        return self.waiting + self.unacked


def known_queues(client: Any) -> set[str]:
    """Every job queue declared on this broker (kombu's bindings; Celery's own queues left out)."""
    queues: set[str] = set()
    prefix = KOMBU_BINDINGS.format("")
    for key in client.scan_iter(match=KOMBU_BINDINGS.format("*"), count=500):
        exchange = (key.decode() if isinstance(key, bytes) else key)[len(prefix):]
        if exchange in CELERY_EXCHANGES:
            continue
        for member in client.smembers(key):
            text = member.decode() if isinstance(member, bytes) else member
            parts = text.split(KOMBU_SEP)
            if len(parts) == 3 and parts[2]:
                queues.add(parts[2])
    return queues


def unacked_by_queue(client: Any) -> dict[str, int]:
    flat = client.eval(_UNACKED_BY_QUEUE, 1, KOMBU_UNACKED)
    out: dict[str, int] = {}
    for key, n in zip(flat[::2], flat[1::2]):
        out[key.decode() if isinstance(key, bytes) else key] = int(n)
    return out


def _lists(queue: str) -> list[str]:
    """The Redis lists that hold a queue's waiting messages: its own and kombu's priority lists."""
    return [queue, *(f"{queue}{KOMBU_SEP}{step}" for step in KOMBU_PRIORITY_STEPS)]


def waiting(client: Any, queue: str) -> int:
    """Messages waiting in ``queue``'s Redis list(s), not yet received by any worker (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for key in _lists(queue):
        pipe.llen(key)
    return int(sum(pipe.execute()))


def queue_depths(client: Any, queues: Iterable[str] = ()) -> dict[str, QueueDepth]:
    """Depth of ``queues`` plus every queue that has a binding or unacked messages, by name."""
    unacked = unacked_by_queue(client)
    names = sorted(set(queues) | known_queues(client) | set(unacked))
    pipe = client.pipeline(transaction=False)
    for name in names:
        for key in _lists(name):
            pipe.llen(key)
    lengths = pipe.execute()
    per = 1 + len(KOMBU_PRIORITY_STEPS)
    return {name: QueueDepth(name, sum(lengths[i * per:(i + 1) * per]), unacked.get(name, 0))
            for i, name in enumerate(names)}


def shared_queue_depths(client: Any, queues: Iterable[str] = ()) -> dict[str, QueueDepth]:
    """:func:`queue_depths` read by one worker for all: counting the unacked hash reads every entry, and
    with N workers scraped every 15 s Redis would do it N times over. The first worker to ask in a
    DEPTHS_TTL window counts and shares the result; a queue missing from it (just declared) is counted."""
    raw = client.get(DEPTHS_KEY)
    if raw is not None:
        try:
            depths = {name: QueueDepth(name, int(w), int(u)) for name, (w, u) in json.loads(raw).items()}
        except (ValueError, TypeError):
            depths = None
        if depths is not None and set(queues) <= set(depths):
            return depths
    depths = queue_depths(client, queues)
    client.set(DEPTHS_KEY, json.dumps({name: [q.waiting, q.unacked] for name, q in depths.items()}),
               px=int(DEPTHS_TTL * 1000))
    return depths


def publish_worker(client: Any, record: dict[str, Any]) -> None:
    client.set(WORKER_KEY.format(record["hostname"]), json.dumps(record), ex=WORKER_TTL)


def withdraw_worker(client: Any, hostname: str) -> None:
    client.delete(WORKER_KEY.format(hostname))


def live_workers(client: Any) -> list[dict[str, Any]]:
    """The records of the workers that reported within the last :data:`WORKER_TTL` seconds."""
    keys = sorted(client.scan_iter(match=WORKER_KEY.format("*"), count=500))
    if not keys:
        return []
    out = []
    for raw in client.mget(keys):
        if raw is None:  # expired between SCAN and MGET
            continue
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class Serving:
    """Which live workers serve ``queue``, from the registry: the one check every producer makes before it sends
    (``embedq index``, ``Client(require_worker=True)``, the gateway). A record whose ``ready`` is false (a worker
    stopping, or one that registers before its model is loaded) does not serve: it cannot answer now."""

    queue: str
    ready: list[dict[str, Any]]  # live, ready workers consuming ``queue``
    not_ready: list[dict[str, Any]]  # live records that list ``queue`` but are not ready
    others: list[dict[str, Any]]  # every other live, ready worker (what the broker does serve)

    def __bool__(self) -> bool:
        return bool(self.ready)

    @property
    def starting(self) -> list[dict[str, Any]]:
        """Live records of workers of ``queue`` still loading their model (``state: starting``, issue 51 item 3): a
        producer may wait for one rather than fail (bounded by ``worker_start_timeout``)."""
        return [record for record in self.not_ready if record.get("state") == STARTING]

    def coming(self) -> bool:
        """A worker serves ``queue`` now, or one is starting that will."""
        return bool(self.ready or self.starting)

    def served(self) -> dict[str, list[str]]:
        """What the live, ready workers serve: each one's queues (joined) -> its models, one entry per model."""
        out: dict[str, list[str]] = {}
        for record in self.ready + self.others:
            models = out.setdefault(", ".join(record.get("queues") or ["?"]), [])
            models.append(str(record.get("model", "?")))
        return out

    def describe(self) -> str:
        """Why nothing serves ``queue``, and what is served instead (queue -> model)."""
        text = f"no live worker serves queue {self.queue}"
        if self.starting:
            text += f" yet ({len(self.starting)} starting: loading the model)"
        elif self.not_ready:
            text += f" ({len(self.not_ready)} registered but not ready: stopping)"
        served = self.served()
        if not served:
            return text + "; no live worker is registered on this broker"
        parts = []
        for queues, models in sorted(served.items()):
            counts = {m: models.count(m) for m in models}
            names = ", ".join(f"{m} ({n} worker{'s' if n > 1 else ''})" for m, n in counts.items())
            parts.append(f"{queues} -> {names}")
        return text + "; live workers serve: " + "; ".join(parts)


def serving(records: Iterable[dict[str, Any]], queue: str) -> Serving:
    """:class:`Serving` of ``queue`` among the registry's ``records`` (:func:`live_workers`)."""
    ready: list[dict[str, Any]] = []
    not_ready: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    for record in records:
        listed = queue in (record.get("queues") or [])
        if listed and record.get("ready"):
            ready.append(record)
        elif listed:
            not_ready.append(record)
        elif record.get("ready"):
            others.append(record)
    return Serving(queue, ready, not_ready, others)


class Registry:
    """The live-worker registry read at most once per ``max_age`` seconds (thread-safe): a producer that checks
    before every send (the gateway, ``Client(require_worker=True)``) costs Redis one read a second, not one per
    job."""

    def __init__(self, max_age: float = 1.0) -> None:
        self.max_age = max_age
        self._read: tuple[float, list[dict[str, Any]]] = (-float("inf"), [])
        self._lock = threading.Lock()

    def fresh(self) -> list[dict[str, Any]] | None:
        """The records read within ``max_age`` seconds, or None (an event loop reads Redis in a thread only then)."""
        at, records = self._read
        return records if time.monotonic() - at <= self.max_age else None

    def last(self) -> list[dict[str, Any]]:
        """The records of the last read, however old (none before the first)."""
        return self._read[1]

    def records(self, client: Any) -> list[dict[str, Any]]:
        records = self.fresh()
        if records is not None:
            return records
        with self._lock:  # one read for the threads that find it stale together
            at, records = self._read
            if time.monotonic() - at > self.max_age:
                records = live_workers(client)
                self._read = (time.monotonic(), records)
        return records

    def serving(self, client: Any, queue: str) -> Serving:
        return serving(self.records(client), queue)


def dead_letter_count(client: Any) -> int:
    return int(client.llen(DEAD_LETTERS))


@dataclass
class Snapshot:
    """Everything ``embedq status`` shows, read in one go."""

    queues: dict[str, QueueDepth]
    workers: list[dict[str, Any]]
    dead_letters: int
    taken_at: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "taken_at": self.taken_at,
            "queues": {name: {"waiting": q.waiting, "unacked": q.unacked, "depth": q.depth}
                       for name, q in self.queues.items()},
            "workers": self.workers,
            "dead_letters": self.dead_letters,
        }


def snapshot(client: Any, queues: Iterable[str] = ()) -> Snapshot:
    workers = live_workers(client)
    wanted = set(queues)
    for record in workers:
        wanted.update(record.get("queues", []))
    return Snapshot(queue_depths(client, wanted), workers, dead_letter_count(client), time.time())
