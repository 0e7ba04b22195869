"""`embedq index` at scale: throughput against the core benchmark, and Redis memory kept bounded.

    python bench/index.py                  # 100,000 distinct texts (the corpus 25 times, each copy marked), CPU fp32
    python bench/index.py --n 20000        # quicker
    python bench/index.py --device cuda:0 --dtype float16
    python bench/index.py --sink           # the same texts into Parquet and into pgvector (a private pgserver)
    python bench/index.py --sink 'postgresql://user@host/db?table=bench'   # into that server instead
    python bench/index.py --sink --also lancedb,milvus   # and into LanceDB and Milvus Lite (local files)

Runs, in this one process tree:
  1. core: the throughput benchmark's embedq run (``bench/throughput.py``: the 4,000 corpus texts as
     32-text jobs, all enqueued, results collected) on a private redis-server and one worker;
  2. index: a fresh private redis-server and one worker, and ``embedq index`` (the CLI, as its own
     process, default chunk size and window) embedding ``--n`` texts JSONL -> Parquet. A sampler reads
     Redis ``INFO memory`` twice a second; Redis' own ``used_memory_peak`` is read at the end.
The last line is the headline ratio: index texts/s / core texts/s.

With ``--sink`` (issue 40 e) it runs instead, on one private redis-server and one warm worker, the same ``--n`` texts
(default 4,000: the corpus) through ``embedq index`` into Parquet and into PostgreSQL + pgvector, alternating
(Parquet, pgvector, pgvector, Parquet, ... for ``--rounds``), each into a fresh output, no ANN index (its build is
timed apart, once, after the last run). Without a URL it starts its own cluster from the pgserver wheel
(tests/pgcluster.py). ``--also lancedb,milvus`` adds LanceDB and Milvus Lite (a fresh local database per run) to the
rotation, each with its ratio to Parquet. The last line is the headline ratio: pgvector seconds / Parquet seconds
(summed over rounds).
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

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
    """``n`` distinct texts: the corpus, then again with `` (copy k)`` appended (a repeated text would be embedded once
    since issue 57; bench/reindex.py measures repeats)."""
    rows = corpus_rows()
    with path.open("w") as fh:
        for i in range(n):
            k, text = divmod(i, len(rows))[0], rows[i % len(rows)]["text"]
            fh.write(json.dumps({"id": f"doc-{i}", "text": f"{text} (copy {k})" if k else text}) + "\n")


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


def _index_once(settings: Settings, src: Path, out: str, extra: list[str]) -> tuple[float, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_")}
    env.update({"EMBEDQ_BROKER_URL": settings.broker_url, "PYTHONPATH": str(ROOT)})
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "embedq", "index", str(src), "-o", out, "-q", "--json", *extra],
                          env=env, capture_output=True, text=True, cwd=src.parent)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"embedq index -o {out} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return elapsed, json.loads(done.stdout)


def sink_main(args: argparse.Namespace, base: dict) -> None:
    """Parquet against pgvector: same texts, same worker, alternating runs; the ANN index build timed apart."""
    import contextlib

    from embedq.producers.index.sinks.urls import mask_url, split_param

    n = args.n if args.n_given else 4000
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-bench"
    logdir.mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="embedq-bench-sink-")))
        url = args.sink
        if url == "auto":
            from pgcluster import PgCluster

            cluster = stack.enter_context(PgCluster(tmp / "pg"))
            url = cluster.url(cluster.create_database("bench"))
            where = "a private pgserver cluster (PostgreSQL 16.2, pgvector 0.6.2), 127.0.0.1"
        else:
            where = mask_url(url)
        base_url, _ = split_param(url, "table")
        sep = "&" if "?" in base_url else "?"
        src = tmp / "in.jsonl"
        write_input(src, n)
        redis_server = stack.enter_context(RedisServer())
        settings = Settings().model_copy(update={**base, "broker_url": redis_server.url})
        proc = start_worker(settings, log_path=logdir / "worker-sink.log")
        client = Client(settings)
        stack.callback(client.close)
        stack.callback(stop_worker, proc)
        wait_for_worker(client.app, proc, log_path=logdir / "worker-sink.log")
        client.embed(["warm up"] * 64, timeout=300)
        extra = args.index_args.split()
        sinks = ["parquet", "pgvector", *args.also]
        times: dict[str, list[float]] = {sink: [] for sink in sinks}
        last_table = None
        for r in range(args.rounds):
            for sink in sinks[r % len(sinks):] + sinks[:r % len(sinks)]:  # each sink first in turn
                if sink == "parquet":
                    out = str(tmp / f"out-{r}.parquet")
                elif sink == "lancedb":
                    out = f"lancedb://{tmp}/lance-{r}?table=bench"
                elif sink == "milvus":
                    out = f"milvus://{tmp}/milvus-{r}.db?collection=bench"
                else:
                    last_table = f"bench_{os.getpid()}_{r}"
                    out = f"{base_url}{sep}table={last_table}"
                seconds, summary = _index_once(settings, src, out, extra)
                assert summary["rows"] == n and summary["failed"] == 0, summary
                times[sink].append(seconds)
                print(f"  round {r + 1} {sink:<9} {seconds:7.1f}s  {n / seconds:7.1f} texts/s", flush=True)
        import psycopg

        with psycopg.connect(base_url, autocommit=True) as conn:
            t0 = time.perf_counter()
            conn.execute(f"CREATE INDEX ON {last_table} USING hnsw (embedding vector_cosine_ops)")
            index_s = time.perf_counter() - t0
            for r in range(args.rounds):
                conn.execute(f"DROP TABLE IF EXISTS bench_{os.getpid()}_{r}")
            conn.execute("DELETE FROM embedq_index WHERE name LIKE %s", (f"bench_{os.getpid()}_%",))
    seconds = {sink: sum(t) for sink, t in times.items()}
    pq_s, pg_s = seconds["parquet"], seconds["pgvector"]
    print(f"# embedq index --sink  {time.strftime('%Y-%m-%d')}  {platform.node()}  {cpu_summary()}"
          f"  cpus={os.cpu_count()}  device={args.device}  dtype={args.dtype}")
    print(f"# {n} texts JSONL (the corpus{' repeated' if n > 4000 else ''}), {args.rounds} rounds alternating, "
          f"args: {args.index_args or '(defaults)'}; pgvector: {where}")
    print(f"{'sink':<10} {'runs':>4} {'seconds':>9} {'texts/s':>8} {'/ Parquet':>9}")
    for sink, s in seconds.items():
        print(f"{sink:<10} {len(times[sink]):>4} {s:>9.1f} {n * len(times[sink]) / s:>8.1f} {s / pq_s:>8.3f}x")
    print(f"HNSW index build on {n} rows (vector_cosine_ops, not in the times above): {index_s:.1f}s")
    print(f"pgvector / Parquet (seconds, same texts, same worker): {pg_s / pq_s:.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="texts to index (the corpus repeated; default 100,000, "
                   "4,000 with --sink)")
    p.add_argument("--sink", nargs="?", const="auto", metavar="URL",
                   help="Parquet against pgvector (issue 40 e); URL: postgresql://... (default: a private pgserver)")
    p.add_argument("--rounds", type=int, default=2, help="--sink: alternating rounds of each sink (default 2)")
    p.add_argument("--also", type=lambda text: [x for x in text.split(",") if x], default=[],
                   help="--sink: also these local databases, comma-separated: lancedb, milvus")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--index-args", default="", help="extra `embedq index` arguments, e.g. '--chunk-size 128'")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    args.n_given = args.n is not None
    if set(args.also) - {"lancedb", "milvus"}:
        p.error(f"--also takes lancedb and milvus, not {','.join(sorted(set(args.also) - {'lancedb', 'milvus'}))}")
    if args.sink:
        sink_main(args, {"device": args.device, "dtype": args.dtype})
        return
    args.n = args.n or 100_000

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
