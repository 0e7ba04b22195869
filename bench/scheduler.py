"""What choosing a micro-batch costs: embedq's Scheduler against re-sorting the buffer for every batch.

    python bench/scheduler.py

A GPU worker asks for a new micro-batch every few milliseconds, holding the lock the consumer thread
needs to buffer new jobs, so the choice must cost far less than the forward pass. The baseline is the
obvious design (and embedq's first one): sort the oldest 4,096 buffered items by length, pack them
greedily, and return the batch that holds the oldest item. Both run on the same 20,000 items with the
corpus's length mix; the last line is the speed-up.
"""

from __future__ import annotations

import json
import random
import sys
import time
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embedq.batching import Item, Scheduler, batch_cost  # noqa: E402

CORPUS = ROOT / "data" / "corpus.jsonl"


class SortingScheduler:
    """The baseline: a dict in arrival order; every call sorts a 4,096-item window and packs it."""

    def __init__(self, max_tokens: int, max_items: int, window: int = 4096) -> None:
        self.max_tokens, self.max_items, self.window = max_tokens, max_items, window
        self.items: dict[int, Item] = {}

    def add(self, key: int, length: int) -> None:
        self.items[key] = Item(key, length, key)

    def __len__(self) -> int:
        return len(self.items)

    def next_batch(self) -> list[Item]:
        window = list(islice(self.items.values(), self.window))
        oldest = window[0]
        batches, current, longest = [], [], 0
        for item in sorted(window, key=lambda it: (it.length, it.seq)):
            if current and (max(longest, item.length) * (len(current) + 1) > self.max_tokens
                            or len(current) + 1 > self.max_items):
                batches.append(current)
                current, longest = [], 0
            current.append(item)
            longest = max(longest, item.length)
        batches.append(current)
        chosen = next(b for b in batches if oldest in b)
        for item in chosen:
            del self.items[item.key]
        return chosen


def drain(sched, lengths: list[int], keep: int) -> tuple[float, int, float]:
    """(µs per batch, batches, padding) while the buffer stays above ``keep`` items."""
    for key, n in enumerate(lengths):
        sched.add(key, n)
    batches = real = padded = 0
    t0 = time.perf_counter()
    while len(sched) > keep:
        batch = sched.next_batch()
        batches += 1
        real += sum(it.length for it in batch)
        padded += batch_cost([it.length for it in batch])
    return (time.perf_counter() - t0) / batches * 1e6, batches, 1 - real / padded


def main() -> int:
    with CORPUS.open() as fh:
        # About 4.3 characters per token on this corpus; the exact lengths do not matter here.
        mix = [min(256, max(5, round(len(json.loads(line)["text"]) / 4.3))) for line in fh]
    rng = random.Random(0)
    lengths = [rng.choice(mix) for _ in range(20_000)]
    print(f"{'budget':>7} {'scheduler':>22} {'us/batch':>9} {'batches':>8} {'padding':>8}")
    speedups = []
    for budget, items in ((2048, 256), (16384, 256)):
        new = drain(Scheduler(max_tokens=budget, max_items=items), lengths, keep=4096)
        old = drain(SortingScheduler(budget, items), lengths, keep=4096)
        for name, (us, n, pad) in (("embedq Scheduler", new), ("sort-the-window", old)):
            print(f"{budget:>7} {name:>22} {us:>9.1f} {n:>8} {pad:>8.1%}")
        speedups.append(old[0] / new[0])
    print(f"embedq Scheduler / sort-the-window (time per batch): {min(speedups):.0f}x to {max(speedups):.0f}x faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
