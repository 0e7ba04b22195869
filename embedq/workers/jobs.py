"""A job as a worker tracks it, whatever its kind: :class:`Job`, and the callbacks that receive its outcome.

The consumer builds a ``Job`` per message; the service fills it in (its items after ``prepare``, one model row per
item as micro-batches land) and hands it, finished or failed, to the results thread (``workers/outbox.py``), which
calls ``on_done``/``on_done_many`` with its outcome.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from embedq import errors
from embedq.backends.base import Prepared
from embedq.batching.traffic import ONLINE, TrafficClass
from embedq.kinds import EMBED, TaskSpec

#: on_done(job, outcome): outcome is the result payload (dict) or an EmbedqError.
DoneCallback = Callable[["Job", "dict[str, Any] | errors.EmbedqError"], None]
#: on_done_many([(job, outcome), ...]): the same for many jobs at once (one round trip to store them).
DoneManyCallback = Callable[[list[tuple["Job", "dict[str, Any] | errors.EmbedqError"]]], None]


@dataclass(eq=False)
class Job:
    """One job as the worker tracks it, whatever its kind."""

    id: str
    texts: Any  # the message's arguments as received; after prepare, the job's items (texts or pairs)
    options: Any = None  # raw kwargs, then the kind's options model
    context: Any = None  # whatever the transport needs to finish the job (a Celery request)
    received: float = field(default_factory=time.monotonic)
    size: int = 1  # items as received, for the prefetch window
    spec: TaskSpec = EMBED
    prepared: Prepared | None = None
    rows: list[Any] | None = None  # one model output row per item, filled by micro-batches
    remaining: int = 0
    done: bool = False
    suspect: bool = False  # redelivered after its worker died: runs alone (see workers/delivery.py)
    started: float | None = None  # monotonic time its first micro-batch started (set under the service lock)
    finished: float | None = None  # monotonic time its last row landed
    tokenize_seconds: float = 0.0  # its share of the tokenizer call that prepared it
    traffic_class: TrafficClass = ONLINE  # from the queue it came from
    deadline: float | None = None  # monotonic time after which it is dropped unless it has started
    canvas: Any = None  # the Celery canvas work its message carries (workers/canvas.py), None for most jobs
    client: str = ""  # the producer identity its message carries (protocol.client_of): its fair share is per client

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def n_items(self) -> int:
        return len(self.prepared.items) if self.prepared is not None else 0

    def cost(self, i: int) -> int:
        assert self.prepared is not None
        return len(self.prepared.items[i].ids)


def model_aliases(*names: str) -> set[str]:
    """The names a job's ``model`` option may give the worker's model: each name and its last path part."""
    out: set[str] = set()
    for name in names:
        name = name.strip().lower().rstrip("/")
        out.update({name, name.split("/")[-1]})
    return out


def check_job(job: Job, backend: Any, settings: Any, aliases: set[str]) -> None:
    """The job's kind, options and inputs checked (its options parsed, its inputs turned into items)."""
    spec = job.spec
    backend.check_kind(spec.kind)  # first: a job of another kind learns what this worker serves
    opts = spec.parse_options(job.options)
    job.options = opts
    job.texts = spec.items(job.texts, settings.max_texts_per_job, settings.max_chars)
    if opts.model is not None and opts.model.strip().lower() not in aliases:
        raise errors.UnknownModel(
            f"model {opts.model!r} is not served on this queue (this worker serves {backend.info.model_id!r})")


def expired(job: Job) -> errors.Expired:
    """The error of a job dropped because its deadline passed before it started."""
    return errors.Expired(f"job {job.id} passed its deadline before it ran; it was not computed")
