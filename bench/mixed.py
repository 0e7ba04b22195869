"""Online and bulk on one worker: what traffic classes buy a web request while a bulk run saturates the worker.

    python bench/mixed.py                          # CPU: 30 s per phase, 2 rounds
    python bench/mixed.py --seconds 10 --rounds 1  # quick
    python bench/mixed.py --device cuda:0 --dtype float16 --bulk-chunk 64 --bulk-in-flight 64

Starts a private redis-server and one ``embedq worker``. Two producers, each with its own ``Client``:

* **online**: one short query (a corpus text of at most ``--online-max-chars`` characters) every
  ``--interval`` seconds (open loop: sent on schedule whatever the latency), each ``submit`` then
  ``result``; latency is submit to result.
* **bulk**: closed loop, ``--bulk-in-flight`` jobs of ``--bulk-chunk`` corpus texts outstanding (like
  ``embedq index``), sent as ``traffic_class="bulk"``; throughput is the bulk texts the worker ran through
  its model in the window (its ``items_by_class`` counter, read at both ends of the window).

Phases, each ``--seconds`` long after ``--warmup`` seconds, repeated ``--rounds`` times in this order:
``online`` alone (an idle worker), ``bulk`` alone, ``mixed`` (both), and ``fifo`` (both, but the online
queries sent as bulk: one FIFO class, what a server without classes does). Reported: online p50/p99 per
phase and bulk texts/s per phase, pooled over rounds. The last line is the headline, against the targets:
online p50 under bulk <= 2x idle p50, bulk throughput with online traffic >= 85 % of bulk alone.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402

CORPUS = ROOT.parent / "shared" / "data" / "corpus.jsonl"
P50_TARGET = 2.0
BULK_TARGET = 0.85


def load_texts(path: Path) -> list[str]:
    with path.open() as fh:
        return [json.loads(line)["text"] for line in fh]


class Bulk(threading.Thread):
    """Closed loop: keep ``in_flight`` bulk jobs outstanding; count texts as their results arrive."""

    def __init__(self, client: Client, texts: list[str], chunk: int, in_flight: int) -> None:
        super().__init__(daemon=True)
        self.client, self.texts, self.chunk, self.in_flight = client, texts, chunk, in_flight
        self.done: list[tuple[float, int]] = []  # (monotonic time the result arrived, texts)
        self.stop = threading.Event()
        self.errors = 0

    def run(self) -> None:
        window: collections.deque = collections.deque()
        i = 0
        while not self.stop.is_set():
            while len(window) < self.in_flight:
                batch = [self.texts[(i + k) % len(self.texts)] for k in range(self.chunk)]
                i += self.chunk
                window.append(self.client.submit(batch, traffic_class="bulk"))
            handle = window.popleft()
            try:
                handle.result(600)
                self.done.append((time.monotonic(), self.chunk))
            except Exception:
                self.errors += 1
        for handle in window:  # leave nothing behind in the queue for the next phase
            handle.cancel()


class Online(threading.Thread):
    """Open loop: one query every ``interval`` seconds, each waited for in a pool thread."""

    def __init__(self, client: Client, queries: list[str], interval: float, traffic_class: str) -> None:
        super().__init__(daemon=True)
        self.client, self.queries, self.interval, self.traffic_class = client, queries, interval, traffic_class
        self.latencies: list[tuple[float, float]] = []  # (monotonic send time, seconds)
        self.stop = threading.Event()
        self.errors = 0
        self.pool = ThreadPoolExecutor(max_workers=256)

    def one(self, text: str, t0: float) -> None:
        """``t0``: when the query was due (open loop: a query waiting for a pool thread counts that wait)."""
        try:
            self.client.submit([text], traffic_class=self.traffic_class).result(120)
            self.latencies.append((t0, time.monotonic() - t0))
        except Exception:
            self.errors += 1

    def run(self) -> None:
        nxt = time.monotonic()
        i = 0
        while not self.stop.is_set():
            self.pool.submit(self.one, self.queries[i % len(self.queries)], time.monotonic())
            i += 1
            nxt += self.interval
            time.sleep(max(nxt - time.monotonic(), 0.0))
        self.pool.shutdown(wait=True)


def phase(settings: Settings, name: str, texts: list[str], queries: list[str], args: argparse.Namespace) -> dict:
    bulk_client, online_client = Client(settings), Client(settings)
    bulk = Bulk(bulk_client, texts, args.bulk_chunk, args.bulk_in_flight) if name != "online" else None
    online = None
    if name != "bulk":
        online = Online(online_client, queries, args.interval, "bulk" if name == "fifo" else "online")
    for t in (bulk, online):
        if t is not None:
            t.start()
    time.sleep(args.warmup)
    s0 = _worker_stats(bulk_client)
    m0 = time.monotonic()
    time.sleep(args.seconds)
    m1 = time.monotonic()
    s1 = _worker_stats(bulk_client)
    for t in (online, bulk):
        if t is not None:
            t.stop.set()
    for t in (online, bulk):
        if t is not None:
            t.join(180)
    out: dict[str, Any] = {"phase": name, "seconds": m1 - m0}
    dt = m1 - m0
    out["model_busy"] = (s1["inference_seconds"] - s0["inference_seconds"]) / dt
    out["batches_per_s"] = (s1["batches"] - s0["batches"]) / dt
    out["padded_tokens_per_s"] = (s1["padded_tokens"] - s0["padded_tokens"]) / dt
    if bulk is not None:
        out["bulk_texts_per_s"] = (_bulk(s1) - _bulk(s0)) / dt
        out["bulk_results_per_s"] = sum(n for t, n in bulk.done if m0 <= t < m1) / (m1 - m0)
        out["bulk_errors"] = bulk.errors
    if online is not None:
        out["latencies"] = [lat for t, lat in online.latencies if m0 <= t < m1]
        out["online_errors"] = online.errors
    bulk_client.close()
    online_client.close()
    time.sleep(1.5)  # the worker leaves online mode (online_hold) and drains what was cancelled
    return out


def _worker_stats(client: Client) -> dict[str, Any]:
    """The counters of the bench's only worker (returns as soon as it answers)."""
    replies = client.app.control.broadcast("embedq_stats", reply=True, timeout=10.0, limit=1) or []
    stats = [s for reply in replies for s in reply.values()]
    if len(stats) != 1:
        raise RuntimeError(f"expected one worker, {len(stats)} answered")
    return stats[0]


