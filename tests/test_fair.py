"""Fair share between clients as pure logic (issue 50): :class:`~embedq.batching.fair.FairScheduler` against the
plain :class:`~embedq.batching.Scheduler` it must equal with one client, and its promises with several: no client
starves, a one-item client lands in the very next micro-batch, shares are even, every item runs exactly once."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedq.batching import Scheduler, batch_cost
from embedq.batching.fair import FairScheduler
from embedq.batching.traffic import BULK, CLIENT_HOLD, ONLINE, TrafficScheduler


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 400), min_size=1, max_size=200), max_tokens=st.integers(1, 2048),
       max_items=st.integers(1, 64), padded=st.booleans(), data=st.data())
def test_one_client_batches_exactly_as_the_plain_scheduler(lengths, max_tokens, max_items, padded, data):
    plain = Scheduler(max_tokens=max_tokens, max_items=max_items, padded=padded)
    fair = FairScheduler(max_tokens=max_tokens, max_items=max_items, padded=padded)
    other = Scheduler(max_tokens=max_tokens, max_items=max_items, padded=padded)  # fill()'s starting batches
    pending = list(enumerate(lengths))
    while pending or len(plain):
        action = data.draw(st.sampled_from(["add", "batch", "fill", "discard"]))
        if action == "add" and pending:
            count = data.draw(st.integers(1, 20))
            plain.add_many(pending[:count])
            fair.add_many(pending[:count], "only")
            pending = pending[count:]
        elif action == "discard" and len(plain):
            victim = data.draw(st.sampled_from([key for key, _ in enumerate(lengths)]))
            assert plain.discard([victim]) == fair.discard([victim])
        elif action == "fill" and len(plain):
            n = data.draw(st.integers(1, 400))
            other.add(("o", len(pending), n, data.draw(st.integers())), n)
            start = other.next_batch()
            a, b = list(start), list(start)
            assert [i.key for i in plain.fill(a)] == [i.key for i in fair.fill(b)]
        else:
            budget = data.draw(st.none() | st.integers(1, max_tokens))
            assert [i.key for i in plain.next_batch(max_tokens=budget)] == [
                i.key for i in fair.next_batch(max_tokens=budget)]
        assert len(plain) == len(fair)
    assert fair.next_batch() == [] and not fair.clients


def _flood(s: FairScheduler, client: str, lengths: list[int]) -> None:
    s.add_many([((client, i), n) for i, n in enumerate(lengths)], client)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32), max_tokens=st.integers(64, 4096), max_items=st.integers(2, 64),
       padded=st.booleans(), new_length=st.integers(1, 512), taken=st.integers(0, 5))
def test_a_one_item_client_lands_in_the_very_next_batch(seed, max_tokens, max_items, padded, new_length, taken):
    rng = random.Random(seed)
    s = FairScheduler(max_tokens=max_tokens, max_items=max_items, padded=padded)
    _flood(s, "a", [rng.randint(5, 400) for _ in range(2000)])
    _flood(s, "c", [rng.randint(5, 400) for _ in range(500)])
    for _ in range(taken):
        s.next_batch()
    s.add("b's text", new_length, "b")
    assert "b's text" in [item.key for item in s.next_batch()]


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32), clients=st.integers(2, 8), max_tokens=st.integers(32, 4096),
       max_items=st.integers(8, 64), padded=st.booleans())
def test_no_client_waits_more_batches_than_there_are_clients(seed, clients, max_tokens, max_items, padded):
    rng = random.Random(seed)
    s = FairScheduler(max_tokens=max_tokens, max_items=max_items, padded=padded)
    for c in range(clients):
        _flood(s, f"c{c}", [rng.randint(1, 600) for _ in range(300)])
    since = dict.fromkeys(s.clients, 0)  # batches since each client last had an item in one
    while len(s):
        batch = s.next_batch()
        assert batch and len(batch) <= max_items
        assert batch_cost([i.length for i in batch], padded=padded) <= max_tokens or len(batch) == 1
        served = {item.key[0] for item in batch}
        for client in since:
            since[client] = 0 if client in served else since[client] + 1
            assert since[client] < clients or client not in s.clients


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("clients", [2, 3, 5])
def test_clients_that_flood_alike_get_even_shares(padded, clients):
    rng = random.Random(clients)
    s = FairScheduler(max_tokens=2048, max_items=256, padded=padded)
    for c in range(clients):
        _flood(s, f"c{c}", [rng.randint(5, 120) for _ in range(20_000)])
    tokens = dict.fromkeys(s.clients, 0)
    for _ in range(300):
        for item in s.next_batch():
            tokens[item.key[0]] += item.length
    mean = sum(tokens.values()) / clients
    assert all(abs(t - mean) <= 0.1 * mean for t in tokens.values()), tokens


def test_a_flood_leaves_a_small_client_a_short_batch_of_its_own():
    """One client with 20,480 texts, another with one: the small one's text runs in the next batch, a batch of the
    light clients alone (its answer costs its own text, not a full batch of the flood's); then the flood goes on."""
    s = FairScheduler(max_tokens=2048, max_items=256)
    _flood(s, "a", [32] * 20_480)
    first = s.next_batch()
    assert len(first) == 64  # a alone: its own full batch
    s.add("b", 20, "b")
    s.add("c", 40, "c")
    assert [item.key for item in s.next_batch()] == ["c", "b"]  # newest first (each joins at the head), a not in
    assert list(s.clients) == ["a"]  # b and c had nothing left: dropped
    assert len(s.next_batch()) == 64


def test_a_flood_never_preempts_a_light_batch_and_a_light_client_preempts_the_flood():
    """At a preemption point of a running online batch only light clients' items run (``light_only``): a flood that
    waits does not run inside a one-text batch of another client, while a one-text client does inside the flood's."""
    s = FairScheduler(max_tokens=2048, max_items=256)
    _flood(s, "a", [32] * 1000)
    assert s.next_batch(exclude={"b"}, light_only=True) == []  # b's light batch runs: a waits for its end
    s.add("b", 20, "b")
    assert [item.key for item in s.next_batch(exclude={"a"}, light_only=True)] == ["b"]
    _flood(s, "c", [32] * 100)  # c waits for more than its share (2048 / 2 tokens): not light
    assert s.next_batch(exclude={"a"}, light_only=True) == []


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 300)), min_size=1, max_size=200),
       max_tokens=st.integers(1, 2048), max_items=st.integers(1, 64), data=st.data())
