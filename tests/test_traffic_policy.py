"""Traffic classes as pure logic: online first, bulk never starved, budgets, deadlines, the window's reserve."""

from __future__ import annotations

import random

import pytest

from embedq.batching import PrefetchWindow, batch_cost
from embedq.batching.traffic import BULK, ONLINE, Deadlines, TrafficScheduler


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sched(clock: Clock, **kw) -> TrafficScheduler:
    args = {"max_tokens": 1024, "max_items": 64, "online_tokens": 256, "bulk_share": 0.25, "online_hold": 1.0}
    args.update(kw)
    return TrafficScheduler(clock=clock, **args)


def test_an_online_item_goes_into_the_next_batch_ahead_of_older_bulk_items():
    clock = Clock()
    s = _sched(clock)
    for i in range(500):
        s.add(("b", i), 20, BULK)
    clock.now = 5.0
    s.add(("o", 0), 20, ONLINE)
    batch = s.next_batch()
    assert ("o", 0) in [item.key for item in batch]
    # the rest of the batch is bulk, within the online budget (online traffic is about)
    assert batch_cost([item.length for item in batch]) <= 256
    assert len(batch) == 256 // 20


def test_bulk_runs_at_the_full_budget_once_online_traffic_has_gone_quiet():
    clock = Clock()
    s = _sched(clock)
    s.add(("o", 0), 20, ONLINE)
    for i in range(500):
        s.add(("b", i), 20, BULK)
    s.next_batch()
    clock.now = 0.5  # online seen half a second ago: still the small budget
    assert batch_cost([i.length for i in s.next_batch()]) <= 256
    clock.now = 1.5
    big = s.next_batch()
    assert batch_cost([i.length for i in big]) == 1020  # 51 × 20 tokens: the full 1024 budget


def test_online_traffic_alone_batches_at_the_full_budget():
    clock = Clock()
    s = _sched(clock)
    for i in range(200):
        s.add(("o", i), 20, ONLINE)
    assert batch_cost([i.length for i in s.next_batch()]) == 1020  # not capped at online_tokens (256)


def test_a_bulk_fill_never_makes_an_online_batch_long():
    clock = Clock()
    s = _sched(clock, bulk_share=0.0)  # online_tokens 256
    for i in range(20):
        s.add(("o", i), 20, ONLINE)  # 400 tokens of online work: more than the bulk cap
    for i in range(50):
        s.add(("b", i), 20, BULK)
    batch = s.next_batch()
    assert all(item.key[0] == "o" for item in batch) and len(batch) == 20  # no bulk beyond the cap
    s.add(("o", 99), 20, ONLINE)
    batch = s.next_batch()
    assert batch[0].key == ("o", 99) and batch_cost([i.length for i in batch]) <= 256


def test_online_items_fill_first_and_bulk_items_fill_what_is_left():
    clock = Clock()
    s = _sched(clock, online_tokens=1024)
    for i in range(3):
        s.add(("o", i), 100, ONLINE)
    for i in range(50):
        s.add(("b", i), 100, BULK)
    batch = s.next_batch()
    keys = [item.key for item in batch]
    assert keys[:3] == [("o", 0), ("o", 1), ("o", 2)]
    assert len(batch) == 10 and batch_cost([i.length for i in batch]) == 1000


def test_bulk_gets_its_minimum_share_while_online_traffic_saturates_the_model():
    clock = Clock()
    s = _sched(clock, online_tokens=1024, bulk_share=0.25)
    for i in range(200):
        s.add(("b", i), 300, BULK)  # long bulk texts: none fits beside a full online batch
    served = {ONLINE: 0, BULK: 0}
    for step in range(200):
        for j in range(60):  # more online work arrives than one batch takes
            s.add(("o", step, j), 16, ONLINE)
        for item in s.next_batch():
            served[ONLINE if item.key[0] == "o" else BULK] += item.length
    assert served[BULK] > 0
    share = served[BULK] / (served[ONLINE] + served[BULK])
    assert 0.2 <= share <= 0.35, share


def test_with_one_class_waiting_the_share_count_restarts():
    clock = Clock()
    s = _sched(clock, online_tokens=1024, bulk_share=0.5)
    for i in range(100):
        s.add(("o", i), 16, ONLINE)
    while s.waiting(ONLINE):
        s.next_batch()  # online alone: bulk is not owed anything for this time
    s.add(("b", 0), 16, BULK)
    s.add(("o", "x"), 16, ONLINE)
    assert s.next_batch()[0].key == ("o", "x")


