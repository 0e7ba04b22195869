"""Shared fixtures: a private redis-server, a real worker process, the repository's corpus (data/corpus.jsonl)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embedq.backends.cpu import guard_amx
from embedq.producers.client import Client
from embedq.producers.embedded import RedisServer, free_port, start_worker, stop_worker, wait_for_worker
from embedq.settings import Settings

# Tests load CPU models in this process too: protect it from VMs whose AMX faults (see embedq/backends/cpu.py)
# before any test runs oneDNN.
guard_amx()

ROOT_DIR = Path(__file__).resolve().parents[1]
CORPUS = ROOT_DIR / "data" / "corpus.jsonl"  # carried by the repository (data/README.md)
#: ``embedq worker`` with the tests' controls (a gate before each micro-batch, a hold inside one, a failing text).
CONTROLLED_WORKER = [sys.executable, str(Path(__file__).with_name("controlled_worker.py"))]
#: Settings of a worker of the fake model (embedq/backends/fake.py), for the tests of what happens to messages.
FAKE = {"model": "embedq-fake", "allow_fake_backend": True}


#: The modules that take longest (their wall time in a full run under -n 2, 2026-11-28), run first: under pytest-xdist
#: (.ci/run: ``-n 3 --dist loadfile``, each module whole in one process) no long module then starts last while the
#: other processes idle.
SLOW_FIRST = (
    "faults/test_hostile_canvas.py", "faults/test_crashes.py", "test_index.py", "test_gateway.py",
    "test_index_lancedb.py", "test_sentinel.py", "faults/test_broker.py", "test_index_milvus.py", "test_fidelity.py",
    "test_integration.py",
    "test_first_hour.py", "test_preempt.py", "test_operations.py", "test_cli.py", "test_truncation_cut.py",
    "test_sparse.py", "test_index_pgvector.py", "faults/test_liveness.py", "test_kinds.py", "test_canvas.py",
    "test_traffic.py", "test_verify.py", "test_replicas.py", "test_families.py", "test_backend_models.py",
    "test_admission.py", "test_index_kinds.py", "test_sentinel_tools.py",
)


def pytest_configure(config):
    """Under pytest-xdist (.ci/run: ``-n 3`` on a 2-core machine) each test process, and every worker, gateway or
    model it starts, computes on its share of the cores (``OMP_NUM_THREADS``, which torch and ONNX Runtime follow):
    two processes of two threads each on two cores lose more to threads waiting on threads than they gain. A value
    set by the caller is kept."""
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if processes > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))


def pytest_collection_modifyitems(config, items):
    """Modules in :data:`SLOW_FIRST`'s order, then the others as collected; a module's tests keep their order."""
    tests = Path(__file__).parent
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def key(item) -> int:
        try:
            return rank.get(item.path.relative_to(tests).as_posix(), len(rank))
        except ValueError:  # (a test outside tests/)
            return len(rank)

    items.sort(key=key)


def load_corpus(n: int | None = None) -> list[str]:
    texts = []
    with CORPUS.open() as fh:
        for line in fh:
            texts.append(json.loads(line)["text"])
            if n is not None and len(texts) >= n:
                break
    return texts


def sparse_delta(indices_a, values_a, indices_b, values_b) -> float:
    """Max |Δ| between two sparse vectors read as dense ones (an id one lacks counts as 0 there).

    Between different micro-batches, ids cannot be compared exactly: an id is kept where its weight is above 0,
    and a weight within the batch-invariance noise of 0 can fall on either side. Read densely, such an id differs
    by its weight, which is that small, so the dense bar is the promise for sparse vectors too."""
    a = dict(zip((int(i) for i in indices_a), (float(v) for v in values_a)))
    b = dict(zip((int(i) for i in indices_b), (float(v) for v in values_b)))
    return max((abs(a.get(i, 0.0) - b.get(i, 0.0)) for i in a.keys() | b.keys()), default=0.0)


@pytest.fixture(scope="session", autouse=True)
def private_caches(tmp_path_factory, worker_id):
    """ONNX exports and runtime choices go to private folders, for this process and its workers: no test reads
    a choice measured outside the suite. Under pytest-xdist the test processes of one run share them (a folder of the
    run's temporary root; both caches write a file or folder aside and rename it into place), so the model is
    exported and its runtimes measured once per run, not once per process (see :func:`_first_start`)."""
    names = {"EMBEDQ_ONNX_CACHE": "onnx-cache", "EMBEDQ_RUNTIME_CACHE": "runtime-cache"}
    old = {name: os.environ.get(name) for name in names}
    for name, folder in names.items():
        if worker_id == "master":
            os.environ[name] = str(tmp_path_factory.mktemp(folder))
        else:
            shared = tmp_path_factory.getbasetemp().parent / folder
            shared.mkdir(exist_ok=True)
            os.environ[name] = str(shared)
    yield
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def _first_start(settings: Settings):
    """Around a worker's start: the first worker of the default model (runtime ``auto``) in the run's caches
    (:func:`private_caches`) exports it and measures its runtimes, holding a lock that a second test process's start
    of the same model waits on; that one then reads the caches instead of exporting and measuring again."""
    root = os.environ.get("EMBEDQ_ONNX_CACHE")
    if not root or settings.model != Settings.model_fields["model"].default or settings.linear_kernel != "auto":
        yield
        return
    marker = Path(root) / ".default-model-ready"
    if marker.exists():
        yield
        return
    import fcntl

    with open(Path(root) / ".default-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, whatever happens inside
        yield
        marker.touch()


@pytest.fixture(scope="session", autouse=True)
def no_wait_admission():
    """Online admission by expected wait (EMBEDQ_ONLINE_MAX_WAIT) refuses by the workers' measured throughput, a
    figure of the machine: off for this process and the workers and gateways it starts, so that no test depends on
    the speed of the machine it runs on. The tests of admission (tests/test_admission.py, the load bench) turn it on
    with their own bound and a throughput they control."""
    old = os.environ.get("EMBEDQ_ONLINE_MAX_WAIT")
    os.environ["EMBEDQ_ONLINE_MAX_WAIT"] = "0"
    yield
    if old is None:
        os.environ.pop("EMBEDQ_ONLINE_MAX_WAIT", None)
    else:
        os.environ["EMBEDQ_ONLINE_MAX_WAIT"] = old


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return load_corpus()


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pg(tmp_path_factory):
    """One PostgreSQL cluster with pgvector (the ``pgserver`` wheel, tests/pgcluster.py) for the session: the modules
    that write into PostgreSQL each make databases of their own in it."""
    pytest.importorskip("psycopg")
    pytest.importorskip("pgserver")
    from pgcluster import PgCluster

    cluster = PgCluster(tmp_path_factory.mktemp("pg") / "cluster").start()
    yield cluster
    cluster.stop()


#: The workers and gateways this test process started (``STARTED``, in order) and those not stopped yet
#: (``LIVE_PROCESSES``, by pid): a failing test's report shows the state and the end of the log of each one alive, and
#: of each one the test itself started (stopped in its ``finally`` or not), so that a red CI log says whether a worker
#: had died (and why) or hung.
STARTED: list[tuple[str, subprocess.Popen, Path]] = []
LIVE_PROCESSES: dict[int, tuple[str, subprocess.Popen, Path]] = {}


def _started(what: str, proc: subprocess.Popen, log_path: Path) -> None:
    STARTED.append((what, proc, log_path))
    LIVE_PROCESSES[proc.pid] = (what, proc, log_path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_FIRST_STARTED] = len(STARTED)
    yield


_FIRST_STARTED = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    shown = {**LIVE_PROCESSES, **{proc.pid: (what, proc, path)
                                  for what, proc, path in STARTED[item.stash.get(_FIRST_STARTED, len(STARTED)):]}}
    for pid, (what, proc, log_path) in shown.items():
        code = proc.poll()
        state = "running" if code is None else f"exited with status {code}"
        try:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        except OSError as exc:
            tail = f"(no log: {exc})"
        report.sections.append((f"{what} {pid}: {state}; the end of {log_path}", tail))


class WorkerHandle:
    def __init__(self, settings: Settings, log_path: Path, *, command: list[str] | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.log_path = log_path
        self.client = Client(settings)
        with _first_start(settings):
            self.proc = start_worker(settings, log_path=log_path, command=command, extra_env=extra_env)
            try:
                wait_for_worker(self.client.app, self.proc, timeout=120, log_path=log_path)
            except BaseException:
                self.stop()
                raise
        _started(f"worker ({settings.queue_name})", self.proc, log_path)

    def stats(self) -> dict:
        """This worker's counters (other tests' workers may share the broker). After the first call it asks this
        worker alone and returns as soon as it answers."""
        node = getattr(self, "_node", None)
        if node is not None:
            for _ in range(6):  # up to 30 s: a loaded machine may answer late, the first answer returns at once
                replies = self.client.app.control.broadcast("embedq_stats", reply=True, timeout=5.0, limit=1,
                                                            destination=[node]) or []
                mine = [stats for reply in replies for name, stats in reply.items() if name == node]
                if mine or self.proc.poll() is not None:
                    break
            assert mine, f"worker {node} did not answer"
            return mine[0]
        # Which node is ours: a broadcast collects replies for its whole timeout, so ask again (bounded) rather
        # than make one reply within a short timeout the test's criterion on a loaded machine.
        end = time.monotonic() + 60
        while True:
            replies = self.client.workers(2.0)
            mine = [(node, stats) for node, stats in replies.items() if f"-{self.proc.pid}@" in node]
            if mine or time.monotonic() > end or self.proc.poll() is not None:
                break
        assert len(mine) == 1, f"worker {self.proc.pid} did not answer; got {list(replies)}"
        self._node = mine[0][0]
        return mine[0][1]

    def wait_until(self, ready, what: str, timeout: float = 120.0) -> dict:
        """Poll this worker's counters until ``ready(stats)``; returns them. The timeout only bounds a wait for a
        state that never comes (then the assertion names ``what`` and the last counters)."""
        end = time.monotonic() + timeout
        while not ready(stats := self.stats()):
            assert time.monotonic() < end, f"the worker never reached: {what}; last counters {stats}"
            time.sleep(0.02)
        return stats

    def view(self) -> WorkerHandle:
        """The same worker process with a Client of its own (what one module's tests share)."""
        other = copy.copy(self)
        other.client = Client(self.settings)
        return other

    def settle(self, timeout: float = 300.0) -> dict:
        """Idle: nothing waits in this worker's queues (purged) and it holds no job (those it holds run out)."""
        import redis

        from embedq import monitor

        r = redis.Redis.from_url(self.settings.broker_url)
        try:
            for queue in (self.settings.queue_name, self.settings.bulk_queue_name):
                r.delete(queue, *(f"{queue}{monitor.KOMBU_SEP}{step}" for step in monitor.KOMBU_PRIORITY_STEPS))
        finally:
            r.close()
        return self.wait_until(lambda s: s.get("held_messages", 0) == 0 and s.get("buffered", 0) == 0,
                               "idle: no job held, none buffered", timeout)

    def gate_closed(self) -> contextlib.AbstractContextManager[None]:
        """This worker (started by :func:`gated_handle`) starts no micro-batch inside the block; see
        :func:`closed_gate`."""
        return closed_gate(self.settings)

    def step(self) -> dict:
        """Inside :meth:`gate_closed`: let one micro-batch through the gate and return the counters once it ran."""
        import redis

        batches = self.stats()["batches"]
        r = redis.Redis.from_url(self.settings.broker_url)
        try:
            r.incr(f"{_gate_key(self.settings)}:pass")
        finally:
            r.close()
        return self.wait_until(lambda s: s["batches"] > batches, "one micro-batch through the gate")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        LIVE_PROCESSES.pop(self.proc.pid, None)
        stop_worker(self.proc)
        self.client.close()


@pytest.fixture(scope="session")
def shared_worker(redis_server, tmp_path_factory):
    """One real `embedq worker` (MiniLM, default settings) for the whole session, on a queue of its own: the
    modules that only send jobs and read results share it through :func:`worker`."""
    settings = Settings(broker_url=redis_server.url, queue="embedq.test.shared")
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("shared-worker") / "worker.log")
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def shared_gateway(shared_worker, tmp_path_factory):
    """One plain `embedq serve` on the shared worker's queue for the whole session (the modules that only send
    requests and read answers get it through their ``gateway`` fixture, after :func:`worker` settled the worker),
    answering /health once it has seen the worker's record."""
    import httpx

    settings = shared_worker.settings
    g = GatewayHandle(settings.broker_url, settings.queue_name, tmp_path_factory.mktemp("shared-gw") / "gw.log")
    deadline = time.monotonic() + 60  # the worker's registry record (written every second)
    while (status := httpx.get(g.url + "/health").status_code) != 200:
        if time.monotonic() > deadline:
            g.stop()
            raise AssertionError(f"the gateway's /health stayed {status}:\n{g.log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)
    yield g
    g.stop()


@pytest.fixture(scope="session")
def cls_worker(redis_server, tmp_path_factory):
    """MiniLM with CLS pooling (another embedding space of the same weights), for the session: the database sinks'
    refusal tests only send it a probe."""
    settings = Settings(broker_url=redis_server.url, queue="embedq.test.cls", pooling="cls")
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("cls-worker") / "worker.log")
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def splade_worker(redis_server, tmp_path_factory):
    """A tiny SPLADE model's worker (tests/indexdb.py's ``tiny_worker``) for the session's sparse sink tests."""
    from indexdb import tiny_worker

    handle = tiny_worker(redis_server.url, tmp_path_factory.mktemp("splade-worker"), "splade")
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def m3_worker(redis_server, tmp_path_factory, corpus):
    """A tiny BGE-M3 model's worker (tests/indexdb.py's ``tiny_worker``) for the session's hybrid sink tests."""
    from indexdb import tiny_worker

    handle = tiny_worker(redis_server.url, tmp_path_factory.mktemp("m3-worker"), "bge-m3", corpus)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def worker(shared_worker):
    """The session's MiniLM worker (:func:`shared_worker`), idle when the module starts: what an earlier module
    left in its queues (the jobs of an indexer it killed) is purged, and what the worker holds runs out first, so
    a module's counter deltas are its own. A module that floods, gates, kills or reconfigures its worker starts
    its own (``WorkerHandle``, or a ``worker`` fixture of its own). The module gets a Client of its own."""
    shared_worker.settle()
    mine = shared_worker.view()
    yield mine
    mine.client.close()


