"""Overload at the HTTP gateway (issue 50, acceptance c): every request answered within its p99 bar or refused with a
fast 429, no 5xx, memory flat.

    python bench/overload.py                                               # 200 clients, 30 s warm-up, 60 s measured
    python bench/overload.py --clients 20 --seconds 10 --warmup 5          # quick
    python bench/overload.py --code /path/to/other/checkout                # the gateway and worker from other code

Starts a private redis-server, one ``embedq worker`` and one ``embedq serve`` (both from ``--code``, default this
checkout; ``EMBEDQ_*`` variables of this shell reach both), then ``--clients`` keep-alive HTTP/1.1 clients in one
asyncio process (raw streams: the load generator shares the machine, so it stays lean; its own CPU is reported).
Each client sends ``POST /v1/embeddings`` (base64, as the openai SDK asks) again and again: one text, or with
``--large-share`` probability ``--large-inputs`` texts; each client has its own bearer token (its identity at the
gateway; ``--identities`` fewer shares them). With ``--abandon-share`` probability a request is abandoned: its
client closes the connection after a random 0.05-2 s unless answered before, and reconnects. A 429 is honoured as
the openai SDK does: the client sleeps Retry-After (times a jitter of 0.5-1.5) and sends the same request again
(each attempt counts). Requests sent in the measured window count; latency is send to last byte. The worker's and
the gateway's RSS are sampled every second (start and end: medians of the window's first and last 5 s).
The last line is the headline; the exit code is non-zero on a 5xx, a transport error or a bar missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, free_port, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402

MIB = 1024 * 1024
KEEP_ALIVE = 4.0  # seconds a client reuses an idle connection (uvicorn closes them after 5)
P99_BAR, REFUSAL_BAR, RSS_BAR = 5.0, 0.100, 1.10


def texts_from(corpus: str | None, n: int = 4000) -> list[str]:
    """The corpus's texts (``{"text": ...}`` per line), else deterministic sample texts of 5 to 300 words."""
    if corpus:
        with open(corpus) as fh:
            return [json.loads(line)["text"] for line in fh][:n]
    rng = random.Random(50)
    words = [f"w{i}" for i in range(5000)]
    return [" ".join(rng.choice(words) for _ in range(rng.choice((5, 12, 40, 120, 300)))) for _ in range(n)]


def rss(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MIB
    except OSError:
        pass
    return float("nan")


class Stats:
    def __init__(self) -> None:
        self.answered: dict[str, list[float]] = {"small": [], "large": []}
        self.refused: list[float] = []
        self.retry_after: list[float] = []
        self.abandoned = 0
        self.server_errors: dict[int, int] = {}
        self.other: dict[str, int] = {}
        self.window = (0.0, 0.0)
        self.in_flight = 0  # counted requests not yet ended (those still waiting when the run stops are reported)

    def counts(self, t0: float) -> bool:
        return self.window[0] <= t0 < self.window[1]


async def request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes,
                  ) -> tuple[int, dict[str, str]]:
    writer.write(head + body)
    await writer.drain()
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("closed by the gateway")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers


async def one_client(i: int, port: int, args: argparse.Namespace, texts: list[str], stats: Stats, stop: float) -> None:
    rng = random.Random(i)
    token = f"client-{i % (args.identities or args.clients)}"
    conn = None
    used = 0.0
    await asyncio.sleep(rng.random())  # clients start over a second, not in one burst
    while time.monotonic() < stop:
        large = rng.random() < args.large_share
        n = args.large_inputs if large else 1
        start = rng.randrange(len(texts))
        body = json.dumps({"input": [texts[(start + k) % len(texts)] for k in range(n)], "model": "m",
                           "encoding_format": "base64"}).encode()
        head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        abandon = rng.random() < args.abandon_share
        while time.monotonic() < stop:  # the same request again after a 429
            if conn is not None and time.monotonic() - used > KEEP_ALIVE:  # the server closes idle connections
                conn[1].close()
                conn = None
            if conn is None:
                conn = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.monotonic()
            counted = stats.counts(t0)
            stats.in_flight += counted
            try:
                call = request(*conn, head, body)
                status, headers = await asyncio.wait_for(call, rng.uniform(0.05, 2.0) if abandon else args.timeout)
            except asyncio.TimeoutError:
                conn[1].close()
                conn = None
                if stats.counts(t0):
                    if abandon:
                        stats.abandoned += 1
                    else:
                        stats.other["timeout"] = stats.other.get("timeout", 0) + 1
                break
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
                conn = None
                if stats.counts(t0):
                    stats.other[type(exc).__name__] = stats.other.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.1)
                break
            finally:
                stats.in_flight -= counted
            used = time.monotonic()
            took = used - t0
            if status == 429:
                wait = float(headers.get("retry-after", "1"))
                if counted:
                    stats.refused.append(took)
                    stats.retry_after.append(wait)
                await asyncio.sleep(wait * rng.uniform(0.5, 1.5))
                continue
            if counted:
                if status == 200:
                    stats.answered["large" if large else "small"].append(took)
                elif status >= 500:
                    stats.server_errors[status] = stats.server_errors.get(status, 0) + 1
                else:
                    stats.other[str(status)] = stats.other.get(str(status), 0) + 1
            break
    if conn is not None:
        conn[1].close()


