"""A Redis Sentinel failover as a producer sees it (issue 59): how long after the primary's death jobs are answered
again.

    python bench/failover.py                          # 5 failovers, down-after 1000 ms, the fake model
    python bench/failover.py --repeats 10 --down-after-ms 5000

Starts a primary, a replica and three sentinels on loopback ports (tests/sentinel_cluster.py), one worker of the fake
model (``embedq/backends/fake.py``: what is measured is the failover, not the model) and a thread that sends one
online ``Client.embed`` after another through the ``sentinel://`` URL (a typed retryable error is retried). Each
repeat SIGKILLs the primary and measures, from the kill:
  * promotion: every sentinel names the replica and it answers as the primary (polled every 50 ms);
  * first answer: the first online call *made after the kill* answered (necessarily through the new primary).
Then the killed server comes back as a replica of the new primary, and the next repeat waits out Sentinel's guard
(no second failover of a primary within 2 × failover-timeout of the previous one). The worker and the client are the
same processes throughout. The last line is the headline: the median first answer, and how much of it is
down-after (Sentinel's own detection time, a setting).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from sentinel_cluster import MASTER, SentinelCluster  # noqa: E402

from embedq import errors  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402

#: Seconds the prober waits before it retries a call refused with a retryable error.
RETRY_PAUSE = 0.05


class Prober(threading.Thread):
    """Online calls one after another; keeps (started, answered) of each answer and counts retried errors."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(daemon=True)
        self.settings = settings
        self.stopping = threading.Event()
        self.answers: list[tuple[float, float]] = []
        self.retried = 0
        self.lock = threading.Lock()

    def run(self) -> None:
        with Client(self.settings) as client:
            while not self.stopping.is_set():
                started = time.monotonic()
                try:
                    client.embed(["failover probe"], timeout=60)
                except errors.EmbedqError as exc:
                    if not exc.retryable:
                        raise
                    self.retried += 1
                    time.sleep(RETRY_PAUSE)  # as a client that retries would: the count then says something
                    continue
                with self.lock:
                    self.answers.append((started, time.monotonic()))

    def first_after(self, t: float) -> float | None:
        with self.lock:
            return next((answered for started, answered in self.answers if started > t), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--down-after-ms", type=int, default=1000, help="Sentinel's down-after-milliseconds")
    ap.add_argument("--failover-timeout-ms", type=int, default=4000, help="Sentinel's failover-timeout")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="embedq-failover-"))
    rows = []
    with SentinelCluster(down_after_ms=args.down_after_ms, failover_timeout_ms=args.failover_timeout_ms) as cluster:
        settings = Settings(broker_url=cluster.url, sentinel_master=MASTER, queue="embedq.bench.failover",
                            model="embedq-fake", allow_fake_backend=True, metrics_port=0)
        worker = start_worker(settings, log_path=logs / "worker.log")
        prober = Prober(settings)
        try:
            with Client(settings) as client:
                wait_for_worker(client.app, worker, timeout=300, log_path=logs / "worker.log")
            prober.start()
            last_kill = None
            for n in range(args.repeats):
                if last_kill is not None:  # Sentinel's guard against failing over the same primary again too soon
                    time.sleep(max(0.0, last_kill + 2 * args.failover_timeout_ms / 1000 + 1 - time.monotonic()))
                while not prober.answers:  # the first answer ever (the worker is up)
                    if not prober.is_alive():
                        raise SystemExit(f"the prober died; see {logs}")
                    time.sleep(0.02)
                retried = prober.retried
                old, killed_at = cluster.kill_primary()
                cluster.wait_promoted(old)
                promoted = time.monotonic() - killed_at
                while (first := prober.first_after(killed_at)) is None:
                    if not prober.is_alive():
                        raise SystemExit(f"the prober died; see {logs}")
                    time.sleep(0.01)
                rows.append((promoted, first - killed_at, prober.retried - retried))
                print(f"  failover {n + 1}: promotion {promoted:5.2f}s  first answer {first - killed_at:5.2f}s",
                      file=sys.stderr, flush=True)
                last_kill = killed_at
                cluster.revive(old)
        finally:
            prober.stopping.set()
            prober.join(120)
            stop_worker(worker)
    print(f"# Sentinel failover  {time.strftime('%Y-%m-%d')}  {platform.node()}  {cpu_summary()}")
    print(f"# down-after {args.down_after_ms} ms, failover-timeout {args.failover_timeout_ms} ms, "
          f"{args.repeats} failovers, one worker and one client throughout; seconds after the SIGKILL")
    print(f"{'failover':>8} {'promotion':>10} {'first answer':>13} {'retried':>8}")
    for n, (promoted, first, retried) in enumerate(rows, 1):
        print(f"{n:>8} {promoted:>10.2f} {first:>13.2f} {retried:>8}")
    firsts = [first for _, first, _ in rows]
    print(f"{'median':>8} {statistics.median(p for p, _, _ in rows):>10.2f} {statistics.median(firsts):>13.2f}")
    print(f"first answer through the new primary: median {statistics.median(firsts):.2f}s after the kill "
          f"(max {max(firsts):.2f}s), of which down-after {args.down_after_ms / 1000:.2f}s")


if __name__ == "__main__":
    main()
