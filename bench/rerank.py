"""Rerank: query × documents jobs through embedq against sentence-transformers' CrossEncoder, same pairs.

    python bench/rerank.py                              # 200 jobs × 50 docs, BERT-base cross-encoder, CPU
    python bench/rerank.py --small --jobs 20 --docs 20  # quick: a MiniLM-L6-sized cross-encoder
    python bench/rerank.py --linear-kernel torch --malloc-default --cache-default   # worker at library defaults
    python bench/rerank.py --baseline-only --small      # CrossEncoder only (no Redis, no worker)

Runs, in this one process tree and on the same pairs:
  1. ``CrossEncoder(model).predict(pairs, batch_size=32)`` in-process over every pair (the reference),
  2. embedq: a private redis-server, one ``embedq worker`` serving the same folder, every job submitted
     with ``client.submit_rerank(query, docs)`` before any is collected (first submit -> last result).
The model is a randomly initialised cross-encoder of BERT-base's shape (bench/models.py; built once,
cached under --model-dir), or --model PATH. Scores are checked against the reference (max |Δ|, order).
The last line is the headline ratio embedq / CrossEncoder (pairs/s).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.models import build_cross_encoder, default_model_dir  # noqa: E402

CORPUS = ROOT / "data" / "corpus.jsonl"
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
TOLERANCE = 1e-5  # DESIGN.md fidelity bar, fp32
COUNTERS = ("batches", "items", "real_tokens", "padded_tokens", "inference_seconds", "results_seconds",
            "jobs_succeeded", "jobs_failed")
#: --malloc-default: glibc reads MALLOC_MMAP_THRESHOLD_ once, at exec, and *any* value in it (even 128 KiB, or
#: a non-number, which it takes as 0) fixes the threshold; glibc's default is a dynamic one. So the worker starts
#: without the variable and sets it only in os.environ afterwards, where workers/memory.py sees an operator's value
#: and leaves malloc alone.
GLIBC_MALLOC_WORKER = ("import os, runpy; os.environ['MALLOC_MMAP_THRESHOLD_'] = '131072'; "
                       "runpy.run_module('embedq', run_name='__main__', alter_sys=True)")
LIBRARY_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}  # oneDNN/ideep defaults

Job = tuple[str, list[str]]


def make_jobs(n_jobs: int, n_docs: int, seed: int) -> list[Job]:
    """Queries: short corpus texts (5-20 tokens); documents: a sample of the whole corpus (all lengths)."""
    with CORPUS.open() as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    queries = [r["text"] for r in rows if r["kind"] == "query"]
    texts = [r["text"] for r in rows]
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(queries), size=n_jobs, replace=n_jobs > len(queries))
    return [(queries[q], [texts[d] for d in rng.choice(len(texts), size=n_docs, replace=False)]) for q in picked]


def cpu_info() -> tuple[str, dict[str, bool]]:
    name, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return name, {f: f in flags for f in FLAGS}


def run_baseline(jobs: list[Job], model_path: str, device: str, threads: int) -> tuple[float, np.ndarray, int, int]:
    import torch
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(threads)
    model = CrossEncoder(model_path, device=device)
    pairs = [(q, d) for q, docs in jobs for d in docs]
    # Tokens of predict's own batches: it sorts by -(characters of query + document), unstable argsort as here.
    order = np.argsort([-(len(q) + len(d)) for q, d in pairs])
    real = padded = 0
    for i in range(0, len(order), 32):
        mask = model.preprocess([pairs[j] for j in order[i:i + 32]])["attention_mask"]
        real, padded = real + int(mask.sum()), padded + mask.numel()
    model.predict(pairs[:32], batch_size=32, show_progress_bar=False)  # warm-up
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    scores = model.predict(pairs, batch_size=32, show_progress_bar=False, convert_to_numpy=True)
    sync()
    return time.perf_counter() - t0, np.asarray(scores, dtype=np.float32).reshape(len(jobs), -1), real, padded


def worker_setup(args: argparse.Namespace) -> tuple[dict[str, str], list[str] | None, dict[str, str]]:
    """The worker's extra environment, its command (None: ``python -m embedq worker``) and a description."""
    extra, command = {}, None
    own = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if own:
        malloc = f"MALLOC_MMAP_THRESHOLD_={own} (caller's env)"
    elif args.malloc_default:
        malloc = "glibc default (dynamic mmap threshold)"
        command = [sys.executable, "-c", GLIBC_MALLOC_WORKER, "worker"]
    else:
        malloc = "mmap threshold fixed at 128 KiB (embedq memory policy mmap)"
    if args.cache_default:
        extra.update({k: os.environ.get(k, v) for k, v in LIBRARY_CACHES.items()})
    caches = ",".join(f"{k}={extra.get(k) or os.environ.get(k) or '64 (embedq)'}" for k in LIBRARY_CACHES)
    return extra, command, {"malloc": malloc, "caches": caches, "linear_kernel_asked": args.linear_kernel}


