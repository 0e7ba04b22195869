"""Failover under load (issue 59, part a): a real primary, replica and three sentinels (tests/sentinel_cluster.py), one
worker of the fake model and producers that reach them through ``sentinel://`` URLs; the primary is SIGKILLed and
Sentinel promotes the replica, with nothing restarted.

* During a bulk ``embedq index`` of 4,000 texts (the CLI, a subprocess) and a stream of online ``Client.embed`` calls
  from a thread: every online call is answered (or fails with a typed retryable error, which a retry answers), the
  worker serves on (the same process), and the indexer exits 0 with an output equal to a clean run's (every id once,
  the same vectors).
* The same with the primary killed while the indexer is inside its final commit: a sink plugin (``heldparquet://``,
  the Parquet sink wrapped, :data:`PLUGIN`) writes a marker as its last commit starts and waits there for the test,
  which kills the primary, sees the promotion and an online call answered through the new primary, then lets it go.
  The final commit itself sends nothing to Redis (the results were read and deleted as they were collected); what
  the run still does with Redis after it, closing its client, must not fail either.
* The time from the primary's death to the first job answered through the new primary, printed and bounded loosely
  (the real figures: bench/failover.py).

The kill always lands on an observed state (the worker's counters, the plugin's marker), never after a sleep. The
fake model's ``EMBEDQ_FAKE_ITEM_MS`` keeps the indexer's run long enough for that state to come before its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import FAKE, ROOT_DIR, WorkerHandle, load_corpus
from sentinel_cluster import MASTER, SentinelCluster
from test_index import _index_cmd, _read_parquet, _write_jsonl

from embedq import errors
from embedq.broker import BROKER_ERRORS
from embedq.producers.client import Client
from embedq.settings import Settings

pytestmark = pytest.mark.integration
pq = pytest.importorskip("pyarrow.parquet")

TEXTS = 4000
#: Seconds an online call may go on being refused with a retryable error (the failover itself takes a few)
RETRY_FOR = 60.0
#: Milliseconds of the fake model per item: 4,000 texts take seconds, so the kill lands mid-run on any machine.
ITEM_MS = "2"
DOWN_AFTER_MS = 1000
#: Online texts the thread cycles through (their vectors read once before any failover).
ONLINE = [f"online question {i}: " + "word " * (i % 7) for i in range(20)]

PLUGIN = '''
"""``heldparquet:///absolute/out.parquet?hold=/absolute/folder&rows=N``: embedq's Parquet output, whose commit that
brings the output to N rows first writes ``entered`` in the hold folder and waits until ``go`` appears there."""
import time
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from embedq.producers.index.sinks import FileTarget, SinkScheme
from embedq.producers.index.sinks.contract import Sink


class HeldSink(Sink):
    def __init__(self, inner, hold, rows):
        super().__init__(inner.ledger, where=inner.where, probe_first=inner.probe_first)
        self.inner, self.hold, self.rows = inner, hold, rows
        self.arrow_columns, self.stores_hashes = inner.arrow_columns, inner.stores_hashes

    def accept(self, fingerprint):
        self.inner.accept(fingerprint)

    def write(self, *args, **kwargs):
        return self.inner.write(*args, **kwargs)

    def commit(self):
        if self.manifest.rows + self.ledger.pending_rows >= self.rows and not (self.hold / "entered").exists():
            # written whole, then renamed: the test sees the file only with its contents
            (self.hold / "entered.tmp").write_text(f"{self.manifest.rows} {self.ledger.pending_rows}")
            (self.hold / "entered.tmp").rename(self.hold / "entered")
            end = time.monotonic() + 300
            while not (self.hold / "go").exists():
                if time.monotonic() > end:
                    raise RuntimeError("the test never said go")
                time.sleep(0.02)
        self.inner.commit()

    def flush(self):
        self.inner.flush()

    def save_manifest(self):
        self.inner.save_manifest()

    def close(self):
        self.inner.close()

    def rows_by_hash(self, hashes):
        return self.inner.rows_by_hash(hashes)


class HeldTarget(FileTarget):
    def __init__(self, url, config):
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        super().__init__(Path(unquote(parts.path)), "parquet")
        self.hold, self.rows = Path(query["hold"]), int(query["rows"])

    def open(self, **kwargs):
        return HeldSink(super().open(**kwargs), self.hold, self.rows)


SINKS = [SinkScheme("heldparquet", HeldTarget, "held Parquet", "heldparquet:///out.parquet?hold=/dir&rows=N")]
'''


@pytest.fixture(scope="module")
def cluster():
    # failover-timeout 4 s: the sentinels start no second failover of the primary within twice that of the first
    with SentinelCluster(down_after_ms=DOWN_AFTER_MS, failover_timeout_ms=4000) as c:
        yield c


@pytest.fixture
def healthy(cluster):
    """The cluster with a primary and a live replica: a primary an earlier test killed comes back as a replica."""
    for server in list(cluster.servers):
        if server.proc is not None and server.proc.poll() is not None:
            cluster.revive(server.port)
    return cluster


@pytest.fixture(scope="module")
def worker(cluster, tmp_path_factory):
    settings = Settings(broker_url=cluster.url, sentinel_master=MASTER, queue="embedq.test.sentinel", **FAKE)
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("sentinel-worker") / "worker.log",
                          extra_env={"EMBEDQ_FAKE_ITEM_MS": ITEM_MS})
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def env(worker, tmp_path_factory) -> dict[str, str]:
    """The indexer's environment: the cluster's URL and primary's name, the worker's queue, the plugin."""
    plugins = tmp_path_factory.mktemp("plugin")
    (plugins / "held_sink.py").write_text(PLUGIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith(("_CACHE", "_MAX_WAIT"))}
    return {**env, "EMBEDQ_BROKER_URL": worker.settings.broker_url, "EMBEDQ_SENTINEL_MASTER": MASTER,
            "EMBEDQ_QUEUE": worker.settings.queue_name, "EMBEDQ_SINKS": "held_sink",
            "PYTHONPATH": os.pathsep.join([str(plugins), str(ROOT_DIR)])}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("input") / "in.jsonl"
    return path, _write_jsonl(path, load_corpus(TEXTS))


@pytest.fixture(scope="module")
def clean(env, source, tmp_path_factory):
    """A run with no failover, on the same cluster and worker: id -> vector."""
    src, ids = source
    out = tmp_path_factory.mktemp("clean") / "out.parquet"
    proc = subprocess.run(_index_cmd(src, out), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got, vectors = _read_parquet(out)
    assert sorted(got) == sorted(ids)
    return dict(zip(got, vectors))


@pytest.fixture(scope="module")
def online_reference(worker):
    with Client(worker.settings) as client:
        return client.embed(ONLINE, timeout=60)


class OnlineStream(threading.Thread):
    """``Client.embed`` of one text after another (its own client) until stopped: each answer checked against the
    reference vectors; a typed retryable error retried with the same text; anything else recorded as a failure."""

    def __init__(self, settings: Settings, reference: np.ndarray) -> None:
        super().__init__(daemon=True)
        self.settings, self.reference = settings, reference
        self.stopping = threading.Event()
        self.answered: list[tuple[float, float]] = []  # (monotonic time of the call, of its answer) of each answer
        self.retried: list[errors.EmbedqError] = []
        self.failures: list[BaseException] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        with Client(self.settings) as client:
            i, retrying_since = 0, None
            while not self.stopping.is_set():
                text = ONLINE[i % len(ONLINE)]
                started = time.monotonic()
                try:
                    vector = client.embed([text], timeout=60)[0]
                except errors.EmbedqError as exc:
                    with self.lock:
                        (self.retried if exc.retryable else self.failures).append(exc)
                    if not exc.retryable:
                        return
                    # the same text again after a pause, as a client that retries would (during the failover a call
                    # fails at once: an unpaced loop would count hundreds of retries); a call that is still
                    # refused RETRY_FOR seconds after its first try is the test's failure
                    retrying_since = retrying_since or started
                    if time.monotonic() - retrying_since > RETRY_FOR:
                        self.failures.append(AssertionError(f"refused for {RETRY_FOR} s: {exc!r}"))
                        return
                    time.sleep(0.1)
                    continue
                except BaseException as exc:  # any other exception is the test's failure
                    self.failures.append(exc)
                    return
                retrying_since = None
                if float(np.max(np.abs(vector - self.reference[i % len(ONLINE)]))) > 1e-6:
                    self.failures.append(AssertionError(f"online text {i} answered with another vector"))
                with self.lock:
                    self.answered.append((started, time.monotonic()))
                i += 1

    def answers_after(self, t: float) -> int:
        """Calls made after ``t`` and answered."""
        with self.lock:
            return sum(1 for started, _ in self.answered if started > t)

    def first_after(self, t: float) -> float | None:
        """When the first call made after ``t`` was answered."""
        with self.lock:
            return next((answered for started, answered in self.answered if started > t), None)

    def describe(self) -> str:
        with self.lock:
            last = time.monotonic() - self.answered[-1][1] if self.answered else None
            return (f"online calls answered {len(self.answered)} (the last {last}s ago), retried "
                    f"{[repr(e) for e in self.retried[-5:]]}, failures {self.failures!r}")

    def stop(self) -> None:
        self.stopping.set()
        self.join(120)
        assert not self.is_alive(), "an online call never returned"


def _until(check, what: str, timeout: float = 120.0, proc: subprocess.Popen | None = None,
           stream: OnlineStream | None = None) -> None:
    """Poll ``check()``; the timeout only bounds a state that never comes (the assertion then says what the online
    ``stream`` saw)."""
    end = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the indexer exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        assert time.monotonic() < end, f"never reached: {what}" + (f"; {stream.describe()}" if stream else "")
        time.sleep(0.02)


def _bulk_done(worker: WorkerHandle) -> int:
    """The bulk texts the worker has embedded. The first broadcast after a failover meets a connection kombu's pool
    kept to the dead primary (it raises, as after any restart of Redis): asked again on a new one."""
    for attempt in range(3):
        try:
            return worker.stats().get("items_by_class", {}).get("bulk", 0)
        except BROKER_ERRORS:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _indexer(env: dict[str, str], src: Path, out: Path | str, *extra: str) -> Iterator[subprocess.Popen]:
    """``embedq index`` running in the block (killed on the way out if it still runs)."""
    proc = subprocess.Popen(_index_cmd(src, out, *extra), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    return json.loads(stdout), stderr


def _check_output(out: Path, ids: list[str], clean: dict[str, np.ndarray], summary: dict, stderr: str) -> None:
    assert summary["rows"] == summary["texts"] == len(ids) and summary["failed"] == 0, summary
    assert f"output     {len(ids):,} rows" in stderr, stderr
    got, vectors = _read_parquet(out)
    assert len(got) == len(set(got)) == len(ids) and set(got) == set(ids)  # every id once
    worst = max(float(np.max(np.abs(vector - clean[doc_id]))) for doc_id, vector in zip(got, vectors))
    assert worst <= 1e-6, worst


def _check_online(stream: OnlineStream, killed_at: float) -> None:
    stream.stop()
    assert not stream.failures, stream.failures
    assert all(exc.retryable for exc in stream.retried)
    assert stream.answers_after(killed_at) > 0


def test_a_failover_mid_run_loses_no_job_and_changes_no_vector(healthy, worker, env, source, clean, online_reference,
                                                               tmp_path):
    cluster = healthy
    src, ids = source
    out = tmp_path / "out.parquet"
    pid = worker.proc.pid
    start = _bulk_done(worker)
    stream = OnlineStream(worker.settings, online_reference)
    stream.start()
    with _indexer(env, src, out) as proc:
        _until(lambda: _bulk_done(worker) - start >= TEXTS // 4, "a quarter of the texts embedded", proc=proc)
        _until(lambda: stream.answers_after(0) > 0, "an online call answered", proc=proc)
        assert proc.poll() is None  # mid-run
        old, killed_at = cluster.kill_primary()
        cluster.wait_promoted(old)
        _until(lambda: stream.answers_after(killed_at) > 0, "an online call answered after the failover", stream=stream)
        summary, stderr = _finish(proc)
    _check_online(stream, killed_at)
    _check_output(out, ids, clean, summary, stderr)
    assert worker.proc.poll() is None and worker.proc.pid == pid  # the same worker served on
    assert _bulk_done(worker) - start >= TEXTS


def test_a_failover_during_the_final_commit(healthy, worker, env, source, clean, online_reference, tmp_path):
    cluster = healthy
    src, ids = source
    out = tmp_path / "out.parquet"
    hold = tmp_path / "hold"
    hold.mkdir()
    pid = worker.proc.pid
    stream = OnlineStream(worker.settings, online_reference)
    stream.start()
    # a checkpoint after 600 s: the commit that brings the output to 4,000 rows is the run's final one
    url = f"heldparquet://{out}?hold={hold}&rows={TEXTS}"
    with _indexer(env, src, url, "--checkpoint-seconds", "600") as proc:
        _until((hold / "entered").exists, "the indexer inside its final commit", timeout=300, proc=proc)
        assert (hold / "entered").read_text() == f"0 {TEXTS}"  # nothing committed before: this is the final commit
        old, killed_at = cluster.kill_primary()
        cluster.wait_promoted(old)
        _until(lambda: stream.answers_after(killed_at) > 0, "an online call answered through the new primary",
               stream=stream)
        (hold / "go").touch()
        summary, stderr = _finish(proc)
    _check_online(stream, killed_at)
    assert summary["output"] == str(out)
    _check_output(out, ids, clean, summary, stderr)
    assert worker.proc.poll() is None and worker.proc.pid == pid


def test_the_time_from_the_primarys_death_to_the_first_answer(healthy, worker, online_reference):
    """Printed, and bounded loosely (down-after + 15 s): the figures themselves are bench/failover.py's."""
    cluster = healthy
    stream = OnlineStream(worker.settings, online_reference)
    stream.start()
    _until(lambda: stream.answers_after(0) > 0, "an online call answered")
    old, killed_at = cluster.kill_primary()
    cluster.wait_promoted(old)
    promoted_at = time.monotonic()
    _until(lambda: stream.answers_after(killed_at) > 0, "an online call answered after the failover", stream=stream)
    first = stream.first_after(killed_at)
    _check_online(stream, killed_at)
    assert first is not None
    print(f"\nfailover: down-after {DOWN_AFTER_MS} ms; promotion seen {promoted_at - killed_at:.2f} s after the kill; "
          f"first answer through the new primary {first - killed_at:.2f} s after it")
    assert first - killed_at < DOWN_AFTER_MS / 1000 + 15
