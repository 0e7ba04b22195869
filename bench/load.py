"""Load: many concurrent producers on the online path, the worker's memory watched.

    python bench/load.py                                   # 200 producers, 10 s warm-up, 60 s measured
    python bench/load.py --producers 20 --duration 10 --warmup 3      # quick
    python bench/load.py --processes 4 --texts-per-job 4 --json load.json

Starts a private redis-server and one ``embedq worker``, then ``--producers`` closed-loop producers,
spread over ``--processes`` producer processes (spawned, threads in each, one ``Client`` per process):
each producer calls ``Client.embed([text], timeout=...)`` (the blocking online call) again and again,
texts drawn from the corpus (each producer cycling through it from its own offset). Throughput counts the
requests completed in the measured window; latency (submit to result) is over the requests submitted in it.
Every exception (type and ``code``) is counted, warm-up included. The worker's RSS (``/proc/<pid>/status``
VmRSS) is sampled once a second: start and end are the medians of the window's first and last 5 s, "flat"
means max / start <= 1.10.
The last line is the headline; the exit code is non-zero on any error or a failed RSS check.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402

CORPUS = ROOT / "data" / "corpus.jsonl"
MIB = 1024 * 1024
RSS_LIMIT = 1.10  # "flat within 10 %": max RSS of the measured window / its start
EDGE_S = 5.0  # seconds of RSS samples whose median is the window's start (end)


# -- producers (run in spawned processes) -----------------------------------------------------------
def _producer_thread(client: Client, texts: list[str], offset: int, per_job: int, timeout: float,
                     m0: float, m1: float, stop: Any, out: dict[str, Any]) -> None:
    n = len(texts)
    i = offset
    while not stop.is_set():
        t0 = time.monotonic()
        if t0 >= m1:
            break
        batch = [texts[(i + k) % n] for k in range(per_job)]
        i += per_job
        phase = "warmup" if t0 < m0 else "measured"
        try:
            vecs = client.embed(batch, timeout=timeout)
            if vecs.shape[0] != len(batch):
                raise RuntimeError(f"{vecs.shape[0]} vectors for {len(batch)} texts")
        except Exception as exc:
            key = (phase, type(exc).__name__, str(getattr(exc, "code", "")))
            out["errors"][key] += 1
            out["examples"].setdefault(key, str(exc)[:300])
            time.sleep(0.1)  # a broken broker must not turn this into a busy loop
            continue
        out["submit"].append(t0 - m0)  # seconds into the measured window (< 0: warm-up)
        out["latency"].append(time.monotonic() - t0)


def producer_process(index: int, first_producer: int, threads: int, total_producers: int, settings: Settings,
                     texts: list[str], per_job: int, timeout: float, ready_q: Any, result_q: Any, go: Any,
                     start_at: Any, stop: Any) -> None:
    """One producer process: ``threads`` closed-loop producers sharing one Client."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop (its ``stop`` event)
    try:
        client = Client(settings)
        cpu: list[float] = []
        outs = [{"submit": [], "latency": [],
                 "errors": collections.Counter(), "examples": {}} for _ in range(threads)]
        ready_q.put((index, None))
    except Exception:
        ready_q.put((index, traceback.format_exc()))
        return
    try:
        if not go.wait(600) or stop.is_set():
            return
        m0, m1 = start_at[0], start_at[1]  # the measured window, on the (system-wide) monotonic clock
        stride = max(len(texts) // total_producers, 1)
        workers = [threading.Thread(target=_producer_thread, daemon=True,
                                    args=(client, texts, (first_producer + t) * stride, per_job, timeout, m0, m1,
                                          stop, outs[t]))
                   for t in range(threads)]
        for w in workers:
            w.start()
        for mark in (m0, m1):  # this process's CPU time in the measured window
            stop.wait(max(0.0, mark - time.monotonic()))
            cpu.append(time.process_time())
        for w in workers:
            w.join()
    finally:
        errors: collections.Counter = collections.Counter()
        examples: dict = {}
        for o in outs:
            errors.update(o["errors"])
            for k, v in o["examples"].items():
                examples.setdefault(k, v)
        result_q.put({
            "index": index,
            "submit": [s for o in outs for s in o["submit"]],
            "latency": [s for o in outs for s in o["latency"]],
            "cpu_s": cpu[1] - cpu[0] if len(cpu) == 2 else None,
            "errors": [(list(k), c, examples[k]) for k, c in errors.items()],
        })
        with contextlib.suppress(Exception):
            client.close()


# -- the parent: worker RSS, machine, orchestration, report -----------------------------------------
def read_rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in bytes, from /proc (psutil where there is no /proc)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except FileNotFoundError:
        import psutil

        rss = psutil.Process(pid).memory_info().rss
        return rss, rss


class RssSampler(threading.Thread):
    """Samples the worker's RSS every ``every`` seconds: a list of (monotonic time, bytes)."""

    def __init__(self, pid: int, every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.every = every
        self.samples: list[tuple[float, int]] = []
        self.hwm = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            with contextlib.suppress(OSError, ValueError, KeyError):
                rss, self.hwm = read_rss(self.pid)
                self.samples.append((time.monotonic(), rss))
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join()


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` (/proc/<pid>/stat), None where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def cpu_model() -> str:
    return cpu_summary()


def load_texts(path: Path) -> list[str]:
    with path.open() as fh:
        texts = [json.loads(line)["text"] for line in fh if line.strip()]
    if not texts:
        raise SystemExit(f"no texts in {path}")
    return texts


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def worker_counters(client: Client, pid: int) -> dict[str, Any] | None:
    with contextlib.suppress(Exception):
        for node, stats in client.workers(3).items():
            if f"-{pid}@" in node:
                return stats
    return None


def rss_summary(samples: list[tuple[float, int]], m0: float, m1: float) -> dict[str, Any]:
    window = [(t, r) for t, r in samples if m0 <= t <= m1 + 0.5]
    if not window:
        return {"samples": 0}
    first = [r for t, r in window if t < m0 + EDGE_S] or [window[0][1]]
    last = [r for t, r in window if t >= m1 - EDGE_S] or [window[-1][1]]
    start, end, peak = statistics.median(first), statistics.median(last), max(r for _, r in window)
    return {"samples": len(window), "start": start, "end": end, "max": peak, "min": min(r for _, r in window),
            "drift": end / start - 1, "max_over_start": peak / start, "pass": peak / start <= RSS_LIMIT}


def run(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    processes = max(1, min(args.processes, args.producers))
    counts = split(args.producers, processes)
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-bench"
    logdir.mkdir(exist_ok=True)
    log = logdir / "worker-load.log"
    ctx = mp.get_context("spawn")
    stop, go = ctx.Event(), ctx.Event()
    ready_q, result_q = ctx.Queue(), ctx.Queue()
    window = ctx.Array("d", 2)
    procs: list[Any] = []
    results: list[dict[str, Any]] = []
    out: dict[str, Any] = {"interrupted": False, "worker_died": None}
    sampler: RssSampler | None = None

    def collect(deadline: float) -> None:
        while len(results) < len(procs) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                results.append(result_q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic()))))

    with RedisServer() as redis_server:
        extra = {"linear_kernel": args.linear_kernel} if args.linear_kernel else {}
        settings = Settings(broker_url=redis_server.url, queue="embedq.load", device=args.device, dtype=args.dtype,
                            **extra)
        worker = start_worker(settings, log_path=log)
        client = Client(settings)
        try:
            print(f"[load] waiting for the worker (pid {worker.pid}, log {log})", file=sys.stderr)
            wait_for_worker(client.app, worker, log_path=log)
            client.embed(["warm up"], timeout=300)
            sampler = RssSampler(worker.pid)
            sampler.start()
            first = 0
            for i, n in enumerate(counts):
                p = ctx.Process(target=producer_process, name=f"load-producers-{i}", daemon=True,
                                args=(i, first, n, args.producers, settings, texts, args.texts_per_job,
                                      args.timeout, ready_q, result_q, go, window, stop))
                p.start()
                procs.append(p)
                first += n
            print(f"[load] starting {args.producers} producers in {processes} processes", file=sys.stderr)
            for _ in procs:
                index, failure = ready_q.get(timeout=300)
                if failure:
                    raise SystemExit(f"producer process {index} failed to start:\n{failure}")
            t_go = time.monotonic()
            m0, m1 = t_go + args.warmup, t_go + args.warmup + args.duration
            window[0], window[1] = m0, m1
            out.update(t_go=t_go, m0=m0, m1=m1)
            go.set()
            print(f"[load] warm-up {args.warmup:g} s, then {args.duration:g} s measured", file=sys.stderr)
            marks = {m0: "before", m1: "after"}
            for mark in (m0, m1):
                while time.monotonic() < mark and worker.poll() is None:
                    time.sleep(min(0.2, max(0.0, mark - time.monotonic())))
                if worker.poll() is not None:
                    out["worker_died"] = worker.returncode
                    break
                out[f"cpu_{marks[mark]}"] = {"worker": cpu_seconds(worker.pid),
                                             "redis": cpu_seconds(redis_server.proc.pid)}
                out[marks[mark]] = worker_counters(client, worker.pid)
            if out["worker_died"] is not None:
                print(f"[load] the worker exited with code {worker.returncode}", file=sys.stderr)
                stop.set()
                collect(time.monotonic() + 15)
            else:
                print("[load] window over, collecting", file=sys.stderr)
                collect(time.monotonic() + args.timeout + 60)
        except KeyboardInterrupt:
            out["interrupted"] = True
            print("[load] interrupted: stopping producers, worker and Redis", file=sys.stderr)
        finally:
            # Clean up with Ctrl-C and SIGTERM ignored, so a second one cannot leave the worker or Redis behind.
            previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
            stop.set()
            go.set()  # wakes processes still waiting for the start
            grace = 3.0 if out["interrupted"] else 15.0  # interrupted: their figures are not wanted
            collect(time.monotonic() + grace)
            deadline = time.monotonic() + grace
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
            if sampler is not None:
                sampler.stop()
                out["hwm"] = sampler.hwm
            stop_worker(worker)
            client.close()
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    out.update(results=results, processes=processes, counts=counts,
               samples=sampler.samples if sampler else [], log=str(log))
    return out


def summarize(args: argparse.Namespace, texts: list[str], run_out: dict[str, Any]) -> dict[str, Any]:
    results = run_out["results"]
    m0, m1 = run_out["m0"], run_out["m1"]
    all_latency = np.array([x for r in results for x in r["latency"]], dtype=np.float64)
    submit = np.array([x for r in results for x in r["submit"]], dtype=np.float64)
    done = submit + all_latency  # completion, seconds into the window
    latency = all_latency[submit >= 0]  # of the requests submitted in the window
    completed = int(((done >= 0) & (done < args.duration)).sum())  # completed in the window
    errors: collections.Counter = collections.Counter()
    examples: dict[tuple[str, ...], str] = {}
    for r in results:
        for key, count, example in r["errors"]:
            errors[tuple(key)] += count
            examples.setdefault(tuple(key), example)
    measured_errors = sum(c for k, c in errors.items() if k[0] == "measured")
    total_errors = sum(errors.values())
    missing = len(run_out["counts"]) - len(results)
    n = len(latency)
    in_window = done[(done >= 0) & (done < args.duration)]
    per_second = np.bincount(in_window.astype(int), minlength=int(args.duration))
    pct = {f"p{q}": float(np.percentile(latency, q) * 1e3) if n else None for q in (50, 90, 99)}
    before, after = run_out.get("before"), run_out.get("after")
    worker = None
    if before and after:
        d = {k: after[k] - before[k] for k in ("batches", "items", "jobs_succeeded", "jobs_failed",
                                                 "inference_seconds", "real_tokens", "padded_tokens")}
        d["texts_per_batch"] = d["items"] / d["batches"] if d["batches"] else None
        d["busy"] = d["inference_seconds"] / args.duration
        d["linear_kernel"] = after.get("linear_kernel")
        d["peak_held_messages"] = after.get("peak_held_messages")
        worker = d
    cpu = {}
    b, a = run_out.get("cpu_before") or {}, run_out.get("cpu_after") or {}
    for name in ("worker", "redis"):
        cpu[name] = a[name] - b[name] if a.get(name) is not None and b.get(name) is not None else None
    producer_cpu = [r["cpu_s"] for r in results if r.get("cpu_s") is not None]
    cpu["producers"] = sum(producer_cpu) if len(producer_cpu) == len(results) and results else None
    rss = rss_summary(run_out["samples"], m0, m1)
    rss["after_model_load"] = run_out["samples"][0][1] if run_out["samples"] else None
    rss["hwm"] = run_out.get("hwm")
    rss["series_mib"] = [(round(t - m0, 1), round(r / MIB, 1)) for t, r in run_out["samples"]]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": platform.node(), "cpu": cpu_model(),
        "cores": os.cpu_count(), "python": platform.python_version(), "device": args.device, "dtype": args.dtype,
        "producers": args.producers, "processes": run_out["processes"], "threads_per_process": run_out["counts"],
        "texts_per_job": args.texts_per_job, "warmup_s": args.warmup, "duration_s": args.duration,
        "timeout_s": args.timeout, "corpus": str(args.corpus), "corpus_texts": len(texts),
        "warmup_requests": int((submit < 0).sum()),
        "warmup_completed": int(((done >= -args.warmup) & (done < 0)).sum()),
        "requests": completed, "texts": completed * args.texts_per_job, "requests_submitted": n,
        "errors": total_errors, "measured_errors": measured_errors,
        "errors_by_kind": [{"phase": k[0], "type": k[1], "code": k[2], "count": c, "example": examples[k]}
                           for k, c in sorted(errors.items())],
        "missing_processes": missing,
        "requests_per_s": completed / args.duration, "texts_per_s": completed * args.texts_per_job / args.duration,
        "per_second": {"min": int(per_second.min()), "median": float(np.median(per_second)),
                       "max": int(per_second.max())} if len(per_second) else None,
        "per_second_series": per_second.tolist(),
        "latency_ms": {**pct, "max": float(latency.max() * 1e3) if n else None,
                       "mean": float(latency.mean() * 1e3) if n else None},
        "cpu_s": cpu, "rss": rss, "worker": worker, "worker_died": run_out["worker_died"], "worker_log": run_out["log"],
    }


def report(s: dict[str, Any]) -> list[str]:
    lat, rss, w = s["latency_ms"], s["rss"], s["worker"]

    def ms(v: float | None) -> str:
        return f"{v:>8.1f}" if v is not None else f"{'-':>8}"

    threads = sorted(set(s["threads_per_process"]))
    lines = [
        f"# embedq load  {s['date']}  {s['host']}  {s['cpu']}  cores={s['cores']}  device={s['device']}"
        f"  dtype={s['dtype']}",
        f"# {s['producers']} closed-loop producers in {s['processes']} processes "
        f"({'/'.join(map(str, threads))} threads each), Client.embed of {s['texts_per_job']} text(s), "
        f"timeout {s['timeout_s']:g} s; {s['corpus_texts']} corpus texts; warm-up {s['warmup_s']:g} s, "
        f"measured {s['duration_s']:g} s",
        f"# completed: requests finished in the window; latency: submit to result, of the "
        f"{s['requests_submitted']} requests submitted in the measured window",
        f"{'window':<10} {'completed':>9} {'errors':>7} {'req/s':>8} {'texts/s':>8} "
        f"{'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}",
        f"{'warm-up':<10} {s['warmup_completed']:>9} {s['errors'] - s['measured_errors']:>7} "
        f"{s['warmup_completed'] / s['warmup_s'] if s['warmup_s'] else 0:>8.1f} "
        f"{s['warmup_completed'] * s['texts_per_job'] / s['warmup_s'] if s['warmup_s'] else 0:>8.1f}",
        f"{'measured':<10} {s['requests']:>9} {s['measured_errors']:>7} {s['requests_per_s']:>8.1f} "
        f"{s['texts_per_s']:>8.1f} {ms(lat['p50'])} {ms(lat['p90'])} {ms(lat['p99'])} {ms(lat['max'])}",
    ]
    if s["per_second"]:
        ps = s["per_second"]
        lines.append(f"completions per second in the window: min {ps['min']}, median {ps['median']:g}, "
                     f"max {ps['max']}; mean latency {lat['mean']:.1f} ms" if lat["mean"] is not None else "")
    if w:
        tpb = f"{w['texts_per_batch']:.1f}" if w["texts_per_batch"] else "-"
        lines.append(f"worker in the window: {w['jobs_succeeded']} jobs, {w['batches']} micro-batches "
                     f"({tpb} texts each), {w['inference_seconds']:.1f} s in the model, "
                     f"kernel {w['linear_kernel']}, peak held messages {w['peak_held_messages']}")
    cpu = s["cpu_s"]
    if any(v is not None for v in cpu.values()):
        parts = [f"{k} {v:.1f} s ({v / s['duration_s']:.2f} cores)" for k, v in cpu.items() if v is not None]
        lines.append(f"CPU in the window ({s['cores']} cores): " + ", ".join(parts))
    if rss.get("samples"):
        verdict = "PASS" if rss["pass"] else "FAIL"
        lines.append(f"worker RSS (MiB): after model load {rss['after_model_load'] / MIB:.1f}; window start "
                     f"{rss['start'] / MIB:.1f}, end {rss['end'] / MIB:.1f}, min {rss['min'] / MIB:.1f}, max "
                     f"{rss['max'] / MIB:.1f} ({rss['samples']} samples; VmHWM {(rss['hwm'] or 0) / MIB:.1f})")
        lines.append(f"worker RSS drift end/start {rss['drift']:+.1%}, max/start {rss['max_over_start'] - 1:+.1%} "
                     f"(limit +{RSS_LIMIT - 1:.0%}): {verdict}")
    else:
        lines.append("worker RSS: no samples in the window: FAIL")
    if s["worker_died"] is not None:
        lines.append(f"the worker EXITED with code {s['worker_died']} (log: {s['worker_log']})")
    if s["missing_processes"]:
        lines.append(f"{s['missing_processes']} producer process(es) sent no results (their requests are missing)")
    for e in s["errors_by_kind"]:
        lines.append(f"error: {e['count']} x {e['type']} [{e['code'] or '-'}] in {e['phase']}: {e['example']}")
    drift = f"{rss['drift'] * 100:+.1f} %" if rss.get("samples") else "n/a"
    p50 = f"{lat['p50']:.0f}" if lat["p50"] is not None else "-"
    p99 = f"{lat['p99']:.0f}" if lat["p99"] is not None else "-"
    lines.append(f"load: {s['producers']} producers × {s['duration_s']:g} s: {s['errors']} errors, p50 {p50} ms, "
                 f"p99 {p99} ms, RSS drift {drift}: {'PASS' if passed(s) else 'FAIL'}")
    return [line for line in lines if line]


def passed(s: dict[str, Any]) -> bool:
    return (s["errors"] == 0 and not s["missing_processes"] and s["worker_died"] is None
            and bool(s["rss"].get("pass")) and s["requests_submitted"] > 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--producers", type=int, default=200, help="concurrent closed-loop producers")
    p.add_argument("--processes", type=int, default=8, help="producer processes the producers are spread over")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of measured load")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the measured window")
    p.add_argument("--texts-per-job", type=int, default=1, help="texts per Client.embed call")
    p.add_argument("--timeout", type=float, default=60.0, help="Client.embed timeout (a timeout is an error)")
    p.add_argument("--corpus", type=Path, default=CORPUS, help="JSONL with a 'text' field per line")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--linear-kernel", choices=["auto", "onednn", "torch", "onnxruntime"],
                   help="the worker's runtime (default: settings)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="machine-readable summary: to PATH, or alone on stdout (the table then goes to stderr)")
    args = p.parse_args()
    if args.producers < 1 or args.processes < 1 or args.texts_per_job < 1 or args.duration <= 0 or args.warmup < 0:
        p.error("--producers, --processes, --texts-per-job and --duration must be positive, --warmup >= 0")

    texts = load_texts(args.corpus)
    signal.signal(signal.SIGTERM, _interrupt)
    run_out = run(args, texts)
    if run_out["interrupted"]:
        return 130
    summary = summarize(args, texts, run_out)
    lines = report(summary)
    table_out = sys.stderr if args.json == "-" else sys.stdout
    print("\n".join(lines), file=table_out)
    if args.json == "-":
        print(json.dumps(summary, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if passed(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