@pytest.fixture(scope="module")
def gated_worker(redis_server, tmp_path_factory):
    """A real worker with a gate (tests/controlled_worker.py): inside ``gated_worker.gate_closed()`` it buffers jobs
    and runs none, so a test decides what is buffered when the model runs, on any machine."""
    queue = f"embedq.test.gated.{tmp_path_factory.mktemp('q').name}"
    settings = Settings(broker_url=redis_server.url, queue=queue)
    handle = gated_handle(settings, tmp_path_factory.mktemp("logs") / "worker.log")
    yield handle
    handle.stop()


def gated_handle(settings: Settings, log_path: Path) -> WorkerHandle:
    """A real worker from tests/controlled_worker.py whose gate is :func:`closed_gate` of ``settings``."""
    return WorkerHandle(settings, log_path, command=CONTROLLED_WORKER,
                        extra_env={"EMBEDQ_TEST_GATE": _gate_key(settings)})


def _gate_key(settings: Settings) -> str:
    return f"{settings.queue_name}.gate"


@contextlib.contextmanager
def closed_gate(settings: Settings):
    """Inside the block a gated worker of ``settings`` (:func:`gated_handle`, started before or inside it) starts no
    micro-batch; it still receives jobs, up to its window. Opened on the way out."""
    import redis

    r = redis.Redis.from_url(settings.broker_url)
    r.set(_gate_key(settings), 1)
    try:
        yield
    finally:
        r.delete(_gate_key(settings), f"{_gate_key(settings)}:pass")
        r.close()


