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

This module holds the service itself: intake (``submit_many``, ``cancel``), the inference thread's loop (which
micro-batch next, suspects alone, deadlines, preemption) and liveness (``health``). Its parts live beside it:
the job record and its callbacks in ``workers/jobs.py``; launching a micro-batch, landing it and storing its rows
(two in flight on an async device) in ``workers/inflight.py`` (:class:`~embedq.workers.inflight.MicroBatches`,
which the service owns as ``batches``); identical items run once in ``workers/dedupe.py`` (``dedupe``, between the
intake and the scheduler); the results thread in ``workers/outbox.py``.

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
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from embedq import errors
from embedq.backends.base import Backend
from embedq.backends.windowing import window_counts
from embedq.batching import Scheduler
from embedq.batching.traffic import ONLINE, Deadlines, TrafficScheduler
from embedq.settings import Settings
from embedq.workers import hooks, memory
from embedq.workers.dedupe import Dedupe
from embedq.workers.inflight import Flight, MicroBatches
from embedq.workers.jobs import DoneCallback, DoneManyCallback, Job, check_job, expired, model_aliases
from embedq.workers.outbox import Outbox
from embedq.workers.preparer import Preparer, heavy
from embedq.workers.stats import Stats

log = logging.getLogger(__name__)

#: The longest the idle inference thread sleeps at once (it wakes sooner for a deadline or new work).
IDLE_WAIT = 60.0