def start_gateway(redis_url: str, queue: str, code: str, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, EMBEDQ_BROKER_URL=redis_url, EMBEDQ_QUEUE=queue, PYTHONPATH=code)
    proc = subprocess.Popen([sys.executable, "-m", "embedq", "serve", "--port", str(port), "--loglevel", "warning"],
                            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            import socket

            with socket.create_connection(("127.0.0.1", port), 0.5) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                if b" 200 " in s.recv(64):
                    return proc, port
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the gateway did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def prewarm(port: int, texts: list[str], n: int, settings: Settings) -> None:
    """Two large requests, then a wait (at most 20 s) until the worker's record shows a measured throughput (a
    worker whose record has none, older code, is not waited for longer): what a gateway in service has."""
    import threading
    import urllib.request

    body = json.dumps({"input": texts[:n], "model": "m", "encoding_format": "base64"}).encode()

    def send() -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", data=body,
                                     headers={"Content-Type": "application/json"})
        with contextlib.suppress(OSError):
            urllib.request.urlopen(req, timeout=600).read()

    for _ in range(2):
        threading.Thread(target=send, daemon=True).start()
    from embedq import monitor

    with Client(settings) as client:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            ready = monitor.serving(monitor.live_workers(client.redis()), settings.queue_name).ready
            if ready and ready[0].get("throughput"):
                return
            time.sleep(0.5)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (
        values[0] if values else float("nan"))


async def sample_rss(pids: dict[str, int], out: dict[str, list[tuple[float, float]]], stop: float) -> None:
    while time.monotonic() < stop:
        for name, pid in pids.items():
            out[name].append((time.monotonic(), rss(pid)))
        await asyncio.sleep(1.0)


def rss_row(samples: list[tuple[float, float]], m0: float, m1: float) -> tuple[float, float, float]:
    window = [v for t, v in samples if m0 <= t <= m1]
    first = [v for t, v in samples if m0 <= t <= m0 + 5] or window[:1]
    last = [v for t, v in samples if m1 - 5 <= t <= m1] or window[-1:]
    return statistics.median(first), max(window), statistics.median(last)


