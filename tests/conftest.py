"""Shared fixtures: a private redis-server, a real worker process, the shared corpus."""

from __future__ import annotations

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
CORPUS = ROOT_DIR.parent / "shared" / "data" / "corpus.jsonl"


def load_corpus(n: int | None = None) -> list[str]:
    if not CORPUS.exists():
        pytest.skip(f"benchmark corpus not found at {CORPUS}")
    texts = []
    with CORPUS.open() as fh:
        for line in fh:
            texts.append(json.loads(line)["text"])
            if n is not None and len(texts) >= n:
                break
    return texts


@pytest.fixture(scope="session", autouse=True)
def private_caches(tmp_path_factory):
    """ONNX exports and runtime choices go to private folders, for this process and its workers: no test reads
    a choice measured outside the suite."""
    names = {"EMBEDQ_ONNX_CACHE": "onnx-cache", "EMBEDQ_RUNTIME_CACHE": "runtime-cache"}
    old = {name: os.environ.get(name) for name in names}
    for name, folder in names.items():
        os.environ[name] = str(tmp_path_factory.mktemp(folder))
    yield
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return load_corpus()


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


class WorkerHandle:
    def __init__(self, settings: Settings, log_path: Path, *, command: list[str] | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.log_path = log_path
        self.client = Client(settings)
        self.proc = start_worker(settings, log_path=log_path, command=command, extra_env=extra_env)
        try:
            wait_for_worker(self.client.app, self.proc, timeout=120, log_path=log_path)
        except BaseException:
            self.stop()
            raise

    def stats(self) -> dict:
        """This worker's counters (other tests' workers may share the broker). After the first call it asks this
        worker alone and returns as soon as it answers."""
        node = getattr(self, "_node", None)
        if node is not None:
            replies = self.client.app.control.broadcast("embedq_stats", reply=True, timeout=5.0, limit=1,
                                                        destination=[node]) or []
            mine = [stats for reply in replies for name, stats in reply.items() if name == node]
            assert mine, f"worker {node} did not answer"
            return mine[0]
        replies = self.client.workers(2.0)
        mine = [(node, stats) for node, stats in replies.items() if f"-{self.proc.pid}@" in node]
        assert len(mine) == 1, f"worker {self.proc.pid} did not answer; got {list(replies)}"
        self._node = mine[0][0]
        return mine[0][1]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_worker(self.proc)
        self.client.close()


@pytest.fixture(scope="module")
def worker(redis_server, tmp_path_factory):
    """One real `embedq worker` process with its own queue, per test module."""
    queue = f"embedq.test.{tmp_path_factory.mktemp('q').name}"
    settings = Settings(broker_url=redis_server.url, queue=queue)
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("logs") / "worker.log")
    yield handle
    handle.stop()


class GatewayHandle:
    """A real `embedq serve` process on a free port (its environment: the broker, the queue, ``env``)."""

    def __init__(self, broker_url: str, queue: str, log: Path, **env: str) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith("_CACHE")}
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
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway did not answer:\n{log.read_text()}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
