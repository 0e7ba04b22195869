"""Pick the token budget: the backend and scheduler in-process, swept over micro-batch budgets.

    python bench/budget.py                               # CPU: 1024, 2048, 4096, 8192 on 2,000 texts
    python bench/budget.py --device cuda:0 --dtype float16 --budgets 4096,8192,16384,32768,65536
    python bench/budget.py --profile                     # where one forward pass spends its time

No Redis or Celery: this isolates what the budget does to the model's speed (padded tokens/s) and to
padding. Each budget runs twice, interleaved, and the faster pass is reported, which damps the noise
of shared machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedq.backends import load_backend  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.batching import Scheduler  # noqa: E402

CORPUS = ROOT / "data" / "corpus.jsonl"


def run(backend, ids: list[list[int]], budget: int, sync) -> tuple[float, int, int]:
    """(seconds, padded tokens, micro-batches) for all texts under ``budget``."""
    sched = Scheduler(max_tokens=budget, max_items=256, padded=backend.is_padded)
    for i, row in enumerate(ids):
        sched.add(i, len(row))
    padded = passes = 0
    t0 = time.perf_counter()
    while len(sched):
        batch = [ids[item.key] for item in sched.next_batch()]
        padded += max(map(len, batch)) * len(batch)
        passes += 1
        backend.embed(batch)
    sync()
    return time.perf_counter() - t0, padded, passes


def profile(backend, budget: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    length = min(256, backend.info.max_seq_length)
    batch = [[101] + [2000 + i for i in range(length - 2)] + [102]] * max(1, budget // length)
    batch[0] = batch[0][: length // 2]  # one shorter row, so the batch is padded as in service
    for _ in range(3):
        backend.embed(batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if backend.info.device.startswith("cuda") else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(5):
            backend.embed(batch)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000, help="texts from the shared corpus")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--linear-kernel", default="auto", choices=["auto", "onednn", "torch"])
    p.add_argument("--budgets", default="1024,2048,4096,8192", help="comma-separated token budgets")
    p.add_argument("--profile", action="store_true", help="print an op profile of one forward pass instead")
    args = p.parse_args()

    backend = load_backend("all-MiniLM-L6-v2", device=args.device, dtype=args.dtype,
                           linear_kernel=args.linear_kernel)
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.profile:
        profile(backend, budgets[0])
        return 0
    with CORPUS.open() as fh:
        texts = [json.loads(line)["text"] for _, line in zip(range(args.n), fh)]
    ids = backend.tokenize(texts).ids
    real = sum(map(len, ids))
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    run(backend, ids, budgets[0], sync)  # warm-up
    best: dict[int, tuple[float, int, int]] = {}
    for _ in range(2):
        for budget in budgets:
            result = run(backend, ids, budget, sync)
            if budget not in best or result[0] < best[budget][0]:
                best[budget] = result
    print(f"# embedq budget sweep  {time.strftime('%Y-%m-%d')}  {platform.node()}  "
          f"{cpu_summary()}  cpus={os.cpu_count()}  "
          f"device={args.device}  dtype={args.dtype}  kernel={backend.info.linear_kernel}  "
          f"{len(texts)} texts, {real} real tokens")
    print(f"{'budget':>7} {'batches':>8} {'seconds':>8} {'texts/s':>8} {'padded tok/s':>13} {'padding':>8}")
    for budget in budgets:
        secs, padded, passes = best[budget]
        print(f"{budget:>7} {passes:>8} {secs:>8.2f} {len(texts) / secs:>8.1f} {padded / secs:>13.0f} "
              f"{1 - real / padded:>8.1%}")
    fastest = min(budgets, key=lambda b: best[b][0])
    print(f"fastest budget: {fastest} ({len(texts) / best[fastest][0]:.1f} texts/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
