"""Issue 39, the first hour without dead ends (acceptance b): a producer sending to a queue no live worker serves is
told so at once (``embedq index`` after a short bounded wait, ``Client(require_worker=True)``, the gateway's 503);
a broker that cannot be reached is named within ``EMBEDQ_BROKER_TIMEOUT``; SIGTERM stops ``embedq index`` within
5 s at every stage, cleanly and resumably; a refused run leaves no files.

Real parts only: a private redis-server, a real gated worker (tests/controlled_worker.py: with its gate closed it
receives jobs and runs none, a slow worker on any machine) whose window holds two jobs at most, so that a few
jobs sent before the indexer fill it and the rest wait in the queue, as behind a busy or a missing worker."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import CONTROLLED_WORKER, GatewayHandle, gated_handle

from embedq import errors, monitor
from embedq.producers.client import Client
from embedq.producers.embedded import free_port, stop_worker
from embedq.settings import Settings, model_slug

pytestmark = pytest.mark.integration
pq = pytest.importorskip("pyarrow.parquet")
#: the acceptance's bound on a stop, from SIGTERM to exit
STOP_WITHIN = 5.0


@pytest.fixture(scope="module")
def worker(redis_server, tmp_path_factory):
    """A gated worker holding two jobs at most (its prefetch window; bulk jobs get their share of it)."""
    queue = f"embedq.test.first-hour.{tmp_path_factory.mktemp('q').name}"
    handle = gated_handle(Settings(broker_url=redis_server.url, queue=queue, prefetch_window=2),
                          tmp_path_factory.mktemp("logs") / "worker.log")
    yield handle
    handle.stop()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith(("_CACHE", "_MAX_WAIT"))}
    return {**env, **extra}


def _worker_env(worker, **extra: str) -> dict[str, str]:
    return _env(EMBEDQ_BROKER_URL=worker.settings.broker_url, EMBEDQ_QUEUE=worker.settings.queue_name, **extra)


def _write_jsonl(path: Path, texts: list[str]) -> list[str]:
    ids = [f"doc-{i}" for i in range(len(texts))]
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts)))
    return ids


def _committed_rows(out: Path) -> int:
    try:
        return json.loads((out / "_embedq.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return 0


class Indexing:
    """``embedq index`` running, its stderr collected as it comes (what a user sees while it runs)."""

    def __init__(self, env: dict[str, str], *args: str, stdin: bool = False) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "embedq", "index", *args, "-q", "--json"], env=env,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_for(self, reached, what: str, timeout: float = 120.0) -> None:
        """Until ``reached()``; the timeout only bounds a stage that never comes."""
        deadline = time.monotonic() + timeout
        while not reached():
            assert self.proc.poll() is None, f"embedq index exited ({self.proc.returncode}) before {what}:\n" \
                f"{self.stderr}"
            assert time.monotonic() < deadline, f"embedq index never reached {what}:\n{self.stderr}"
            time.sleep(0.05)

    def terminate(self) -> tuple[float, dict]:
        """SIGTERM; the seconds until it exited (asserted within the acceptance's bound), and its summary."""
        self.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        took = time.monotonic() - started
        self._reader.join(10)
        out = self.proc.stdout.read()
        assert took < STOP_WITHIN, f"SIGTERM took {took:.1f}s:\n{self.stderr}"
        assert self.proc.returncode == 130, self.stderr
        assert "Traceback" not in self.stderr, self.stderr
        return took, json.loads(out) if out.strip() else {}


def _index(env: dict[str, str], *args: str, stdin: str | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "embedq", "index", *args, "-q", "--json"], env=env, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


# -- no live worker serves the queue ---------------------------------------------------------------------------
def test_index_against_a_queue_no_worker_serves_exits_naming_it_and_what_is_served(worker, tmp_path):
    """A model name no worker serves (a typo): after the default wait, exit 2 with the queue and what the live
    workers serve, no traceback, no files, and no job left stranded on that queue."""
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, ["hello", "world"])
    model = "sentence-transformers/all-MiniLM-L6-v3"  # a typo
    started = time.monotonic()
    proc = _index(_env(EMBEDQ_BROKER_URL=worker.settings.broker_url), str(src), "-o", str(tmp_path / "out.parquet"),
                  "--model", model, timeout=120)
    took = time.monotonic() - started
    queue = f"embedq.{model_slug(model)}.bulk"
    assert proc.returncode == 2, proc.stderr
    assert took < 60, took  # the default wait (10 s) and a process start
    assert f"[no_worker] no live worker serves queue {queue}" in proc.stderr, proc.stderr
    served = f"{worker.settings.queue_name}, {worker.settings.bulk_queue_name} -> {worker.settings.model} (1 worker)"
    assert served in proc.stderr and "--wait-for-worker" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    with Client(worker.settings) as client:
        assert monitor.waiting(client.redis(), queue) == 0  # nothing was sent


