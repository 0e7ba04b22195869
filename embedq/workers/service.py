"""The coalescing embedding service: a plain object, testable without Celery.

``submit`` validates and tokenizes a job on the caller's thread (the Celery consumer), and puts
its texts into the :class:`~embedq.batching.Scheduler`. One inference thread takes micro-batches
from the scheduler and runs the backend; when every text of a job is done it hands the job to a
results thread, which post-processes and encodes the vectors and calls ``on_done`` (the worker
stores the result in Redis there). So neither tokenizing new jobs nor writing results stands between
two forward passes, and the consumer thread stays free to send heartbeats during long batches.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedq import __version__, errors
from embedq.backends.base import Backend, postprocess
from embedq.batching import Scheduler, batch_cost
from embedq.batching.traffic import ONLINE, Deadlines, TrafficClass, TrafficScheduler
from embedq.protocol import EmbedOptions, Fingerprint, encode_result, validate_texts
from embedq.settings import Settings

log = logging.getLogger(__name__)

#: on_done(job, outcome): outcome is the result payload (dict) or an EmbedqError.
DoneCallback = Callable[["Job", "dict[str, Any] | errors.EmbedqError"], None]


@dataclass(eq=False)
class Job:
    """One embedding request as the worker tracks it."""

    id: str
    texts: Any
    options: Any = None  # raw kwargs or EmbedOptions
    context: Any = None  # whatever the transport needs to finish the job (a Celery request)
    received: float = field(default_factory=time.monotonic)
    size: int = 1  # texts as received, for the prefetch window
    ids: list[list[int]] = field(default_factory=list)
    prompt: str | None = None
    prompt_length: int = 0
    raw: np.ndarray | None = None
    remaining: int = 0
    done: bool = False
    suspect: bool = False  # redelivered after its worker died: runs alone (see workers/delivery.py)
    started: float | None = None  # monotonic time its first micro-batch started (set under the service lock)
    traffic_class: TrafficClass = ONLINE  # from the queue it came from
    deadline: float | None = None  # monotonic time after which it is dropped unless it has started


@dataclass
class Stats:
    """The worker's own counters (read by tests, the CLI and later by metrics)."""

    jobs_received: int = 0
    jobs_succeeded: int = 0
    jobs_failed: int = 0
    items_received: int = 0  # texts, as received (a malformed job counts one)
    items_succeeded: int = 0
    items_failed: int = 0
    batches: int = 0
    items: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    max_batch_cost: int = 0
    max_batch_items: int = 0
    inference_seconds: float = 0.0
    results_seconds: float = 0.0  # results thread: post-processing, encoding and storing finished jobs
    errors_by_code: dict[str, int] = field(default_factory=dict)  # failed jobs by error code
    items_failed_by_code: dict[str, int] = field(default_factory=dict)
    # delivery (see workers/delivery.py)
    redelivered: int = 0  # messages that came back to the queue (a worker died or stopped)
    duplicates: int = 0  # deliveries of a job this worker already held (counted once)
    already_stored: int = 0  # redelivered jobs whose record was already stored: acknowledged, not run
    isolated_runs: int = 0  # suspect jobs run alone
    dead_letters: int = 0
    # traffic classes (see batching/traffic.py)
    jobs_by_class: dict[str, int] = field(default_factory=dict)  # jobs received, by traffic class
    items_by_class: dict[str, int] = field(default_factory=dict)  # texts run through the model, by class
    jobs_cancelled: int = 0  # cancelled before they ran (their texts never reached the model)
    items_cancelled: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["errors_by_code"] = dict(self.errors_by_code)
        out["items_failed_by_code"] = dict(self.items_failed_by_code)
        out["jobs_by_class"] = dict(self.jobs_by_class)
        out["items_by_class"] = dict(self.items_by_class)
        out["padding_ratio"] = (1 - self.real_tokens / self.padded_tokens) if self.padded_tokens else 0.0
        return out


