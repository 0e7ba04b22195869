"""A submitted job (:class:`JobHandle`): its id, its state, its outcome once read, and how it was sent (:class:`Sent`:
what sending it again takes). A handle waits through the client that sent it, seen as a :class:`JobOwner`: its
``result()`` is that client's ``collect([handle])``, one waiter for one job as for many."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from celery import states

from embedq import errors
from embedq.batching.traffic import ONLINE
from embedq.kinds import EMBED, TaskSpec
from embedq.protocol import MAX_DEADLINE_SECONDS, Fingerprint
from embedq.windows import decode_windows, has_windows

#: Seconds a result may take before a producer's blocking call gives up (``Client.embed``).
DEFAULT_RESULT_TIMEOUT = 600.0
#: Seconds a handle waits past its job's deadline for a result of a job that started just in time.
DEADLINE_GRACE = 1.0


class JobOwner(Protocol):
    """What a :class:`JobHandle` uses of the client that sent it (:class:`~embedq.producers.client.Client`)."""

    def collect(self, handles: Iterable[JobHandle], timeout: float | None = ..., *, return_exceptions: bool = ...,
                forget: bool = ..., decode: bool = ...) -> list[Any]: ...

    def forget(self, handles: Iterable[JobHandle]) -> None: ...

    def cancel(self, job_id: str) -> bool: ...

    def status(self, job_id: str) -> str: ...


@dataclass
class Sent:
    """How a job was sent, for sending it again under its id: its task's positional arguments (None: it cannot be
    sent again) and options, its queue and the producer identity its message carries; the broker's epoch and the
    moment (monotonic) of its last sending, and how many times it was sent again."""

    args: list[Any] | None
    options: dict[str, Any] | None
    queue: str | None
    client_id: str | None
    epoch: str | None
    at: float = field(default_factory=time.monotonic)
    resent: int = 0

    def again(self, epoch: str) -> None:
        """It was just sent again, under the broker epoch ``epoch``."""
        self.epoch, self.at, self.resent = epoch, time.monotonic(), self.resent + 1


class JobHandle:
    """A submitted job: its id, its state, and its result once the worker stored it.

    Once collected, the outcome (vectors or typed error) stays on the handle, so reading it again, or
    asking its status after the stored copy was deleted from Redis, answers at once. While waiting, the
    client checks every few seconds that the broker answers (else ``unavailable`` after
    ``broker_timeout``) and still has its data: if Redis came back empty, the job is sent again under
    the same id (workers treat a repeated id as the same job).
    """

    def __init__(self, job_id: str, client: JobOwner, *, spec: TaskSpec = EMBED, traffic_class: str = ONLINE,
                 deadline: dt.datetime | None = None, return_text: bool = False, sent: Sent | None = None) -> None:
        """Made by the client that sent the job (``client``), which it waits through."""
        self._id = job_id
        self._owner = client
        #: the kind of job (embed, rerank, predict, tokenize)
        self.spec = spec
        self.traffic_class = traffic_class
        #: When the job expires (an aware UTC datetime; None: never). A worker that meets it later drops it.
        self.deadline = deadline
        #: how it was sent (its arguments, queue, epoch): the client sends it again from this
        self.sent = sent or Sent(None, None, None, None, None)
        self._return_text = return_text
        self._payload: dict[str, Any] | None = None
        self._error: errors.EmbedqError | None = None
        self.fingerprint: Fingerprint | None = None
        self.usage: dict[str, int] | None = None
        #: its stored record was deleted (after it was collected): set by the client that deleted it
        self.forgotten = False

    @property
    def id(self) -> str:
        return self._id

    @property
    def resent(self) -> int:
        """How many times the client sent the job again (Redis lost it, or it had no result long after sending)."""
        return self.sent.resent

    @property
    def collected(self) -> bool:
        """Its outcome is kept here: a result, or a typed error."""
        return self._payload is not None or self._error is not None

    @property
    def error(self) -> errors.EmbedqError | None:
        """The job's typed error, once collected (None: none, or not collected yet)."""
        return self._error

    def keep(self, outcome: dict[str, Any] | BaseException) -> None:
        """Keep the job's outcome read from its record: a result payload, or a typed error (an error that is not
        embedq's is not kept: it is raised to the caller that read it)."""
        if isinstance(outcome, errors.EmbedqError):
            self._error = outcome
        elif not isinstance(outcome, BaseException):
            self._payload = outcome

    def expire(self) -> errors.Expired:
        """The job's deadline (and its grace) passed with no result: it ends ``expired``."""
        assert self.deadline is not None
        self._error = errors.Expired(f"job {self.id} has no result {DEADLINE_GRACE:.0f}s after its deadline "
                                     f"({self.deadline.isoformat()})")
        return self._error

    def output(self, *, decode: bool = True) -> Any:
        """The collected result: decoded for the job's kind (see :meth:`result`; sets ``usage`` and ``fingerprint``),
        or with ``decode=False`` the raw payload."""
        payload = self._payload
        assert payload is not None, "not collected"
        if not decode:
            return payload
        self.usage = payload.get("usage")
        self.fingerprint = Fingerprint.model_validate(payload["fingerprint"])
        texts = self.sent.args[-1] if self._return_text and self.sent.args else None
        if has_windows(payload):  # long_inputs="windows": pooled, or each input's windows (embedq/windows.py)
            return decode_windows(self.spec, payload, texts)
        return self.spec.decode(payload, texts)

    def status(self) -> str:
        """Celery's state: PENDING (queued or buffered), SUCCESS or FAILURE."""
        if self.collected:
            return "FAILURE" if self._error is not None else "SUCCESS"
        return self._owner.status(self.id)

    def ready(self) -> bool:
        return self.collected or self._owner.status(self.id) in states.READY_STATES

    def payload(self, timeout: float | None = DEFAULT_RESULT_TIMEOUT) -> dict[str, Any]:
        """The raw result dict, or the job's typed :class:`~embedq.errors.EmbedqError`.

        Raises :class:`~embedq.errors.JobTimeout` after ``timeout`` seconds (None: no limit), and
        :class:`~embedq.errors.Unavailable` when the broker stays unreachable for ``broker_timeout``.
        """
        payload: dict[str, Any] = self._owner.collect([self], timeout, forget=False, decode=False)[0]
        return payload

    def result(self, timeout: float | None = DEFAULT_RESULT_TIMEOUT, *, forget: bool = True) -> Any:
        """Block for the job's output, decoded for its kind:

        * ``embed``: the vectors (float32 numpy array, one row per input, input order);
        * ``embed_sparse``: one :class:`~embedq.protocol.SparseVector` per input, input order;
        * ``embed_hybrid``: a :class:`~embedq.protocol.HybridEmbedding` (dense, lexical, ColBERT);
        * ``embed_all``: per input, its tokens' hidden states (tokens × hidden float32 array);
        * ``rerank``: ``[{"index", "score"(, "text")}]`` sorted by score, highest first;
        * ``predict``: per input, ``[{"label", "score"}]`` sorted by score, highest first;
        * ``tokenize``: per text, ``[{"id", "text", "special", "start", "stop"}]`` (offsets are
          characters of the string the model saw: the prompt, if any, then the text);
        * ``decode``: per id list, its text.

        With ``forget`` (the default) the stored result is deleted from Redis once read. This is the client's
        ``collect([handle], timeout, forget=forget)``: the same waits, errors and timeouts.
        """
        return self._owner.collect([self], timeout, forget=forget)[0]

    def forget(self) -> None:
        """Delete the job's stored record from Redis (its outcome, once collected, stays on this handle)."""
        self._owner.forget([self])

    def cancel(self) -> bool:
        """Cancel the job unless it already has an outcome.

        Every worker drops a cancelled job that has not started: still queued, or buffered waiting for
        its micro-batch; it never reaches the model. Returns True when the job had no outcome yet: this
        handle then raises :class:`~embedq.errors.Cancelled` (a job that was already running finishes in
        its worker, harmlessly; its result expires unread). False: the job had finished; read it as usual.
        """
        if self.collected or not self._owner.cancel(self.id):
            return False
        self._error = errors.Cancelled(f"job {self.id} was cancelled")
        return True


