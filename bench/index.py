"""`embedq index` at scale: throughput against the core benchmark, and Redis memory kept bounded.

    python bench/index.py                  # 100,000 texts (the corpus 25 times), CPU fp32
    python bench/index.py --n 20000        # quicker
    python bench/index.py --device cuda:0 --dtype float16

Runs, in this one process tree:
  1. core: the throughput benchmark's embedq run (``bench/throughput.py``: the 4,000 corpus texts as
     32-text jobs, all enqueued, results collected) on a private redis-server and one worker;
  2. index: a fresh private redis-server and one worker, and ``embedq index`` (the CLI, as its own
     process, default chunk size and window) embedding ``--n`` texts JSONL -> Parquet. A sampler reads
     Redis ``INFO memory`` twice a second; Redis' own ``used_memory_peak`` is read at the end.
The last line is the headline ratio: index texts/s / core texts/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.throughput import CORPUS, run_embedq  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402

MIB = 1024 * 1024


def corpus_rows() -> list[dict]:
    with CORPUS.open() as fh:
        return [json.loads(line) for line in fh]


def write_input(path: Path, n: int) -> None:
    rows = corpus_rows()
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"doc-{i}", "text": rows[i % len(rows)]["text"]}) + "\n")


class MemorySampler(threading.Thread):
    def __init__(self, url: str, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url)
        self.every = every
        self.max_used = 0
        self.max_keys = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            info = self.r.info("memory")
            self.max_used = max(self.max_used, int(info["used_memory"]))
            self.max_keys = max(self.max_keys, int(self.r.dbsize()))
            self._halt.wait(self.every)

    def stop(self) -> dict:
        self._halt.set()
        self.join()
        info = self.r.info("memory")
        return {"used_memory_peak": int(info["used_memory_peak"]), "used_memory_end": int(info["used_memory"]),
                "max_used_memory_sampled": self.max_used, "max_keys": self.max_keys, "keys_end": self.r.dbsize()}


def run_index(settings: Settings, src: Path, out: Path, extra: list[str], log: Path) -> tuple[float, dict, dict,
                                                                                              dict]:
    proc = start_worker(settings, log_path=log)
    client = Client(settings)
    try:
        wait_for_worker(client.app, proc, log_path=log)
        client.embed(["warm up"] * 64, timeout=300)
        before = next(iter(client.workers(2).values()))
        sampler = MemorySampler(settings.broker_url)
        sampler.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_")}
        env.update({"EMBEDQ_BROKER_URL": settings.broker_url, "PYTHONPATH": str(ROOT)})
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "embedq", "index", str(src), "-o", str(out), "-q", "--json",
                               *extra], env=env, capture_output=True, text=True)
        elapsed = time.perf_counter() - t0
        memory = sampler.stop()
        if done.returncode != 0:
            raise SystemExit(f"embedq index failed ({done.returncode}):\n{done.stderr[-3000:]}")
        after = next(iter(client.workers(2).values()))
    finally:
        stop_worker(proc)
        client.close()
    delta = {k: after[k] - before[k] for k in ("batches", "items", "real_tokens", "padded_tokens")}
    return elapsed, json.loads(done.stdout), memory, delta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000, help="texts to index (the corpus repeated)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--index-args", default="", help="extra `embedq index` arguments, e.g. '--chunk-size 128'")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    core_texts = [r["text"] for r in corpus_rows()]
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-bench"
    logdir.mkdir(exist_ok=True)
    base = {"device": args.device, "dtype": args.dtype}

    with RedisServer() as core_redis:
        settings = Settings().model_copy(update={**base, "broker_url": core_redis.url})
        core_s, _, core = run_embedq(core_texts, settings, 32, logdir / "worker-core.log")

    with tempfile.TemporaryDirectory(prefix="embedq-bench-index-") as tmp, RedisServer() as index_redis:
        src, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.parquet"
        write_input(src, args.n)
        settings = Settings().model_copy(update={**base, "broker_url": index_redis.url})
        index_s, summary, memory, idx = run_index(settings, src, out, args.index_args.split(),
                                                  logdir / "worker-index.log")
        import pyarrow.parquet as pq

        rows = pq.read_table(out, columns=["id"]).num_rows
        shards = len([f for f in out.iterdir() if f.name.startswith("part-")])

    core_tps = len(core_texts) / core_s
    index_tps = args.n / index_s
    print(f"# embedq index  {time.strftime('%Y-%m-%d')}  {platform.node()}  {cpu_summary()}"
          f"  cpus={os.cpu_count()}  device={args.device}  dtype={args.dtype}")
    print(f"# index: {args.n} texts JSONL -> Parquet ({rows} rows in {shards} shards), "
          f"args: {args.index_args or '(defaults)'}; failed {summary['failed']}, resubmitted {summary['resubmitted']}")
    print(f"{'run':<46} {'texts':>7} {'seconds':>8} {'texts/s':>8} {'tokens/s':>9} {'padding':>8}")
    print(f"{'core: 4,000 texts as 32-text jobs, all queued':<46} {len(core_texts):>7} {core_s:>8.1f} "
          f"{core_tps:>8.1f} {core['real_tokens'] / core_s:>9.0f} "
          f"{1 - core['real_tokens'] / core['padded_tokens']:>8.1%}")
    print(f"{'embedq index (CLI process, end to end)':<46} {args.n:>7} {index_s:>8.1f} {index_tps:>8.1f} "
          f"{idx['real_tokens'] / index_s:>9.0f} {1 - idx['real_tokens'] / idx['padded_tokens']:>8.1%}")
    print(f"Redis during the index run: used_memory_peak {memory['used_memory_peak'] / MIB:.1f} MiB "
          f"(max sampled {memory['max_used_memory_sampled'] / MIB:.1f} MiB, at the end "
          f"{memory['used_memory_end'] / MIB:.1f} MiB); keys: max {memory['max_keys']}, at the end "
          f"{memory['keys_end']}")
    if args.json:
        args.json.write_text(json.dumps({"n": args.n, "core_s": core_s, "index_s": index_s, "memory": memory,
                                         "summary": summary, "core": core, "index": idx}, indent=2))
    print(f"embedq index / core benchmark (texts/s): {index_tps / core_tps:.2f}x")


if __name__ == "__main__":
    main()
