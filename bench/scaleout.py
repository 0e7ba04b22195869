"""`embedq index` against several workers on one Redis, as in docs/INDEXING.md's scale-out section.

    python bench/scaleout.py                       # 2 workers x 1 torch thread vs 1 worker x 2 threads
    python bench/scaleout.py --workers 4 --threads 4 --device cuda:0   # e.g. on a multi-GPU machine, per device

Starts a private redis-server, then runs the corpus through the `embedq index` CLI twice: once with
one worker using all `workers x threads` threads, once with `--workers` workers of `--threads` threads
each, all consuming the same queue. Prints each run's summary (texts per worker) and the ratio.
On a 2-core machine this shows that every worker on the queue takes part, not a speed-up: the cores are
the same. On N machines or GPUs each worker brings its own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.throughput import CORPUS  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402


def run(settings: Settings, workers: int, out: Path, logdir: Path) -> tuple[dict, str]:
    procs = [start_worker(settings, log_path=logdir / f"scaleout-{workers}-{i}.log") for i in range(workers)]
    client = Client(settings)
    try:
        for i, proc in enumerate(procs):
            wait_for_worker(client.app, proc, log_path=logdir / f"scaleout-{workers}-{i}.log")
        client.embed(["warm up"] * 64, timeout=300)
        env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_")}
        env.update({"EMBEDQ_BROKER_URL": settings.broker_url, "EMBEDQ_QUEUE": settings.queue_name,
                    "PYTHONPATH": str(ROOT)})
        done = subprocess.run([sys.executable, "-m", "embedq", "index", str(CORPUS), "-o", str(out), "-q",
                               "--json"], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        return json.loads(done.stdout), done.stderr.strip()
    finally:
        for proc in procs:
            stop_worker(proc)
        client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-bench"
    logdir.mkdir(exist_ok=True)
    print(f"# embedq scale-out  {time.strftime('%Y-%m-%d')}  {platform.node()}  "
          f"{cpu_summary()}  cpus={os.cpu_count()}  "
          f"device={args.device}  corpus: {CORPUS.name}")
    with tempfile.TemporaryDirectory(prefix="embedq-scaleout-") as tmp, RedisServer() as redis_server:
        base = Settings(broker_url=redis_server.url, device=args.device)
        one, one_text = run(base.model_copy(update={"torch_threads": args.workers * args.threads}), 1,
                            Path(tmp) / "one.parquet", logdir)
        many, many_text = run(base.model_copy(update={"torch_threads": args.threads}), args.workers,
                              Path(tmp) / "many.parquet", logdir)
    print(f"## 1 worker x {args.workers * args.threads} threads\n{one_text}\n")
    print(f"## {args.workers} workers x {args.threads} threads, one queue\n{many_text}\n")
    print(f"{args.workers} workers / 1 worker (texts/s): {many['texts_per_second'] / one['texts_per_second']:.2f}x")


if __name__ == "__main__":
    main()
