"""The coalescing service: a plain object, testable without Celery, that knows no kind of job.

``submit`` validates a job on the caller's thread (the Celery consumer) with its kind's spec
(``protocol.TASKS``), lets the backend prepare it (check options, tokenize texts or pairs) and puts its
items into the :class:`~embedq.batching.Scheduler`, where items of every job and kind pack together by
token cost. One inference thread takes micro-batches from the scheduler and runs ``backend.forward``
(one row per item); when every item of a job is done it hands the job to a results thread, which calls
``backend.finish`` (post-process, check, encode) and ``on_done`` (the worker stores the outcome there).
So neither tokenizing new jobs nor writing results stands between two forward passes, and the consumer
thread stays free to send heartbeats during long batches. A job with no items to run (``tokenize``) goes
straight to the results thread.

**Preemption (issue 18).** A bulk micro-batch runs with a hook before each of the model's layers
(``backend.between_layers``). When online items wait there, the inference thread runs micro-batches of them to
completion (their own forward passes, their own results) and then lets the bulk batch go on with its hidden
states untouched: an online job waits at most one layer of a bulk batch, bulk batches keep their full size and
nothing is computed twice or differently (tests/test_preempt.py: bit-identical in fp32). The time a bulk batch
spends paused is not counted as its model time. Where the model cannot stop between layers the scheduler's
online cap bounds the wait instead (``TrafficScheduler``), and the worker says so once at start.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from embedq import errors
from embedq.backends.base import Backend, Prepared, row_is_finite
from embedq.batching import Scheduler, batch_cost
from embedq.batching.traffic import BULK, ONLINE, Deadlines, TrafficClass, TrafficScheduler
from embedq.kinds import EMBED, TaskSpec
from embedq.protocol import result_size
from embedq.settings import Settings
from embedq.workers import memory
from embedq.workers.stats import Stats

log = logging.getLogger(__name__)

#: The longest the idle inference thread sleeps at once (it wakes sooner for a deadline or new work).
IDLE_WAIT = 60.0

#: on_done(job, outcome): outcome is the result payload (dict) or an EmbedqError.
DoneCallback = Callable[["Job", "dict[str, Any] | errors.EmbedqError"], None]
#: on_done_many([(job, outcome), ...]): the same for many jobs at once (one round trip to store them).
DoneManyCallback = Callable[[list[tuple["Job", "dict[str, Any] | errors.EmbedqError"]]], None]
#: Most finished jobs the results thread stores at once.
WRITE_BATCH = 256


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
    traffic_class: TrafficClass = ONLINE  # from the queue it came from
    deadline: float | None = None  # monotonic time after which it is dropped unless it has started

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def n_items(self) -> int:
        return len(self.prepared.items) if self.prepared is not None else 0

    def cost(self, i: int) -> int:
        assert self.prepared is not None
        return len(self.prepared.items[i].ids)


class EmbeddingService:
    def __init__(self, backend: Backend, settings: Settings, on_done: DoneCallback,
                 on_isolated_run: Callable[[Job, bool], None] | None = None,
                 on_started: Callable[[Job], None] | None = None, metrics: Any = None,
                 memory_policy: str | None = None, on_done_many: DoneManyCallback | None = None) -> None:
        self.backend = backend
        self.settings = settings
        self.on_done = on_done
        self.on_done_many = on_done_many
        self.on_isolated_run = on_isolated_run
        self.on_started = on_started  # inference thread: a job's first micro-batch starts
        self.metrics = metrics  # a workers.metrics.WorkerMetrics, or None
        self.info = backend.info
        self.stats = Stats()
        # A backend may lower the budget (SPLADE: its vocabulary logits grow with it).
        self.batch_tokens = min(settings.batch_tokens, backend.max_batch_tokens or settings.batch_tokens)
        self.scheduler = TrafficScheduler(
            max_tokens=self.batch_tokens,
            max_items=settings.max_batch_requests,
            padded=backend.is_padded,
            online_tokens=min(settings.online_tokens, self.batch_tokens),
            bulk_share=settings.bulk_min_share,
        )
        # Preemption between layers: on unless turned off or the model cannot stop between two layers.
        self.preemption_blocker = (backend.preemption_blocker() if settings.preempt
                                   else "turned off (EMBEDQ_PREEMPT=false)")
        self.preemptive = self.scheduler.preemptive = self.preemption_blocker is None
        if self.preemptive:
            log.info("online micro-batches preempt bulk micro-batches: %s (bulk budget %d tokens)",
                     self.preemption, self.batch_tokens)
        else:
            log.warning("%s: online jobs cannot preempt bulk micro-batches: %s. While online jobs are about, "
                        "micro-batches with bulk texts are capped at %d padded tokens instead (online_batch_tokens)",
                        self.info.model_id, self.preemption_blocker, self.scheduler.online_tokens)
        # The running bulk micro-batch (inference thread only): seconds paused so far, preemption points met.
        self._paused, self._layer = 0.0, 0
        # Liveness (read by the worker's watchdog, see health()): when the inference thread last showed progress,
        # and the jobs of the micro-batch(es) it has in the model now.
        self.beat = time.monotonic()
        self._in_model: list[tuple[Job, ...]] = []  # the jobs of each micro-batch in the model now (see running)
        self.deadlines = Deadlines()
        self._cond = threading.Condition()
        self._stopping = False
        # Suspects of a crash, oldest first: each runs alone, so a poison job can only take itself down.
        self._suspects: collections.deque[Job] = collections.deque()
        self._aliases = _model_aliases(settings.model, self.info.model_id)
        self._thread = threading.Thread(target=self._loop, name="embedq-inference", daemon=True)
        self.memory_policy = memory_policy or settings.memory_policy  # in force (auto settles on one)
        self._trimmer = memory.trimmer(self.memory_policy, settings.malloc_trim_interval)
        # (job, None) to finish a job, (job, error) to fail it; None stops the results thread.
        self._outbox: queue.SimpleQueue[tuple[Job, errors.EmbedqError | None] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="embedq-results", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> EmbeddingService:
        self._writer.start()
        self._thread.start()
        return self

    @property
    def preemption(self) -> str:
        """How online micro-batches get ahead of bulk ones on this worker, in words (``embedq status``)."""
        if not self.preemptive:
            return f"off: {self.preemption_blocker}"
        layered = getattr(getattr(self.backend, "encoder", None), "preempt_runtime", None)
        return f"between layers (bulk micro-batches on {layered})" if layered else "between layers"

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish the micro-batch in progress, write every finished job's outcome, and stop.

        Buffered jobs stay unfinished (their messages are not acknowledged, so they are redelivered).
        """
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._writer.is_alive():
            self._outbox.put(None)
            self._writer.join(timeout)

    # -- intake (consumer thread) ------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Validate and tokenize ``job``; a bad job is finished with its typed error at once, and one
        whose deadline has passed with ``expired``, before it is tokenized."""
        self.submit_many([job])

    def submit_many(self, jobs: list[Job]) -> None:
        """:meth:`submit` for the jobs of one fetch: each validated on its own, the texts of all those of a kind
        tokenized together (``backend.prepare_many``: one tokenizer call where the options agree, exactly the ids
        each job's texts get alone), then put into the scheduler under one lock."""
        now = time.monotonic()
        by_kind: dict[str, list[Job]] = {}
        for job in jobs:
            if job.done:  # cancelled (or refused) between its delivery and now
                continue
            self.count_received(job.size, job.traffic_class, job.kind)
            if job.deadline is not None and job.deadline <= now:
                self.fail(job, _expired(job))
                continue
            try:
                self._check(job)
            except errors.EmbedqError as exc:
                self.fail(job, exc)
                continue
            except Exception as exc:  # a bad message must not take the consumer down
                log.exception("checking job %s failed", job.id)
                self.fail(job, errors.BackendError(f"could not read the job: {type(exc).__name__}"))
                continue
            by_kind.setdefault(job.kind, []).append(job)
        ready: list[Job] = []
        for kind, group in by_kind.items():
            t0 = time.perf_counter()
            try:
                prepared = self.backend.prepare_many(kind, [(job.texts, job.options) for job in group])
            except Exception as exc:  # a tokenizer crash must not take the consumer down
                log.exception("preparing %d job(s) failed", len(group))
                prepared = [errors.BackendError(f"could not tokenize: {type(exc).__name__}")] * len(group)
            each = (time.perf_counter() - t0) / len(group)
            for job, outcome in zip(group, prepared):
                if isinstance(outcome, errors.EmbedqError):
                    self.fail(job, outcome)
                else:
                    if self.metrics is not None:  # a job's share of the call (jobs that failed it are not counted)
                        self.metrics.observe("tokenize_seconds", each)
                    job.prepared = outcome
                    job.rows = [None] * job.n_items
                    job.remaining = job.n_items
                    ready.append(job)
        if not ready:
            return
        with self._cond:
            for job in ready:
                if job.done:  # cancelled while it was tokenized
                    continue
                if not job.n_items:  # nothing to run (tokenize): the results thread finishes it
                    self._finish(job)
                    continue
                if job.suspect:
                    self._suspects.append(job)
                else:
                    # Longest first within the job: the scheduler anchors each batch on its oldest item, so a job's
                    # items then feed it like a length-sorted sweep (bench/peers.py: 4.0 % padding instead of 5.5 %
                    # on 32-text jobs). Order within a job changes nothing else: its result waits for all of them.
                    order = sorted(range(job.n_items), key=job.cost, reverse=True)
                    self.scheduler.add_many([((job, i), job.cost(i)) for i in order], job.traffic_class)
                if job.deadline is not None:
                    self.deadlines.add(job.deadline, job)
            self._cond.notify()

    def count_received(self, items: int, traffic_class: str | None = None, kind: str | None = None) -> None:
        self.stats.add(jobs_received=1, items_received=items)
        if traffic_class is not None:
            self.stats.add_labelled("jobs_by_class", traffic_class)
        if kind is not None:
            self.stats.add_labelled("jobs_by_kind", kind)

    def cancel(self, job: Job, error: errors.EmbedqError | None = None) -> bool:
        """Consumer thread: drop a job that has not started; it finishes with ``cancelled``. A job whose
        first micro-batch has started runs to the end (returns False)."""
        with self._cond:
            if job.done or job.started is not None:
                return False
            job.done, job.rows = True, None
            self.scheduler.discard((job, i) for i in range(job.n_items))
            if job in self._suspects:
                self._suspects.remove(job)
        self.stats.add(jobs_cancelled=1, items_cancelled=job.size)
        self._outbox.put((job, error or errors.Cancelled(f"job {job.id} was cancelled before it ran")))
        return True

    def count_failure(self, code: str, items: int) -> None:
        """One failed job of ``items`` items (also for messages refused before they became jobs)."""
        self.stats.failure(code, items)

    def _check(self, job: Job) -> None:
        """The job's kind, options and inputs checked (its options parsed, its inputs turned into items)."""
        spec = job.spec
        self.backend.check_kind(spec.kind)  # first: a job of another kind learns what this worker serves
        opts = spec.parse_options(job.options)
        job.options = opts
        job.texts = spec.items(job.texts, self.settings.max_texts_per_job, self.settings.max_chars)
        if opts.model is not None and opts.model.strip().lower() not in self._aliases:
            raise errors.UnknownModel(
                f"model {opts.model!r} is not served on this queue (this worker serves {self.info.model_id!r})"
            )

    # -- inference thread --------------------------------------------------------------------
    def _loop(self) -> None:
        # On a device that runs behind the CPU (backend.launches_async), the micro-batch launched last is landed
        # (waited for, its rows stored) only after the next one is launched, so the device always has work queued
        # while this thread stores rows, picks and assembles the next batch. Elsewhere each lands as it is launched.
        pending: _Flight | None = None
        while True:
            suspect = batch = None
            with self._cond:
                while not self._stopping:
                    now = self.beat = time.monotonic()
                    self._expire(now)
                    if len(self.scheduler) or self._suspects or pending is not None:
                        break
                    wake = self.deadlines.next_deadline(lambda job: job.done)
                    self._cond.wait(IDLE_WAIT if wake is None else min(max(wake - now, 0.0) + 0.001, IDLE_WAIT))
                stopping = self._stopping
                if not stopping:
                    if self._suspects:
                        if pending is None:  # a suspect runs alone: nothing else in the model with it
                            suspect = self._suspects.popleft()
                            starting = self._start([suspect])
                    elif len(self.scheduler):
                        batch = self.scheduler.next_batch()
                        starting = self._start(item.key[0] for item in batch)
            if suspect is not None or batch is not None:
                self._started(starting)
            try:
                if suspect is not None:
                    self._run_alone(suspect)
                elif batch is not None:
                    keys = [item.key for item in batch]
                    flight = self._launch(keys, self.preemptive and all(j.traffic_class == BULK for j, _ in keys))
                    if self.backend.launches_async:  # the last one lands now, this one after the next launch
                        flight, pending = pending, flight
                    if flight is not None:
                        self._land(flight)
                elif pending is not None:
                    landing, pending = pending, None
                    self._land(landing)
            except Exception:  # never let the inference thread die
                log.exception("micro-batch bookkeeping failed")
            if stopping and pending is None:
                return
            if self._trimmer is not None:  # outside the lock: a trim takes milliseconds
                if len(self.scheduler) or self._suspects:
                    self._trimmer.after_batch()
                else:
                    self._trimmer.idle()

    def _start(self, jobs: Any) -> list[Job]:
        """Under the lock: mark the jobs among ``jobs`` whose first micro-batch starts now; returns them."""
        now = time.monotonic()
        starting = [job for job in dict.fromkeys(jobs) if job.started is None]
        waited = 0.0
        online = 0
        for job in starting:
            job.started = now
            if job.traffic_class == ONLINE:
                online += 1
                waited += now - job.received
        if online:
            self.stats.add(online_started=online)
            self.stats.time("online_wait_seconds", waited)
        return starting

    @property
    def running(self) -> tuple[Job, ...]:
        """The jobs of the micro-batches in the model now (read by the watchdog from other threads)."""
        return tuple(itertools.chain.from_iterable(self._in_model))

    def _started(self, starting: list[Job]) -> None:
        if self.on_started is not None:
            for job in starting:
                self.on_started(job)

    def _between_layers(self) -> None:
        """Inference thread, before a layer of a running bulk micro-batch (a preemption point)."""
        self._layer += 1
        self.beat = time.monotonic()
        self._preempt()

    def _preempt(self) -> None:
        """Inference thread, at a preemption point: if online items wait, run micro-batches of them to completion,
        then return (the bulk batch goes on). Never raises into the model."""
        if not self.scheduler.waiting(ONLINE) or self._stopping:  # unlocked read: the common case costs nothing
            return
        t0 = time.perf_counter()
        ran = 0
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        break
                    self._expire(time.monotonic())
                    batch = self.scheduler.next_online_batch()
                    if not batch:
                        break
                    starting = self._start(item.key[0] for item in batch)
                self._started(starting)
                ran += 1
                self._run([item.key for item in batch])
        except Exception:  # the bulk batch must go on whatever happened to the online one
            log.exception("a preempting micro-batch failed")
        if ran:
            paused = time.perf_counter() - t0
            self._paused += paused
            log.info("bulk micro-batch paused at preemption point %d: %d online micro-batch(es) in %.1f ms",
                     self._layer, ran, paused * 1e3)
            self.stats.add(preemptions=1, preempting_batches=ran)
            self.stats.time("bulk_paused_seconds", paused)
            if self.metrics is not None:
                self.metrics.observe("preempt_seconds", paused)

    def _expire(self, now: float) -> None:
        """Under the lock: fail every buffered job whose deadline has passed and that has not started."""
        for job in self.deadlines.due(now):
            if not job.done and job.started is None:
                self.fail(job, _expired(job))
        if len(self.deadlines) > 2 * len(self.scheduler) + 1024:
            self.deadlines.prune(lambda job: job.done)

    def _run_alone(self, job: Job) -> None:
        """A suspect job: count the run, run its texts in micro-batches of their own, uncount it.

        Only a run during which the process dies stays counted; a job that finished running before
        another suspect took the worker down is not blamed for it."""
        if job.done:
            return
        self.stats.add(isolated_runs=1)
        if self.on_isolated_run is not None:
            self.on_isolated_run(job, True)
        own = Scheduler(max_tokens=self.batch_tokens, max_items=self.settings.max_batch_requests,
                        padded=self.backend.is_padded)
        own.add_many(((job, i), job.cost(i)) for i in range(job.n_items))
        while len(own) and not job.done:
            self._run([item.key for item in own.next_batch()])
        if self.on_isolated_run is not None:
            self.on_isolated_run(job, False)

    def _run(self, keys: list[tuple[Job, int]], preemptible: bool = False) -> None:
        """One micro-batch through the model, to its stored rows. ``preemptible``: a bulk batch online batches may
        pause between two layers (its model time leaves out the pauses)."""
        flight = self._launch(keys, preemptible)
        if flight is not None:
            self._land(flight)

    def _launch(self, keys: list[tuple[Job, int]], preemptible: bool = False) -> _Flight | None:
        """Start a micro-batch in the model (``backend.launch``); :meth:`_land` waits for it and stores its rows."""
        keys = [(job, i) for job, i in keys if not job.done]
        if not keys:
            return None
        batch = [job.prepared.items[i] for job, i in keys]
        lengths = [len(item.ids) for item in batch]
        if preemptible:  # (not in a preempting batch: that one runs inside the bulk batch's pause)
            self._paused, self._layer = 0.0, 0
        jobs = tuple(dict.fromkeys(job for job, _ in keys))
        self._in_model.append(jobs)  # a preempting batch runs inside a bulk one: both are in the model
        t0 = time.perf_counter()
        try:
            if preemptible:
                with self.backend.between_layers(self._between_layers):
                    rows = self.backend.launch(batch)
            else:
                rows = self.backend.launch(batch)
        except Exception as exc:
            rows = _raising(exc)
        return _Flight(keys, jobs, rows, lengths, t0, preemptible, self._paused if preemptible else 0.0)

    def _land(self, flight: _Flight) -> None:
        """Wait for a launched micro-batch's rows and store them; a batch that failed is split (:meth:`_isolate`)."""
        keys = flight.keys
        try:
            rows = flight.rows()
            bad = [not row_is_finite(row) for row in rows]
        except Exception as exc:
            rows, bad = None, None
            failure: Exception = exc
        # Not in a finally: if something the thread cannot survive escapes the model, these jobs stay "running",
        # and the worker's watchdog counts the delivery against them (see health()).
        self._in_model = [jobs for jobs in self._in_model if jobs is not flight.jobs]
        self.beat = time.monotonic()
        # From launch to rows: with two micro-batches in flight (launches_async) their times overlap.
        elapsed = time.perf_counter() - flight.t0 - flight.paused
        lengths = flight.lengths
        cost = batch_cost(lengths, padded=self.backend.is_padded)
        real = sum(lengths)
        by_class: dict[str, int] = {}
        by_kind: dict[str, int] = {}
        for job, _ in keys:
            by_class[job.traffic_class] = by_class.get(job.traffic_class, 0) + 1
            by_kind[job.kind] = by_kind.get(job.kind, 0) + 1
        self.stats.batch(items=len(keys), real=real, padded=cost, seconds=elapsed, by_class=by_class, by_kind=by_kind)
        log.info("micro-batch: %d items, %d real / %d padded tokens, %.1f ms (%s)%s", len(keys), real, cost,
                 elapsed * 1e3, ", ".join(f"{n} {k}" for k, n in by_kind.items()),
                 f", paused {flight.paused * 1e3:.1f} ms" if flight.paused else "")
        if self.metrics is not None:
            self.metrics.observe_batch(len(keys), real, cost, elapsed)
        if rows is None:
            self._isolate(keys, failure, flight.preemptible)
            return
        good = [(key, row) for key, row, b in zip(keys, rows, bad) if not b]
        self._store_rows([k for k, _ in good], [r for _, r in good])
        for (job, i), b in zip(keys, bad):
            if b:
                self.fail(job, errors.BackendError(f"inputs[{i}] produced a non-finite output"))

    def _isolate(self, keys: list[tuple[Job, int]], exc: Exception, preemptible: bool = False) -> None:
        """A failing micro-batch: split it and retry the halves so only the culprit fails (a bulk batch's halves
        stay preemptible)."""
        if len(keys) == 1:
            job, i = keys[0]
            log.warning("inputs[%d] of job %s failed in the model: %s", i, job.id, type(exc).__name__)
            self.fail(job, errors.BackendError(f"inputs[{i}] failed in the model: {type(exc).__name__}"))
            return
        mid = len(keys) // 2
        self._run(keys[:mid], preemptible)
        self._run(keys[mid:], preemptible)

    def _store_rows(self, keys: list[tuple[Job, int]], rows: list[Any]) -> None:
        for (job, i), row in zip(keys, rows):
            if job.done or job.rows is None:
                continue
            job.rows[i] = row
            job.remaining -= 1
            if job.remaining == 0:
                self._finish(job)

    # -- liveness ------------------------------------------------------------------------------
    def health(self, stall_timeout: float) -> str | None:
        """Why this service can no longer do its work, or None while it can: its inference or results thread has
        died, or work waits and the inference thread has shown no progress (a finished micro-batch, a preemption
        point, an idle wake) for ``stall_timeout`` seconds. The worker's watchdog stops the worker on it."""
        if self._stopping:
            return None
        for thread in (self._thread, self._writer):
            if thread.ident is not None and not thread.is_alive():
                return f"the {thread.name} thread has died"
        idle = time.monotonic() - self.beat
        if idle > stall_timeout and (len(self.scheduler) or self._suspects or self.running):
            return (f"the {self._thread.name} thread has made no progress for {idle:.0f}s while work waits "
                    f"(EMBEDQ_STALL_TIMEOUT={stall_timeout:g})")
        return None

    def abandon(self) -> None:
        """The watchdog gives up on this service: no more micro-batches start; what the results thread has in
        hand is still written (see :meth:`drain`)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._outbox.put(None)

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the results thread to write what it has (it stops after that)."""
        if self._writer.is_alive():
            self._writer.join(timeout)

    # -- completion --------------------------------------------------------------------------
    def _finish(self, job: Job) -> None:
        """Every item of ``job`` has its row; the results thread does the rest."""
        job.done = True
        self._outbox.put((job, None))

    def fail(self, job: Job, exc: errors.EmbedqError) -> None:
        if job.done:
            return
        job.done, job.rows = True, None
        with self._cond:
            self.scheduler.discard((job, i) for i in range(job.n_items))
        self.count_failure(exc.code, job.size)
        self._outbox.put((job, exc))

    # -- results thread ------------------------------------------------------------------------
    def _write_loop(self) -> None:
        """Results thread: finish jobs as they come, taking every job waiting at once (up to WRITE_BATCH) so their
        outcomes are stored in one round trip (``on_done_many``)."""
        stop = False
        while not stop:
            entry = self._outbox.get()
            if entry is None:
                break
            entries = [entry]
            while len(entries) < WRITE_BATCH:
                try:
                    entry = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if entry is None:
                    stop = True
                    break
                entries.append(entry)
            t0 = time.perf_counter()
            done = [(job, self._outcome(job, outcome)) for job, outcome in entries]
            try:
                if self.on_done_many is not None:
                    self.on_done_many(done)
                else:
                    for job, outcome in done:
                        self.on_done(job, outcome)
            except Exception:
                log.exception("storing the outcomes of %d job(s) failed", len(done))
            self.stats.time("results_seconds", time.perf_counter() - t0)

    def _outcome(self, job: Job, outcome: errors.EmbedqError | None) -> dict[str, Any] | errors.EmbedqError:
        """Results thread: a finished job's result payload (or the typed error of a job that failed)."""
        if outcome is not None:
            return outcome
        try:
            payload: dict[str, Any] | errors.EmbedqError = self._payload(job)
        except errors.EmbedqError as exc:
            payload = exc
        except Exception as exc:  # never let the results thread die
            log.exception("encoding the result of job %s failed", job.id)
            payload = errors.BackendError(f"could not encode the result: {type(exc).__name__}")
        if isinstance(payload, errors.EmbedqError):
            self.count_failure(payload.code, job.size)
        else:
            self.stats.add(jobs_succeeded=1, items_succeeded=job.size)
        return payload

    def _payload(self, job: Job) -> dict[str, Any]:
        """Results thread: the backend's head post-processes, checks and encodes; the size is capped."""
        rows, prepared = job.rows or [], job.prepared
        job.rows, job.prepared = None, None  # the job's memory goes with its result
        assert prepared is not None
        payload = self.backend.finish(job.kind, rows, prepared, job.options)
        size = result_size(payload)
        if size > self.settings.max_result_bytes:
            raise errors.ResultTooLarge(
                f"the result would take about {size} bytes; the limit is {self.settings.max_result_bytes} "
                "(EMBEDQ_MAX_RESULT_BYTES): send fewer inputs per job or a compact encoding")
        return payload


@dataclass
class _Flight:
    """A launched micro-batch: ``rows()`` waits for its rows."""

    keys: list[tuple[Job, int]]
    jobs: tuple[Job, ...]
    rows: Callable[[], list[Any]]
    lengths: list[int]
    t0: float
    preemptible: bool
    paused: float  # seconds its launch spent paused for online batches


def _raising(exc: Exception) -> Callable[[], list[Any]]:
    def rows() -> list[Any]:
        raise exc

    return rows


def _expired(job: Job) -> errors.Expired:
    return errors.Expired(f"job {job.id} passed its deadline before it ran; it was not computed")


def _model_aliases(*names: str) -> set[str]:
    out: set[str] = set()
    for name in names:
        name = name.strip().lower().rstrip("/")
        out.update({name, name.split("/")[-1]})
    return out