def _bulk(stats: dict[str, Any]) -> int:
    """Bulk texts the worker has run through its model."""
    return int(stats.get("items_by_class", {}).get("bulk", 0))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between online queries")
    p.add_argument("--online-max-chars", type=int, default=120)
    p.add_argument("--bulk-max-chars", type=int, help="bulk texts: only corpus texts this short")
    p.add_argument("--bulk-chunk", type=int, default=32, help="texts per bulk job")
    p.add_argument("--bulk-in-flight", type=int, default=8, help="bulk jobs outstanding")
    p.add_argument("--phases", default="online,bulk,mixed,fifo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--online-batch-tokens", type=int, help="EMBEDQ_ONLINE_BATCH_TOKENS for the worker")
    p.add_argument("--torch-threads", type=int, help="EMBEDQ_TORCH_THREADS for the worker")
    p.add_argument("--json", help="write the raw results here")
    args = p.parse_args()

    texts = load_texts(CORPUS)
    queries = [t for t in texts if len(t) <= args.online_max_chars]
    if args.bulk_max_chars:
        texts = [t for t in texts if len(t) <= args.bulk_max_chars]
    redis = RedisServer().start()
    extra: dict[str, Any] = {"online_batch_tokens": args.online_batch_tokens} if args.online_batch_tokens else {}
    if args.torch_threads:
        extra["torch_threads"] = args.torch_threads
    settings = Settings(broker_url=redis.url, queue="embedq.bench.mixed", device=args.device, dtype=args.dtype,
                        online_queue_limit=0, bulk_queue_limit=0, **extra)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-mixed-worker.log"
    worker = start_worker(settings, log_path=log)
    results: list[dict] = []
    try:
        with Client(settings) as probe:
            wait_for_worker(probe.app, worker, timeout=300, log_path=log)
            probe.embed(queries[:8])  # warm the model
        names = args.phases.split(",")
        for r in range(args.rounds):
            for name in names:
                res = phase(settings, name, texts, queries, args)
                res["round"] = r
                results.append(res)
                lat = res.get("latencies")
                print(f"# round {r} {name:6s}: "
                      + (f"online p50 {pct(lat, .5) * 1e3:.1f} ms p99 {pct(lat, .99) * 1e3:.1f} ms (n={len(lat)}) "
                         if lat is not None else "")
                      + (f"bulk {res['bulk_texts_per_s']:.1f} texts/s " if "bulk_texts_per_s" in res else "")
                      + f"| model busy {res['model_busy']:.0%}, {res['batches_per_s']:.1f} batches/s, "
                        f"{res['padded_tokens_per_s']:.0f} padded tokens/s",
                      flush=True)
    finally:
        stop_worker(worker)
        redis.stop()

    def pooled(name: str) -> dict[str, Any]:
        rows = [r for r in results if r["phase"] == name]
        lat = [x for r in rows for x in r.get("latencies", [])]
        bulk = [r["bulk_texts_per_s"] for r in rows if "bulk_texts_per_s" in r]
        return {"n": len(lat), "p50": pct(lat, .5), "p99": pct(lat, .99),
                "bulk": statistics.fmean(bulk) if bulk else None,
                "errors": sum(r.get("online_errors", 0) + r.get("bulk_errors", 0) for r in rows)}

    summary = {name: pooled(name) for name in args.phases.split(",")}
    print(f"# embedq mixed  {time.strftime('%Y-%m-%d')}  {platform.node()}  "
          f"{cpu_summary()}  cpus={os.cpu_count()}  "
          f"device={args.device}  dtype={args.dtype}  interval={args.interval * 1e3:.0f} ms  "
          f"bulk {args.bulk_in_flight} x {args.bulk_chunk} texts  {args.seconds:.0f} s x {args.rounds} rounds")
    print(f"{'phase':8s} {'online n':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'bulk texts/s':>13s} {'errors':>7s}")
    for name, s in summary.items():
        p50 = f"{s['p50'] * 1e3:8.1f}" if s["n"] else f"{'-':>8s}"
        p99 = f"{s['p99'] * 1e3:8.1f}" if s["n"] else f"{'-':>8s}"
        bulk = f"{s['bulk']:13.1f}" if s["bulk"] is not None else f"{'-':>13s}"
        print(f"{name:8s} {s['n']:9d} {p50} {p99} {bulk} {s['errors']:7d}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "phases": results}))
    if not all(k in summary for k in ("online", "bulk", "mixed")):
        return 0
    p50_ratio = summary["mixed"]["p50"] / summary["online"]["p50"]
    bulk_ratio = summary["mixed"]["bulk"] / summary["bulk"]["bulk"]
    extra_fifo = ""
    if "fifo" in summary and summary["fifo"]["n"]:
        extra_fifo = f"; FIFO (no classes) p50 {summary['fifo']['p50'] / summary['online']['p50']:.1f}x idle"
    ok = p50_ratio <= P50_TARGET and bulk_ratio >= BULK_TARGET
    print(f"online p50 under bulk {p50_ratio:.2f}x idle (target <= {P50_TARGET}), bulk with online traffic "
          f"{bulk_ratio:.0%} of solo (target >= {BULK_TARGET:.0%}){extra_fifo}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