class EmbeddingService:
    def __init__(self, backend: Backend, settings: Settings, on_done: DoneCallback,
                 on_isolated_run: Callable[[Job, bool], None] | None = None,
                 on_started: Callable[[Job], None] | None = None, metrics: Any = None,
                 memory_policy: str | None = None, on_done_many: DoneManyCallback | None = None,
                 outbox: Callable[[Stats], Any] | None = None) -> None:
        self.backend = backend
        self.settings = settings
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
        # Identical items waiting at the same time run once (workers/dedupe.py, issue 57).
        self.dedupe = Dedupe(self.scheduler, self.stats, settings.dedupe)
        self._preempt_exclude: frozenset[str] = frozenset()  # clients of the running preemptible online batch
        # Liveness (read by the worker's watchdog, see health()): when the inference thread last showed progress.
        self.beat = time.monotonic()
        self.deadlines = Deadlines()
        self._cond = threading.Condition()
        self._stopping = False
        # Suspects of a crash, oldest first: each runs alone, so a poison job can only take itself down.
        self._suspects: collections.deque[Job] = collections.deque()
        self._aliases = model_aliases(settings.model, self.info.model_id)
        self._thread = threading.Thread(target=self._loop, name="embedq-inference", daemon=True)
        self.hooks = hooks.installed()  # seams for a program that steers the worker (workers/hooks.py)
        # The micro-batches in the model (workers/inflight.py), the jobs of which are in the model now included.
        self.batches = MicroBatches(backend, self.stats, metrics, self.dedupe, at_point=self._at_point, fail=self.fail,
                                    before_launch=lambda keys: self.hooks.before_launch(self, keys),
                                    finish=self._finish, progress=self._progress)
        self.memory_policy = memory_policy or settings.memory_policy  # in force (auto settles on one)
        self._trimmer = memory.trimmer(self.memory_policy, settings.malloc_trim_interval)
        # Finished and failed jobs go to the results thread (workers/outbox.py), which stores their outcomes; a
        # device process passes its own (workers/device.py: the rows go back to the job's host process).
        self._outbox = outbox(self.stats) if outbox else Outbox(backend, settings, self.stats, on_done, on_done_many)
        self.preparer = Preparer(self._prepare_heavy)  # bulk jobs of long texts in windows (workers/preparer.py)
        self.on_prepared: Callable[[list[Job]], None] | None = None  # jobs the preparer tokenized (held.py)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> EmbeddingService:
        self._outbox.start()
        self._thread.start()
        return self

    @property
    def preemption(self) -> str:
        """How online micro-batches get ahead of bulk ones on this worker, in words (``embedq status``)."""
        if not self.preemptive:
            return f"off: {self.preemption_blocker}"
        layered = self.backend.runtime_facts().bulk_runtime
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
        self.preparer.close()
        if self._outbox.thread.is_alive():
            self._outbox.close()
            self._outbox.thread.join(timeout)

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
                self.fail(job, expired(job))
                continue
            try:
                check_job(job, self.backend, self.settings, self._aliases)
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
            light = [job for job in group if not heavy(job)]
            if len(light) < len(group):  # bulk jobs of long texts in windows: tokenized off this thread
                self.preparer.put(kind, [job for job in group if heavy(job)])
            ready += self._prepare(kind, light) if light else []
        self.enqueue(ready)

    def _prepare(self, kind: str, group: list[Job]) -> list[Job]:
        """Tokenize the jobs of one kind together; those that fail get their error, the rest are returned."""
        ready: list[Job] = []
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
                self.stats.add(**window_counts(outcome))
                job.tokenize_seconds, job.rows, job.remaining = each, [None] * job.n_items, job.n_items
                ready.append(job)
        return ready

    def _prepare_heavy(self, kind: str, group: list[Job]) -> None:
        """The preparer's thread: heavy jobs tokenized, told to ``on_prepared`` (held.py), then scheduled."""
        with self._cond:
            group = [job for job in group if not job.done]  # cancelled while they waited
        ready = self._prepare(kind, group) if group else []
        if self.on_prepared is not None:
            self.on_prepared(ready)
        self.enqueue(ready)

    def enqueue(self, ready: list[Job]) -> None:
        """Put prepared jobs (``prepared``, ``rows`` and ``remaining`` set) into the scheduler under one lock: the
        end of :meth:`submit_many`, and what a device process calls for the jobs its host processes prepared."""
        if not ready:
            return
        with self._cond:
            for job in self._runnable(ready):
                if job.suspect:
                    self._suspects.append(job)
                else:
                    # Longest first within the job: the scheduler anchors each batch on its oldest item, so a job's
                    # items then feed it like a length-sorted sweep (bench/peers.py: 4.0 % padding instead of 5.5 %
                    # on 32-text jobs). Order within a job changes nothing else: its result waits for all of them.
                    order = sorted(self.dedupe.add(job), key=job.cost, reverse=True)
                    self.scheduler.add_many([((job, i), job.cost(i)) for i in order], job.traffic_class,
                                            job.client)
                if job.deadline is not None:
                    self.deadlines.add(job.deadline, job)
            self._cond.notify()

    def _runnable(self, ready: list[Job]) -> Iterator[Job]:
        """The prepared jobs with items to run: those cancelled while they were tokenized are left out, those with
        nothing to run (tokenize) go to the results thread to be finished."""
        for job in ready:
            if job.done:
                continue
            if not job.n_items:
                self._finish(job)
                continue
            yield job

    def count_received(self, items: int, traffic_class: str | None = None, kind: str | None = None) -> None:
        self.stats.add(jobs_received=1, items_received=items)
        for name, label in (("jobs_by_class", traffic_class), ("jobs_by_kind", kind)):
            if label is not None:
                self.stats.add_labelled(name, label)

    def cancel(self, job: Job, error: errors.EmbedqError | None = None) -> bool:
        """Consumer thread: drop a job that has not started; it finishes with ``cancelled``. A job whose
        first micro-batch has started runs to the end (returns False)."""
        with self._cond:
            if job.done or job.started is not None:
                return False
            job.done, job.rows = True, None
            self.scheduler.discard(self.dedupe.discard([(job, i) for i in range(job.n_items)]))
            if job in self._suspects:
                self._suspects.remove(job)
        self.stats.add(jobs_cancelled=1, items_cancelled=job.size)
        self._outbox.put(job, error or errors.Cancelled(f"job {job.id} was cancelled before it ran"))
        return True

    def count_failure(self, code: str, items: int) -> None:
        """One failed job of ``items`` items (also for messages refused before they became jobs)."""
        self.stats.failure(code, items)

    # -- inference thread --------------------------------------------------------------------
    def _loop(self) -> None:
        # On a device that runs behind the CPU (backend.launches_async), the micro-batch launched last is landed
        # (waited for, its rows stored) only after the next one is launched, so the device always has work queued
        # while this thread stores rows, picks and assembles the next batch. Elsewhere each lands as it is launched.
        pending: Flight | None = None
        while True:
            suspect = batch = None
            with self._cond:
                while not self._stopping:
                    now = self.beat = time.monotonic()
                    self._intake()
                    self._expire(now)
                    if len(self.scheduler) or self._suspects or pending is not None:
                        break
                    wake = self.deadlines.next_deadline(lambda job: job.done)
                    self._cond.wait(IDLE_WAIT if wake is None else min(max(wake - now, 0.0) + 0.001, IDLE_WAIT))
                stopping = self._stopping
                picks = pending is None if self._suspects else bool(len(self.scheduler))
                if not stopping and picks:
                    self.hooks.before_pick(self)
                    stopping = self._stopping
                if not stopping:
                    if self._suspects:
                        if pending is None:  # a suspect runs alone: nothing else in the model with it
                            suspect = self._suspects.popleft()
                            starting = self._start([suspect])
                    elif len(self.scheduler):
                        # Whether online batches may pause this one, and whose may not (the running online batch's
                        # clients: they wait for it); identical items run once (workers/dedupe.py).
                        batch, jobs, exclude = self.dedupe.take([item.key for item in self.scheduler.next_batch()],
                                                                self._preemption)
                        starting = self._start(jobs)
            if suspect is not None or batch is not None:
                self._started(starting)
            try:
                if suspect is not None:
                    self._run_alone(suspect)
                elif batch is not None:
                    self._preempt_exclude = exclude or frozenset()
                    flight = self.batches.launch(batch, exclude is not None)
                    if self.backend.launches_async:  # the last one lands now, this one after the next launch
                        flight, pending = pending, flight
                    if flight is not None:
                        self.batches.land(flight)
                elif pending is not None:
                    landing, pending = pending, None
                    self.batches.land(landing)
            except Exception:  # never let the inference thread die
                log.exception("micro-batch bookkeeping failed")
            if stopping and pending is None:
                return
            if self._trimmer is not None:  # outside the lock: a trim takes milliseconds
                if len(self.scheduler) or self._suspects:
                    self._trimmer.after_batch()
                else:
                    self._trimmer.idle()

    def _intake(self) -> None:
        """Inference thread, under the lock, before each pick: a device process reads its hosts' items here."""

    def wait_locked(self, seconds: float) -> None:
        """Under the lock (a hook's ``before_pick``): wait up to ``seconds``, letting jobs arrive meanwhile; returns
        sooner on new work or a stop."""
        self._cond.wait(seconds)

    def _preemption(self, keys: list[tuple[Job, int]]) -> frozenset[str] | None:
        return self.scheduler.preemption((job.traffic_class, job.client) for job, _ in keys)

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

    def _started(self, starting: list[Job]) -> None:
        if self.on_started is not None:
            for job in starting:
                self.on_started(job)

    @property
    def running(self) -> tuple[Job, ...]:
        """The jobs of the micro-batches in the model now (read by the watchdog from other threads)."""
        return self.batches.running

    def _progress(self) -> None:
        self.beat = time.monotonic()

    def _at_point(self, layer: int) -> None:
        """Inference thread, before a layer of a running bulk micro-batch (preemption point ``layer``)."""
        self.beat = time.monotonic()
        self.preempt()
        self.hooks.at_point(self, layer)

    def preempt(self) -> None:
        """Inference thread, at a preemption point: if online items wait (of clients other than the running online
        batch's), run micro-batches of them to completion, then return (the paused batch goes on). Never raises into
        the model."""
        if not self.scheduler.waiting(ONLINE) or self._stopping:  # unlocked read: the common case costs nothing
            return
        exclude = self._preempt_exclude
        if exclude and not self.scheduler.others_waiting(exclude):
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        ran = 0
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        break
                    self._expire(time.monotonic())
                    self.hooks.before_pick(self)
                    if self._stopping:
                        break
                    batch = self.scheduler.next_online_batch(exclude)
                    if not batch:
                        break
                    keys, jobs, _ = self.dedupe.take([item.key for item in batch], _unhooked)
                    starting = self._start(jobs)
                self._started(starting)
                ran += 1
                self.batches.run(keys)
        except Exception:  # the bulk batch must go on whatever happened to the online one
            log.exception("a preempting micro-batch failed")
        if ran:
            paused = time.perf_counter() - t0
            self.batches.paused += paused
            self.batches.paused_cpu += time.thread_time() - c0
            log.info("%s micro-batch paused at preemption point %d: %d online micro-batch(es) in %.1f ms",
                     "an online" if exclude else "a bulk", self.batches.layer, ran, paused * 1e3)
            self.stats.add(preemptions=1, preempting_batches=ran)
            self.stats.time("bulk_paused_seconds", paused)
            if self.metrics is not None:
                self.metrics.observe("preempt_seconds", paused)

    def _expire(self, now: float) -> None:
        """Under the lock: fail every buffered job whose deadline has passed and that has not started."""
        for job in self.deadlines.due(now):
            if not job.done and job.started is None:
                self.fail(job, expired(job))
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
            self.batches.run([item.key for item in own.next_batch()])
        if self.on_isolated_run is not None:
            self.on_isolated_run(job, False)

    # -- liveness ------------------------------------------------------------------------------
    def health(self, stall_timeout: float) -> str | None:
        """Why this service can no longer do its work, or None while it can: its inference or results thread has
        died, or work waits and the inference thread has shown no progress (a finished micro-batch, a preemption
        point, an idle wake) for ``stall_timeout`` seconds, or results wait and the results thread has shown none
        (a batch taken or stored, a retry while the broker is away) for as long. The worker's watchdog stops the
        worker on it."""
        if self._stopping:
            return None
        for thread in (self._thread, self._outbox.thread):
            if thread.ident is not None and not thread.is_alive():
                return f"the {thread.name} thread has died"
        idle = time.monotonic() - self.beat
        if idle > stall_timeout and (len(self.scheduler) or self._suspects or self.running):
            return (f"the {self._thread.name} thread has made no progress for {idle:.0f}s while work waits "
                    f"(EMBEDQ_STALL_TIMEOUT={stall_timeout:g})")
        idle = self._outbox.stalled(stall_timeout)
        if idle is not None:
            return (f"the {self._outbox.thread.name} thread has made no progress for {idle:.0f}s while results wait "
                    f"(EMBEDQ_STALL_TIMEOUT={stall_timeout:g})")
        return None

    def results_beat(self) -> None:
        """Results thread: it is making progress (riding out a broker outage, waiting for the canvas thread)."""
        self._outbox.beat = time.monotonic()

    def abandon(self) -> None:
        """The watchdog gives up on this service: no more micro-batches start; what the results thread has in
        hand is still written (see :meth:`drain`)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._outbox.close()

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the results thread to write what it has (it stops after that)."""
        if self._outbox.thread.is_alive():
            self._outbox.thread.join(timeout)

    # -- completion --------------------------------------------------------------------------
    def _finish(self, job: Job) -> None:
        """Every item of ``job`` has its row; the results thread does the rest."""
        job.done, job.finished = True, time.monotonic()
        self._outbox.put(job)

    def fail(self, job: Job, exc: errors.EmbedqError) -> None:
        if job.done:
            return
        job.done, job.rows = True, None
        with self._cond:
            self.scheduler.discard(self.dedupe.discard([(job, i) for i in range(job.n_items)]))
        self.count_failure(exc.code, job.size)
        self._outbox.put(job, exc)


def _unhooked(keys: list[tuple[Job, int]]) -> None:
    """An online micro-batch at a preemption point runs whole: nothing pauses it."""
    return None
