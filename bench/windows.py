"""Long documents in token windows (issue 58 c): what windowing costs, and what a long-document bulk run does to online
queries.

    python bench/windows.py                      # CPU fp32, MiniLM (windows of 256 tokens), 3 rounds
    python bench/windows.py --docs 60 --rounds 2 # quicker
    python bench/windows.py --device cuda:0 --dtype float16 --docs 600

One private redis-server and one warm ``embedq worker``. Documents are corpus texts (data/corpus.jsonl) put one
after another until each has ``--words`` words (by default 4–20 windows of the model's length). First one windows
job per chunk of documents (``pool_windows=False``) gives every window's character span; then, alternating, in
``--rounds`` rounds:

* **windows**: the documents sent as bulk jobs of ``--chunk`` documents with ``long_inputs="windows"`` (pooled, what a
  user asks), all at once; timed from the first submit to the last result;
* **pre-cut**: the same windows' texts (``text[start:end]``, the same token ids) sent as plain bulk jobs holding as
  many texts as the windows jobs held windows on average; timed the same way.

Headline 1: windows/s of the windows runs over texts/s of the pre-cut runs (medians of the rounds; target >= 0.95).
Then online latency: ``--online-seconds`` of one short query every ``--interval`` seconds on the idle worker, then the
same while a closed loop keeps ``--in-flight`` windows jobs of long documents outstanding (bulk). Headline 2: online
p50 under the long-document bulk run over idle p50 (target <= 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.mixed import CORPUS, Online, load_texts, pct  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402

RATIO_TARGET = 0.95
P50_TARGET = 2.0


def documents(texts: list[str], n: int, low: int, high: int, seed: int = 58) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        want, parts, count = rng.randint(low, high), [], 0
        while count < want:
            text = rng.choice(texts)
            parts.append(text)
            count += len(text.split())
        docs.append("\n\n".join(parts))
    return docs


def timed(client: Client, jobs: list[list[str]], **options: Any) -> float:
    """Seconds from the first submit of ``jobs`` (bulk) to the last result."""
    t0 = time.perf_counter()
    handles = client.submit_many(jobs, traffic_class="bulk", **options)
    client.collect(handles, 1800)
    return time.perf_counter() - t0


class LongBulk(threading.Thread):
    """Closed loop: ``in_flight`` windows jobs of long documents outstanding."""

    def __init__(self, client: Client, jobs: list[list[str]], in_flight: int) -> None:
        super().__init__(daemon=True)
        self.client, self.jobs, self.in_flight = client, jobs, in_flight
        self.stop = threading.Event()
        self.done = 0

    def run(self) -> None:
        window: list[Any] = []
        i = 0
        while not self.stop.is_set():
            while len(window) < self.in_flight:
                window.append(self.client.submit(self.jobs[i % len(self.jobs)], traffic_class="bulk",
                                                 long_inputs="windows"))
                i += 1
            window.pop(0).result(1800)
            self.done += 1
        for handle in window:
            handle.cancel()


def online_p50(settings: Settings, queries: list[str], args: argparse.Namespace, bulk_jobs: list[list[str]] | None
               ) -> tuple[float, int, int]:
    """(p50 seconds, queries, bulk jobs done) of ``--online-seconds`` of online queries, with a bulk run or not."""
    clients = [Client(settings), Client(settings)]
    bulk = LongBulk(clients[1], bulk_jobs, args.in_flight) if bulk_jobs else None
    online = Online(clients[0], queries, args.interval, "online")
    if bulk is not None:
        bulk.start()
        time.sleep(args.warmup)
    online.start()
    time.sleep(args.online_seconds)
    online.stop.set()
    online.join(300)
    if bulk is not None:
        bulk.stop.set()
        bulk.join(1800)
    for c in clients:
        c.close()
    latencies = [lat for _, lat in online.latencies]
    time.sleep(1.5)  # the worker leaves online mode and drains what was cancelled
    return pct(latencies, 0.5), len(latencies), bulk.done if bulk else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=120, help="long documents")
    p.add_argument("--words", default="800,3600", help="words per document: low,high")
    p.add_argument("--chunk", type=int, default=8, help="documents per windows job")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--online-seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--interval", type=float, default=0.1, help="seconds between online queries")
    p.add_argument("--in-flight", type=int, default=4, help="windows jobs outstanding in the bulk run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    texts = load_texts(CORPUS)
    queries = [t for t in texts if len(t) <= 120]
    low, high = (int(x) for x in args.words.split(","))
    docs = documents(texts, args.docs, low, high)
    doc_jobs = [docs[i:i + args.chunk] for i in range(0, len(docs), args.chunk)]
    redis = RedisServer().start()
    settings = Settings(broker_url=redis.url, queue="embedq.bench.windows", device=args.device, dtype=args.dtype,
                        online_queue_limit=0, bulk_queue_limit=0)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-windows-worker.log"
    worker = start_worker(settings, log_path=log)
    out: dict[str, Any] = {}
    try:
        with Client(settings) as client:
            wait_for_worker(client.app, worker, timeout=300, log_path=log)
            client.embed(queries[:8])  # warm the model
            per_doc = [w for job in client.collect(client.submit_many(doc_jobs, traffic_class="bulk",
                                                                      long_inputs="windows", pool_windows=False), 1800)
                       for w in job]
            pieces = [doc[w.start:w.end] for doc, windows in zip(docs, per_doc) for w in windows]
            per_job = max(1, round(len(pieces) / len(doc_jobs)))
            piece_jobs = [pieces[i:i + per_job] for i in range(0, len(pieces), per_job)]
            print(f"# {len(docs)} documents, {len(pieces)} windows ({min(map(len, per_doc))}-"
                  f"{max(map(len, per_doc))} per document), {len(doc_jobs)} windows jobs, {len(piece_jobs)} "
                  f"pre-cut jobs of {per_job} texts", flush=True)
            rates: dict[str, list[float]] = {"windows": [], "pre-cut": []}
            for r in range(args.rounds):
                for name in ("windows", "pre-cut") if r % 2 == 0 else ("pre-cut", "windows"):
                    if name == "windows":
                        seconds = timed(client, doc_jobs, long_inputs="windows")
                    else:
                        seconds = timed(client, piece_jobs)
                    rates[name].append(len(pieces) / seconds)
                    print(f"# round {r} {name:8s}: {len(pieces) / seconds:8.1f} windows/s ({seconds:.1f} s)",
                          flush=True)
        idle = online_p50(settings, queries, args, None)
        loaded = online_p50(settings, queries, args, doc_jobs)
    finally:
        stop_worker(worker)
        redis.stop()
    ratio = statistics.median(rates["windows"]) / statistics.median(rates["pre-cut"])
    p50_ratio = loaded[0] / idle[0]
    out = {"rates": rates, "ratio": ratio, "idle_p50": idle[0], "loaded_p50": loaded[0],
           "online_n": [idle[1], loaded[1]],
           "bulk_jobs_during_online": loaded[2], "p50_ratio": p50_ratio, "windows": len(pieces), "docs": len(docs)}
    print(f"# embedq windows  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {cpu_summary()}  "
          f"cpus={os.cpu_count()}  device={args.device}  dtype={args.dtype}")
    print(f"windows {statistics.median(rates['windows']):.1f} windows/s vs pre-cut "
          f"{statistics.median(rates['pre-cut']):.1f} texts/s: {ratio:.3f}x (target >= {RATIO_TARGET})")
    print(f"online p50 idle {idle[0] * 1e3:.1f} ms (n={idle[1]}), under a long-document bulk run "
          f"{loaded[0] * 1e3:.1f} ms (n={loaded[1]}, {loaded[2]} bulk jobs done): {p50_ratio:.2f}x "
          f"(target <= {P50_TARGET})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if ratio >= RATIO_TARGET and p50_ratio <= P50_TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
