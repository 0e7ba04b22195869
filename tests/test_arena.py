"""The shared-memory arena of token ids (embedq/workers/arena.py): its ring of spans freed out of order, and a
second process reading a job's ids in place."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedq.workers.arena import IdsArena, Spans


def test_spans_freed_out_of_order_are_reclaimed_only_behind_the_oldest_live_one():
    spans = Spans(10)
    a, b, c = spans.alloc(3), spans.alloc(3), spans.alloc(3)
    assert (a, b, c) == (0, 3, 6)
    assert spans.alloc(2) is None  # one slot left at the end, and the head is at 0
    spans.free(b)  # a job in the middle finishes first: its slots stay taken while the oldest lives
    assert spans.alloc(2) is None
    spans.free(a)  # now the head moves past a and b, to c
    assert spans.alloc(7) is None  # [0, 6) is free, not 7: c starts at 6
    assert spans.alloc(4) == 0  # not 4 free at the end ([9, 10)): wraps to the start, up to c's
    assert spans.alloc(3) is None  # wrapped: [4, 6) is what is left before c
    assert spans.alloc(2) == 4
    assert spans.alloc(1) is None  # [6, 9) is c's, and [9, 10) lies behind the wrap
    spans.free(c)
    assert spans.alloc(4) == 6  # the head is at 0 again: the ring's end is free
    with pytest.raises(KeyError):
        spans.free(9)  # no live span starts there
    with pytest.raises(ValueError):
        spans.alloc(11)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 8), st.integers(0, 1000)), max_size=200))
def test_live_spans_never_overlap_and_an_empty_ring_takes_its_whole_capacity(ops):
    capacity = 12
    spans = Spans(capacity)
    live: dict[int, int] = {}  # start -> end
    for allocate, n, pick in ops:
        if allocate or not live:
            start = spans.alloc(n)
            if start is None:
                assert live, "an empty ring refused a span that fits"
                continue
            end = start + n
            assert start >= 0 and end <= capacity
            assert all(end <= s or start >= e for s, e in live.items()), (start, end, live)
            live[start] = end
        else:
            start = sorted(live)[pick % len(live)]
            spans.free(start)
            del live[start]
    for start in list(live):
        spans.free(start)
    assert len(spans) == 0
    assert spans.alloc(capacity) == 0


def test_a_job_is_written_and_read_back_item_by_item():
    arena = IdsArena.create(64)
    try:
        items = [[101, 7592, 102], [101, 2088, 2003, 1037, 102], [101, 102]]
        start, offsets = arena.write(items)
        for offset, item in zip(offsets.tolist(), items):
            assert arena.read(offset, len(item)).tolist() == item
        assert arena.write([[1] * 60]) is None  # 10 of 64 taken: back-pressure, nothing overwritten
        assert arena.read(int(offsets[0]), 3).tolist() == items[0]
        arena.free(start)
        start2, _ = arena.write([[1] * 60])
        assert start2 == 0  # an empty ring starts again at 0
        with pytest.raises(ValueError):
            arena.write([[101], []])
    finally:
        arena.close()


READER = """
import sys
import time
import numpy as np
from embedq.workers.arena import IdsArena
arena = IdsArena.attach(sys.argv[1], int(sys.argv[2]))
for spec in sys.argv[3:]:
    offset, length = map(int, spec.split(":"))
    print(int(np.asarray(arena.read(offset, length), dtype=np.int64).sum()))
arena.close()
"""


@pytest.mark.integration  # a second Python process
def test_another_process_reads_the_ids_in_place_and_leaves_the_arena_to_its_creator(tmp_path):
    """The device process's side: it attaches by name and reads each item where the host wrote it; its exit does
    not remove the block (Python's resource tracker would, for an attached block, without the unregister)."""
    arena = IdsArena.create(1 << 16)
    try:
        rng = np.random.default_rng(0)
        items = [rng.integers(0, 30_000, size=int(n)).tolist() for n in rng.integers(1, 300, size=50)]
        _, offsets = arena.write(items)
        specs = [f"{o}:{len(i)}" for o, i in zip(offsets.tolist(), items)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        out = subprocess.run([sys.executable, "-c", READER, arena.name, str(arena.capacity), *specs], env=env,
                             capture_output=True, text=True, timeout=120, check=True)
        assert [int(x) for x in out.stdout.split()] == [sum(i) for i in items]
        assert "leaked" not in out.stderr, out.stderr
        assert Path("/dev/shm", arena.name.lstrip("/")).exists()  # still the creator's after the reader left
        again = IdsArena.attach(arena.name, arena.capacity)  # and still readable
        assert again.read(int(offsets[3]), len(items[3])).tolist() == items[3]
        again.close()
    finally:
        arena.close()
    assert not Path("/dev/shm", arena.name.lstrip("/")).exists()  # the creator removed it


CREATOR = """
import sys, time
from embedq.workers.arena import IdsArena
arena = IdsArena.create(1024)
print(arena.name, flush=True)
time.sleep(600)
"""


@pytest.mark.integration  # a second Python process, SIGKILLed
def test_a_sigkilled_creator_leaves_no_block_behind():
    """A host process that dies without closing its arena (SIGKILL): its resource tracker removes the block."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", CREATOR], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        path = Path("/dev/shm", proc.stdout.readline().strip().lstrip("/"))
        assert path.exists()
    finally:
        proc.kill()
        proc.wait(30)
    end = time.monotonic() + 60  # bounds the wait for the tracker, which notices its parent's end
    while path.exists():
        assert time.monotonic() < end, f"{path} is still there a minute after its creator died"
        time.sleep(0.05)
