"""What ``EMBEDQ_REPLICA_ACKS=1`` costs: a Redis primary with one replica (loopback), the fake model, one-text jobs.

    python bench/replication.py                 # 3 rounds of 2,000 jobs, replica_acks 0 and 1 alternating
    python bench/replication.py --jobs 500 --rounds 1

Per round and setting: a fresh ``embedq worker`` (the fake model: the queue path is what is measured) on the pair;
(1) **submit**: one ``Client.submit`` call per job, one after another, its wall time per call (the producer's WAIT for
the replica is in it); (2) **end to end**: the worker's process group is paused (SIGSTOP), the jobs submitted, the
group resumed and every result collected: jobs per second of the worker, whose results wait for the replica before it
acknowledges. Settings alternate within each round (0, 1, 1, 0, ...), and the medians over rounds are printed with the
ratio 1/0. Loopback replication: a replica across a network adds its round trip to each WAIT.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402


def pair() -> tuple[RedisServer, RedisServer]:
    base = Path(tempfile.mkdtemp(prefix="embedq-bench-repl-"))
    (base / "p").mkdir()
    (base / "r").mkdir()
    primary = RedisServer(dir=str(base / "p")).start()
    replica = RedisServer(dir=str(base / "r"), extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start()
    r = redis.Redis(port=replica.port, decode_responses=True)
    while r.info("replication").get("master_link_status") != "up":
        time.sleep(0.05)
    return primary, replica


def one_round(url: str, acks: int, jobs: int) -> tuple[float, float]:
    """(seconds per submit, worker jobs/s) with ``replica_acks=acks``."""
    settings = Settings(broker_url=url, queue=f"embedq.bench.{uuid.uuid4().hex[:8]}", model="embedq-fake",
                        allow_fake_backend=True, replica_acks=acks, online_queue_limit=0, online_max_wait=0,
                        online_queue_texts=0)
    log = Path(tempfile.mkdtemp()) / "worker.log"
    proc = start_worker(settings, log_path=log)
    client = Client(settings)
    try:
        wait_for_worker(client.app, proc, timeout=120, log_path=log)
        client.embed(["warm up"], timeout=60)
        # (1) submit latency, jobs consumed as they come
        started = time.perf_counter()
        handles = [client.submit([f"submit {i}"]) for i in range(jobs)]
        per_submit = (time.perf_counter() - started) / jobs
        for h in handles:
            h.result(timeout=300)
        # (2) the worker's rate over a backlog
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            handles = [client.submit([f"backlog {i}"]) for i in range(jobs)]
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
        started = time.perf_counter()
        for h in handles:
            h.result(timeout=300)
        rate = jobs / (time.perf_counter() - started)
        return per_submit, rate
    finally:
        client.close()
        stop_worker(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    print(f"# bench/replication.py: {ns.jobs} one-text jobs x {ns.rounds} rounds; {cpu_summary()}; "
          f"Python {platform.python_version()}")
    primary, replica = pair()
    results: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    try:
        for n in range(ns.rounds):
            for acks in ((0, 1) if n % 2 == 0 else (1, 0)):
                per_submit, rate = one_round(primary.url, acks, ns.jobs)
                results[acks].append((per_submit, rate))
                print(f"round {n + 1} replica_acks={acks}: submit {per_submit * 1e6:.0f} us/job, worker {rate:.0f} "
                      "jobs/s", flush=True)
    finally:
        replica.stop()
        primary.stop()
    med = {acks: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
           for acks, rows in results.items()}
    print(f"median submit: {med[0][0] * 1e6:.0f} us (acks 0) vs {med[1][0] * 1e6:.0f} us (acks 1): "
          f"x{med[1][0] / med[0][0]:.2f}")
    print(f"median worker rate: {med[0][1]:.0f} jobs/s (acks 0) vs {med[1][1]:.0f} jobs/s (acks 1): "
          f"x{med[1][1] / med[0][1]:.2f}")


if __name__ == "__main__":
    main()
