"""The producer API: ``Client.embed``/``embed_sparse``/``rerank``/``predict``/``tokenize``/``decode`` (blocking) and
``Client.submit``/``submit_sparse``/``submit_rerank``/``submit_predict``/``submit_tokenize``/``submit_decode``
(a :class:`JobHandle`).

A job is an ordinary Celery task message, so ``app.send_task("embedq.embed", args=[texts],
kwargs=options)`` (or ``embedq.rerank`` with ``args=[query, texts]``, ``embedq.predict`` with
``args=[inputs]``, ``embedq.tokenize`` with ``args=[texts]``, ``embedq.decode`` with ``args=[[ids, ...]]``) from
any Celery client works too; this
class adds validation at the edge and decoding of the compact result.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from celery import Celery, states
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult
from kombu.utils.url import maybe_sanitize_url

from embedq import cancellation, errors, monitor
from embedq.batching.traffic import BULK, ONLINE, TRAFFIC_CLASSES
from embedq.broker import BROKER_ERRORS, make_app, redis_client
from embedq.protocol import (
    DECODE,
    EMBED,
    EMBED_ALL,
    EMBED_HYBRID,
    EMBED_SPARSE,
    MAX_DEADLINE_SECONDS,
    PREDICT,
    RERANK,
    RESENT_HEADER,
    SENT_HEADER,
    TOKENIZE,
    Fingerprint,
    TaskSpec,
    check_message_size,
    decode_array,
    decode_hybrid,
    decode_ragged,
    decode_result,
    decode_sparse,
    id_lists,
    task_reprs,
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
#: A key with no TTL that changes when Redis loses its data (restarted without persistence, flushed).
EPOCH_KEY = "embedq.epoch"
#: Seconds a handle waits past its job's deadline for a result of a job that started just in time.
DEADLINE_GRACE = 1.0
#: Longest pause between two looks at a full bulk queue.
BULK_WAIT_MAX_SLICE = 1.0


class JobHandle:
    """A submitted job: its id, its state, and its result once the worker stored it.

    Once collected, the outcome (vectors or typed error) stays on the handle, so reading it again, or
    asking its status after the stored copy was deleted from Redis, answers at once. While waiting, the
    handle checks every few seconds that the broker answers (else ``unavailable`` after
    ``broker_timeout``) and still has its data: if Redis came back empty, the job is sent again under
    the same id (workers treat a repeated id as the same job).
    """

    def __init__(self, result: AsyncResult, client: Client | None = None, *, texts: list[Any] | None = None,
                 options: dict[str, Any] | None = None, queue: str | None = None, epoch: str | None = None,
                 traffic_class: str = ONLINE, deadline: dt.datetime | None = None, spec: TaskSpec = EMBED,
                 return_text: bool = False) -> None:
        self._result = result
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
        self._pubsub_ok = True
        self._sent_at = time.monotonic()

    @property
    def id(self) -> str:
        return self._result.id

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
                    self._error = errors.Expired(f"job {self.id} has no result {DEADLINE_GRACE:.0f}s after its "
                                                 f"deadline ({self.deadline.isoformat()})")
                    raise self._error
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
                now = time.monotonic()
                down_since = down_since or now
                outage = True
                if now - down_since >= broker_timeout:
                    raise errors.BrokerUnavailable(
                        f"the broker has not answered for {now - down_since:.0f}s while waiting for job "
                        f"{self.id} ({type(exc).__name__})") from None
                time.sleep(min(0.5, broker_timeout / 10))

    def _poll(self) -> dict[str, Any] | None:
        """Read the stored record directly (a notification can be lost while Redis restarts)."""
        backend = self._result.backend
        meta = backend.get_task_meta(self.id, cache=False)
        if meta.get("status") == states.SUCCESS:
            return meta["result"]
        if meta.get("status") in states.PROPAGATE_STATES:
            exc = backend.exception_to_python(meta["result"])
            if isinstance(exc, errors.EmbedqError):
                self._error = exc
            raise exc
        return None

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
                                   **task_reprs(args[-1], options, self.spec.kind))
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
                self._result.forget()
        self.usage = payload.get("usage")
        if self.spec.kind == "embed":
            vectors, self.fingerprint = decode_result(payload)
            return vectors
        self.fingerprint = Fingerprint.model_validate(payload["fingerprint"])
        texts = self._resend_args[0][-1] if self._return_text and self._resend_args[0] else None
        return decode_output(self.spec.kind, payload, texts)

    def forget(self) -> None:
        self._result.forget()

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


class Client:
    """Send embedding jobs to embedq workers and collect their results."""

    def __init__(self, settings: Settings | None = None, *, broker_url: str | None = None,
                 app: Celery | None = None, follow_results: bool = True) -> None:
        """``follow_results=False``: jobs are sent without subscribing Celery's result consumer to their
        channels, for a caller that reads results itself (the gateway's asyncio waiter); ``JobHandle.result``
        still works by reading the stored record."""
        settings = settings or Settings()
        if broker_url is not None:
            settings = settings.model_copy(update={"broker_url": broker_url})
        self.settings = settings
        self.app = app or make_app(settings)
        self.follow_results = follow_results
        self._redis: Any = None
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

    def submit(self, texts: str | Sequence[str], *, queue: str | None = None, traffic_class: str = ONLINE,
               deadline: float | dt.datetime | None = None, **options: Any) -> JobHandle:
        """Validate and enqueue one embedding job; returns a :class:`JobHandle` at once.

        ``traffic_class``: ``"online"`` (someone waits: served first) or ``"bulk"`` (indexing: fills the
        rest of each micro-batch); each has its own queue per model. ``deadline``: seconds from now, or
        an aware datetime; a job still queued or buffered then is dropped before it costs compute and
        ends with :class:`~embedq.errors.Expired`. When the online queue holds ``online_queue_limit`` jobs
        an online job is refused at once with :class:`~embedq.errors.Overloaded`; a bulk job waits for
        room under ``bulk_queue_limit`` instead (up to ``bulk_wait_timeout``). The same holds for every
        kind of job (``submit_rerank``, ``submit_predict``, ``submit_tokenize``).
        """
        return self._send(EMBED, [_as_list(texts)], options, queue=queue, traffic_class=traffic_class,
                          deadline=deadline)

    def submit_sparse(self, texts: str | Sequence[str], *, top_k: int | None = None, return_tokens: bool = False,
                      queue: str | None = None, traffic_class: str = ONLINE,
                      deadline: float | dt.datetime | None = None, **options: Any) -> JobHandle:
        """Enqueue a sparse (SPLADE) embedding of ``texts`` (a SPLADE model's queue). ``top_k`` keeps each text's
        k largest weights; ``return_tokens`` adds each id's token string. Other options: ``prompt``,
        ``prompt_name``, ``truncate``, ``truncation_side``, ``encoding`` (float16 halves the result)."""
        if top_k is not None:
            options["top_k"] = top_k
        if return_tokens:
            options["return_tokens"] = True
        return self._send(EMBED_SPARSE, [_as_list(texts)], options, queue=queue, traffic_class=traffic_class,
                          deadline=deadline)

    def submit_all(self, texts: str | Sequence[str], *, queue: str | None = None, traffic_class: str = ONLINE,
                   deadline: float | dt.datetime | None = None, **options: Any) -> JobHandle:
        """Enqueue per-token embeddings of ``texts`` (TEI's ``/embed_all``): every token's last hidden state.
        Options: ``prompt``, ``prompt_name``, ``truncate``, ``truncation_side``, ``encoding``."""
        return self._send(EMBED_ALL, [_as_list(texts)], options, queue=queue, traffic_class=traffic_class,
                          deadline=deadline)

    def submit_hybrid(self, texts: str | Sequence[str], *, outputs: Sequence[str] = ("dense", "lexical", "colbert"),
                      queue: str | None = None, traffic_class: str = ONLINE,
                      deadline: float | dt.datetime | None = None, **options: Any) -> JobHandle:
        """Enqueue a BGE-M3 embedding of ``texts``: any of ``dense``, ``lexical`` and ``colbert`` from one forward
        pass. Options: ``top_k`` and ``return_tokens`` (lexical), ``encoding`` (float16 halves dense and ColBERT
        vectors), ``prompt``, ``prompt_name``, ``truncate``, ``truncation_side``."""
        return self._send(EMBED_HYBRID, [_as_list(texts)], {**options, "outputs": list(outputs)}, queue=queue,
                          traffic_class=traffic_class, deadline=deadline)

    def submit_rerank(self, query: str, texts: Sequence[str], *, raw_scores: bool = False, return_text: bool = False,
                      queue: str | None = None, traffic_class: str = ONLINE,
                      deadline: float | dt.datetime | None = None, **options: Any) -> JobHandle:
        """Enqueue a rerank of ``texts`` against ``query`` (a cross-encoder model's queue). Each (query, text)
        pair is one item that packs with other jobs' items. Options: ``truncate`` (False: a pair over the
        model's limit fails with ``too_many_tokens``), ``truncation_side``, ``raw_scores`` (logits instead
        of the model's activation). ``return_text`` puts each text in its result (from this handle, not
        through Redis)."""
        return self._send(RERANK, [query, _as_list(texts)], {**options, "raw_scores": raw_scores}, queue=queue,
                          traffic_class=traffic_class, deadline=deadline, return_text=return_text)

    def submit_predict(self, inputs: str | Sequence[str | Sequence[str]], *, raw_scores: bool = False,
                       queue: str | None = None, traffic_class: str = ONLINE,
                       deadline: float | dt.datetime | None = None, **options: Any) -> JobHandle:
        """Enqueue a classification of ``inputs``: texts, or (text, text) pairs (a classifier's queue)."""
        items = [inputs] if isinstance(inputs, str) else [t if isinstance(t, str) else list(t) for t in inputs]
        return self._send(PREDICT, [items], {**options, "raw_scores": raw_scores}, queue=queue,
                          traffic_class=traffic_class, deadline=deadline)

    def submit_tokenize(self, texts: str | Sequence[str], *, queue: str | None = None, traffic_class: str = ONLINE,
                        deadline: float | dt.datetime | None = None, **options: Any) -> JobHandle:
        """Enqueue a tokenization: the tokens the worker's model would be fed (options ``prompt``,
        ``prompt_name``, ``add_special_tokens``, ``truncate``, ``truncation_side``)."""
        return self._send(TOKENIZE, [_as_list(texts)], options, queue=queue, traffic_class=traffic_class,
                          deadline=deadline)

    def submit_decode(self, ids: Sequence[int] | Sequence[Sequence[int]], *, skip_special_tokens: bool = True,
                      queue: str | None = None, traffic_class: str = ONLINE,
                      deadline: float | dt.datetime | None = None, **options: Any) -> JobHandle:
        """Enqueue a decode: token ids (one list, or a list of lists) back to text by the worker's tokenizer
        (TEI's ``/decode``). ``skip_special_tokens=False`` keeps [CLS], </s> and the like."""
        return self._send(DECODE, [[list(x) for x in id_lists(ids)]],
                          {**options, "skip_special_tokens": skip_special_tokens}, queue=queue,
                          traffic_class=traffic_class, deadline=deadline)

    def _send(self, spec: TaskSpec, args: list[Any], options: dict[str, Any], *, queue: str | None,
              traffic_class: str, deadline: float | dt.datetime | None, return_text: bool = False) -> JobHandle:
        if traffic_class not in TRAFFIC_CLASSES:
            raise errors.InvalidOption(f"traffic_class must be one of {', '.join(TRAFFIC_CLASSES)}, "
                                       f"got {traffic_class!r}")
        expires = _expires(deadline)
        spec.items(args, self.settings.max_texts_per_job, self.settings.max_chars)  # validation at the edge
        wire = spec.parse_options(options).wire()
        check_message_size(args, wire, serializer=self.settings.serializer, limit=self.settings.max_message_bytes)
        queue = queue or self.settings.queue_for(traffic_class)
        try:
            self._admit(queue, traffic_class)
            epoch = self.epoch()
            result = self.app.send_task(spec.name, args=args, kwargs=wire, queue=queue,
                                        task_id=str(uuid.uuid4()),  # random: job ids cannot be guessed
                                        expires=expires, ignore_result=not self.follow_results,
                                        headers={SENT_HEADER: time.time()},
                                        **task_reprs(args[-1], wire, spec.kind))
        except BROKER_ERRORS as exc:
            raise self._unreachable(exc) from None
        handle = JobHandle(result, self, texts=args, options=wire, queue=queue, epoch=epoch,
                           traffic_class=traffic_class, deadline=expires, spec=spec, return_text=return_text)
        with self._resend_lock:
            self.pending.add(handle)
        return handle

    def _admit(self, queue: str, traffic_class: str) -> None:
        """Backpressure: refuse an online job at once when its queue is full; wait for room for a bulk one."""
        limit = self.settings.bulk_queue_limit if traffic_class == BULK else self.settings.online_queue_limit
        if not limit:
            return
        # A depth read less than DEPTH_REUSE seconds ago, plus the jobs this client admitted since, stands in
        # for a new read while it is well under the limit: a busy producer (the gateway) saves a round trip per
        # job, and the queue can overshoot its limit only by what other producers sent within that time.
        now = time.monotonic()
        read_at, counted = self._depths.get(queue, (0.0, 0))
        if now - read_at < DEPTH_REUSE and counted < limit * DEPTH_REUSE_SHARE:
            self._depths[queue] = (read_at, counted + 1)
            return
        depth = monitor.waiting(self.redis(), queue)
        self._depths[queue] = (now, depth + 1)
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
        self.bulk_waits += 1
        self.bulk_waited_seconds += time.monotonic() - started

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
        """This client's redis-py connection to the broker (epoch, queue depths, cancellations)."""
        if self._redis is None:
            self._redis = redis_client(self.settings, timeout=5.0)
        return self._redis

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

        texts = [query, *_as_list(documents)]
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
        if self._redis is not None:
            self._redis.close()
        self.app.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_list(texts: Any) -> Any:
    """A single string is a job of one text; anything else is passed on as sent (validated by the spec)."""
    if isinstance(texts, str):
        return [texts]
    return list(texts) if isinstance(texts, (list, tuple)) else texts


def decode_output(kind: str, payload: dict[str, Any], texts: Sequence[str] | None = None) -> Any:
    """A sparse, rerank, predict, tokenize or decode result, decoded (the last four in the shapes TEI's API
    returns)."""
    if kind == "embed_sparse":
        return decode_sparse(payload)
    if kind == "embed_hybrid":
        return decode_hybrid(payload)
    if kind == "embed_all":
        return decode_ragged(payload)
    if kind == "rerank":
        scores = decode_array(payload["scores"])
        order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
        out = [{"index": i, "score": float(scores[i])} for i in order]
        if texts is not None:
            for entry in out:
                entry["text"] = texts[entry["index"]]
        return out
    if kind == "predict":
        scores, labels = decode_array(payload["scores"]), payload["labels"]
        return [sorted(({"label": labels[j], "score": float(row[j])} for j in range(len(labels))),
                       key=lambda e: -e["score"]) for row in scores]
    if kind == "tokenize":
        ids, offsets = decode_array(payload["ids"]), decode_array(payload["offsets"])
        spans, special, tokens = decode_array(payload["spans"]), decode_array(payload["special"]), payload["tokens"]
        return [[{"id": int(ids[t]), "text": tokens[t], "special": bool(special[t]), "start": int(spans[t][0]),
                  "stop": int(spans[t][1])} for t in range(int(offsets[i]), int(offsets[i + 1]))]
                for i in range(len(offsets) - 1)]
    if kind == "decode":
        return list(payload["texts"])
    raise errors.InvalidOption(f"unknown job kind {kind!r}")
