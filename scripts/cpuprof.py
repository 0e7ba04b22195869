"""A pytest plugin that writes each test's CPU time (this process and every descendant, live or reaped: the workers,
gateways, indexers and servers a test starts) and wall time as JSON lines, to find where the suite's CPU goes.

    PYTHONPATH=.:scripts CPUPROF_OUT=/tmp/cpu.jsonl python -m pytest -p cpuprof -n 3 --dist loadfile
    python scripts/cpuprof.py /tmp/cpu.jsonl        # by module, then the 40 costliest tests

A line is ``{"id": nodeid, "cpu": seconds, "wall": seconds, "w": xdist worker}``, from the end of the previous test to
the end of this one (its setup and teardown included). Under pytest-xdist the controller gets the reports too: its lines
(``"w": ""``) are left out of the summary. A session worker's CPU counts to the tests that ran while it worked.
Not part of the suite: a tool for work on the suite's cost (issue 52).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

_last: tuple[float, float] | None = None


def _total() -> float:
    import psutil

    times = os.times()
    total = times.user + times.system + times.children_user + times.children_system
    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        kids = []
    for kid in kids:
        try:
            t = kid.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def pytest_runtest_logstart(nodeid, location):
    global _last
    if _last is None:
        _last = (_total(), time.monotonic())


def pytest_runtest_logfinish(nodeid, location):
    global _last
    now = (_total(), time.monotonic())
    if _last is not None:
        with open(os.environ.get("CPUPROF_OUT", "cpuprof.jsonl"), "a") as fh:
            fh.write(json.dumps({"id": nodeid, "cpu": now[0] - _last[0], "wall": now[1] - _last[1],
                                 "w": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")
    _last = now


def summary(path: str) -> None:
    with open(path) as fh:
        rows = [json.loads(line) for line in fh]
    rows = [r for r in rows if r["w"]] or rows  # under xdist, the test processes' lines
    by_module: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        entry = by_module[r["id"].split("::")[0]]
        entry[0] += r["cpu"]
        entry[1] += r["wall"]
        entry[2] += 1
    print(f"{len(rows)} tests, {sum(r['cpu'] for r in rows):.0f} CPU-s, {sum(r['wall'] for r in rows):.0f} s summed")
    print("   CPU-s  wall-s tests  module")
    for module, (cpu, wall, n) in sorted(by_module.items(), key=lambda kv: -kv[1][0]):
        print(f"{cpu:8.1f} {wall:7.1f} {n:5d}  {module}")
    print("\n   CPU-s  wall-s  test")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:40]:
        print(f"{r['cpu']:8.1f} {r['wall']:7.1f}  {r['id']}")


if __name__ == "__main__":
    summary(sys.argv[1] if len(sys.argv) > 1 else "cpuprof.jsonl")