def test_client_require_worker_raises_no_worker_before_sending(worker):
    nobody = worker.settings.model_copy(update={"queue": f"{worker.settings.queue_name}.nobody", "bulk_queue": None})
    with Client(nobody, require_worker=True) as client:
        with pytest.raises(errors.NoWorker, match=f"no live worker serves queue {nobody.queue_name};") as caught:
            client.submit(["hello"])
        assert caught.value.retryable and caught.value.http_status == 503
        assert worker.settings.queue_name in caught.value.message  # what is served instead
        assert monitor.waiting(client.redis(), nobody.queue_name) == 0
    with Client(nobody) as client:  # the default is unchanged: the job waits for a worker to come
        with pytest.raises(errors.NoWorker):
            client.submit_many([["per call"]], require_worker=True)
        handle = client.submit(["queued for a worker to come"])
        assert monitor.waiting(client.redis(), nobody.queue_name) == 1
        handle.cancel()
    with Client(worker.settings, require_worker=True) as client:  # a served queue: as ever
        assert client.embed(["hello"], timeout=120).shape == (1, 384)


def test_a_starting_worker_counts_for_require_worker_and_a_stopping_one_does_not(worker):
    """Issue 51, item 3: a queue whose only worker is starting (its record: ``state: starting``, not ready) takes jobs
    (they wait in the queue for it) where ``require_worker`` (the client's, the gateway's) refused them; one whose
    worker is stopping (not ready, no state) is still refused. The records are written as a worker writes them."""
    queue = f"{worker.settings.queue_name}.coming"
    settings = worker.settings.model_copy(update={"queue": queue, "bulk_queue": None})
    record = {"hostname": f"embedq-cpu-0@{queue}", "pid": 0, "started_at": time.time(), "reported_at": time.time(),
              "ready": False, "queues": [queue], "model": "m", "device": "cpu"}
    with Client(settings, require_worker=True) as client:
        try:
            monitor.publish_worker(client.redis(), record)  # stopping: not ready, no state
            client.registry = monitor.Registry()  # no cached read
            with pytest.raises(errors.NoWorker, match="not ready: stopping"):
                client.submit(["refused"])
            monitor.publish_worker(client.redis(), {**record, "state": monitor.STARTING})
            client.registry = monitor.Registry()
            handle = client.submit(["waits for the starting worker"])
            assert monitor.waiting(client.redis(), queue) == 1
            handle.cancel()
        finally:
            monitor.withdraw_worker(client.redis(), record["hostname"])

def test_gateway_answers_503_with_retry_after_within_two_seconds_without_a_worker(redis_server, tmp_path):
    queue = f"embedq.test.first-hour.nobody-{os.getpid()}"
    g = GatewayHandle(redis_server.url, queue, tmp_path / "gw.log")
    try:
        for path, body in (("/embed", {"inputs": ["hello"]}), ("/v1/embeddings", {"input": "hello", "model": "m"})):
            started = time.monotonic()
            r = httpx.post(g.url + path, json=body, timeout=30)
            took = time.monotonic() - started
            assert r.status_code == 503 and took < 2.0, (path, r.status_code, took)
            assert r.headers["retry-after"] == "1"
            message = r.json()["error"] if path == "/embed" else r.json()["error"]["message"]
            assert message.startswith(f"[no_worker] no live worker serves queue {queue}"), message
        assert httpx.get(g.url + "/health").status_code == 503
        # an async job is still taken: it waits, queued, for a worker
        assert httpx.post(g.url + "/jobs", json={"kind": "embed", "body": {"inputs": "later"}}).status_code == 202
        with Client(Settings(broker_url=redis_server.url, queue=queue)) as client:
            assert monitor.waiting(client.redis(), queue) == 1  # the async job only
    finally:
        g.stop()


