"""What an idle worker costs: the CPU time an ``embedq worker`` that holds no job spends per minute (its event loop's
timers, its reporter), and what its Redis spends serving it.

    python bench/idle.py                                   # this checkout's worker, the fake model, 60 s
    python bench/idle.py --before /path/to/other/checkout  # and, at the same time, a worker from that checkout
    python bench/idle.py --model sentence-transformers/all-MiniLM-L6-v2

Starts a private redis-server and one worker per checkout, each on its own queue, runs one job through each (so every
timer has run once), then reads each worker's CPU time (user + system, ``psutil``) over ``--seconds`` of idleness, all
in the same window, and Redis's over the same window (shared by the workers). The fake model
(``embedq/backends/fake.py``) by default: what is measured is the worker, not the model. The last line is the
headline: CPU seconds a minute, and the share of one core.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedq.backends.cpu import cpu_description  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, settings_env, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="the idle window measured")
    ap.add_argument("--model", default="embedq-fake")
    ap.add_argument("--before", default=None, help="also run a worker from this checkout, in the same window")
    args = ap.parse_args()
    server = RedisServer().start()
    logs = Path(tempfile.mkdtemp(prefix="embedq-idle-"))
    checkouts = {"this checkout": ROOT, **({"--before": Path(args.before).resolve()} if args.before else {})}
    workers = {}
    try:
        for i, (name, code) in enumerate(checkouts.items()):
            settings = Settings(broker_url=server.url, queue=f"embedq.bench.idle.{i}", model=args.model,
                                allow_fake_backend=args.model == "embedq-fake", metrics_port=0)
            env = {**os.environ, **settings_env(settings), "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
            with open(logs / f"worker-{i}.log", "wb") as log:  # cwd: `-m embedq` imports that checkout's package
                proc = subprocess.Popen([sys.executable, "-m", "embedq", "worker"], cwd=code, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            client = Client(settings)
            wait_for_worker(client.app, proc, timeout=300, log_path=logs / f"worker-{i}.log")
            client.embed(["one job, so that every timer has run"], timeout=120)
            client.close()
            workers[name] = proc
        time.sleep(3)  # the job's acknowledgement and the last reports
        watched = {name: psutil.Process(proc.pid) for name, proc in workers.items()}
        redis = psutil.Process(server.proc.pid)
        start = {name: _cpu(p) for name, p in watched.items()}
        redis_start, t0 = _cpu(redis), time.monotonic()
        time.sleep(args.seconds)
        elapsed = time.monotonic() - t0
        used = {name: _cpu(p) - start[name] for name, p in watched.items()}
        redis_used = _cpu(redis) - redis_start
    finally:
        for proc in workers.values():
            stop_worker(proc)
        server.stop()
    cpu = cpu_description()
    print(f"machine: {cpu['model_name']} (family {cpu['family']} model {cpu['model']}), {cpu['cores']} cores; "
          f"model {args.model}; idle window {elapsed:.0f} s")
    print(f"redis-server (shared): {60 * redis_used / elapsed:.2f} CPU-s a minute")
    for name, seconds in used.items():
        share = 100 * seconds / elapsed
        print(f"worker, {name}: {60 * seconds / elapsed:.2f} CPU-s a minute ({share:.2f} % of a core)")


if __name__ == "__main__":
    main()
