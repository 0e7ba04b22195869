"""``embedq worker --processes N`` (issue 36): N replicas under one supervisor, each a full worker; a SIGKILL of one
loses no job, the supervisor restarts it, and SIGTERM stops them all gracefully."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import CONTROLLED_WORKER, closed_gate

from embedq.producers.client import Client
from embedq.producers.embedded import start_worker, stop_worker, wait_for_worker
from embedq.settings import Settings
from embedq.workers import replicas

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_how_many_replicas(monkeypatch):
    monkeypatch.delenv(replicas.REPLICA_ENV, raising=False)
    assert replicas.processes_for(Settings(device="cpu"), cpus=16) == 1  # the model's own threads use the cores
    assert replicas.processes_for(Settings(device="cuda:0"), cpus=16, gpus=1) == 4
    assert replicas.processes_for(Settings(device="cuda:0"), cpus=64, gpus=1) == 4
    assert replicas.processes_for(Settings(device="cuda:0"), cpus=16, gpus=8) == 1  # two cores per GPU
    assert replicas.processes_for(Settings(device="cuda:0"), cpus=64, gpus=8) == 2
    assert replicas.processes_for(Settings(device="cuda:0"), cpus=2, gpus=1) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert replicas.visible_gpus() == 2
    assert replicas.processes_for(Settings(device="cuda:0", worker_processes=3), cpus=2) == 3
    assert replicas.processes_for(Settings(device="cpu", worker_processes=2)) == 2
    monkeypatch.setenv(replicas.REPLICA_ENV, "0")  # a replica never supervises replicas of its own
    assert replicas.processes_for(Settings(device="cpu", worker_processes=2)) == 1
    env = replicas.replica_env(Settings(device="cpu", metrics_port=9000), 1, 2, cpus=8)
    assert env["EMBEDQ_METRICS_PORT"] == "9100" and env["EMBEDQ_TORCH_THREADS"] == "4"
    assert env["EMBEDQ_WORKER_PROCESSES"] == "1"
    assert (env["EMBEDQ_PREFETCH_TEXTS"], env["EMBEDQ_PREFETCH_WINDOW"]) == ("4096", "512")  # half the window each
    # Metrics port unset (the default): a replica gets none from its supervisor and takes the next free default port
    # itself, as every worker of the machine does.
    assert "EMBEDQ_METRICS_PORT" not in replicas.replica_env(Settings(device="cpu"), 1, 2, cpus=8)


def _children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry.name))
    return out


def _replicas(client: Client, pid: int) -> dict[str, dict]:
    return {node: stats for node, stats in client.workers(1.0).items() if f"-{pid}-r" in node}


def _wait(what: str, check, timeout: float = 180.0):
    end = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < end, f"never reached: {what}"
        time.sleep(0.1)
    return value


def test_a_killed_replica_loses_no_job_and_comes_back(redis_server, tmp_path, corpus):
    # the fake model (embedq/backends/fake.py): what a killed replica does to jobs, not to vectors (a SIGKILLed worker
    # on the real model: tests/faults/test_crashes.py)
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.replicas.{uuid.uuid4().hex[:8]}",
                        model="embedq-fake", allow_fake_backend=True, worker_processes=2, prefetch_window=20,
                        visibility_timeout=5)
    log = tmp_path / "worker.log"
    with closed_gate(settings):  # the replicas hold their jobs and run none
        proc = start_worker(settings, log_path=log, command=CONTROLLED_WORKER,
                            extra_env={"EMBEDQ_TEST_GATE": f"{settings.queue_name}.gate"})
        client = Client(settings)
        try:
            wait_for_worker(client.app, proc, timeout=180, log_path=log, processes=2)
            nodes = _replicas(client, proc.pid)
            assert len(nodes) == 2 and all(s["ready"] for s in nodes.values())
            texts = [t[:300] for t in corpus[:20]]
            handles = [client.submit([t]) for t in texts]
            # each replica's share of the window (20 messages) is 10: both hold 10
            _wait("both replicas hold 10 jobs",
                  lambda: [s["held_messages"] for s in _replicas(client, proc.pid).values()] == [10, 10])
            before = _children(proc.pid)
            assert len(before) == 2
            victim = min(before)
            os.kill(victim, signal.SIGKILL)
            # the supervisor starts a new replica in its place
            _wait("a new replica", lambda: len(after := _children(proc.pid)) == 2 and victim not in after)
            _wait("both replicas ready again",
                  lambda: len(r := _replicas(client, proc.pid)) == 2 and all(s["ready"] for s in r.values()))
        except BaseException:
            stop_worker(proc)
            client.close()
            raise
    try:
        # the gate is open: every job is answered, the killed replica's after its messages' visibility timeout
        vectors = [h.result(timeout=300) for h in handles]
        assert all(v.shape == (1, 32) and np.isfinite(v).all() for v in vectors)
        served = {n: s["jobs_succeeded"] for n, s in _replicas(client, proc.pid).items()}
        assert sum(served.values()) >= 10  # the survivor's ten and what the restarted replica took back
        assert "exited with status -9" in log.read_text() and "restarting it" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        assert not _children(proc.pid)
    finally:
        stop_worker(proc)
        client.close()