async def drive(args: argparse.Namespace, port: int, pids: dict[str, int], texts: list[str]) -> tuple[Stats, dict]:
    stats = Stats()
    now = time.monotonic()
    m0, m1 = now + args.warmup, now + args.warmup + args.seconds
    stats.window = (m0, m1)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
    sampler = asyncio.ensure_future(sample_rss(pids, samples, m1 + 0.5))
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    clients = asyncio.gather(*(one_client(i, port, args, texts, stats, m1) for i in range(args.clients)))
    # requests sent in the window may end after it, within a grace; those still waiting then are counted
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(clients, m1 + args.grace - time.monotonic())
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    sampler.cancel()
    wall = time.monotonic() - now
    cpu = (cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime) / wall
    return stats, {"rss": {name: rss_row(s, m0, m1) for name, s in samples.items()}, "generator_cpu": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    ap.add_argument("--warmup", type=float, default=30.0, help="load before the window (the worker's throughput is "
                    "measured, the first burst drains)")
    ap.add_argument("--large-share", type=float, default=0.10)
    ap.add_argument("--large-inputs", type=int, default=512)
    ap.add_argument("--abandon-share", type=float, default=0.05)
    ap.add_argument("--identities", type=int, default=0, help="bearer tokens among the clients (0: one each)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a client waits for an answer")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds after the window the requests sent in it may "
                    "still end; those still waiting then are reported (and fail the run)")
    ap.add_argument("--corpus", default=str(ROOT / "data" / "corpus.jsonl"),
                    help="a JSONL file of {\"text\": ...} (default: data/corpus.jsonl; '' for generated sample texts)")
    ap.add_argument("--code", default=str(ROOT), help="PYTHONPATH of the gateway and the worker")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    texts = texts_from(args.corpus)
    logs = Path(tempfile.mkdtemp(prefix="embedq-overload-"))
    with RedisServer() as redis_server:
        settings = Settings(broker_url=redis_server.url, queue=f"embedq.overload.{os.getpid()}")
        worker = start_worker(settings, log_path=logs / "worker.log", extra_env={"PYTHONPATH": args.code})
        gateway = None
        try:
            with Client(settings) as client:
                wait_for_worker(client.app, worker, timeout=600, log_path=logs / "worker.log")
            gateway, port = start_gateway(redis_server.url, settings.queue_name, args.code, logs / "gateway.log")
            prewarm(port, texts, args.large_inputs, settings)
            stats, extra = asyncio.run(drive(args, port, {"worker": worker.pid, "gateway": gateway.pid}, texts))
        finally:
            if gateway is not None:
                gateway.terminate()
                gateway.wait(10)
            stop_worker(worker)
    return report(args, stats, extra, logs)


def report(args: argparse.Namespace, stats: Stats, extra: dict, logs: Path) -> int:
    small, large = stats.answered["small"], stats.answered["large"]
    every = small + large
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {dt.date.today()}; code "
          f"{args.code}; {args.clients} clients, {args.seconds:g} s measured after {args.warmup:g} s, large "
          f"{args.large_share:.0%} x {args.large_inputs}, abandoned {args.abandon_share:.0%}; logs {logs}")
    print(f"{'what':<26}{'count':>8}{'p50':>10}{'p99':>10}{'max':>10}")
    for name, values in (("answered, 1 text", small), (f"answered, {args.large_inputs} texts", large),
                         ("answered, all", every), ("refused 429 (time to it)", stats.refused)):
        print(f"{name:<26}{len(values):>8}{pct(values, 50):>10.3f}{pct(values, 99):>10.3f}"
              f"{max(values, default=float('nan')):>10.3f}")
    print(f"{'Retry-After given (s)':<26}{len(stats.retry_after):>8}{pct(stats.retry_after, 50):>10.0f}"
          f"{pct(stats.retry_after, 99):>10.0f}")
    print(f"still waiting {args.grace:g} s after the window: {stats.in_flight}")
    print(f"abandoned {stats.abandoned}; 5xx {sum(stats.server_errors.values())} {stats.server_errors}; "
          f"other {stats.other}")
    for name, (start, peak, end) in extra["rss"].items():
        print(f"{name} RSS MiB: start {start:.0f}, peak {peak:.0f}, end {end:.0f} (end/start {end / start:.3f}, "
              f"peak/start {peak / start:.3f})")
    print(f"load generator CPU: {extra['generator_cpu']:.2f} cores")
    p99 = pct(every, 99)
    refusal = pct(stats.refused, 99) if stats.refused else 0.0
    flat = all(end / start <= RSS_BAR for start, _peak, end in extra["rss"].values())
    errors = sum(stats.server_errors.values()) + sum(stats.other.values()) + stats.in_flight
    ok = p99 <= P99_BAR and refusal <= REFUSAL_BAR and not errors and flat
    if args.json:
        Path(args.json).write_text(json.dumps({"answered": {"small": small, "large": large}, "refused": stats.refused,
                                               "abandoned": stats.abandoned, "server_errors": stats.server_errors,
                                               "other": stats.other, **extra}, default=str))
    print(f"{'PASS' if ok else 'FAIL'}: answered {len(every)} p99 {p99:.2f} s (bar {P99_BAR:g}), refused "
          f"{len(stats.refused)} p99 {refusal * 1000:.0f} ms (bar {REFUSAL_BAR * 1000:.0f}), 5xx "
          f"{sum(stats.server_errors.values())}, memory {'flat' if flat else 'NOT flat'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