# -- a refused run leaves no files -----------------------------------------------------------------------------
def test_a_refused_run_leaves_no_files(redis_server, tmp_path):
    """A CSV without the text column is refused before anything starts (no private stack, no output files); from
    stdin at its first record, still before the output is created."""
    src = tmp_path / "in.csv"
    src.write_text("id,body\n1,hello\n")
    proc = _index(_env(), str(src), "-o", str(tmp_path / "out.parquet"), timeout=120)
    assert proc.returncode == 2 and "no column 'text'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "starting a private redis-server" not in proc.stderr
    proc = _index(_env(EMBEDQ_BROKER_URL=redis_server.url), "-", "--input-format", "csv", "-o",
                  str(tmp_path / "out.npy"), stdin=src.read_text(), timeout=120)
    assert proc.returncode == 2 and "no column 'text'" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.csv"]


def test_an_unreachable_broker_is_named_within_broker_timeout(tmp_path):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, ["hello"])
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    started = time.monotonic()
    proc = _index(_env(EMBEDQ_BROKER_URL=url, EMBEDQ_BROKER_TIMEOUT="2"), str(src), "-o", str(tmp_path / "o.parquet"),
                  timeout=120)
    assert proc.returncode == 2 and time.monotonic() - started < 60, proc.stderr
    assert f"cannot reach the broker at {url}" in proc.stderr and "gave up after 2s" in proc.stderr, proc.stderr
    assert "EMBEDQ_BROKER_URL" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


