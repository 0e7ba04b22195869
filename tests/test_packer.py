"""Pure tests of token-budget packing and the scheduler (no Celery, Redis or torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedq.batching import Item, Scheduler, batch_cost, plan

lengths_st = st.lists(st.integers(min_value=1, max_value=600), min_size=0, max_size=300)


def _items(lengths: list[int]) -> list[Item]:
    return [Item(key=i, length=n, seq=i) for i, n in enumerate(lengths)]


@pytest.mark.parametrize(
    ("lengths", "padded", "cost"),
    [([], True, 0), ([3], True, 3), ([3, 5, 4], True, 15), ([3, 5, 4], False, 12), ([7, 7], True, 14)],
)
def test_batch_cost_table(lengths, padded, cost):
    assert batch_cost(lengths, padded=padded) == cost


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "max_items", "expected"),
    [
        ([10, 10, 10, 10], 40, 8, [[10, 10, 10, 10]]),
        ([10, 10, 10, 10], 39, 8, [[10, 10, 10], [10]]),
        ([10, 10, 10, 10], 100, 2, [[10, 10], [10, 10]]),
        ([50, 5, 5, 50], 100, 8, [[50, 50], [5, 5]]),  # length-aware: short with short, oldest first
        ([500], 100, 8, [[500]]),  # over budget: alone, not clamped
        ([1, 500, 2], 100, 8, [[1, 2], [500]]),
    ],
)
def test_plan_table(lengths, max_tokens, max_items, expected):
    batches = plan(_items(lengths), max_tokens=max_tokens, max_items=max_items)
    assert [[it.length for it in b] for b in batches] == expected


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, max_tokens=st.integers(1, 4096), max_items=st.integers(1, 64),
       padded=st.booleans())
def test_plan_properties(lengths, max_tokens, max_items, padded):
    items = _items(lengths)
    batches = plan(items, max_tokens=max_tokens, max_items=max_items, padded=padded)
    seen = [it.key for b in batches for it in b]
    assert sorted(seen) == list(range(len(lengths)))  # every item exactly once
    for b in batches:
        assert b, "no empty batch"
        assert len(b) <= max_items
        cost = batch_cost([it.length for it in b], padded=padded)
        # never over budget, except an item that alone exceeds it, which runs alone
        assert cost <= max_tokens or len(b) == 1


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 400), min_size=1, max_size=200), max_tokens=st.integers(1, 2048),
       max_items=st.integers(1, 32), padded=st.booleans())
def test_scheduler_drains_everything_oldest_first(lengths, max_tokens, max_items, padded):
    sched = Scheduler(max_tokens=max_tokens, max_items=max_items, padded=padded)
    for i, n in enumerate(lengths):
        sched.add(i, n)
    order: list[int] = []
    rounds = 0
    while len(sched):
        head = min(set(range(len(lengths))) - set(order))
        batch = sched.next_batch()
        assert batch, "a non-empty buffer always yields a batch (never a hang)"
        keys = [it.key for it in batch]
        assert head in keys, "the oldest waiting item is always in the next batch"
        assert len(batch) <= max_items
        assert batch_cost([it.length for it in batch], padded=padded) <= max_tokens or len(batch) == 1
        order.extend(keys)
        rounds += 1
        assert rounds <= len(lengths)
    assert sorted(order) == list(range(len(lengths)))
    assert sched.next_batch() == []


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=150), max_tokens=st.integers(1, 2048),
       max_items=st.integers(1, 64), data=st.data())
def test_scheduler_interleaved_adds_and_discards(lengths, max_tokens, max_items, data):
    """Arrivals, batches and cancellations interleaved: each live item runs exactly once, the dropped never."""
    sched = Scheduler(max_tokens=max_tokens, max_items=max_items)
    pending = list(enumerate(lengths))
    live: set[int] = set()
    dropped: set[int] = set()
    ran: list[int] = []
    while pending or live:
        action = data.draw(st.sampled_from(["add", "batch", "discard"]))
        if action == "add" and pending:
            count = data.draw(st.integers(1, 10))
            for key, n in pending[:count]:
                sched.add(key, n)
                live.add(key)
            pending = pending[count:]
        elif action == "discard" and live:
            victim = data.draw(st.sampled_from(sorted(live)))
            assert sched.discard([victim, "not-buffered"]) == 1
            live.discard(victim)
            dropped.add(victim)
        elif live:
            oldest = min(live)
            batch = sched.next_batch()
            keys = [it.key for it in batch]
            assert oldest in keys
            assert len(batch) <= max_items
            assert batch_cost([it.length for it in batch]) <= max_tokens or len(batch) == 1
            live.difference_update(keys)
            ran.extend(keys)
        assert len(sched) == len(live)
    assert sched.next_batch() == []
    assert len(ran) == len(set(ran)) and not dropped & set(ran)
    assert sorted(ran + sorted(dropped)) == list(range(len(lengths)))


def test_scheduler_grows_batches_by_least_padding():
    """From the oldest item, the next row is whichever neighbour in length wastes fewer padded tokens."""
    sched = Scheduler(max_tokens=10_000, max_items=3)
    for key, n in [("oldest", 100), ("a", 60), ("b", 101), ("c", 99), ("d", 300)]:
        sched.add(key, n)
    # 99 pads by 1; 101 makes the batch's longest 101 (1 extra for the one row in it): tie -> shorter
    assert [it.key for it in sched.next_batch()] == ["oldest", "c", "b"]
    assert [it.key for it in sched.next_batch()] == ["a", "d"]  # what is left, under the cap
    assert len(sched) == 0 and sched.next_batch() == []


def test_scheduler_discard_and_duplicates():
    sched = Scheduler(max_tokens=100, max_items=10)
    sched.add("a", 5)
    sched.add("b", 5)
    with pytest.raises(KeyError):
        sched.add("a", 3)
    assert sched.discard(["a", "zzz"]) == 1
    assert [it.key for it in sched.next_batch()] == ["b"]


def test_many_small_jobs_share_one_batch_and_large_job_spreads():
    sched = Scheduler(max_tokens=1024, max_items=256)
    for job in range(50):  # 50 jobs of 2 short texts
        sched.add_many(((job, i), 12) for i in range(2))
    assert len(sched.next_batch()) == 85  # 85 × 12 = 1020 ≤ 1024: many jobs in one pass
    big = Scheduler(max_tokens=1024, max_items=256)
    big.add_many((("big", i), 200) for i in range(20))
    sizes = []
    while len(big):
        sizes.append(len(big.next_batch()))
    assert sizes == [5, 5, 5, 5]


@pytest.mark.parametrize("bad", [dict(max_tokens=0, max_items=1), dict(max_tokens=1, max_items=0)])
def test_plan_rejects_nonsense_limits(bad):
    with pytest.raises(ValueError):
        plan(_items([1]), **bad)
