"""Online and bulk on one worker: what traffic classes buy a web request while a bulk run saturates the worker.

    python bench/mixed.py                          # CPU: 30 s per phase, 2 rounds
    python bench/mixed.py --seconds 10 --rounds 1  # quick
    python bench/mixed.py --device cuda:0 --dtype float16 --bulk-chunk 64 --bulk-in-flight 64
    python bench/mixed.py --no-preempt             # before issue 18: the online cap instead of preemption
    python bench/mixed.py --linear-kernel torch    # pin the worker's runtime (default: its own choice, auto)

Starts a private redis-server and one ``embedq worker``. Two producers, each with its own ``Client``:

* **online**: one short query (a corpus text of at most ``--online-max-chars`` characters) every
  ``--interval`` seconds (open loop: sent on schedule whatever the latency), each ``submit`` then
  ``result``; latency is submit to result.
* **bulk**: closed loop, ``--bulk-in-flight`` jobs of ``--bulk-chunk`` corpus texts outstanding (like
  ``embedq index``), sent as ``traffic_class="bulk"``; throughput is the bulk texts the worker ran through
  its model in the window (its ``items_by_class`` counter, read at both ends of the window).

Phases, each ``--seconds`` long after ``--warmup`` seconds, repeated ``--rounds`` times in this order:
``online`` alone (an idle worker), ``bulk`` alone, ``mixed`` (both), and ``fifo`` (both, but the online
queries sent as bulk: one FIFO class, what a server without classes does). Then the **burst** scenario, what a
new user tries first (issue 18): ``burst-bulk`` submits ``--burst-jobs`` bulk jobs of ``--burst-chunk`` texts at
once and times them to the last result; ``burst-mixed`` does the same with one online query every
``--interval`` seconds from the moment the burst is sent until its last result. Reported: online p50/p99 per
phase and bulk texts/s per phase, pooled over rounds. The last lines are the headlines, one per scenario,
against the targets: online p50 under bulk <= 2x idle p50, online p99 <= 4x idle p99, bulk throughput with
online traffic >= 85 % of bulk alone.
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

CORPUS = ROOT / "data" / "corpus.jsonl"
P50_TARGET = 2.0
P99_TARGET = 4.0
BULK_TARGET = 0.85
#: scenario -> (idle online phase, bulk-alone phase, both phase)
SCENARIOS = {"open loop": ("online", "bulk", "mixed"), "burst": ("online", "burst-bulk", "burst-mixed")}


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
    out["preemptions"] = s1.get("preemptions", 0) - s0.get("preemptions", 0)
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


def burst(settings: Settings, name: str, texts: list[str], queries: list[str], args: argparse.Namespace,
          offset: int) -> dict:
    """``--burst-jobs`` bulk jobs sent at once (and, for ``burst-mixed``, online queries until they are done)."""
    bulk_client, online_client = Client(settings), Client(settings)
    chunk, n = args.burst_chunk, args.burst_jobs
    jobs = [[texts[(offset + j * chunk + k) % len(texts)] for k in range(chunk)] for j in range(n)]
    online = Online(online_client, queries, args.interval, "online") if name == "burst-mixed" else None
    s0 = _worker_stats(bulk_client)
    t0 = time.monotonic()
    handles = [bulk_client.submit(job, traffic_class="bulk") for job in jobs]
    if online is not None:
        online.start()
    errors = 0
    for handle in handles:
        try:
            handle.result(900)
        except Exception:
            errors += 1
    t1 = time.monotonic()
    if online is not None:
        online.stop.set()
        online.join(180)
    s1 = _worker_stats(bulk_client)
    dt = t1 - t0
    out: dict[str, Any] = {"phase": name, "seconds": dt, "bulk_texts_per_s": n * chunk / dt, "bulk_errors": errors,
                           "model_busy": (s1["inference_seconds"] - s0["inference_seconds"]) / dt,
                           "batches_per_s": (s1["batches"] - s0["batches"]) / dt,
                           "padded_tokens_per_s": (s1["padded_tokens"] - s0["padded_tokens"]) / dt,
                           "preemptions": s1.get("preemptions", 0) - s0.get("preemptions", 0)}
    if online is not None:
        out["latencies"] = [lat for t, lat in online.latencies if t0 <= t < t1]
        out["online_errors"] = online.errors
    bulk_client.close()
    online_client.close()
    time.sleep(1.5)
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
    p.add_argument("--burst-jobs", type=int, default=40, help="burst: bulk jobs sent at once")
    p.add_argument("--burst-chunk", type=int, default=100, help="burst: texts per bulk job")
    p.add_argument("--phases", default="online,bulk,mixed,fifo,burst-bulk,burst-mixed")
    p.add_argument("--no-preempt", action="store_true", help="EMBEDQ_PREEMPT=false: the online cap alone")
    p.add_argument("--linear-kernel", help="EMBEDQ_LINEAR_KERNEL for the worker (default: auto)")
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
    if args.no_preempt:
        extra["preempt"] = False
    if args.linear_kernel:
        extra["linear_kernel"] = args.linear_kernel
    settings = Settings(broker_url=redis.url, queue="embedq.bench.mixed", device=args.device, dtype=args.dtype,
                        online_queue_limit=0, bulk_queue_limit=0, **extra)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-mixed-worker.log"
    worker = start_worker(settings, log_path=log)
    results: list[dict] = []
    try:
        with Client(settings) as probe:
            wait_for_worker(probe.app, worker, timeout=300, log_path=log)
            probe.embed(queries[:8])  # warm the model
            ident = {k: v for k, v in _worker_stats(probe).items()
                     if k in ("linear_kernel", "max_batch_tokens", "preemption")}
        names = args.phases.split(",")
        print(f"# worker: {ident}", flush=True)
        for r in range(args.rounds):
            for name in names:
                if name.startswith("burst"):
                    res = burst(settings, name, texts, queries, args, offset=r * 7919)
                else:
                    res = phase(settings, name, texts, queries, args)
                res["round"] = r
                results.append(res)
                lat = res.get("latencies")
                print(f"# round {r} {name:6s}: "
                      + (f"online p50 {pct(lat, .5) * 1e3:.1f} ms p99 {pct(lat, .99) * 1e3:.1f} ms (n={len(lat)}) "
                         if lat is not None else "")
                      + (f"bulk {res['bulk_texts_per_s']:.1f} texts/s " if "bulk_texts_per_s" in res else "")
                      + f"| model busy {res['model_busy']:.0%}, {res['batches_per_s']:.1f} batches/s, "
                        f"{res['padded_tokens_per_s']:.0f} padded tokens/s, {res['preemptions']} preemptions",
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
    print(f"# embedq mixed  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  "
          f"{cpu_summary()}  cpus={os.cpu_count()}  "
          f"device={args.device}  dtype={args.dtype}  interval={args.interval * 1e3:.0f} ms  "
          f"bulk {args.bulk_in_flight} x {args.bulk_chunk} texts  {args.seconds:.0f} s x {args.rounds} rounds  "
          f"burst {args.burst_jobs} x {args.burst_chunk}  preempt={not args.no_preempt}  worker {ident}")
    print(f"{'phase':12s} {'online n':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'bulk texts/s':>13s} {'errors':>7s}")
    for name, s in summary.items():
        p50 = f"{s['p50'] * 1e3:8.1f}" if s["n"] else f"{'-':>8s}"
        p99 = f"{s['p99'] * 1e3:8.1f}" if s["n"] else f"{'-':>8s}"
        bulk = f"{s['bulk']:13.1f}" if s["bulk"] is not None else f"{'-':>13s}"
        print(f"{name:12s} {s['n']:9d} {p50} {p99} {bulk} {s['errors']:7d}")
    headlines = {}
    for scenario, (idle, alone, both) in SCENARIOS.items():
        if not all(k in summary for k in (idle, alone, both)):
            continue
        p50_ratio = summary[both]["p50"] / summary[idle]["p50"]
        p99_ratio = summary[both]["p99"] / summary[idle]["p99"]
        bulk_ratio = summary[both]["bulk"] / summary[alone]["bulk"]
        extra_fifo = ""
        if scenario == "open loop" and "fifo" in summary and summary["fifo"]["n"]:
            extra_fifo = f"; FIFO (no classes) p50 {summary['fifo']['p50'] / summary[idle]['p50']:.1f}x idle"
        ok = p50_ratio <= P50_TARGET and p99_ratio <= P99_TARGET and bulk_ratio >= BULK_TARGET
        headlines[scenario] = {"p50_ratio": p50_ratio, "p99_ratio": p99_ratio, "bulk_ratio": bulk_ratio, "ok": ok}
        print(f"{scenario}: online p50 under bulk {p50_ratio:.2f}x idle (target <= {P50_TARGET}), p99 "
              f"{p99_ratio:.2f}x idle (target <= {P99_TARGET}), bulk with online traffic {bulk_ratio:.0%} of solo "
              f"(target >= {BULK_TARGET:.0%}){extra_fifo}: {'PASS' if ok else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "worker": ident, "summary": summary,
                                               "headlines": headlines, "phases": results}))
    return 0 if all(h["ok"] for h in headlines.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
