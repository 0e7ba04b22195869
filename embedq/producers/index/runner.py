"""The ``embedq index`` run: stream an input through the workers into a resumable output.

Records are read one at a time, checked (id, duplicates, text) and grouped into jobs of
``chunk_size`` texts; at most ``max_in_flight`` jobs are submitted and not yet collected. Jobs are
sent many at a time (``Client.submit_many``: the window is refilled once half of it is collected) and
collected oldest first, many per round trip (``Client.collect``), written, and deleted from Redis at
once, so memory here and in Redis is bounded by the window however large the input. Ids already in the
output with the same text (content hash) are skipped, which is how a run continues after an interruption and
how a changed corpus is re-indexed (edited ids replaced, ``--prune``); a text the run has a vector of, coming or
stored, is not embedded again (``repeats.py``, written by ``rows.py``).

Failure handling, per job:
- a text the job's worker refuses (``empty_text``, ``too_many_tokens``, ...) fails the whole job, so
  the job is split in halves until the bad text is alone; it goes to the errors file, the rest is
  embedded;
- a retryable error (``backend_error``, ``unavailable``) is resubmitted, up to ``max_attempts``;
- a job whose result does not come ``job_timeout`` seconds after it became the oldest (a lost
  message, a killed worker, a broker restarted without persistence) is resubmitted, together with
  every other job in flight that has no result yet;
- an error that concerns the options and would fail every job (``unknown_model``,
  ``invalid_dimensions``, ...) stops the run.

What the run reports, :class:`~embedq.producers.index.summary.Summary`, is in ``summary.py``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from embedq import errors
from embedq.producers.client import Client, JobHandle
from embedq.producers.index.config import IndexConfig, storage_options
from embedq.producers.index.content import ContentHasher
from embedq.producers.index.idset import IdSet, digest
from embedq.producers.index.kinds import index_kind
from embedq.producers.index.repeats import DEFER_MAX, Chunk, Repeats, start_hashes
from embedq.producers.index.rows import RowWriter
from embedq.producers.index.sinks.contract import Sink, Target, check_flags
from embedq.producers.index.sinks.manifests import check_space
from embedq.producers.index.sinks.registry import load_sinks, output_target
from embedq.producers.index.sources import Record, Source, record_text
from embedq.producers.index.stopping import Stop, Stopper, ride_out, say, wait_for_worker
from embedq.producers.index.summary import Failures, Summary
from embedq.producers.index.windowed import per_window
from embedq.protocol import Fingerprint

log = logging.getLogger(__name__)

#: errors about the options, not the texts: every job would fail the same way, so the run stops
FATAL_CODES = frozenset({"invalid_option", "unknown_model", "unknown_prompt_name", "invalid_dimensions",
                         "too_many_texts", "empty_input", "unsupported_model", "invalid_request"})
#: stop early when this many records in a row are unusable before any is usable (a wrong --text-field)
FAIL_FAST_RECORDS = 1000


class Indexer:
    def __init__(self, client: Client, source: Source, output: Path | str | Target, output_format: str | None,
                 config: IndexConfig) -> None:
        self.client = client
        self.source = source
        self.config = config
        load_sinks(client.settings.sink_plugins)  # a plugin's scheme, as the CLI loads them (EMBEDQ_SINKS)
        self.target = output_target(output, output_format, config)
        self.kind = index_kind(config.kind, self.target.format)
        self.job_options = self.kind.job_options(config.options, config.vector_dtype)
        self.windows = per_window(self.job_options)  # one row per window of a document (windowed.py)
        self.summary = Summary(input=source.describe(), output=self.target.describe())
        self.errors_path = config.errors_file or self.target.default_errors_path()
        self.window: deque[Chunk] = deque()
        self.seen = IdSet()
        self.failures = Failures(self.summary, self.errors_path, source.describe(), FAIL_FAST_RECORDS)
        self._fail = self.failures.fail
        self._no_worker_warned = False
        self.sink: Sink | None = None
        self.readers: list[Sink] = []  # --reuse outputs
        self.repeats: Repeats | None = None
        self.rows: RowWriter | None = None
        self.options: dict[str, Any] = {}  # the output's storage options, once the kind is fitted to the target
        self.hasher: ContentHasher | None = None  # content hashes under those options
        self.bar: Any = None
        self.stop = Stopper()
        self._full_noted = False
        self._waits_at_start = (client.bulk_waits, client.bulk_waited_seconds)
        client.on_bulk_wait = self._on_bulk_wait

    # -- the run -------------------------------------------------------------------------------------
    def run(self) -> Summary:
        """Check the input, reach the broker and find a worker before the output is created (a refused run
        leaves no files), then stream. Ctrl-C or SIGTERM stops at once at any stage, committing what arrived."""
        check_flags(self.target, build_index=self.config.ann_index, store_text=self.config.store_text,
                    windows=self.windows)
        if self.windows and self.config.reuse:
            raise errors.InvalidOption("--reuse reads rows back by content hash, one per text: not with --long-inputs "
                                       "windows (a repeated document rides with the job that carries it)")
        self.target.check_input(self.source.path)
        self.target.check()  # a database reached and its table checked before the broker (a file: when opened)
        self._fit_kind()
        self.options = storage_options(self.config.options, self.kind)
        self.hasher = ContentHasher(self.options, self.config.vector_dtype)
        t0 = time.perf_counter()
        restore = self.stop.catch()
        try:
            self._open_readers()
            try:
                records = self._prepare()
                with self.target.lock():
                    self._stream(records, t0)
            except Stop:  # before the output existed: nothing to commit
                self.summary.interrupted = True
                self.summary.seconds = time.perf_counter() - t0
        finally:
            restore()
            for reader in self.readers:
                reader.close()
            if self.bar is not None:
                self.bar.close()
        return self.summary

    def _open_readers(self) -> None:
        """``--reuse``: each output opened to read rows back, checked against this run's options before anything is
        embedded (its space once the run's is known: :meth:`_probe`)."""
        for spec in self.config.reuse:
            target = output_target(spec, None, self.config)
            self.readers.append(target.open_reader(vector_dtype=self.config.vector_dtype, options=self.options))

    def _fit_kind(self) -> None:
        """The kind as the target stores it (a database says which column shapes it cannot store): outputs it cannot
        store are left out, with a note, or the run is refused before anything is embedded."""
        refused = self.target.refused_shapes()
        if refused or self.config.outputs is not None:
            self.kind, notes = self.kind.fit(self.config.outputs, refused, self.target.describe())
            self.job_options = self.kind.job_options(self.config.options, self.config.vector_dtype)
            for note in notes:
                say(note)
            self.summary.notes += notes

    def _prepare(self) -> Iterator[Record]:
        """The input's first record read (a CSV's or Parquet's columns checked), the broker reached and a live
        worker found on the queue: the records, from the first."""
        records = iter(self.source)
        first = next(records, None)
        self._connect()
        wait_for_worker(self.client, self.client.settings.bulk_queue_name, self.config.wait_for_worker,
                        self.config.broker_timeout)
        return records if first is None else itertools.chain([first], records)

    def _stream(self, records: Iterator[Record], t0: float) -> None:
        created = not self.target.exists()
        with self.stop.writing(then_stop=False):  # a stop asked meanwhile: at the check below
            self.sink = self.target.open(vector_dtype=self.config.vector_dtype, options=self.options,
                                         shard_rows=self.config.shard_rows, overwrite=self.config.overwrite)
        self.summary.errors_file = str(self.errors_path)
        self._last_commit = time.monotonic()
        try:
            self._start_hashes()
            self._check_stop()
            if self.sink.manifest.fingerprint is not None or self.sink.probe_first or self.readers:
                self._probe()
            from tqdm import tqdm

            total = self.source.count() if self.config.progress else None
            self.bar = tqdm(total=total, unit="text", disable=not self.config.progress, smoothing=0.05,
                            dynamic_ncols=True, desc="embedq index")
            self.rows.bar = self.failures.bar = self.bar
            self._loop(records)
        except errors.OutputMismatch:
            self.sink.close()  # nothing was written: the existing output stays as it was
            raise
        except Stop:
            self.summary.interrupted = True
            self._finish(t0, complete=False)
        except KeyboardInterrupt:  # a second Ctrl-C: leave at once; the next run cuts back to the last commit
            self.sink.close()
            raise
        except errors.EmbedqError:
            self._finish(t0, complete=False)
            if created and self.sink.manifest.fingerprint is None:  # refused before a row: leave no files
                self.target.remove()
            raise
        except BaseException:
            self._finish(t0, complete=False)
            raise
        else:
            self._finish(t0, complete=True)
            if created and self.sink.manifest.fingerprint is None and self.target.remove_empty():
                self.summary.output_removed = True  # no record had a usable text: no output made of nothing
                return
            if self.config.ann_index:  # after the load, timed on its own line of the summary
                self.summary.ann_index, self.summary.ann_index_seconds = self.target.build_index()

    def _start_hashes(self) -> None:
        """Content hashes for the opened output (:func:`~embedq.producers.index.repeats.start_hashes`) and the writer
        of its rows; ``--prune`` refused where rows cannot be removed. Before anything is embedded."""
        assert self.sink is not None
        note = start_hashes(self.sink)
        if note:
            say(note)
            self.summary.notes.append(note)
        if self.config.prune and type(self.sink).prune is Sink.prune:
            raise errors.InvalidOption(f"--prune: {self.sink.where} cannot remove rows (a {self.target.format} "
                                       "output)")
        self.repeats = Repeats(self.sink, self.readers, read_back=not self.windows)
        self.rows = RowWriter(self.sink, self.repeats, self.kind, vector_dtype=self.config.vector_dtype,
                              store_text=self.config.store_text, summary=self.summary, stop=self.stop, fail=self._fail)
        self.summary.windowed = self.windows

    def _connect(self) -> None:
        """Reach the broker before anything else, for at most ``connect_timeout`` seconds: a wrong URL or a
        broker that is down is named at once and refused after that (later outages are ridden out longer)."""
        ride_out(self.client, lambda: self.client.epoch(refresh=True), self.config.connect_timeout,
                 "; check EMBEDQ_BROKER_URL")

    def _check_stop(self) -> None:
        self.stop.check()

    def _loop(self, records: Iterator[Record]) -> None:
        assert self.sink is not None and self.repeats is not None and self.hasher is not None
        self._chunk = Chunk([], [])
        self._staged: list[Chunk] = []  # full chunks not sent yet: sent together once the window has room for them
        limits = self.client.settings
        for rec in records:
            self._check_stop()
            self.failures.records += 1
            if rec.error is not None:
                self._fail(rec.id, rec.error)
                continue
            key = digest(rec.id)
            if key in self.seen:
                self._fail(rec.id, errors.DuplicateId(f"id {rec.id!r} appears more than once in the input"))
                continue
            self.seen.add(key)
            content_hash = self.hasher(rec.text) if isinstance(rec.text, str) else b""
            if key in self.sink.committed:
                kept = self.sink.ledger.hashes.get(key)
                if kept is None or kept == content_hash:  # the same text (or an output without hashes): kept
                    self.summary.skipped += 1
                    if self.bar.total:
                        self.bar.total -= 1
                    continue
                # its text changed: written anew below (the sink replaces the row)
            try:
                record_text(rec.text, limits.max_chars)
            except errors.EmbedqError as exc:
                self._fail(rec.id, exc)
                continue
            self.failures.usable += 1
            self._route(rec.id, rec.text, content_hash)
            if len(self.repeats.deferred) >= DEFER_MAX:
                self._resolve()
        self._resolve_all()
        if self.config.prune:
            with self.stop.writing():
                self.summary.pruned = self.sink.prune(self.seen)

    def _route(self, doc_id: str, text: str, content_hash: bytes, *, defer: bool = True) -> None:
        """A usable record: with a job in flight that carries its text, deferred to a stored row, or into a job."""
        assert self.repeats is not None
        if self.repeats.attach(doc_id, text, content_hash, defer=defer):
            return
        chunk = self._chunk
        chunk.add(doc_id, text, content_hash)
        self.repeats.carry(chunk, len(chunk.ids) - 1)
        if len(chunk.ids) >= self.config.chunk_size:
            self._staged.append(chunk)
            self._chunk = Chunk([], [])
            if len(self.window) + len(self._staged) >= self.config.max_in_flight:
                self._submit(self._staged)
                self._staged = []
                self._drain(self.config.max_in_flight // 2)  # refilled when down to half

    def _resolve_all(self) -> None:
        """The end of the input: every job sent and collected, every deferred record written (or embedded)."""
        assert self.repeats is not None
        while True:
            if self._chunk.ids:
                self._staged.append(self._chunk)
                self._chunk = Chunk([], [])
            if self._staged:
                self._submit(self._staged)
                self._staged = []
            self._drain(0)
            if not self.repeats.deferred:
                return
            self._resolve()

    def _resolve(self) -> None:
        """Write the deferred records from stored rows (after a commit, so this run's rows can be read back); a text no
        store holds any more (its row replaced meanwhile) is embedded after all."""
        assert self.sink is not None and self.repeats is not None
        with self.stop.writing():
            if self.sink.ledger.pending_rows and self.sink.manifest.fingerprint is not None:
                self.sink.commit()
                self.failures.flush()
                self._last_commit = time.monotonic()
        assert self.rows is not None
        for doc_id, content_hash, text in self.rows.stored(self.repeats.take_deferred()):
            self._route(doc_id, text, content_hash, defer=False)

    def _finish(self, t0: float, *, complete: bool) -> None:
        assert self.sink is not None
        self.stop.finishing = True  # a stop asked now waits for the commit (a second one quits at once)
        s = self.summary
        s.input = self.source.describe()  # stdin's format is known once it was read
        try:
            if self.sink.manifest.fingerprint is not None:
                self.sink.commit()
            self.failures.flush(final=complete)
            s.rows = self.sink.manifest.rows
            s.seconds = time.perf_counter() - t0
            s.bulk_waits = self.client.bulk_waits - self._waits_at_start[0]
            s.bulk_waited_seconds = self.client.bulk_waited_seconds - self._waits_at_start[1]
            s.fingerprint = self.sink.manifest.fingerprint
            m = self.sink.manifest
            m.complete = complete and not s.failed
            m.runs = [*m.runs[-19:], s.run_record(complete)]
            self.sink.save_manifest()
        finally:
            self.sink.close()
        if not s.failed:
            s.errors_file = None

    def _on_bulk_wait(self, queue: str, depth: int, waited: float) -> None:
        """The bulk queue is full: this run waits for the workers to make room instead of failing; Ctrl-C
        still stops it."""
        if not self._full_noted:
            self._full_noted = True
            say(f"the bulk queue {queue} is full ({depth:,} jobs waiting); sending resumes as workers "
                      "make room")
        self._check_stop()

    def _probe(self) -> None:
        """Continuing an output: one tiny job first shows which space the workers now make, so another
        model or dtype is refused before anything is read or written, even when nothing is missing."""
        assert self.sink is not None
        handle = self._broker(lambda: self._submit_job(["embedq embedding-space probe"]))
        try:
            payload = self._broker(lambda: handle.payload(timeout=self.config.job_timeout))
        except errors.JobTimeout:
            raise errors.Unavailable(f"no worker answered on queue {self.client.settings.bulk_queue_name} within "
                                     f"{self.config.job_timeout:.0f}s") from None
        finally:
            handle.forget()
        fingerprint = Fingerprint.model_validate(payload["fingerprint"])
        try:
            self.sink.accept(fingerprint)
            for reader in self.readers:  # --reuse: rows of this run's space only
                check_space(reader.manifest.fingerprint, fingerprint, where=f"--reuse {reader.where}",
                            container=reader.container)
        except errors.OutputMismatch:
            self.sink.close()
            raise

    # -- submitting and collecting ---------------------------------------------------------------
    def _submit_job(self, texts: list[str]) -> Any:
        return self._submit_jobs([texts])[0]

    def _submit_jobs(self, jobs: list[list[str]]) -> list[JobHandle]:
        # bulk: behind online traffic on the same workers; waits (does not fail) while the bulk queue is full
        return self.client.submit_many(jobs, kind=self.kind.job_kind, traffic_class="bulk", **self.job_options)

    def _send(self, *chunks: Chunk) -> None:
        """Send ``chunks`` as jobs, together (one round trip)."""
        handles = self._broker(lambda: self._submit_jobs([c.texts for c in chunks]))
        for chunk, handle in zip(chunks, handles):
            chunk.handle = handle
            chunk.head_since = None
            chunk.attempts += 1

    def _submit(self, chunks: list[Chunk]) -> None:
        self._send(*chunks)
        self.window.extend(chunks)

    def _drain(self, keep: int) -> None:
        while len(self.window) > keep:
            self._check_stop()
            self._collect_heads(len(self.window) - keep)
            self._maybe_commit()

    def _collect_heads(self, count: int) -> None:
        """Collect the oldest ``count`` jobs in one go (results read many per round trip) and write those that
        are done, in window order, up to the first that is not."""
        heads = [self.window[i] for i in range(count)]
        head = heads[0]
        now = time.monotonic()
        if head.head_since is None:
            head.head_since = now
        deadline = head.head_since + self.config.job_timeout
        wait = max(min(deadline - now, 5.0), 0.05)
        # the records read leave Redis at once; every handle keeps its outcome for the next look
        outcomes = self._broker(lambda: self.client.collect([c.handle for c in heads], timeout=wait,
                                                            return_exceptions=True, decode=False))
        for chunk, outcome in zip(heads, outcomes):
            if not self.window or self.window[0] is not chunk:
                return  # a retried or split job went back to the head: it is collected next
            if isinstance(outcome, errors.JobTimeout):  # no result yet (not an error the worker sent)
                if chunk is head and time.monotonic() >= deadline:
                    self._on_timeout()
                return
            self.window.popleft()
            if isinstance(outcome, errors.EmbedqError):  # the job's own typed error, from the worker
                self._on_job_error(chunk, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                self._write(chunk, outcome)

    def _write(self, chunk: Chunk, payload: dict[str, Any]) -> None:
        """A chunk's result into the output, under its ids and its riders'."""
        assert self.rows is not None
        n = self.rows.result(chunk, payload)
        self.summary.tokens += (payload.get("usage") or {}).get("tokens", 0)
        self.summary.workers[str(payload.get("worker", "unknown"))] += n
        if self.bar.format_dict.get("elapsed"):
            self.bar.set_postfix_str(f"{self.summary.tokens / self.bar.format_dict['elapsed']:,.0f} tokens/s",
                                     refresh=False)

    def _on_timeout(self) -> None:
        """The oldest job is overdue: resubmit every job in flight that has no result yet. Jobs keep their place in
        the window (and so the output keeps input order). Live workers are read from the registry, not asked by a
        remote-control broadcast: a producer's Redis user has no rights on Celery's pidbox."""
        live = self._broker(lambda: self.client.serving(self.client.settings.bulk_queue_name).ready)
        if not live:
            if not self._no_worker_warned:
                say("no embedq worker answers; waiting for one (jobs stay queued)")
                self._no_worker_warned = True
            self.window[0].head_since = time.monotonic()  # not the job's fault: wait another round
            return
        self._no_worker_warned = False
        overdue = self._broker(lambda: [c for c in self.window if c.handle is not None and not c.handle.ready()])
        resend = []
        for chunk in overdue:
            assert chunk.handle is not None
            chunk.handle.forget()
            if chunk.attempts < self.config.max_attempts:
                self.summary.resubmitted += 1
                resend.append(chunk)
            else:
                self.window.remove(chunk)
                self._give_up(chunk, errors.JobTimeout(
                    f"no result after {chunk.attempts} attempts of {self.config.job_timeout:.0f}s"))
        if resend:
            self._send(*resend)
        if overdue:
            log.warning("resubmitted %d jobs with no result after %.0fs", len(overdue), self.config.job_timeout)

    def _on_job_error(self, chunk: Chunk, exc: errors.EmbedqError) -> None:
        """``chunk`` failed with the worker's typed error (and has left the window)."""
        if exc.code in FATAL_CODES:
            raise exc
        if exc.retryable and chunk.attempts < self.config.max_attempts:
            self.summary.resubmitted += 1
            self._send(chunk)
            self.window.appendleft(chunk)
        else:
            self._give_up(chunk, exc)

    def _give_up(self, chunk: Chunk, exc: errors.EmbedqError) -> None:
        """Split a failing job until the text that fails it is alone; a lone text is a failure."""
        assert self.repeats is not None
        if len(chunk.ids) == 1:  # the same text under other ids fails the same way
            for doc_id in (chunk.ids[0], *(rider for rider, _, _ in chunk.riders)):
                self._fail(doc_id, exc)
            self.repeats.landed(chunk)
            return
        parts = chunk.split()
        self.repeats.moved(chunk, parts)
        self._send(*parts)
        self.window.extendleft(reversed(parts))

    # -- commits -------------------------------------------------------------------------------------
    def _maybe_commit(self) -> None:
        assert self.sink is not None
        if time.monotonic() - self._last_commit < self.config.checkpoint_seconds:
            return
        with self.stop.writing():
            if self.sink.manifest.fingerprint is not None:
                self.sink.commit()
                self.failures.flush()
        self._last_commit = time.monotonic()

    def _broker(self, call: Any) -> Any:
        """Run a broker call, riding out a broker that is restarting for up to ``broker_timeout``."""
        return ride_out(self.client, call, self.config.broker_timeout)


def run_index(client: Client, input_path: str | Source, output: Path | str | Target, *,
              input_format: str | None = None, output_format: str | None = None, text_field: str = "text",
              id_field: str | None = None, config: IndexConfig | None = None) -> Summary:
    """Embed ``input_path`` (a path, ``-``, or a :class:`Source` made already) into ``output`` (a path, a database
    URL or a target made already: ``sinks/``); see :class:`IndexConfig`."""
    source = input_path if isinstance(input_path, Source) else Source(input_path, input_format,
                                                                       text_field=text_field, id_field=id_field)
    return Indexer(client, source, output, output_format, config or IndexConfig()).run()