class GatewayHandle:
    """A real `embedq serve` process on a free port (its environment: the broker, the queue, ``env``)."""

    def __init__(self, broker_url: str, queue: str, log: Path, **env: str) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        environ = {k: v for k, v in os.environ.items()
                   if not k.startswith("EMBEDQ_") or k.endswith(("_CACHE", "_MAX_WAIT"))}
        environ.update({"EMBEDQ_BROKER_URL": broker_url, "EMBEDQ_QUEUE": queue, "PYTHONPATH": str(ROOT_DIR), **env})
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "embedq", "serve", "--port", str(self.port)],
                                     env=environ, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited ({self.proc.returncode}):\n{log.read_text()}")
            try:
                httpx.get(self.url + "/openapi.json", timeout=1)
                _started(f"gateway ({queue})", self.proc, log)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway did not answer:\n{log.read_text()}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        LIVE_PROCESSES.pop(self.proc.pid, None)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def cut_connections(server: object, settings: Settings) -> None:
    """Close every client connection of a live Redis (``server``: a redis-py client of it) but the caller's, the
    subscriptions first and then the rest, as a network blip, a proxy's idle cut or Redis's own ``timeout`` would, and
    see a job answered after each through ``settings`` (a fresh client each time: the cut closes producers'
    connections too). The worker's consumer must reconnect by itself: a read of its event loop that retried and then
    waited on the new connection held every delivery (tests/test_sentinel_tools.py)."""
    for kind in ("pubsub", "normal"):
        assert server.client_kill_filter(_type=kind, skipme=True) >= 1, kind
        with Client(settings) as client:
            assert client.embed([f"after the {kind} connections were cut"], timeout=30).shape[0] == 1