class EmbeddingService:
    def __init__(self, backend: Backend, settings: Settings, on_done: DoneCallback,
                 on_isolated_run: Callable[[Job, bool], None] | None = None,
                 on_started: Callable[[Job], None] | None = None, metrics: Any = None) -> None:
        self.backend = backend
        self.settings = settings
        self.on_done = on_done
        self.on_isolated_run = on_isolated_run
        self.on_started = on_started  # inference thread: a job's first micro-batch starts
        self.metrics = metrics  # a workers.metrics.WorkerMetrics, or None
        self.info = backend.info
        self.stats = Stats()
        self.scheduler = TrafficScheduler(
            max_tokens=settings.batch_tokens,
            max_items=settings.max_batch_requests,
            padded=backend.is_padded,
            online_tokens=settings.online_tokens,
            bulk_share=settings.bulk_min_share,
        )
        self.deadlines = Deadlines()
        self._cond = threading.Condition()
        self._stopping = False
        # Suspects of a crash, oldest first: each runs alone, so a poison job can only take itself down.
        self._suspects: collections.deque[Job] = collections.deque()
        self._aliases = _model_aliases(settings.model, self.info.model_id)
        self._thread = threading.Thread(target=self._loop, name="embedq-inference", daemon=True)
        # (job, None) to finish a job, (job, error) to fail it; None stops the results thread.
        self._outbox: queue.SimpleQueue[tuple[Job, errors.EmbedqError | None] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="embedq-results", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> EmbeddingService:
        self._writer.start()
        self._thread.start()
        return self

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
        self.count_received(job.size, job.traffic_class)
        if job.deadline is not None and job.deadline <= time.monotonic():
            self.fail(job, _expired(job))
            return
        t0 = time.perf_counter()
        try:
            self._prepare(job)
        except errors.EmbedqError as exc:
            self.fail(job, exc)
            return
        except Exception as exc:  # a tokenizer crash must not take the consumer down
            log.exception("preparing job %s failed", job.id)
            self.fail(job, errors.BackendError(f"could not tokenize: {type(exc).__name__}"))
            return
        if self.metrics is not None:
            self.metrics.observe("tokenize_seconds", time.perf_counter() - t0)
        with self._cond:
            if job.done:  # cancelled while it was tokenized
                return
            if job.suspect:
                self._suspects.append(job)
            else:
                self.scheduler.add_many([((job, i), len(ids)) for i, ids in enumerate(job.ids)], job.traffic_class)
            if job.deadline is not None:
                self.deadlines.add(job.deadline, job)
            self._cond.notify()

    def count_received(self, items: int, traffic_class: str | None = None) -> None:
        self.stats.jobs_received += 1
        self.stats.items_received += items
        if traffic_class is not None:
            self.stats.jobs_by_class[traffic_class] = self.stats.jobs_by_class.get(traffic_class, 0) + 1

    def cancel(self, job: Job, error: errors.EmbedqError | None = None) -> bool:
        """Consumer thread: drop a job that has not started; it finishes with ``cancelled``. A job whose
        first micro-batch has started runs to the end (returns False)."""
        with self._cond:
            if job.done or job.started is not None:
                return False
            job.done, job.raw = True, None
            self.scheduler.discard((job, i) for i in range(len(job.ids)))
            if job in self._suspects:
                self._suspects.remove(job)
        self.stats.jobs_cancelled += 1
        self.stats.items_cancelled += job.size
        self._outbox.put((job, error or errors.Cancelled(f"job {job.id} was cancelled before it ran")))
        return True

    def count_failure(self, code: str, items: int) -> None:
        """One failed job of ``items`` texts (also for messages refused before they became jobs)."""
        st = self.stats
        st.jobs_failed += 1
        st.items_failed += items
        st.errors_by_code[code] = st.errors_by_code.get(code, 0) + 1
        st.items_failed_by_code[code] = st.items_failed_by_code.get(code, 0) + items

    def _prepare(self, job: Job) -> None:
        opts = job.options if isinstance(job.options, EmbedOptions) else EmbedOptions.parse(job.options)
        job.options = opts
        texts = validate_texts(
            job.texts, max_texts=self.settings.max_texts_per_job, max_chars=self.settings.max_chars
        )
        job.texts = texts
        if opts.model is not None and opts.model.strip().lower() not in self._aliases:
            raise errors.UnknownModel(
                f"model {opts.model!r} is not served on this queue (this worker serves {self.info.model_id!r})"
            )
        if opts.dimensions is not None and opts.dimensions > self.info.dimension:
            raise errors.InvalidDimensions(
                f"dimensions={opts.dimensions} but the model's vectors have {self.info.dimension}"
            )
        job.prompt = self._resolve_prompt(opts)
        tok = self.backend.tokenize(
            texts, prompt=job.prompt, truncate=opts.truncate, truncation_side=opts.truncation_side
        )
        job.ids, job.prompt_length = tok.ids, tok.prompt_length
        job.raw = np.empty((len(texts), self.info.dimension), dtype=np.float32)
        job.remaining = len(texts)

    def _resolve_prompt(self, opts: EmbedOptions) -> str | None:
        if opts.prompt is not None:
            return opts.prompt
        name = opts.prompt_name or self.info.default_prompt_name
        if name is None:
            return None
        if name not in self.info.prompts:
            known = ", ".join(sorted(self.info.prompts)) or "none"
            raise errors.UnknownPromptName(f"prompt_name {name!r} is not defined by the model (known: {known})")
        return self.info.prompts[name] or None

    # -- inference thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            suspect = None
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    self._expire(time.monotonic())
                    if len(self.scheduler) or self._suspects:
                        break
                    wake = self.deadlines.next_deadline()
                    self._cond.wait(None if wake is None else max(wake - time.monotonic(), 0.0) + 0.001)
                now = time.monotonic()
                if self._suspects:
                    suspect = self._suspects.popleft()
                    starting = [suspect] if suspect.started is None else []
                    if starting:
                        suspect.started = now
                else:
                    batch = self.scheduler.next_batch()
                    starting = list({item.key[0]: None for item in batch if item.key[0].started is None})
                    for job in starting:
                        job.started = now
            if self.on_started is not None:
                for job in starting:
                    self.on_started(job)
            try:
                if suspect is not None:
                    self._run_alone(suspect)
                else:
                    self._run([item.key for item in batch])
            except Exception:  # never let the inference thread die
                log.exception("micro-batch bookkeeping failed")

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
        self.stats.isolated_runs += 1
        if self.on_isolated_run is not None:
            self.on_isolated_run(job, True)
        own = Scheduler(max_tokens=self.settings.batch_tokens, max_items=self.settings.max_batch_requests,
                        padded=self.backend.is_padded)
        own.add_many(((job, i), len(ids)) for i, ids in enumerate(job.ids))
        while len(own) and not job.done:
            self._run([item.key for item in own.next_batch()])
        if self.on_isolated_run is not None:
            self.on_isolated_run(job, False)

    def _run(self, keys: list[tuple[Job, int]]) -> None:
        keys = [(job, i) for job, i in keys if not job.done]
        if not keys:
            return
        seqs = [job.ids[i] for job, i in keys]
        lengths = [len(s) for s in seqs]
        cost = batch_cost(lengths, padded=self.backend.is_padded)
        t0 = time.perf_counter()
        try:
            vectors = self.backend.embed(seqs, [job.prompt_length for job, _ in keys])
            bad = ~np.isfinite(vectors).all(axis=1)
        except Exception as exc:
            vectors, bad = None, None
            failure: Exception = exc
        elapsed = time.perf_counter() - t0
        st = self.stats
        real = sum(lengths)
        st.batches += 1
        st.items += len(keys)
        st.real_tokens += real
        st.padded_tokens += cost
        st.max_batch_cost = max(st.max_batch_cost, cost)
        st.max_batch_items = max(st.max_batch_items, len(keys))
        st.inference_seconds += elapsed
        for job, _ in keys:
            st.items_by_class[job.traffic_class] = st.items_by_class.get(job.traffic_class, 0) + 1
        log.info("micro-batch: %d items, %d real / %d padded tokens, %.1f ms",
                 len(keys), real, cost, elapsed * 1e3)
        if self.metrics is not None:
            self.metrics.observe_batch(len(keys), real, cost, elapsed)
        if vectors is None:
            self._isolate(keys, failure)
            return
        if bad.any():
            good = [k for k, b in zip(keys, bad) if not b]
            self._store_rows(good, vectors[~bad])
            for job, i in (k for k, b in zip(keys, bad) if b):
                self.fail(job, errors.BackendError(f"inputs[{i}] produced a non-finite vector"))
            return
        self._store_rows(keys, vectors)

    def _isolate(self, keys: list[tuple[Job, int]], exc: Exception) -> None:
        """A failing micro-batch: split it and retry the halves so only the culprit fails."""
        if len(keys) == 1:
            job, i = keys[0]
            log.warning("inputs[%d] of job %s failed in the model: %s", i, job.id, type(exc).__name__)
            self.fail(job, errors.BackendError(f"inputs[{i}] failed in the model: {type(exc).__name__}"))
            return
        mid = len(keys) // 2
        self._run(keys[:mid])
        self._run(keys[mid:])

    def _store_rows(self, keys: list[tuple[Job, int]], vectors: np.ndarray) -> None:
        for (job, i), vec in zip(keys, vectors):
            if job.done:
                continue
            job.raw[i] = vec
            job.remaining -= 1
            if job.remaining == 0:
                self._finish(job)

    # -- completion --------------------------------------------------------------------------
    def _finish(self, job: Job) -> None:
        """Inference thread: every text of ``job`` is embedded; the results thread does the rest."""
        job.done = True
        self.stats.jobs_succeeded += 1
        self.stats.items_succeeded += len(job.ids)
        self._outbox.put((job, None))

    def fail(self, job: Job, exc: errors.EmbedqError) -> None:
        if job.done:
            return
        job.done, job.raw = True, None
        with self._cond:
            self.scheduler.discard((job, i) for i in range(len(job.ids)))
        self.count_failure(exc.code, job.size)
        self._outbox.put((job, exc))

    # -- results thread ------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (entry := self._outbox.get()) is not None:
            t0 = time.perf_counter()
            job, outcome = entry
            if outcome is None:
                try:
                    outcome = self._payload(job)
                except errors.EmbedqError as exc:
                    outcome = exc
                except Exception as exc:  # never let the results thread die
                    log.exception("encoding the result of job %s failed", job.id)
                    outcome = errors.BackendError(f"could not encode the result: {type(exc).__name__}")
                if isinstance(outcome, errors.EmbedqError):
                    self.stats.jobs_succeeded -= 1
                    self.stats.items_succeeded -= len(job.ids)
                    self.count_failure(outcome.code, job.size)
            try:
                self.on_done(job, outcome)
            except Exception:
                log.exception("storing the outcome of job %s failed", job.id)
            self.stats.results_seconds += time.perf_counter() - t0

    def _payload(self, job: Job) -> dict[str, Any]:
        opts: EmbedOptions = job.options
        normalize = self.info.normalizes if opts.normalize is None else opts.normalize
        dims = opts.dimensions or self.info.dimension
        vectors = postprocess(job.raw, normalize=normalize, dimensions=opts.dimensions)
        job.raw = None
        if not np.isfinite(vectors).all():  # never a success
            raise errors.BackendError("a vector is not finite after post-processing")
        fingerprint = Fingerprint(
            model=self.info.model_id, weights_sha256=self.info.weights_sha256, pooling=self.info.pooling,
            normalize=normalize, dimensions=dims, dtype=self.info.dtype, prompt=job.prompt,
            embedq_version=__version__,
        )
        return encode_result(vectors, opts, fingerprint, tokens=sum(len(s) for s in job.ids))


def _expired(job: Job) -> errors.Expired:
    return errors.Expired(f"job {job.id} passed its deadline before it ran; it was not computed")


def _model_aliases(*names: str) -> set[str]:
    out: set[str] = set()
    for name in names:
        name = name.strip().lower().rstrip("/")
        out.update({name, name.split("/")[-1]})
    return out