def test_every_item_of_every_client_runs_exactly_once(lengths, max_tokens, max_items, data):
    s = FairScheduler(max_tokens=max_tokens, max_items=max_items)
    pending = [(key, client, n) for key, (client, n) in enumerate(lengths)]
    live: set[int] = set()
    dropped: set[int] = set()
    ran: list[int] = []
    while pending or live:
        action = data.draw(st.sampled_from(["add", "batch", "discard"]))
        if action == "add" and pending:
            for key, client, n in pending[:data.draw(st.integers(1, 10))]:
                s.add(key, n, f"c{client}")
                live.add(key)
                pending.pop(0)
        elif action == "discard" and live:
            victim = data.draw(st.sampled_from(sorted(live)))
            assert s.discard([victim, "not-buffered"]) == 1
            live.discard(victim)
            dropped.add(victim)
        elif live:
            batch = s.next_batch()
            assert batch and len(batch) <= max_items
            assert batch_cost([i.length for i in batch]) <= max_tokens or len(batch) == 1
            live.difference_update(i.key for i in batch)
            ran.extend(i.key for i in batch)
        assert len(s) == len(live) == sum(s.waiting_by_client().values())
        with pytest.raises(KeyError):
            if live:
                s.add(min(live), 1, "another client")
                raise AssertionError("a buffered key was added again")
            raise KeyError
    assert s.next_batch() == [] and not s.clients
    assert len(ran) == len(set(ran)) and not dropped & set(ran)
    assert sorted(ran + sorted(dropped)) == list(range(len(lengths)))


def test_the_traffic_classes_share_each_class_between_its_clients():
    """Within each class a newcomer's item comes first: online between callers, bulk between indexers."""
    s = TrafficScheduler(max_tokens=1024, max_items=64, online_tokens=256, bulk_share=0.0)
    s.add_many([(("a", i), 16) for i in range(1000)], ONLINE, client="a")
    s.add_many([(("x", i), 16) for i in range(1000)], BULK, client="indexer-x")
    assert len(s.next_batch()) == 64  # a alone: the full budget
    s.add(("b", 0), 16, ONLINE, client="b")
    assert s.next_batch()[0].key == ("b", 0)  # b's light batch (bulk rides along within online_tokens)
    assert s.waiting_by_client(ONLINE) == {"a": 1000 - 64}
    # while b is about (within CLIENT_HOLD) a's batches are short (online_tokens), so b's next job waits for little
    assert [item.key[0] for item in s.next_batch()] == ["a"] * 16
    bulk = TrafficScheduler(max_tokens=1024, max_items=64)
    bulk.add_many([(("x", i), 16) for i in range(1000)], BULK, client="indexer-x")
    bulk.next_batch()
    bulk.add(("y", 0), 16, BULK, client="indexer-y")
    assert bulk.next_batch()[0].key == ("y", 0)


def test_another_online_client_is_seen_while_it_waits_or_sent_within_the_hold():
    """A large online micro-batch is made preemptible only while another client is about (service._preemptible):
    one client alone keeps the unlayered runtime."""
    now = [0.0]
    s = TrafficScheduler(max_tokens=64, max_items=8, online_hold=1.0, clock=lambda: now[0])
    s.add("a1", 8, ONLINE, "a")
    assert not s.other_online_clients(frozenset({"a"}))
    s.add("b1", 8, ONLINE, "b")
    assert s.other_online_clients(frozenset({"a"}))
    s.discard(["b1"])
    now[0] = CLIENT_HOLD - 0.5  # b has nothing waiting, but sent within the hold
    assert s.other_online_clients(frozenset({"a"}))
    now[0] = CLIENT_HOLD + 0.1
    assert not s.other_online_clients(frozenset({"a"}))
    s.add("c1", 8, BULK, "c")  # bulk clients do not count
    assert not s.other_online_clients(frozenset({"a"}))


def test_online_items_preempt_a_running_online_batch_again_and_again_while_no_bulk_waits():
    """The bulk share is owed only while bulk items wait: with online work alone, every preemption point of a flood's
    batch lets a light client's newest item in, not just the first one (the second was refused as "bulk owed")."""
    s = TrafficScheduler(max_tokens=1024, max_items=64, bulk_share=0.1)
    s.add_many([(("a", i), 16) for i in range(1000)], ONLINE, client="a")
    assert len(s.next_batch()) == 64
    for i in range(5):
        s.add(("b", i), 16, ONLINE, client="b")
        assert [item.key for item in s.next_online_batch(exclude={"a"})] == [("b", i)]
    s.add(("x", 0), 16, BULK, client="indexer")
    s.add(("b", 5), 16, ONLINE, client="b")
    assert s.next_online_batch(exclude={"a"}) == []  # bulk waits and is owed its share: it comes first