def test_preemptive_bulk_batches_take_the_full_budget_and_online_ones_stay_online():
    clock = Clock()
    s = _sched(clock)
    s.preemptive = True
    for i in range(500):
        s.add(("b", i), 20, BULK)
    s.add(("o", 0), 20, ONLINE)
    online = s.next_batch()  # online first, alone: no bulk fill to lengthen it
    assert [item.key for item in online] == [("o", 0)]
    bulk = s.next_batch()  # online traffic is about (clock unchanged), yet bulk takes the full budget
    assert all(item.key[0] == "b" for item in bulk) and batch_cost([i.length for i in bulk]) == 1020
    assert s.next_online_batch() == []  # nothing online waits
    s.add(("o", 1), 20, ONLINE)
    s.add(("o", 2), 20, ONLINE)
    assert [item.key for item in s.next_online_batch()] == [("o", 1), ("o", 2)]


def test_preemptions_stop_while_bulk_is_owed_its_share():
    clock = Clock()
    s = _sched(clock, bulk_share=0.25)
    s.preemptive = True
    for i in range(100):
        s.add(("b", i), 100, BULK)
    running = s.next_batch()  # a bulk batch of 1,000 tokens runs; online items come while it does
    assert batch_cost([i.length for i in running]) == 1000
    taken = 0
    for step in range(100):
        s.add(("o", step), 100, ONLINE)
        taken += sum(item.length for item in s.next_online_batch())
    # online may take about 3x the running bulk batch (bulk keeps 25 %): until one batch takes it past that
    assert taken == 3100
    assert s.next_online_batch() == [] and s.waiting(ONLINE) == 69
    assert s.next_batch()[0].key[0] == "b"  # and the next batch is bulk's


def test_every_item_comes_out_exactly_once_within_budget():
    rng = random.Random(7)
    clock = Clock()
    s = _sched(clock, max_tokens=512, online_tokens=128, max_items=32)
    seen: list = []
    added = 0
    for _step in range(400):
        clock.now += rng.choice([0.0, 0.1, 2.0])
        for _ in range(rng.randint(0, 6)):
            cls = rng.choice([ONLINE, BULK])
            length = rng.choice([3, 8, 30, 90, 200, 700])
            s.add((cls, added), length, cls)
            added += 1
        if rng.random() < 0.1 and added:
            dropped = s.discard([(c, added - 1) for c in (ONLINE, BULK)])
            if dropped:
                seen.append(("dropped", added - 1))
        batch = s.next_batch()
        if batch:
            cost = batch_cost([i.length for i in batch])
            assert cost <= 512 or len(batch) == 1, (cost, len(batch))
            assert len(batch) <= 32
        seen.extend(item.key[1] for item in batch)
    while len(s):
        seen.extend(item.key[1] for item in s.next_batch())
    ids = [k[1] if isinstance(k, tuple) else k for k in seen]
    assert sorted(ids) == list(range(added))


def test_deadlines_come_due_in_order_and_finished_jobs_are_pruned():
    d = Deadlines()
    jobs = [{"name": n, "done": False} for n in "abc"]
    d.add(3.0, jobs[0])
    d.add(1.0, jobs[1])
    d.add(2.0, jobs[2])
    assert d.next_deadline() == 1.0
    assert [j["name"] for j in d.due(2.0)] == ["b", "c"]
    assert d.due(2.5) == []
    jobs[0]["done"] = True
    d.prune(lambda job: job["done"])
    assert len(d) == 0 and d.next_deadline() is None


def test_the_prefetch_window_keeps_a_share_for_online_jobs():
    w = PrefetchWindow(max_messages=100, max_texts=1000, online_reserve=0.25)
    while w.admits(bulk=True):
        w.received(10, bulk=True)
    assert w.texts == 750 and w.messages == 75  # bulk stops at its three quarters
    assert w.admits(bulk=False)
    for _ in range(25):
        w.received(10)
    assert not w.admits(bulk=False) and not w.admits(bulk=True)
    w.released(10)
    assert w.admits(bulk=False) and not w.admits(bulk=True)  # room freed by online: bulk stays at its cap
    w.released(10, bulk=True)
    assert w.admits(bulk=True) and w.admits(bulk=False)  # (the transport asks the online queue first)


def test_online_jobs_may_overflow_the_text_window_by_a_bound_and_bulk_jobs_never():
    w = PrefetchWindow(max_messages=100, max_texts=1000, online_overflow=500)
    for _ in range(10):
        w.received(100)  # the window's texts are full
    assert not w.admits(bulk=True) and w.fetch_room(bulk=True, most=10) == 0
    assert w.admits(bulk=False) and w.fetch_room(bulk=False, most=10) == 5
    assert w.limit() == 10 + 90  # the channel may deliver what the overflow has room for
    for _ in range(5):
        w.received(100)
    assert not w.admits(bulk=False) and w.limit() == w.messages == 15  # the overflow is a hard bound too
    with pytest.raises(ValueError):
        PrefetchWindow(max_messages=1, max_texts=1, online_overflow=-1)


def test_window_reserve_is_validated():
    with pytest.raises(ValueError):
        PrefetchWindow(max_messages=1, max_texts=1, online_reserve=1.0)
