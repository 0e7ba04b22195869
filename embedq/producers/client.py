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

Every kind goes through one call, :meth:`Client.submit_job` (the kinds table, ``embedq/kinds.py``); the named methods
are that call with the kind's name. The client's parts, each an object it owns, handed what it needs: ``writer``
(:mod:`~embedq.producers.direct`: messages written straight into Redis, else through ``send_task``), ``pending``
(:mod:`~embedq.producers.pending`: the jobs not collected yet, sent again when Redis lost them), ``collector``
(:mod:`~embedq.producers.collect`: the one waiter, many results per round trip); a job's handle
(:mod:`~embedq.producers.handle`) waits through its client's ``collect``. Here: submitting, backpressure,
cancelling, the broker's epoch.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from celery import Celery, states

from embedq import acl, cancellation, errors, monitor
from embedq.admission import DEPTH_REUSE, DEPTH_REUSE_SHARE, Admission
from embedq.batching.traffic import BULK, ONLINE, TRAFFIC_CLASSES
from embedq.broker import BROKER_ERRORS, make_app, redis_client, unavailable
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
)
from embedq.kinds import kind as kind_spec
from embedq.producers.collect import Collector
from embedq.producers.direct import JobWriter
from embedq.producers.handle import DEFAULT_RESULT_TIMEOUT, JobHandle, Sent, job_expiry
from embedq.producers.pending import Pending

__all__ = ["BROKER_ERRORS", "Client", "JobHandle", "worker_stats"]  # what producers import from here
from embedq.protocol import MAX_CLIENT_CHARS, check_client_id, check_message_size
from embedq.results import ResultStore
from embedq.settings import Settings

log = logging.getLogger(__name__)

#: Longest pause between two looks at a full bulk queue.
BULK_WAIT_MAX_SLICE = 1.0


def worker_stats(app: Celery, timeout: float = 1.0) -> dict[str, dict[str, Any]]:
    """Counters of every live embedq worker (Celery remote control ``embedq_stats``), by node name."""
    replies = app.control.broadcast("embedq_stats", reply=True, timeout=timeout) or []
    return {node: stats for reply in replies for node, stats in reply.items()}


