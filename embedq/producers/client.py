"""The producer API: ``Client.embed``/``embed_sparse``/``rerank``/``predict``/``tokenize``/``decode`` (blocking) and
``Client.submit``/``submit_sparse``/``submit_rerank``/``submit_predict``/``submit_tokenize``/``submit_decode``
(a :class:`JobHandle`), and the batch calls ``Client.submit_many`` (many jobs in one round trip) and
``Client.collect`` (many results per round trip).

A job is an ordinary Celery task message, so ``app.send_task("embedq.embed", args=[texts],
kwargs=options)`` (or ``embedq.rerank`` with ``args=[query, texts]``, ``embedq.predict`` with
``args=[inputs]``, ``embedq.tokenize`` with ``args=[texts]``, ``embedq.decode`` with ``args=[[ids, ...]]``) from
any Celery client works too; this
class adds validation at the edge and decoding of the compact result. It writes those messages into kombu's Redis
lists itself (the message ``send_task`` would write, field for field), so a job costs the producer little CPU;
where the app is configured in a way it does not reproduce, it sends through ``send_task``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import logging
import math
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from celery import Celery, states
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult
from kombu.utils.url import maybe_sanitize_url

from embedq import cancellation, errors, monitor
from embedq.batching.traffic import BULK, ONLINE, TRAFFIC_CLASSES
from embedq.broker import BROKER_ERRORS, make_app, redis_client
from embedq.keys import EPOCH_KEY
from embedq.kinds import (
    DECODE,
    EMBED,
    EMBED_ALL,
    EMBED_HYBRID,
    EMBED_SPARSE,
    PREDICT,
    RERANK,
    TOKENIZE,
    TaskSpec,
    as_list,
    task_reprs,
)
from embedq.kinds import kind as kind_spec
from embedq.protocol import (
    MAX_DEADLINE_SECONDS,
    RESENT_HEADER,
    SENT_HEADER,
    Fingerprint,
    check_message_size,
)
from embedq.results import ResultStore
from embedq.settings import Settings

log = logging.getLogger(__name__)

#: Seconds a result may take before a producer's blocking call gives up (``Client.embed``).
DEFAULT_RESULT_TIMEOUT = 600.0
#: Seconds between checks, while a producer waits, that the broker is there and still holds its jobs.
WAIT_SLICE = 2.0
#: Seconds between reads of the stored result once notifications are lost.
POLL_SLICE = 0.25
#: Seconds a queue's depth read by the backpressure check is reused, while under this share of the limit.
DEPTH_REUSE = 0.05
DEPTH_REUSE_SHARE = 0.5
#: Seconds a handle waits past its job's deadline for a result of a job that started just in time.
DEADLINE_GRACE = 1.0
#: Longest pause between two looks at a full bulk queue.
BULK_WAIT_MAX_SLICE = 1.0
#: Messages per LPUSH command of a batch, and the bytes after which a command is closed: one round trip sends
#: many jobs, and no single command grows past what Redis reads comfortably at once.
PUSH_MESSAGES = 1000
PUSH_BYTES = 8 * 1024 * 1024
#: Keys per MGET, DEL or SUBSCRIBE command of :meth:`Client.collect`.
COLLECT_KEYS = 1000
#: The third part of a Celery protocol-2 body (no callbacks, errbacks, chain or chord).
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


class JobHandle:
    """A submitted job: its id, its state, and its result once the worker stored it.

    Once collected, the outcome (vectors or typed error) stays on the handle, so reading it again, or
    asking its status after the stored copy was deleted from Redis, answers at once. While waiting, the
    handle checks every few seconds that the broker answers (else ``unavailable`` after
    ``broker_timeout``) and still has its data: if Redis came back empty, the job is sent again under
    the same id (workers treat a repeated id as the same job).
    """

    def __init__(self, result: AsyncResult | None, client: Client | None = None, *, job_id: str | None = None,
                 texts: list[Any] | None = None, options: dict[str, Any] | None = None, queue: str | None = None,
                 epoch: str | None = None, traffic_class: str = ONLINE, deadline: dt.datetime | None = None,
                 spec: TaskSpec = EMBED, return_text: bool = False) -> None:
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
                down_since = _ride_out(down_since, broker_timeout, exc, f"job {self.id}")

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
                                   headers={RESENT_HEADER: self.resent + 1, SENT_HEADER: time.time()},
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


def _expires(deadline: float | dt.datetime | None) -> dt.datetime | None:
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


def worker_stats(app: Celery, timeout: float = 1.0) -> dict[str, dict[str, Any]]:
    """Counters of every live embedq worker (Celery remote control ``embedq_stats``), by node name."""
    replies = app.control.broadcast("embedq_stats", reply=True, timeout=timeout) or []
    return {node: stats for reply in replies for node, stats in reply.items()}


@dataclass(frozen=True)
class _Route:
    """Where and how ``app.send_task`` publishes a task to a queue on kombu's Redis transport."""

    key: str  # the Redis list: the queue's list for priority 0
    routing_key: str  # delivery_info's (the anonymous exchange routes by queue name)
    delivery_mode: int
    binding: tuple[str, str, str] | None  # kombu's binding set, its permanent copy, the member; None: no declare


