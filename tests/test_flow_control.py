"""The prefetch window counted in texts: many small jobs are buffered together, big ones are bounded."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from embedq.batching import PrefetchWindow
from embedq.settings import Settings


def test_window_table():
    w = PrefetchWindow(max_messages=10, max_texts=100)
    assert w.limit() == 10  # idle: the message cap
    w.received(60)
    assert w.limit() == 10  # 1 held + 9 more (40 texts of room >= 9 one-text jobs)
    w.received(30)
    assert w.limit() == 2 + 8
    w.received(20)  # 110 texts: over the budget, so nothing new until something is done
    assert w.limit() == 3
    w.released(60)
    assert (w.messages, w.texts, w.limit()) == (2, 50, 10)
    assert (w.peak_messages, w.peak_texts) == (3, 110)
    tight = PrefetchWindow(max_messages=1000, max_texts=5)
    assert tight.limit() == 5  # five one-text jobs at most
    tight.received(500)
    assert tight.limit() == 1  # never 0: a prefetch count of 0 means "unlimited" to the broker


@hypothesis_settings(deadline=None)  # pure logic: a loaded machine's stall is no failure
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300)), max_size=200),
       st.integers(1, 64), st.integers(1, 500))
def test_window_never_admits_past_its_bounds(ops, max_messages, max_texts):
    w = PrefetchWindow(max_messages=max_messages, max_texts=max_texts)
    held: list[int] = []
    for receive, size in ops:
        if receive and w.messages < w.limit():  # the broker delivers only under the limit
            assert w.texts < max_texts and w.messages < max_messages
            w.received(size)
            held.append(size)
        elif held:
            w.released(held.pop(0))
        assert w.limit() >= 1
        assert w.messages == len(held) and w.texts == sum(held)
        assert w.messages <= max_messages
        assert w.texts <= max_texts - 1 + max(held, default=0)  # overshoot: one job's size at most


def test_fetch_room_sizes_a_burst_by_the_texts_its_class_brings():
    w = PrefetchWindow(max_messages=100, max_texts=640, online_reserve=0.25)
    assert w.fetch_room(bulk=False, most=63) == 63  # nothing seen yet: a message counts one text
    for _ in range(4):
        w.received(32, bulk=True)
    # bulk: 480 texts of its share, 128 held, 32 texts a message -> 11 more messages at most
    assert w.fetch_room(bulk=True, most=63) == (480 - 128) // 32
    assert w.fetch_room(bulk=False, most=63) == 63  # online jobs have brought nothing: one text each
    for _ in range(12):
        w.received(32, bulk=True)
    assert not w.admits(bulk=True) and w.fetch_room(bulk=True, most=63) == 0
    assert w.fetch_room(bulk=False, most=200) == 100 - 16  # the online reserve: 128 texts, 84 messages
    w.received(5000)
    assert w.fetch_room(bulk=False, most=63) == 0  # over the text budget: nothing until some are done


def _settled(worker, timeout: float = 5.0) -> dict:
    """Stats once every stored result has been acknowledged (the consumer acks every 20 ms)."""
    deadline = time.monotonic() + timeout
    while (stats := worker.stats())["held_messages"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["held_messages"] == 0
    return stats


@pytest.mark.integration
def test_worker_window_in_texts(redis_server, tmp_path, corpus):
    """What the worker holds, not what it computes: a gated worker of the fake model (``FAKE``; the gate decides
    when anything runs, so the model's speed plays no part)."""
    import redis

    from embedq import monitor
    from embedq.backends.fake import DIMENSION
    from tests.conftest import FAKE, gated_handle

    queue = "embedq.test.window"
    settings = Settings(broker_url=redis_server.url, queue=queue, prefetch_texts=300, online_overflow_texts=0, **FAKE)
    worker = gated_handle(settings, tmp_path / "worker.log")  # its gate holds the model back: see below
    r = redis.Redis.from_url(redis_server.url)
    try:
        # 400 one-text jobs: the worker buffers 300 of them, far more than the 64 messages of the old message
        # window, and no more. With the gate closed nothing runs, so the window fills whatever the speed of the
        # model against the producer (running, a fast model keeps pace with one-by-one submits).
        short = [t for t in corpus if len(t) < 200][:400]
        with worker.gate_closed():
            handles = [worker.client.submit([t]) for t in short]
            held = worker.wait_until(lambda st: st["held_messages"] == 300, "300 one-text jobs held")
            assert held["held_texts"] == 300 and monitor.waiting(r, queue) == 100  # the rest wait in Redis
        for h in handles:
            assert h.result(timeout=300).shape == (1, DIMENSION)
        stats = worker.stats()
        assert stats["peak_held_messages"] == 300
        assert stats["peak_held_texts"] <= 300
        assert stats["jobs_succeeded"] == 400
        assert _settled(worker)["held_texts"] == 0
        # 12 jobs of 100 texts: at most 3 (plus one overshooting) are held, the rest wait in Redis (the unacked
        # messages counted for this queue: kombu's hash is shared by every queue on the server). The gate closed,
        # the window fills (3 jobs at least: 300 texts) and stays so; then they run, the rest follow.
        with worker.gate_closed():
            big = [worker.client.submit(corpus[i * 100:(i + 1) * 100]) for i in range(12)]
            worker.wait_until(lambda st: st["held_texts"] >= 300, "the window full of 100-text jobs")
            peak_unacked = monitor.unacked_by_queue(r).get(queue, 0)
            assert 3 <= peak_unacked <= 4 and monitor.waiting(r, queue) == 12 - peak_unacked
        while not all(h.ready() for h in big):
            peak_unacked = max(peak_unacked, monitor.unacked_by_queue(r).get(queue, 0))
            time.sleep(0.005)  # leave the worker its cores
        for h in big:
            assert h.result(timeout=300).shape == (100, DIMENSION)
        stats = worker.stats()
        assert stats["peak_held_texts"] <= 300 + 99
        assert 1 <= peak_unacked <= 4
        assert _settled(worker)["held_texts"] == 0
    finally:
        worker.stop()