class Client:
    """Send embedding jobs to embedq workers and collect their results."""

    def __init__(self, settings: Settings | None = None, *, broker_url: str | None = None,
                 app: Celery | None = None, follow_results: bool = True, require_worker: bool = False,
                 client_id: str | None = None) -> None:
        """``require_worker``: refuse a job with :class:`~embedq.errors.NoWorker` (503, retryable) at once, nothing
        sent, when no live worker serves its queue (the registry, read at most once a second), instead of leaving
        it queued until a worker comes; also per call (``submit(..., require_worker=True)``). Off by default: a job
        sent before its workers start (scaling up from zero) is served when they do.

        ``follow_results``: the ``ignore_result`` header of the jobs' messages: False for a caller that reads
        results itself (the gateway's asyncio waiter). Either way no job's result channel is subscribed when it
        is sent (a round trip per job): a wait (:meth:`collect`, ``JobHandle.result``) subscribes the channels of
        the jobs it finds unfinished, after reading their stored records, many per round trip.

        ``client_id``: the identity every job of this client carries (message header ``embedq_client``), by which
        a worker shares its model time fairly between clients; default ``EMBEDQ_CLIENT_ID``, else
        ``<hostname>:<pid>``. A submit's ``client=`` overrides it for that call (the gateway: one per API key)."""
        settings = settings or Settings()
        if broker_url is not None:
            settings = settings.model_copy(update={"broker_url": broker_url})
        self.settings = settings
        self.app = app or make_app(settings)
        self.require_worker = require_worker
        default_id = f"{socket.gethostname()}:{os.getpid()}"[-MAX_CLIENT_CHARS:]
        self.client_id = check_client_id(client_id or settings.client_id or default_id)
        self.registry = monitor.Registry(max_age=1.0)
        self._redis: Any = None
        self._redis_lock = threading.Lock()
        self.writer = JobWriter(self.app, settings, follow_results=follow_results, redis=self.redis)
        #: the jobs submitted and not collected yet
        self.pending = Pending(self.writer, self.epoch, settings.resend_after or 2.0 * settings.visibility_timeout)
        self.collector = Collector(self.app, self.pending, broker_timeout=settings.broker_timeout)
        self._epoch: str | None = None
        self._epoch_read = 0.0
        #: bulk queue -> (when its depth was read, the depth read plus the jobs admitted since): see _admit
        self._depths: dict[str, tuple[float, int]] = {}
        #: online admission by expected wait (its own texts outstanding: this client's uncollected online handles;
        #: the gateway replaces ``admission.outstanding`` by its exact in-flight table)
        self.admission = Admission(settings, self.registry, self.outstanding)
        self.bulk_waits = 0  # bulk submits that waited for room in a full queue, and for how long in all
        self.bulk_waited_seconds = 0.0
        #: Called on every look at a full bulk queue with (queue, jobs waiting, seconds waited); may raise to
        #: stop waiting (the indexer stops on Ctrl-C that way).
        self.on_bulk_wait: Callable[[str, int, float], None] | None = None

    @property
    def follow_results(self) -> bool:
        """The ``ignore_result`` header of the jobs' messages, negated (see :class:`Client`)."""
        return self.writer.follow_results

    def submit_job(self, kind: str | TaskSpec, job: Any, *, queue: str | None = None, traffic_class: str = ONLINE,
                   deadline: float | dt.datetime | None = None, return_text: bool = False,
                   require_worker: bool | None = None, client: str | None = None, **options: Any) -> JobHandle:
        """Validate and enqueue one job of any kind (its name, an alias, or its :class:`~embedq.kinds.TaskSpec`,
        a plugin's included): ``job`` is what the kind takes (texts; a ``(query, texts)`` pair for rerank; inputs
        for predict; token ids for decode), ``options`` its options. Every named submit below is this call.

        ``traffic_class``: ``"online"`` (someone waits: served first) or ``"bulk"`` (indexing: fills the
        rest of each micro-batch); each has its own queue per model. ``deadline``: seconds from now, or
        an aware datetime; a job still queued or buffered then is dropped before it costs compute and
        ends with :class:`~embedq.errors.Expired`. When the online queue holds ``online_queue_limit`` jobs
        an online job is refused at once with :class:`~embedq.errors.Overloaded`; a bulk job waits for
        room under ``bulk_queue_limit`` instead (up to ``bulk_wait_timeout``). ``return_text``: the result
        carries each text (rerank; from this handle, not through Redis). ``require_worker``: this call's choice
        over the client's (see :class:`Client`). ``client``: the identity this job carries instead of the client's
        ``client_id`` (workers share their time fairly between identities)."""
        spec = kind if isinstance(kind, TaskSpec) else kind_spec(kind)
        return self._submit(spec, [spec.job_args(job)], options, queue=queue, traffic_class=traffic_class,
                            deadline=deadline, return_text=return_text, require_worker=require_worker,
                            client=client)[0]

    def submit(self, texts: str | Sequence[str], **options: Any) -> JobHandle:
        """Enqueue one embedding job (``embed``); returns a :class:`JobHandle` at once. An input may also be a list
        of the model's token ids (embedded as they are). Options: ``normalize``, ``prompt``, ``prompt_name``,
        ``dimensions``, ``encoding``, ``truncate``, ``truncation_side``, ``model``, ``long_inputs`` (``"truncate"``,
        ``"error"`` or ``"windows"``), ``window_overlap``, ``pool_windows`` (embedq/windows.py); ``queue``,
        ``traffic_class`` and ``deadline`` as for :meth:`submit_job`, the same for every kind."""
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
                    return_text: bool = False, require_worker: bool | None = None, client: str | None = None,
                    **options: Any) -> list[JobHandle]:
        """Validate and enqueue many jobs of one kind with the same options: their handles, in order, sent to
        Redis in one round trip (a pipeline; one backpressure check for the batch).

        ``jobs`` holds one entry per job, what :meth:`submit_job` takes as ``job`` for the kind: texts (a list,
        or one string) for ``embed``, ``embed_sparse``, ``embed_all``, ``embed_hybrid`` and ``tokenize``; a
        ``(query, texts)`` pair for ``rerank``; inputs (texts or text pairs) for ``predict``; token ids for
        ``decode``. ``options`` are the kind's options, the single submits' keywords included (``top_k``,
        ``return_tokens``, ``outputs``, ``raw_scores``, ``skip_special_tokens``; ``return_text`` for rerank);
        ``queue``, ``traffic_class``, ``deadline``, ``require_worker`` and ``client`` as for :meth:`submit_job`, for
        every job.

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
                            return_text=return_text, require_worker=require_worker, client=client)

    def _submit(self, spec: TaskSpec, argses: list[list[Any]], options: dict[str, Any], *, queue: str | None,
                traffic_class: str, deadline: float | dt.datetime | None, return_text: bool,
                require_worker: bool | None = None, client: str | None = None) -> list[JobHandle]:
        """Jobs of one kind and options (``argses``: each job's task arguments): checked, admitted, sent."""
        if traffic_class not in TRAFFIC_CLASSES:
            raise errors.InvalidOption(f"traffic_class must be one of {', '.join(TRAFFIC_CLASSES)}, "
                                       f"got {traffic_class!r}")
        client = self.client_id if client is None else check_client_id(client)
        expires = job_expiry(deadline)
        limits = self.settings
        texts = 0  # items in all: what online admission counts
        for i, args in enumerate(argses):  # validation at the edge, every job before any is sent
            try:
                texts += len(spec.items(args, limits.max_texts_per_job, limits.max_chars))
            except errors.EmbedqError as exc:
                if len(argses) > 1 and hasattr(exc, "add_note"):
                    exc.add_note(f"job {i} of the {len(argses)} submitted together; none was sent")
                raise
        wire = spec.parse_options(options).wire()
        queue = queue or limits.queue_for(traffic_class)
        writer = self.writer
        route = writer.route(spec.name, queue)
        bodies = None if route is None else [writer.body(args, wire, i, len(argses)) for i, args in enumerate(argses)]
        if bodies is None:
            for args in argses:
                check_message_size(args, wire, serializer=limits.serializer, limit=limits.max_message_bytes)
        try:
            if self.require_worker if require_worker is None else require_worker:
                self.check_worker(queue)
            self._admit(queue, traffic_class, len(argses), texts=texts, client=client)
            epoch = self.epoch()
            if bodies is not None and route is not None and writer.direct_now():
                ids = writer.push(route, spec, argses, bodies, wire, expires, epoch, client)
            else:
                ids = [writer.send_task(spec, args, wire, queue, expires, client) for args in argses]
        except (*BROKER_ERRORS, *acl.CAUGHT) as exc:
            raise self._unreachable(exc) from None
        handles = [JobHandle(job_id, self, spec=spec, traffic_class=traffic_class, deadline=expires,
                             return_text=return_text, sent=Sent(args, wire, queue, client, epoch))
                   for job_id, args in zip(ids, argses)]
        self.pending.add(handles)
        return handles

    def _admit(self, queue: str, traffic_class: str, count: int = 1, *, texts: int = 0, client: str = "") -> None:
        """Backpressure, once for ``count`` jobs of ``texts`` items in all sent together: refuse online jobs at once
        (:class:`~embedq.errors.Overloaded` with ``retry_after``) when they would wait too long or their queue holds
        too many texts (:mod:`embedq.admission`); wait for room for bulk ones."""
        if traffic_class != BULK:
            self.admission.check(self.redis(), queue, count, max(texts, count), client or self.client_id)
            return
        limit = self.settings.bulk_queue_limit
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

    def outstanding(self, queue: str) -> dict[str, int]:
        """Texts of this client's online jobs on ``queue`` not collected yet, by client identity (what online
        admission counts as each identity's own backlog)."""
        return self.pending.outstanding(queue, self.client_id)

    def serving(self, queue: str) -> monitor.Serving:
        """Which live workers serve ``queue`` (the registry, re-read at most once a second)."""
        return self.registry.serving(self.redis(), queue)

    def check_worker(self, queue: str) -> None:
        """:class:`~embedq.errors.NoWorker`, naming the queue and what the live workers serve, unless a live worker
        serves ``queue`` or is starting to (loading its model: the job waits in the queue for it)."""
        found = self.serving(queue)
        if not found.coming():
            raise errors.NoWorker(found.describe())

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
        except (*BROKER_ERRORS, *acl.CAUGHT) as exc:
            raise self._unreachable(exc) from None

    def status(self, job_id: str) -> str:
        """A job's state by id (its stored record): PENDING (queued, running, or unknown), SUCCESS or FAILURE."""
        try:
            status: str = ResultStore(self.app).outcome(job_id)["status"]
        except (*BROKER_ERRORS, *acl.CAUGHT) as exc:
            raise self._unreachable(exc) from None
        return status

    def collect(self, handles: Iterable[JobHandle], timeout: float | None = DEFAULT_RESULT_TIMEOUT, *,
                return_exceptions: bool = False, forget: bool = True, decode: bool = True) -> list[Any]:
        """The results of many jobs, in the order of ``handles``: each what ``handle.result()`` returns (with
        ``decode=False``, what ``handle.payload()`` returns, for a caller that decodes payloads itself).
        ``handle.result()`` is this call for one handle.

        Stored records are read many per round trip (MGET); the jobs still running are awaited on their
        result channels, all on one subscription, not polled. A failed job raises its typed error, as
        ``handle.result()`` does, as soon as it is read (the first in ``handles``' order of those read);
        the jobs still running go on and can be collected later. With ``return_exceptions=True`` (as in
        ``asyncio.gather``) each job's error takes its place in the list instead, and the jobs with no result
        after ``timeout`` seconds get :class:`~embedq.errors.JobTimeout` (else it is raised). A job past its
        deadline ends :class:`~embedq.errors.Expired`, a broker that stays away ``broker_timeout`` raises
        :class:`~embedq.errors.BrokerUnavailable`, and jobs Redis lost, or with no result long after sending
        (``resend_after``), are sent again. Every handle keeps its outcome. With ``forget`` (the default) the
        records read are deleted from Redis, in one round trip.
        """
        return self.collector.collect(handles, timeout, return_exceptions=return_exceptions, forget=forget,
                                      decode=decode)

    def forget(self, handles: Iterable[JobHandle]) -> None:
        """Delete the stored records of ``handles`` in one round trip (each keeps its outcome, once collected)."""
        self.collector.forget(handles)

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
        again, under its own id (:meth:`Pending.resend_lost <embedq.producers.pending.Pending.resend_lost>`)."""
        self.pending.resend_lost(epoch)

    def _unreachable(self, exc: BaseException) -> BaseException:
        """A broker call's error, typed: BrokerForbidden (its user refused), BrokerUnavailable (away), else as is."""
        refused = not isinstance(exc, errors.EmbedqError) and acl.refusal(exc) is not None
        if not refused and (isinstance(exc, errors.EmbedqError) or not isinstance(exc, BROKER_ERRORS)):
            return exc
        if refused:
            return acl.forbidden(exc, self.settings.broker_url)
        return unavailable(exc, self.settings.broker_url)

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
        """Embed texts and wait: a ``(len(texts), dim)`` float32 array in input order. With
        ``long_inputs="windows"`` a text longer than the model is embedded in windows of the model's length, pooled
        into its one vector; ``pool_windows=False`` returns per text the list of its
        :class:`~embedq.windows.TextWindow` instead (each window's vector, character span and tokens)."""
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
        self.collector.close()
        if self._redis is not None:
            self._redis.close()
        self.app.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