# -- SIGTERM at every stage ------------------------------------------------------------------------------------
@pytest.fixture
def silent_broker():
    """A TCP server that takes connections and never answers: a broker URL that holds every call."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0", accepted
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    server.close()


def test_sigterm_while_connecting_to_a_broker_that_never_answers(silent_broker, tmp_path):
    url, accepted = silent_broker
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, ["hello"])
    run = Indexing(_env(EMBEDQ_BROKER_URL=url), str(src), "-o", str(tmp_path / "out.parquet"))
    run.wait_for(lambda: accepted, "its connection to the broker")
    run.terminate()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing to resume: it starts afresh


def test_sigterm_while_waiting_for_a_worker(redis_server, tmp_path):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, ["hello"])
    env = _env(EMBEDQ_BROKER_URL=redis_server.url, EMBEDQ_QUEUE=f"embedq.test.first-hour.none-{os.getpid()}")
    run = Indexing(env, str(src), "-o", str(tmp_path / "out.parquet"), "--wait-for-worker", "inf")
    run.wait_for(lambda: "waiting for one (--wait-for-worker)" in run.stderr, "its wait for a worker")
    run.terminate()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def _held(worker) -> int:
    return worker.stats()["held_messages"]


def _settle(worker) -> None:
    """The gate open, every job of the stage run: the next stage starts from an idle worker."""
    with Client(worker.settings) as client:
        deadline = time.monotonic() + 120
        while _held(worker) or monitor.waiting(client.redis(), worker.settings.bulk_queue_name):
            assert time.monotonic() < deadline, "the worker did not drain its jobs"
            time.sleep(0.1)


def _resumes(worker, src: Path, out: Path, ids: list[str], stopped: dict) -> None:
    """The next run (the gate open) embeds exactly what the stopped one had not committed."""
    proc = _index(_worker_env(worker), str(src), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["skipped"] == stopped.get("rows", 0) and summary["texts"] == len(ids) - summary["skipped"]
    assert sorted(pq.read_table(out).column("id").to_pylist()) == sorted(ids)  # every id, once


@pytest.mark.parametrize("stage", ["submitting", "results-queued", "results-slow-worker"])
def test_sigterm_while_sending_or_waiting_for_results(worker, stage, tmp_path):
    """``submitting``: the bulk queue is full (another producer's jobs, behind a busy worker), so the indexer waits
    for room; ``results-queued``: its jobs wait in the queue, which no worker takes from (the only one is full);
    ``results-slow-worker``: the worker holds its jobs and runs none yet."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    ids = _write_jsonl(src, [f"stage text {i}" for i in range(6)])
    queue = worker.settings.bulk_queue_name
    env = _worker_env(worker, EMBEDQ_BULK_QUEUE_LIMIT="1") if stage == "submitting" else _worker_env(worker)
    with worker.gate_closed(), Client(worker.settings) as client:
        redis = client.redis()
        queued = 0
        if stage != "results-slow-worker":  # the worker's window full of other jobs, the rest waiting in the queue
            client.submit_many([[f"another producer's {i}"] for i in range(3)], traffic_class="bulk")
            deadline = time.monotonic() + 60
            while not ((held := _held(worker)) >= 1 and held + (queued := monitor.waiting(redis, queue)) == 3):
                assert time.monotonic() < deadline, f"the worker's window did not fill ({held} held, {queued} queued)"
                time.sleep(0.05)
            assert queued >= 1
        run = Indexing(env, str(src), "-o", str(out), "--chunk-size", "2")
        if stage == "submitting":
            run.wait_for(lambda: f"the bulk queue {queue} is full" in run.stderr, "a full bulk queue")
        elif stage == "results-queued":
            run.wait_for(lambda: monitor.waiting(redis, queue) > queued, "its jobs in the queue")
        else:
            run.wait_for(lambda: _held(worker) >= 1, "its jobs held by the worker")
        _, stopped = run.terminate()
    assert stopped["interrupted"] and stopped["rows"] == 0
    _settle(worker)
    _resumes(worker, src, out, ids, stopped)


def test_sigterm_while_reading_input(worker, tmp_path):
    """stdin sends two records and stays open: the run commits them, then waits for the third."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    ids = _write_jsonl(src, [f"read text {i}" for i in range(4)])
    lines = src.read_text().splitlines(keepends=True)
    run = Indexing(_worker_env(worker), "-", "-o", str(out), "--chunk-size", "1", "--max-in-flight", "1",
                   "--checkpoint-seconds", "0.001", stdin=True)
    run.proc.stdin.write("".join(lines[:2]))
    run.proc.stdin.flush()
    run.wait_for(lambda: _committed_rows(out) == 2, "the first two records committed")
    _, stopped = run.terminate()
    assert stopped["interrupted"] and stopped["rows"] == 2
    _resumes(worker, src, out, ids, stopped)


def test_an_indexer_started_together_with_its_worker_waits_for_it_while_it_loads(redis_server, corpus, tmp_path):
    """Issue 51, item 3: a worker whose start outlasts `embedq index`'s default --wait-for-worker (10 s) — a first start
    that exports and measures on a busy machine — and the indexer started at the same moment: the worker is
    "starting" in the registry from its process's start, and the indexer waits for it (saying so) and exits 0 with
    every text, where it exited 2 after 10 s ("no live worker is registered on this broker"). The worker's model load
    is held (tests/controlled_worker.py's load gate) until the indexer has waited past its 10 s, so the start is that
    long on any machine (two CPU hogs beside a first start made it probable, at ~160 s of CPU)."""
    import redis

    queue = f"embedq.test.together.{tmp_path.name[-12:]}"
    gate = f"{queue}.load-gate"
    env = _env(EMBEDQ_BROKER_URL=redis_server.url, EMBEDQ_QUEUE=queue, EMBEDQ_TEST_LOAD_GATE=gate)
    src = tmp_path / "in.jsonl"
    ids = _write_jsonl(src, corpus[:40])
    r = redis.Redis.from_url(redis_server.url)
    r.set(gate, 1)
    log = (tmp_path / "worker.log").open("w")
    stderr = (tmp_path / "index.err").open("w")
    worker = subprocess.Popen(CONTROLLED_WORKER, env=env, stdout=log, stderr=subprocess.STDOUT)
    started = time.monotonic()
    index = subprocess.Popen([sys.executable, "-m", "embedq", "index", str(src), "-o", str(tmp_path / "out.parquet"),
                              "-q", "--json"], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        # Past the indexer's 10 s, the worker still loading: the indexer is still there, waiting for it.
        while time.monotonic() - started < 12 or "starting worker" not in (tmp_path / "index.err").read_text():
            assert index.poll() is None, (tmp_path / "index.err").read_text()
            assert time.monotonic() - started < 300, "the indexer never said that it waits for a starting worker"
            time.sleep(0.2)
        r.delete(gate)
        out, _ = index.communicate(timeout=600)
        err = (tmp_path / "index.err").read_text()
        assert index.returncode == 0, err + (tmp_path / "worker.log").read_text()[-3000:]
        assert "starting worker" in err, err  # it said what it waited for
        assert json.loads(out)["rows"] == len(ids)
        assert sorted(pq.read_table(tmp_path / "out.parquet").column("id").to_pylist()) == sorted(ids)
    finally:
        r.delete(gate)
        r.close()
        for proc in (index, worker):
            stop_worker(proc, timeout=60)  # SIGTERM, then SIGKILL if it outlives the timeout
        log.close()
        stderr.close()