def run_embedq(jobs: list[Job], settings: Any, extra_env: dict[str, str], command: list[str] | None, log: Path,
               timeout: float) -> tuple[float, list[list[dict]], dict]:
    from embedq.producers.client import Client
    from embedq.producers.embedded import start_worker, stop_worker, wait_for_worker

    proc = start_worker(settings, log_path=log, extra_env=extra_env, command=command)
    client = Client(settings)
    try:
        wait_for_worker(client.app, proc, log_path=log)
        client.submit_rerank(jobs[0][0], jobs[0][1][:32]).result(timeout=600)  # warm-up
        before = _stats(client)
        t0 = time.perf_counter()
        handles = [client.submit_rerank(query, docs) for query, docs in jobs]
        results = [h.result(timeout=timeout) for h in handles]
        elapsed = time.perf_counter() - t0
        after = _stats(client)
    finally:
        stop_worker(proc)
        client.close()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    delta["linear_kernel"] = after.get("linear_kernel", "?")
    return elapsed, results, delta


def _stats(client: Any) -> dict:
    replies = client.workers(2)
    return next(iter(replies.values()))


def check(results: list[list[dict]], reference: np.ndarray) -> dict[str, Any]:
    """max |Δ| per pair, and each job's order: exact, or differing only among scores tied within TOLERANCE."""
    delta, exact, tied = 0.0, 0, 0
    for ranked, ref in zip(results, reference):
        got = np.full(len(ref), np.nan)
        for row in ranked:
            got[row["index"]] = row["score"]
        delta = max(delta, float(np.nanmax(np.abs(got - ref))) if not np.isnan(got).any() else float("inf"))
        order = [row["index"] for row in ranked]
        if order == np.argsort(-ref, kind="stable").tolist():  # CrossEncoder.rank: stable sort, descending
            exact += 1
        elif len(order) == len(ref) and all(ref[a] >= ref[b] - TOLERANCE for a, b in itertools.pairwise(order)):
            tied += 1
    return {"max_abs_delta": delta, "orders_exact": exact, "orders_within_ties": tied, "jobs": len(results),
            "ok": delta <= TOLERANCE and exact + tied == len(results)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=200, help="rerank jobs (one query each)")
    p.add_argument("--docs", type=int, default=50, help="documents per job")
    p.add_argument("--seed", type=int, default=0, help="seed of the query and document sample")
    p.add_argument("--model", help="an existing CrossEncoder folder (default: build one, see --model-dir)")
    p.add_argument("--model-dir", type=Path, help="where the random cross-encoder is built once "
                   f"(default {default_model_dir(False)}, with --small {default_model_dir(True)})")
    p.add_argument("--small", action="store_true", help="build a MiniLM-L6-sized cross-encoder (384 hidden, 6 layers)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads, baseline and worker (default: torch's own count)")
    p.add_argument("--linear-kernel", default="auto", choices=["auto", "torch", "onednn", "onnxruntime"],
                   help="EMBEDQ_LINEAR_KERNEL")
    p.add_argument("--malloc-default", action="store_true", help="worker keeps glibc's dynamic mmap threshold")
    p.add_argument("--cache-default", action="store_true", help="worker keeps oneDNN/ideep cache capacities (1024)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds to wait for each job's result")
    p.add_argument("--baseline-only", action="store_true", help="run only the CrossEncoder baseline")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    import torch

    threads = args.threads or torch.get_num_threads()
    if args.model:
        model_path = args.model
    else:
        model_dir = args.model_dir or default_model_dir(args.small)
        model_path = str(build_cross_encoder(model_dir, shape="minilm" if args.small else "bert-base"))
    jobs = make_jobs(args.jobs, args.docs, args.seed)
    n_pairs = sum(len(docs) for _, docs in jobs)
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-bench"
    logdir.mkdir(exist_ok=True)
    cpu, flags = cpu_info()
    extra_env, command, worker_desc = worker_setup(args)

    st_s, st_scores, st_real, st_padded = run_baseline(jobs, model_path, args.device, threads)
    eq_s = eq = checked = None
    if not args.baseline_only:
        from embedq.producers.embedded import RedisServer
        from embedq.settings import Settings

        with RedisServer() as redis_server:
            settings = Settings().model_copy(update={
                "broker_url": redis_server.url, "model": model_path, "queue": "embedq.bench-rerank",
                "device": args.device, "torch_threads": threads, "linear_kernel": args.linear_kernel})
            eq_s, results, eq = run_embedq(jobs, settings, extra_env, command, logdir / "worker-rerank.log",
                                           args.timeout)
        checked = check(results, st_scores)

    print(f"# embedq rerank  {time.strftime('%Y-%m-%d')}  {platform.node()}  {cpu}  cpus={os.cpu_count()}"
          f"  torch threads={threads}  device={args.device}  fp32")
    print("# cpu flags: " + "  ".join(f"{f}={'yes' if v else 'no'}" for f, v in flags.items()))
    print(f"# model {model_path}; {args.jobs} jobs × {args.docs} docs = {n_pairs} pairs, seed {args.seed}; "
          f"{st_real} real tokens")
    env = {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", *LIBRARY_CACHES)}
    print("# baseline: this process, PyTorch Linear kernels; " + (", ".join(f"{k}={v}" for k, v in env.items() if v)
                                                                 or "glibc malloc and cache sizes at their defaults"))
    if eq is not None:
        print(f"# worker: linear_kernel={eq['linear_kernel']} (asked {args.linear_kernel}); malloc: "
              f"{worker_desc['malloc']}; caches: {worker_desc['caches']}")
        print(f"# vs CrossEncoder: max |Δ| {checked['max_abs_delta']:.1e} (bar {TOLERANCE:.0e}); order equal in "
              f"{checked['orders_exact']}/{checked['jobs']} jobs, {checked['orders_within_ties']} more differ only "
              f"among scores tied within {TOLERANCE:.0e}: {'OK' if checked['ok'] else 'FAIL'}")
    rows = [("CrossEncoder.predict(bs=32)", st_s, st_real, 1 - st_real / st_padded)]
    if eq is not None:
        rows.append((f"embedq ({args.docs}-doc jobs, 1 worker, {eq['linear_kernel']})", eq_s, eq["real_tokens"],
                     1 - eq["real_tokens"] / max(eq["padded_tokens"], 1)))
    print(f"{'run':<44} {'pairs':>6} {'seconds':>8} {'pairs/s':>9} {'tokens/s':>9} {'padding':>8}")
    for name, secs, toks, pad in rows:
        print(f"{name:<44} {n_pairs:>6} {secs:>8.2f} {n_pairs / secs:>9.1f} {toks / secs:>9.0f} {pad:>8.1%}")
    ratio = (st_s / eq_s) if eq_s else None
    if eq is not None:
        print(f"embedq worker: {eq['batches']} micro-batches ({eq['items'] / max(eq['batches'], 1):.1f} pairs each), "
              f"{eq['inference_seconds']:.2f}s in the model, real tokens/s {eq['real_tokens'] / eq_s:.0f}, "
              f"padding {1 - eq['real_tokens'] / max(eq['padded_tokens'], 1):.1%}, jobs failed {eq['jobs_failed']}")
    if args.json:
        args.json.write_text(json.dumps({
            "host": platform.node(), "cpu": cpu, "cpu_flags": flags, "cpus": os.cpu_count(), "threads": threads,
            "device": args.device, "model": model_path, "jobs": args.jobs, "docs": args.docs, "pairs": n_pairs,
            "seed": args.seed, "baseline": {"seconds": st_s, "pairs_per_s": n_pairs / st_s, "real_tokens": st_real,
                                            "padded_tokens": st_padded},
            "embedq": None if eq is None else {"seconds": eq_s, "pairs_per_s": n_pairs / eq_s, **eq, **worker_desc},
            "check": checked, "ratio": ratio}, indent=2))
    if ratio is None:
        print("embedq / CrossEncoder (pairs/s): n/a (--baseline-only)")
    else:
        print(f"embedq / CrossEncoder (pairs/s): {ratio:.2f}x")
    if checked is not None and not checked["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
