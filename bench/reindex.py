"""Re-indexing a changed corpus and indexing one with repeated texts (issue 57 b, c, e), against full runs.

    python bench/reindex.py                 # CPU fp32, MiniLM, the 4,000 corpus texts
    python bench/reindex.py --device cuda:0 --dtype float16

On one private redis-server and one warm worker, each ``embedq index`` as its own process (as a user runs it):
  1. full:     the first version (the corpus: 4,000 texts) into a fresh Parquet output;
  2. reindex:  the second version (10 % of the texts edited, 5 % of the ids removed, 5 % new: tests/reindex.py) into
               the same output with ``--prune``;
  3. fresh:    the second version into a fresh output (what a re-index costs without content hashes);
  4. repeats:  4,000 rows of which 30 % repeat a text of the other 70 % (distinct texts from the corpus), fresh output;
  5. distinct: 4,000 distinct texts (the first version's) again, fresh output: the run 4 is compared with.
For each: wall seconds and the items the worker's model ran (its ``items`` counter). The headline ratios: reindex /
fresh seconds (target <= 0.25) and repeats / distinct seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from reindex import versions, write_jsonl  # noqa: E402

from bench.index import _index_once  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-bench"
    logdir.mkdir(exist_ok=True)
    first, second = versions()
    distinct = [text for _, text in first]
    rng = random.Random(57)
    kept = distinct[: int(len(distinct) * 0.7)]
    repeated = kept + [rng.choice(kept) for _ in range(len(distinct) - len(kept))]
    rng.shuffle(repeated)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="embedq-bench-reindex-") as tmp_name, RedisServer() as redis_server:
        tmp = Path(tmp_name)
        settings = Settings().model_copy(update={"device": args.device, "dtype": args.dtype,
                                                 "broker_url": redis_server.url})
        log = logdir / "worker-reindex.log"
        proc = start_worker(settings, log_path=log)
        client = Client(settings)
        try:
            wait_for_worker(client.app, proc, log_path=log)
            client.embed(["warm up"] * 64, timeout=300)
            plan = [("full", write_jsonl(tmp / "v1.jsonl", first), "out.parquet", []),
                    ("reindex", write_jsonl(tmp / "v2.jsonl", second), "out.parquet", ["--prune"]),
                    ("fresh", tmp / "v2.jsonl", "fresh.parquet", []),
                    ("repeats", write_jsonl(tmp / "rep.jsonl", [(f"r-{i}", t) for i, t in enumerate(repeated)]),
                     "rep.parquet", []),
                    ("distinct", tmp / "v1.jsonl", "distinct.parquet", [])]
            for name, src, out, extra in plan:
                before = next(iter(client.workers(2).values()))["items"]
                seconds, summary = _index_once(settings, src, str(tmp / out), extra)
                items = next(iter(client.workers(2).values()))["items"] - before
                rows = sum(1 for _ in src.open())
                runs[name] = {"seconds": seconds, "items": items, "rows": rows, "summary": summary}
                print(f"  {name:<9} {rows:>6} rows {seconds:7.1f}s  model items {items:>6} "
                      f"({items / rows:.1%})", flush=True)
        finally:
            stop_worker(proc)
            client.close()
    print(f"# embedq index, re-index and repeats  {time.strftime('%Y-%m-%d')}  {platform.node()}  {cpu_summary()}"
          f"  cpus={os.cpu_count()}  device={args.device}  dtype={args.dtype}")
    print(f"{'run':<10} {'rows':>6} {'seconds':>8} {'model items':>12} {'of rows':>8}")
    for name, r in runs.items():
        print(f"{name:<10} {r['rows']:>6} {r['seconds']:>8.1f} {r['items']:>12} {r['items'] / r['rows']:>8.1%}")
    print(f"reindex / fresh (seconds, the second version): "
          f"{runs['reindex']['seconds'] / runs['fresh']['seconds']:.3f}x")
    print(f"repeats / distinct (seconds, 4,000 rows, 30 % repeats): "
          f"{runs['repeats']['seconds'] / runs['distinct']['seconds']:.3f}x")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