def _direct_route(app: Celery, name: str, queue: str, broker_url: str | None) -> _Route | None:
    """The route of ``name`` to ``queue`` if this client can write the message ``app.send_task`` would send
    straight into Redis; None where send_task would do something else (another transport, protocol, serializer
    or compression, sent events, a key prefix, a route with options of its own, a queue bound otherwise than
    kombu's direct default or that expires, a task registered here with options): then jobs go through
    ``send_task``."""
    from bisect import bisect

    from kombu.entity import maybe_delivery_mode
    from kombu.transport import redis as kombu_redis

    conf = app.conf
    url = conf.broker_write_url or conf.broker_url
    if (conf.task_protocol != 2 or conf.task_send_sent_event or conf.task_compression
            or conf.task_serializer not in ("json", "msgpack") or not isinstance(url, str) or url != broker_url
            or not url.startswith(("redis://", "rediss://")) or name in getattr(app, "_tasks", {})):
        return None
    options = conf.broker_transport_options or {}
    if options.get("global_keyprefix"):
        return None
    try:
        routed = app.amqp.router.route({"queue": queue}, name, (), {}, None)
    except Exception:  # whatever it is, send_task will say it
        return None
    target = routed.get("queue")
    if set(routed) != {"queue"} or getattr(target, "name", None) != queue:
        return None
    exchange = target.exchange
    if (getattr(exchange, "type", None) != "direct" or target.bindings or target.expires is not None
            or "x-expires" in (target.queue_arguments or {})):
        return None
    sep = options.get("sep", kombu_redis.Channel.sep)
    steps = options.get("priority_steps", kombu_redis.PRIORITY_STEPS)
    priority = steps[bisect(steps, 0) - 1]  # kombu's list for a message of priority 0
    binding = None
    if not target.no_declare and exchange.name:
        binding = (kombu_redis.Channel.keyprefix_queue % exchange.name,
                   kombu_redis.Channel.keyprefix_binding_permanent % exchange.name,
                   sep.join([target.routing_key or "", "", queue]))
    return _Route(key=f"{queue}{sep}{priority}" if priority else queue, routing_key=queue,
                  delivery_mode=maybe_delivery_mode(exchange.delivery_mode or conf.task_default_delivery_mode),
                  binding=binding)


def _ride_out(down_since: float | None, broker_timeout: float, exc: BaseException, waiting_for: str) -> float:
    """A wait's read failed because the broker is away: raise :class:`~embedq.errors.BrokerUnavailable` once it has
    been away ``broker_timeout`` seconds, else pause before the next try. Returns when the outage began."""
    now = time.monotonic()
    down_since = down_since or now
    if now - down_since >= broker_timeout:
        raise errors.BrokerUnavailable(f"the broker has not answered for {now - down_since:.0f}s while waiting for "
                                       f"{waiting_for} ({type(exc).__name__})") from None
    time.sleep(min(0.5, broker_timeout / 10))
    return down_since