def job_expiry(deadline: float | dt.datetime | None) -> dt.datetime | None:
    """A job's deadline as an aware UTC datetime (Celery's ``expires``): seconds from now, or an aware datetime, at
    most :data:`~embedq.protocol.MAX_DEADLINE_SECONDS` from now (else :class:`~embedq.errors.InvalidOption`), so no
    value reaches a clock or a timestamp that overflows."""
    if deadline is None:
        return None
    now = dt.datetime.now(dt.timezone.utc)
    if isinstance(deadline, dt.datetime):
        if deadline.utcoffset() is None:
            raise errors.InvalidOption("deadline must be an aware datetime (with a timezone) or seconds from now")
        # the difference of aware datetimes is a timedelta: no conversion that overflows at datetime.max or .min
        left: float = (deadline - now).total_seconds()
        shown = deadline.isoformat()
    elif isinstance(deadline, (int, float)) and not isinstance(deadline, bool):
        shown = _number(deadline) + " s"
        if not deadline > 0:  # NaN too
            raise errors.InvalidOption(f"deadline must be a positive number of seconds, got {shown}")
        left = deadline  # an int of any size compares with the bound; inf is above it
    else:
        raise errors.InvalidOption(f"deadline must be seconds from now or a datetime, got {type(deadline).__name__}")
    if left > MAX_DEADLINE_SECONDS:
        raise errors.InvalidOption(f"deadline must be at most {MAX_DEADLINE_SECONDS} s (one week) from now, got "
                                   f"{shown}")
    if left <= 0:
        raise errors.Expired("the deadline passed before the job was sent")
    if isinstance(deadline, dt.datetime):
        return deadline.astimezone(dt.timezone.utc)
    return now + dt.timedelta(seconds=left)


def _number(value: float) -> str:
    """A number for a message: never a conversion that overflows (a huge int to float) or is refused (to str)."""
    if isinstance(value, int) and abs(value) >= 10**18:
        return f"an integer of {value.bit_length()} bits"
    return f"{value:.6g}" if isinstance(value, float) else str(value)
