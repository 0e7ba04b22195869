"""A submitted job (:class:`JobHandle`): its id, its state, its outcome once stored, and the waits that ride out a
broker restart (the job is sent again under its own id when Redis lost it)."""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from celery import states
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult

from embedq import errors
from embedq.batching.traffic import ONLINE
from embedq.broker import BROKER_ERRORS
from embedq.kinds import EMBED, TaskSpec, task_reprs
from embedq.protocol import CLIENT_HEADER, MAX_DEADLINE_SECONDS, RESENT_HEADER, SENT_HEADER, Fingerprint

log = logging.getLogger(__name__)

#: Seconds a result may take before a producer's blocking call gives up (``Client.embed``).
DEFAULT_RESULT_TIMEOUT = 600.0
#: Seconds between checks, while a producer waits, that the broker is there and still holds its jobs.
WAIT_SLICE = 2.0
#: Seconds between reads of the stored result once notifications are lost.
POLL_SLICE = 0.25
#: Seconds a handle waits past its job's deadline for a result of a job that started just in time.
DEADLINE_GRACE = 1.0


class JobHandle:
    """A submitted job: its id, its state, and its result once the worker stored it.

    Once collected, the outcome (vectors or typed error) stays on the handle, so reading it again, or
    asking its status after the stored copy was deleted from Redis, answers at once. While waiting, the
    handle checks every few seconds that the broker answers (else ``unavailable`` after
    ``broker_timeout``) and still has its data: if Redis came back empty, the job is sent again under
    the same id (workers treat a repeated id as the same job).
    """

    def __init__(self, result: AsyncResult | None, client: Any = None, *, job_id: str | None = None,
                 texts: list[Any] | None = None, options: dict[str, Any] | None = None, queue: str | None = None,
                 epoch: str | None = None, traffic_class: str = ONLINE, deadline: dt.datetime | None = None,
                 spec: TaskSpec = EMBED, return_text: bool = False, client_id: str | None = None) -> None:
        """``result``: Celery's handle of the job, or None with ``job_id`` (it is then made on first use, so a
        batch of handles costs no Celery object each)."""
        if result is None and (job_id is None or client is None):
            raise ValueError("a JobHandle needs a Celery AsyncResult, or a job id and a client")
        self._async = result
        self._id: str = result.id if result is not None else job_id  # type: ignore[assignment]
        self._client = client
        #: the kind of job (embed, rerank, predict, tokenize)
        self.spec = spec
        self._return_text = return_text
        self._resend_args = (texts, options, queue)  # texts: the task's positional arguments
        self._client_id = client_id  # the producer identity its message carries (sent again with it)
        self._epoch = epoch
        self.traffic_class = traffic_class
        #: When the job expires (an aware UTC datetime; None: never). A worker that meets it later drops it.
        self.deadline = deadline
        self._payload: dict[str, Any] | None = None
        self._error: errors.EmbedqError | None = None
        self.fingerprint: Fingerprint | None = None
        self.usage: dict[str, int] | None = None
        self.resent = 0
        self._forgotten = False  # its stored record was deleted (after it was collected)
        self._pubsub_ok = True
        self._sent_at = time.monotonic()

    @property
    def id(self) -> str:
        return self._id

    @property
    def _result(self) -> AsyncResult:
        """Celery's handle of the job (made on first use). Never marked ``ignored``: Celery's ``get`` of an ignored
        result answers None at once, whereas this handle waits for the stored record."""
        if self._async is None:
            assert self._client is not None
            self._async = self._client.app.AsyncResult(self._id)
        return self._async

    @property
    def _collected(self) -> bool:
        return self._payload is not None or self._error is not None

    def status(self) -> str:
        """Celery's state: PENDING (queued or buffered), SUCCESS or FAILURE."""
        if self._collected:
            return "FAILURE" if self._error is not None else "SUCCESS"
        return self._result.state

    def ready(self) -> bool:
        return self._collected or self._result.ready()

    def payload(self, timeout: float | None = DEFAULT_RESULT_TIMEOUT) -> dict[str, Any]:
        """The raw result dict, or the job's typed :class:`~embedq.errors.EmbedqError`.

        Raises :class:`~embedq.errors.JobTimeout` after ``timeout`` seconds (None: no limit), and
        :class:`~embedq.errors.Unavailable` when the broker stays unreachable for ``broker_timeout``.
        """
        if self._error is not None:
            raise self._error
        if self._payload is None:
            self._payload = self._wait(timeout)
            if self._client is not None:
                self._client.pending.discard(self)
        return self._payload

    def _wait(self, timeout: float | None) -> dict[str, Any]:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        expiry = None
        if self.deadline is not None:  # past it (and a grace for a job that started in time) nothing will come
            expiry = start + (self.deadline.timestamp() - time.time()) + DEADLINE_GRACE
            if deadline is None or expiry < deadline:
                deadline = expiry
        broker_timeout = self._client.settings.broker_timeout if self._client else 30.0
        down_since: float | None = None
        outage = False  # the broker did not answer: compare its epoch as soon as it answers again
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                if deadline == expiry:
                    stored = self._poll()
                    if stored is not None:
                        return stored
                    raise self._expire()
                raise errors.JobTimeout(f"job {self.id} has no result after {timeout}s")
            step = WAIT_SLICE if left is None else max(min(WAIT_SLICE, left), 0.01)
            try:
                if outage and self._client is not None:
                    # Before taking any result: a restart may have lost jobs of this client that a result
                    # arriving now would hide until the next slice lapses (which may never happen).
                    self._check_broker(refresh=True)
                    outage = False
                if self._pubsub_ok:
                    try:
                        return self._result.get(timeout=step, propagate=True, disable_sync_subtasks=False)
                    except CeleryTimeout:
                        pass
                    except errors.EmbedqError as exc:  # the job's own outcome: kept on the handle
                        self._error = exc
                        raise
                    except RuntimeError:  # Celery's result consumer gave up reconnecting: poll instead
                        log.warning("result notifications are lost after a broker outage; polling for job %s",
                                    self.id)
                        self._pubsub_ok = False
                else:
                    time.sleep(min(step, POLL_SLICE))
                stored = self._poll()
                if stored is not None:
                    return stored
                if self._client is not None:
                    self._check_broker()
                    self._maybe_resend()
                down_since = None
            except BROKER_ERRORS as exc:
                outage = True
                down_since = ride_out(down_since, broker_timeout, exc, f"job {self.id}")

    def _poll(self) -> dict[str, Any] | None:
        """Read the stored record directly (a notification can be lost while Redis restarts)."""
        backend = self._result.backend
        return self._settle(backend, backend.get_task_meta(self.id, cache=False))

    def _settle(self, backend: Any, meta: dict[str, Any]) -> dict[str, Any] | None:
        """A stored record's outcome: its payload, or the job's error raised (a typed one stays on the handle);
        None while the record holds no outcome."""
        if meta.get("status") == states.SUCCESS:
            return meta["result"]
        if meta.get("status") in states.PROPAGATE_STATES:
            exc = backend.exception_to_python(meta["result"])
            if isinstance(exc, errors.EmbedqError):
                self._error = exc
            raise exc
        return None

    def _expire(self) -> errors.Expired:
        """The job's deadline (and its grace) passed with no result: it ends ``expired``."""
        assert self.deadline is not None
        self._error = errors.Expired(f"job {self.id} has no result {DEADLINE_GRACE:.0f}s after its deadline "
                                     f"({self.deadline.isoformat()})")
        return self._error

    def _check_broker(self, *, refresh: bool = False) -> None:
        """Between two waits: has Redis lost its data since this job was sent? Then the client sends
        this job, and every other job of its own still waiting, again."""
        assert self._client is not None
        # At most 1 s old (one read per client per second, however many wait); fresh after an outage.
        epoch = self._client.epoch(refresh=refresh)
        if self._epoch is not None and epoch != self._epoch:
            self._client.resend_lost(epoch)

    def _maybe_resend(self) -> None:
        """No result long after sending: send the job again under its id. This covers the one window in
        which Redis can lose a message whatever its persistence: a worker killed between popping it and
        recording it as unacknowledged (kombu's BRPOP and its unacked record are two steps). A copy of a
        job that is held or already stored costs the worker one lookup."""
        assert self._client is not None
        if time.monotonic() - self._sent_at >= self._client.resend_after:
            log.info("job %s has no result after %.0fs; sending it again", self.id, self._client.resend_after)
            self._resend(self._client.epoch())

    def _resend(self, epoch: str) -> None:
        args, options, queue = self._resend_args
        if args is None:
            raise errors.JobLost(f"job {self.id} may be lost: the broker restarted and the job cannot be resent")
        assert self._client is not None
        self._client.app.send_task(self.spec.name, args=args, kwargs=options, queue=queue, task_id=self.id,
                                   expires=self.deadline, ignore_result=not self._client.follow_results,
                                   headers={RESENT_HEADER: self.resent + 1, SENT_HEADER: time.time(),
                                            **({CLIENT_HEADER: self._client_id} if self._client_id else {})},
                                   **task_reprs(self.spec, args, options))
        self._epoch = epoch
        self._sent_at = time.monotonic()
        self.resent += 1

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

        With ``forget`` (the default) the stored result is deleted from Redis once read.
        """
        try:
            payload = self.payload(timeout)
        finally:
            if forget and self._collected:
                self.forget()
        return self._output(payload)

    def _output(self, payload: dict[str, Any]) -> Any:
        """``payload`` decoded for the job's kind (see :meth:`result`); sets ``usage`` and ``fingerprint``."""
        self.usage = payload.get("usage")
        self.fingerprint = Fingerprint.model_validate(payload["fingerprint"])
        texts = self._resend_args[0][-1] if self._return_text and self._resend_args[0] else None
        return self.spec.decode(payload, texts)

    def forget(self) -> None:
        """Delete the job's stored record from Redis (its outcome, once collected, stays on this handle)."""
        self._result.forget()
        self._forgotten = True

    def cancel(self) -> bool:
        """Cancel the job unless it already has an outcome.

        Every worker drops a cancelled job that has not started: still queued, or buffered waiting for
        its micro-batch; it never reaches the model. Returns True when the job had no outcome yet: this
        handle then raises :class:`~embedq.errors.Cancelled` (a job that was already running finishes in
        its worker, harmlessly; its result expires unread). False: the job had finished; read it as usual.
        """
        if self._collected:
            return False
        if self._client is None:
            raise errors.Unavailable("this handle has no client to cancel through")
        if not self._client.cancel(self.id):
            return False
        self._error = errors.Cancelled(f"job {self.id} was cancelled")
        self._client.pending.discard(self)
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