class Client:
    """Send embedding jobs to embedq workers and collect their results."""

    def __init__(self, settings: Settings | None = None, *, broker_url: str | None = None,
                 app: Celery | None = None, follow_results: bool = True) -> None:
        """``follow_results``: the ``ignore_result`` header of the jobs' messages: False for a caller that reads
        results itself (the gateway's asyncio waiter). Either way no job's result channel is subscribed when it
        is sent (a round trip per job): ``JobHandle.result`` subscribes when it first waits, after reading the
        stored record, and :meth:`collect` reads many records per round trip."""
        settings = settings or Settings()
        if broker_url is not None:
            settings = settings.model_copy(update={"broker_url": broker_url})
        self.settings = settings
        self.app = app or make_app(settings)
        self.follow_results = follow_results
        self._redis: Any = None
        self._redis_lock = threading.Lock()
        self._listeners = threading.local()  # each thread's result-notification connection (collect)
        self._all_listeners: list[Any] = []
        self.pending: weakref.WeakSet[JobHandle] = weakref.WeakSet()  # submitted, not yet collected
        self._resend_lock = threading.Lock()
        self.resend_after = settings.resend_after or 2.0 * settings.visibility_timeout
        self._epoch: str | None = None
        self._epoch_read = 0.0
        #: queue -> (when its depth was read, the depth read plus the jobs admitted since): see _admit
        self._depths: dict[str, tuple[float, int]] = {}
        self.bulk_waits = 0  # bulk submits that waited for room in a full queue, and for how long in all
        self.bulk_waited_seconds = 0.0
        #: Called on every look at a full bulk queue with (queue, jobs waiting, seconds waited); may raise to
        #: stop waiting (the indexer stops on Ctrl-C that way).
        self.on_bulk_wait: Callable[[str, int, float], None] | None = None
        #: (task name, queue) -> where its messages go when written directly (None: through send_task)
        self._routes: dict[tuple[str, str], _Route | None] = {}
        #: (queue binding, broker epoch) pairs already declared by this client (kombu declares once per connection)
        self._declared: set[tuple[Any, str]] = set()

    def submit_job(self, kind: str | TaskSpec, job: Any, *, queue: str | None = None, traffic_class: str = ONLINE,
                   deadline: float | dt.datetime | None = None, return_text: bool = False,
                   **options: Any) -> JobHandle:
        """Validate and enqueue one job of any kind (its name, an alias, or its :class:`~embedq.kinds.TaskSpec`,
        a plugin's included): ``job`` is what the kind takes (texts; a ``(query, texts)`` pair for rerank; inputs
        for predict; token ids for decode), ``options`` its options. Every named submit below is this call.

        ``traffic_class``: ``"online"`` (someone waits: served first) or ``"bulk"`` (indexing: fills the
        rest of each micro-batch); each has its own queue per model. ``deadline``: seconds from now, or
        an aware datetime; a job still queued or buffered then is dropped before it costs compute and
        ends with :class:`~embedq.errors.Expired`. When the online queue holds ``online_queue_limit`` jobs
        an online job is refused at once with :class:`~embedq.errors.Overloaded`; a bulk job waits for
        room under ``bulk_queue_limit`` instead (up to ``bulk_wait_timeout``). ``return_text``: the result
        carries each text (rerank; from this handle, not through Redis)."""
        spec = kind if isinstance(kind, TaskSpec) else kind_spec(kind)
        return self._submit(spec, [spec.job_args(job)], options, queue=queue, traffic_class=traffic_class,
                            deadline=deadline, return_text=return_text)[0]

    def submit(self, texts: str | Sequence[str], **options: Any) -> JobHandle:
        """Enqueue one embedding job (``embed``); returns a :class:`JobHandle` at once. Options: ``normalize``,
        ``prompt``, ``prompt_name``, ``dimensions``, ``encoding``, ``truncate``, ``truncation_side``, ``model``;
        ``queue``, ``traffic_class`` and ``deadline`` as for :meth:`submit_job`, the same for every kind."""
        return self.submit_job(EMBED, texts, **options)

    def submit_sparse(self, texts: str | Sequence[str], *, top_k: int | None = None, return_tokens: bool = False,
                      **options: Any) -> JobHandle:
        """Enqueue a sparse (SPLADE) embedding of ``texts`` (``embed_sparse``, a SPLADE model's queue). ``top_k``
        keeps each text's k largest weights; ``return_tokens`` adds each id's token string. Other options:
        ``prompt``, ``prompt_name``, ``truncate``, ``truncation_side``, ``encoding`` (float16 halves the result)."""
        if top_k is not None:
            options["top_k"] = top_k
        if return_tokens:
            options["return_tokens"] = True
        return self.submit_job(EMBED_SPARSE, texts, **options)

    def submit_all(self, texts: str | Sequence[str], **options: Any) -> JobHandle:
        """Enqueue per-token embeddings of ``texts`` (``embed_all``, TEI's ``/embed_all``): every token's last
        hidden state. Options: ``prompt``, ``prompt_name``, ``truncate``, ``truncation_side``, ``encoding``."""
        return self.submit_job(EMBED_ALL, texts, **options)

    def submit_hybrid(self, texts: str | Sequence[str], *, outputs: Sequence[str] = ("dense", "lexical", "colbert"),
                      **options: Any) -> JobHandle:
        """Enqueue a BGE-M3 embedding of ``texts`` (``embed_hybrid``): any of ``dense``, ``lexical`` and ``colbert``
        from one forward pass. Options: ``top_k`` and ``return_tokens`` (lexical), ``encoding`` (float16 halves
        dense and ColBERT vectors), ``prompt``, ``prompt_name``, ``truncate``, ``truncation_side``."""
        return self.submit_job(EMBED_HYBRID, texts, outputs=list(outputs), **options)

    def submit_rerank(self, query: str, texts: Sequence[str], *, raw_scores: bool = False, return_text: bool = False,
                      **options: Any) -> JobHandle:
        """Enqueue a rerank of ``texts`` against ``query`` (a cross-encoder model's queue). Each (query, text)
        pair is one item that packs with other jobs' items. Options: ``truncate`` (False: a pair over the
        model's limit fails with ``too_many_tokens``), ``truncation_side``, ``raw_scores`` (logits instead
        of the model's activation). ``return_text`` puts each text in its result (from this handle, not
        through Redis)."""
        return self.submit_job(RERANK, (query, texts), raw_scores=raw_scores, return_text=return_text, **options)

    def submit_predict(self, inputs: str | Sequence[str | Sequence[str]], *, raw_scores: bool = False,
                       **options: Any) -> JobHandle:
        """Enqueue a classification of ``inputs``: texts, or (text, text) pairs (a classifier's queue)."""
        return self.submit_job(PREDICT, inputs, raw_scores=raw_scores, **options)

    def submit_tokenize(self, texts: str | Sequence[str], **options: Any) -> JobHandle:
        """Enqueue a tokenization: the tokens the worker's model would be fed (options ``prompt``,
        ``prompt_name``, ``add_special_tokens``, ``truncate``, ``truncation_side``)."""
        return self.submit_job(TOKENIZE, texts, **options)

    def submit_decode(self, ids: Sequence[int] | Sequence[Sequence[int]], *, skip_special_tokens: bool = True,
                      **options: Any) -> JobHandle:
        """Enqueue a decode: token ids (one list, or a list of lists) back to text by the worker's tokenizer
        (TEI's ``/decode``). ``skip_special_tokens=False`` keeps [CLS], </s> and the like."""
        return self.submit_job(DECODE, ids, skip_special_tokens=skip_special_tokens, **options)

    def submit_many(self, jobs: Iterable[Any], *, kind: str | TaskSpec = "embed", queue: str | None = None,
                    traffic_class: str = ONLINE, deadline: float | dt.datetime | None = None,
                    return_text: bool = False, **options: Any) -> list[JobHandle]:
        """Validate and enqueue many jobs of one kind with the same options: their handles, in order, sent to
        Redis in one round trip (a pipeline; one backpressure check for the batch).

        ``jobs`` holds one entry per job, what :meth:`submit_job` takes as ``job`` for the kind: texts (a list,
        or one string) for ``embed``, ``embed_sparse``, ``embed_all``, ``embed_hybrid`` and ``tokenize``; a
        ``(query, texts)`` pair for ``rerank``; inputs (texts or text pairs) for ``predict``; token ids for
        ``decode``. ``options`` are the kind's options, the single submits' keywords included (``top_k``,
        ``return_tokens``, ``outputs``, ``raw_scores``, ``skip_special_tokens``; ``return_text`` for rerank);
        ``queue``, ``traffic_class`` and ``deadline`` as for :meth:`submit_job`, for every job.

        Every job is checked before any is sent: the first invalid one raises the error its single submit would
        raise (a note names its index) and nothing is sent. An online batch is refused with
        :class:`~embedq.errors.Overloaded` when its queue is full before it; a bulk batch waits for room (it may
        then fill the queue past its limit by its own size). Results are not subscribed to: read them with
        :meth:`collect` (many per round trip) or each handle's ``result``. Each message is the one
        ``app.send_task`` would send for the job, written straight into kombu's Redis list.
        """
        spec = kind if isinstance(kind, TaskSpec) else kind_spec(kind)
        argses = [spec.job_args(job) for job in jobs]
        if not argses:
            return []
        return self._submit(spec, argses, options, queue=queue, traffic_class=traffic_class, deadline=deadline,
                            return_text=return_text)

    def _submit(self, spec: TaskSpec, argses: list[list[Any]], options: dict[str, Any], *, queue: str | None,
                traffic_class: str, deadline: float | dt.datetime | None, return_text: bool) -> list[JobHandle]:
        """Jobs of one kind and options (``argses``: each job's task arguments): checked, admitted, sent."""
        if traffic_class not in TRAFFIC_CLASSES:
            raise errors.InvalidOption(f"traffic_class must be one of {', '.join(TRAFFIC_CLASSES)}, "
                                       f"got {traffic_class!r}")
        expires = _expires(deadline)
        limits = self.settings
        for i, args in enumerate(argses):  # validation at the edge, every job before any is sent
            try:
                spec.items(args, limits.max_texts_per_job, limits.max_chars)
            except errors.EmbedqError as exc:
                if len(argses) > 1 and hasattr(exc, "add_note"):
                    exc.add_note(f"job {i} of the {len(argses)} submitted together; none was sent")
                raise
        wire = spec.parse_options(options).wire()
        queue = queue or limits.queue_for(traffic_class)
        route = self._route(spec.name, queue)
        bodies = None if route is None else [self._body(args, wire, i, len(argses)) for i, args in enumerate(argses)]
        if bodies is None:
            for args in argses:
                check_message_size(args, wire, serializer=limits.serializer, limit=limits.max_message_bytes)
        try:
            self._admit(queue, traffic_class, len(argses))
            epoch = self.epoch()
            if bodies is not None and route is not None and self._direct_now():
                ids = self._push(route, spec, argses, bodies, wire, expires, epoch)
            else:
                ids = [self._send_task(spec, args, wire, queue, expires) for args in argses]
        except BROKER_ERRORS as exc:
            raise self._unreachable(exc) from None
        handles = [JobHandle(None, self, job_id=job_id, texts=args, options=wire, queue=queue, epoch=epoch,
                             traffic_class=traffic_class, deadline=expires, spec=spec, return_text=return_text)
                   for job_id, args in zip(ids, argses)]
        with self._resend_lock:
            for handle in handles:
                self.pending.add(handle)
        return handles

    def _send_task(self, spec: TaskSpec, args: list[Any], wire: dict[str, Any], queue: str,
                   expires: dt.datetime | None) -> str:
        """One job through ``app.send_task`` (where :meth:`_route` finds no direct route): its id."""
        job_id = str(uuid.uuid4())  # random: job ids cannot be guessed
        self.app.send_task(spec.name, args=args, kwargs=wire, queue=queue, task_id=job_id, expires=expires,
                           ignore_result=not self.follow_results, headers={SENT_HEADER: time.time()},
                           **task_reprs(spec, args, wire))
        return job_id

    # -- messages written straight into kombu's Redis lists ---------------------------------------------------
    def _route(self, name: str, queue: str) -> _Route | None:
        """Where ``app.send_task(name, queue=queue)`` would put a job, when this client can write that message
        itself (else None: see :func:`_direct_route`); worked out once per task and queue."""
        key = (name, queue)
        if key not in self._routes:
            self._routes[key] = _direct_route(self.app, name, queue, self.settings.broker_url)
        return self._routes[key]

    def _direct_now(self) -> bool:
        """What ``send_task`` does per call that a direct write would miss: a parent task (called from inside a
        Celery task, its ids go in the message) and publish signals someone listens to."""
        from celery import signals

        if self.app.current_worker_task is not None:
            return False
        return not any(getattr(getattr(signals, name, None), "receivers", None)
                       for name in ("before_task_publish", "after_task_publish", "task_sent"))

    def _body(self, args: list[Any], wire: dict[str, Any], index: int, count: int) -> tuple[str, str, bytes]:
        """A job's message body as kombu's Redis transport stores it: (content type, content encoding, base64
        of the serialized ``(args, kwargs, embed)``), checked against ``max_message_bytes``."""
        from kombu.serialization import dumps

        serializer = self.app.conf.task_serializer
        content_type, encoding, body = dumps((args, wire, _EMBED), serializer=serializer)
        limit = self.settings.max_message_bytes
        if len(body) > limit:  # the error check_message_size raises, from the body it measures
            try:
                check_message_size(args, wire, serializer=serializer, limit=limit)
                raise errors.MessageTooLarge(f"the job's message would have {len(body)} bytes; the limit is {limit}")
            except errors.MessageTooLarge as exc:
                if count > 1 and hasattr(exc, "add_note"):
                    exc.add_note(f"job {index} of the {count} submitted together; none was sent")
                raise
        raw = body.encode("utf-8") if isinstance(body, str) else body
        return content_type, encoding, base64.b64encode(raw)

    def _push(self, route: _Route, spec: TaskSpec, argses: list[list[Any]], bodies: list[tuple[str, str, bytes]],
              wire: dict[str, Any], expires: dt.datetime | None, epoch: str) -> list[str]:
        """Write the jobs' messages into their queue's Redis list, in one pipeline: the messages
        ``app.send_task`` would publish (Celery's protocol 2 on kombu's Redis transport: headers, properties,
        base64 body; see ``celery.app.amqp.AMQP.as_task_v2`` and ``kombu.transport.redis.Channel._put``), and
        the queue's binding as kombu declares it before its first publish (again after Redis lost its data).
        Returns the job ids."""
        from celery.utils.nodenames import anon_nodename
        from kombu.utils.json import dumps

        ids = [str(uuid.uuid4()) for _ in argses]  # random: job ids cannot be guessed
        origin, reply_to = anon_nodename(), self.app.thread_oid
        ignore_result = not self.follow_results
        sent_at = time.time()
        expires_at = expiration = None
        if expires is not None:
            expires_at = expires.isoformat()
            left = max((expires - dt.datetime.now(dt.timezone.utc)).total_seconds(), 0)  # as send_task clamps it
            expiration = str(int(left * 1000))
        reprs: dict[int, dict[str, str]] = {}
        messages = []
        for job_id, args, (content_type, encoding, body) in zip(ids, argses, bodies):
            items = len(args[-1])  # the reprs say how many texts: made once per count
            if items not in reprs:
                reprs[items] = task_reprs(spec, args, wire)
            argsrepr, kwargsrepr = reprs[items]["argsrepr"], reprs[items]["kwargsrepr"]
            headers = {"lang": "py", "task": spec.name, "id": job_id, "shadow": None, "eta": None,
                       "expires": expires_at, "group": None, "group_index": None, "retries": 0,
                       "timelimit": [None, None], "root_id": job_id, "parent_id": None, "argsrepr": argsrepr,
                       "kwargsrepr": kwargsrepr, "origin": origin, "ignore_result": ignore_result,
                       "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {}, SENT_HEADER: sent_at}
            properties: dict[str, Any] = {"correlation_id": job_id, "reply_to": reply_to, "argsrepr": argsrepr,
                                          "kwargsrepr": kwargsrepr, "delivery_mode": route.delivery_mode}
            if expiration is not None:
                properties["expiration"] = expiration
            properties["delivery_info"] = {"exchange": "", "routing_key": route.routing_key}
            properties["priority"] = 0
            properties["body_encoding"] = "base64"
            properties["delivery_tag"] = str(uuid.uuid4())
            # the body first, as kombu writes it: base64 needs no escaping, so it is not run through the encoder
            rest = dumps({"content-encoding": encoding, "content-type": content_type, "headers": headers,
                          "properties": properties})
            messages.append(b'{"body": "' + body + b'", ' + rest[1:].encode("utf-8"))
        commands: list[tuple[str, ...]] = []
        declared = (route.binding, epoch)
        if route.binding is not None and declared not in self._declared:
            commands += [("SADD", key, route.binding[2]) for key in route.binding[:2]]
        # LPUSH of several values is several LPUSHes in a row: the list ends in the same order
        start, size = 0, 0
        for i, message in enumerate(messages):
            size += len(message)
            if i + 1 - start >= PUSH_MESSAGES or size >= PUSH_BYTES or i + 1 == len(messages):
                commands.append(("LPUSH", route.key, *messages[start:i + 1]))
                start, size = i + 1, 0
        if len(commands) == 1:
            self.redis().execute_command(*commands[0])
        else:
            pipe = self.redis().pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            pipe.execute()
        self._declared.add(declared)
        return ids

    def _admit(self, queue: str, traffic_class: str, count: int = 1) -> None:
        """Backpressure, once for ``count`` jobs sent together: refuse online jobs at once when their queue is
        full; wait for room for bulk ones."""
        limit = self.settings.bulk_queue_limit if traffic_class == BULK else self.settings.online_queue_limit
        if not limit:
            return
        # A depth read less than DEPTH_REUSE seconds ago, plus the jobs this client admitted since, stands in
        # for a new read while it is well under the limit: a busy producer (the gateway) saves a round trip per
        # job, and the queue can overshoot its limit only by what other producers sent within that time.
        now = time.monotonic()
        read_at, counted = self._depths.get(queue, (0.0, 0))
        if now - read_at < DEPTH_REUSE and counted + count - 1 < limit * DEPTH_REUSE_SHARE:
            self._depths[queue] = (read_at, counted + count)
            return
        depth = monitor.waiting(self.redis(), queue)
        self._depths[queue] = (now, depth + count)
        if depth < limit:
            return
        if traffic_class != BULK:
            raise errors.Overloaded(f"queue {queue} has {depth} online jobs waiting (limit {limit}, "
                                    "EMBEDQ_ONLINE_QUEUE_LIMIT); try again shortly")
        started = time.monotonic()
        pause = 0.05
        log.info("bulk queue %s is full (%d jobs waiting, limit %d): waiting for room", queue, depth, limit)
        while depth >= limit:
            waited = time.monotonic() - started
            if self.on_bulk_wait is not None:
                self.on_bulk_wait(queue, depth, waited)
            timeout = self.settings.bulk_wait_timeout
            if timeout is not None and waited >= timeout:
                raise errors.Overloaded(f"queue {queue} stayed full ({depth} bulk jobs waiting, limit {limit}) "
                                        f"for {waited:.0f}s (EMBEDQ_BULK_WAIT_TIMEOUT)")
            time.sleep(pause if timeout is None else min(pause, max(timeout - waited, 0.0)))
            pause = min(pause * 2, BULK_WAIT_MAX_SLICE)
            depth = monitor.waiting(self.redis(), queue)
        self._depths[queue] = (time.monotonic(), depth + count)
        self.bulk_waits += 1
        self.bulk_waited_seconds += time.monotonic() - started

    # -- collecting many results ----------------------------------------------------------------------------
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
                    down_since = _ride_out(down_since, broker_timeout, exc,
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

    def cancel(self, job_id: str) -> bool:
        """Cancel a job by id (see :meth:`JobHandle.cancel`): True if it had no outcome yet.

        The ``cancelled`` record is written only if the job has none (:class:`~embedq.results.ResultStore`),
        atomically: a job that finishes at the same moment ends either cancelled or done, the same for every
        reader."""
        try:
            if ResultStore(self.app).outcome(job_id).get("status") in states.READY_STATES:
                return False
            cancellation.announce(self.redis(), job_id)  # workers drop it before it runs
            return ResultStore(self.app).store(job_id, errors.Cancelled(f"job {job_id} was cancelled"))
        except BROKER_ERRORS as exc:
            raise self._unreachable(exc) from None

    def redis(self) -> Any:
        """This client's redis-py connection to the broker (jobs, epoch, queue depths, cancellations)."""
        client = self._redis
        if client is None:
            # once, whatever the threads: a second client made in a race would close its pool, in use, when
            # dropped (redis-py's __del__)
            with self._redis_lock:
                if self._redis is None:
                    self._redis = redis_client(self.settings, timeout=5.0)
                client = self._redis
        return client

    def resend_lost(self, epoch: str) -> None:
        """Redis restarted (or came back without its data): send every job of this client still waiting
        again, under its own id. A worker that holds the job takes the copy as the same job; one that
        finds its record already stored acknowledges the copy without running it."""
        with self._resend_lock:
            lost = [h for h in list(self.pending) if not h._collected and h._epoch not in (None, epoch)]
            if lost:
                log.warning("the broker restarted; sending %d waiting jobs again", len(lost))
            for handle in lost:
                handle._resend(epoch)

    def _unreachable(self, exc: BaseException) -> errors.BrokerUnavailable:
        if isinstance(exc, errors.BrokerUnavailable):
            return exc
        return errors.BrokerUnavailable(
            f"cannot reach the broker at {maybe_sanitize_url(self.settings.broker_url)}: {type(exc).__name__}: "
            f"{str(exc)[:200]}")

    def epoch(self, *, refresh: bool = False) -> str:
        """The broker's epoch (its ``run_id`` and :data:`EPOCH_KEY`), read at most once a second unless
        ``refresh``: it changes whenever Redis restarted or lost its data."""
        now = time.monotonic()
        if refresh or self._epoch is None or now - self._epoch_read > 1.0:
            pipe = self.redis().pipeline(transaction=False)
            pipe.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
            pipe.get(EPOCH_KEY)
            pipe.info("server")
            _, key, info = pipe.execute()
            # A restart changes run_id even when Redis keeps its data: a message a worker was popping at
            # that moment can be lost (kombu's BRPOP is not atomic with its unacked record). A flush keeps
            # run_id but loses the key.
            self._epoch = f"{info.get('run_id')}/{key.decode()}"
            self._epoch_read = now
        return self._epoch

    def embed(self, texts: str | Sequence[str], *, timeout: float | None = DEFAULT_RESULT_TIMEOUT,
              **options: Any) -> np.ndarray:
        """Embed texts and wait: a ``(len(texts), dim)`` float32 array in input order."""
        return self.submit(texts, **options).result(timeout)

    def embed_sparse(self, texts: str | Sequence[str], *, timeout: float | None = DEFAULT_RESULT_TIMEOUT,
                     **options: Any) -> list[Any]:
        """Sparse-embed texts and wait: one :class:`~embedq.protocol.SparseVector` per text, in input order."""
        return self.submit_sparse(texts, **options).result(timeout)

    def embed_all(self, texts: str | Sequence[str], *, timeout: float | None = DEFAULT_RESULT_TIMEOUT,
                  **options: Any) -> list[np.ndarray]:
        """Per-token embeddings and wait: per text a (tokens, hidden) float32 array, special tokens included."""
        return self.submit_all(texts, **options).result(timeout)

    def embed_hybrid(self, texts: str | Sequence[str], *, timeout: float | None = DEFAULT_RESULT_TIMEOUT,
                     **options: Any) -> Any:
        """BGE-M3-embed texts and wait: a :class:`~embedq.protocol.HybridEmbedding` (input order)."""
        return self.submit_hybrid(texts, **options).result(timeout)

    def score(self, query: str, documents: Sequence[str], *, weights: dict[str, float] | None = None,
              outputs: Sequence[str] = ("dense", "lexical", "colbert"),
              timeout: float | None = DEFAULT_RESULT_TIMEOUT, **options: Any) -> list[dict[str, Any]]:
        """Embed ``query`` and ``documents`` with one BGE-M3 job and score each document (:mod:`embedq.scores`):
        ``[{"index", "score", "dense", "sparse", "colbert"}]``, highest hybrid score first. ``weights`` per part
        (default BGE-M3's 0.4/0.2/0.4); ``outputs`` chooses the parts."""
        from embedq import scores
        from embedq.protocol import HybridEmbedding

        texts = [query, *as_list(documents)]
        both = self.embed_hybrid(texts, outputs=outputs, timeout=timeout, **options)
        docs = HybridEmbedding(*(None if part is None else part[1:] for part in (both.dense, both.lexical,
                                                                                   both.colbert)))
        ranked = scores.score_all(both, docs, weights=weights)
        return sorted(ranked, key=lambda entry: (-entry["score"], entry["index"]))

    def rerank(self, query: str, texts: Sequence[str], *, timeout: float | None = DEFAULT_RESULT_TIMEOUT,
               **options: Any) -> list[dict[str, Any]]:
        """Rerank and wait: ``[{"index", "score"(, "text")}]``, highest score first (TEI's ``/rerank``)."""
        return self.submit_rerank(query, texts, **options).result(timeout)

    def predict(self, inputs: str | Sequence[str | Sequence[str]], *,
                timeout: float | None = DEFAULT_RESULT_TIMEOUT, **options: Any) -> list[list[dict[str, Any]]]:
        """Classify and wait: per input, every label with its score, highest first (TEI's ``/predict``)."""
        return self.submit_predict(inputs, **options).result(timeout)

    def tokenize(self, texts: str | Sequence[str], *, timeout: float | None = DEFAULT_RESULT_TIMEOUT,
                 **options: Any) -> list[list[dict[str, Any]]]:
        """Tokenize and wait: per text, its tokens as the model is fed them (TEI's ``/tokenize``)."""
        return self.submit_tokenize(texts, **options).result(timeout)

    def decode(self, ids: Sequence[int] | Sequence[Sequence[int]], *,
               timeout: float | None = DEFAULT_RESULT_TIMEOUT, **options: Any) -> list[str]:
        """Decode and wait: per id list, its text (TEI's ``/decode``)."""
        return self.submit_decode(ids, **options).result(timeout)

    def workers(self, timeout: float = 1.0) -> dict[str, dict[str, Any]]:
        """Live workers and their counters, by Celery node name."""
        return worker_stats(self.app, timeout)

    def close(self) -> None:
        with self._resend_lock:
            listeners, self._all_listeners = self._all_listeners, []
        for pubsub in listeners:
            with contextlib.suppress(Exception):
                pubsub.close()
        if self._redis is not None:
            self._redis.close()
        self.app.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key_bytes(value: Any) -> bytes:
    """A Redis key or channel name as bytes (redis-py answers bytes unless it decodes responses)."""
    return value if isinstance(value, bytes) else str(value).encode()
