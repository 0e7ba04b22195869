"""Identical items waiting at the same time run once (issue 57, part 1: embedq/workers/dedupe.py).

The service's tests drive an :class:`~embedq.workers.service.EmbeddingService` without Celery: jobs are submitted
before its inference thread starts, so what waits together is decided by the test, not by the machine's speed. The
acceptance test runs a real worker (tests/controlled_worker.py) held behind its gate, on real Redis, with MiniLM.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from embedq import errors
from embedq.backends.base import Encoded
from embedq.backends.fake import FakeBackend
from embedq.batching.traffic import BULK, ONLINE, TrafficScheduler
from embedq.kinds import KINDS
from embedq.protocol import EmbedOptions, decode_result
from embedq.settings import Settings
from embedq.workers.dedupe import Dedupe, content_of
from embedq.workers.jobs import Job
from embedq.workers.service import EmbeddingService
from embedq.workers.stats import Stats

STATE_TIMEOUT = 60.0  # bounds each wait for a state; never a pause
POISON = "poisoned"  # a word the model fails on (Counting.forward)
NAN = "nonfinite"  # a word whose row is not finite


class Counting(FakeBackend):
    """The fake model, counting the items it runs; it raises on a batch holding POISON's token and returns a NaN row
    for an item holding NAN's."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, ...]] = []
        self.poison = None  # (FakeBackend's SIGKILL poison: off)
        self._bad = self._token(POISON)
        self._nan = self._token(NAN)

    def _token(self, word: str) -> int:
        return self.prepare("embed", [word], EmbedOptions.parse({})).items[0].ids[1]

    def forward(self, batch):
        self.seen.extend(tuple(item.ids) for item in batch)
        if any(self._bad in item.ids for item in batch):
            raise RuntimeError("the model failed")
        rows = super().forward(batch)
        return [row * np.nan if self._nan in item.ids else row for item, row in zip(batch, rows)]


def _alone_payload(backend: FakeBackend, text: str, kind: str = "embed", **options) -> dict:
    """The text's result embedded alone (its own micro-batch, its own finish)."""
    opts = KINDS[kind].parse_options(options)
    prepared = backend.prepare(kind, [text], opts)
    return FakeBackend.finish(backend, kind, FakeBackend.forward(backend, prepared.items), prepared, opts)


def _alone(backend: FakeBackend, text: str, kind: str = "embed", **options) -> np.ndarray:
    """The text's vectors embedded alone."""
    return decode_result(_alone_payload(backend, text, kind, **options))[0]


class Run:
    """A service on the counting fake model; jobs submitted before it starts wait together."""

    def __init__(self, **settings) -> None:
        self.backend = Counting()
        self.settings = Settings(model="embedq-fake", allow_fake_backend=True, max_batch_tokens=256,
                                 online_batch_tokens=256, **settings)
        self.outcomes: dict[str, list] = {}
        self.jobs: dict[str, Job] = {}
        self.changed = threading.Condition()
        self.service = EmbeddingService(self.backend, self.settings, on_done=self._done)

    def _done(self, job, outcome) -> None:
        with self.changed:
            self.outcomes.setdefault(job.id, []).append(outcome)
            self.changed.notify_all()

    def job(self, job_id: str, texts: list[str], kind: str = "embed", **fields) -> Job:
        options = fields.pop("options", {})
        job = Job(job_id, [texts], options=options, spec=KINDS[kind], size=len(texts), **fields)
        self.jobs[job_id] = job
        return job

    def submit(self, *jobs: Job) -> None:
        self.service.submit_many(list(jobs))

    def finish(self) -> dict[str, object]:
        """Start the service, wait until every job has its outcome, stop; each job's one outcome."""
        self.service.start()
        try:
            with self.changed:
                assert self.changed.wait_for(lambda: len(self.outcomes) == len(self.jobs), STATE_TIMEOUT), \
                    f"outcomes of {sorted(self.outcomes)} of {sorted(self.jobs)}"
        finally:
            self.service.stop(10)
        assert all(len(outs) == 1 for outs in self.outcomes.values()), self.outcomes  # each job's outcome once
        return {job_id: outs[0] for job_id, outs in self.outcomes.items()}

    @property
    def items(self) -> int:
        return self.service.stats.items


def _vectors(outcome) -> np.ndarray:
    assert isinstance(outcome, dict), outcome
    return decode_result(outcome)[0]


def test_identical_items_of_many_jobs_run_once_and_every_job_gets_its_rows():
    run = Run()
    texts = [f"text {k} of a few words" for k in range(10)]
    for n in range(40):  # 40 one-text jobs over 10 texts, and a job with two of them twice
        run.submit(run.job(f"one{n}", [texts[n % 10]]))
    run.submit(run.job("twice", [texts[3], texts[4], texts[3], texts[4]]))
    # The same text with another prompt or another head (embed_all): other items.
    run.submit(run.job("prompted", [texts[0]], options={"prompt": "query: "}),
               run.job("tokens", [texts[0]], kind="embed_all"))
    # Texts that differ only past the model's length are the same item once truncated, unless cut on the other side.
    long = ["word " * 200 + "ends one way", "word " * 200 + "ends another way"]
    run.submit(run.job("cut1", [long[0]]), run.job("cut2", [long[1]]),
               run.job("left", [long[0]], options={"truncation_side": "left"}))
    # Options applied after the model (normalize, dimensions): the same item, each job's own vector.
    run.submit(run.job("short", [texts[1]], options={"dimensions": 8}),
               run.job("raw", [texts[1]], options={"normalize": False}))
    outcomes = run.finish()
    assert run.items == 14 and len(run.backend.seen) == 14  # 10 texts, + prompted, tokens, cut1 (and cut2), left
    assert run.service.stats.items_deduplicated == 40 + 4 + 2 - 10 + 1
    assert run.service.stats.snapshot()["items_deduplicated"] == 37
    for n in range(40):
        np.testing.assert_allclose(_vectors(outcomes[f"one{n}"]), _alone(run.backend, texts[n % 10]), atol=1e-6)
    twice = _vectors(outcomes["twice"])
    for i, k in enumerate((3, 4, 3, 4)):
        np.testing.assert_allclose(twice[i], _alone(run.backend, texts[k])[0], atol=1e-6)
    for job_id, kind, options in (("prompted", "embed", {"prompt": "query: "}), ("tokens", "embed_all", {}),
                                  ("cut1", "embed", {}), ("cut2", "embed", {}),
                                  ("left", "embed", {"truncation_side": "left"}),
                                  ("short", "embed", {"dimensions": 8}), ("raw", "embed", {"normalize": False})):
        text = {"short": texts[1], "raw": texts[1], "cut1": long[0], "cut2": long[1], "left": long[0]}.get(job_id,
                                                                                                            texts[0])
        if kind == "embed_all":  # (the fake model's rows are exact: the payloads are equal)
            got, want = dict(outcomes[job_id]), _alone_payload(run.backend, text, kind)
            assert got.pop("usage")["tokens"] == want.pop("usage")["tokens"] and got == want
        else:
            np.testing.assert_allclose(_vectors(outcomes[job_id]), _alone(run.backend, text, kind, **options),
                                       atol=1e-6)


def test_turned_off_every_item_runs():
    run = Run(dedupe=False)
    run.submit(*(run.job(f"j{n}", ["the same text"]) for n in range(5)))
    outcomes = run.finish()
    assert run.items == 5 and run.service.stats.items_deduplicated == 0
    assert all(isinstance(out, dict) for out in outcomes.values())


@pytest.mark.parametrize("leaves", ["cancelled", "expired"])
def test_a_job_that_leaves_before_it_runs_leaves_its_riders_their_place(leaves):
    run = Run()
    first = run.job("first", ["shared text", "first's own"], deadline=None if leaves == "cancelled" else 10.0**9)
    run.submit(first, run.job("second", ["shared text"]), run.job("third", ["first's own", "shared text"]))
    if leaves == "cancelled":
        assert run.service.cancel(first)
    else:
        run.service._expire(10.0**9)  # first's deadline passes while it waits (as the inference thread checks it)
    outcomes = run.finish()
    assert isinstance(outcomes["first"], errors.Cancelled if leaves == "cancelled" else errors.Expired)
    assert run.items == 2  # the two texts, once each, for the jobs still waiting
    np.testing.assert_allclose(_vectors(outcomes["second"]), _alone(run.backend, "shared text"), atol=1e-6)
    np.testing.assert_allclose(_vectors(outcomes["third"])[1], _alone(run.backend, "shared text")[0], atol=1e-6)


def test_when_every_job_of_an_item_leaves_it_does_not_run():
    run = Run()
    jobs = [run.job(f"j{n}", ["nobody waits for this"]) for n in range(3)]
    run.submit(*jobs, run.job("other", ["another text"]))
    for job in jobs:
        assert run.service.cancel(job)
    outcomes = run.finish()
    assert run.items == 1 and len(run.backend.seen) == 1 and len(run.service.scheduler) == 0
    assert all(isinstance(outcomes[job.id], errors.Cancelled) for job in jobs)


def test_an_item_that_fails_in_the_model_fails_each_job_holding_it_once_and_no_other():
    run = Run()
    # "bad" holds the poisoned text and a text that "good" also holds: bad's shared item is launched for both; when
    # the micro-batch fails and is split, bad has failed, and good's item runs in its place.
    run.submit(run.job("bad", [f"a {POISON} text", "a fine shared text"]),
               run.job("good", ["a fine shared text"]),
               run.job("also bad", ["another fine text", f"a {POISON} text"]),
               run.job("nan1", [f"a {NAN} text"]), run.job("nan2", ["x y", f"a {NAN} text"]),
               run.job("fine", ["another fine text"]))
    outcomes = run.finish()
    assert isinstance(outcomes["bad"], errors.BackendError) and "inputs[0] failed in the model" in str(outcomes["bad"])
    assert "inputs[1] failed in the model" in str(outcomes["also bad"])
    assert "inputs[0] produced a non-finite output" in str(outcomes["nan1"])
    assert "inputs[1] produced a non-finite output" in str(outcomes["nan2"])
    np.testing.assert_allclose(_vectors(outcomes["good"]), _alone(run.backend, "a fine shared text"), atol=1e-6)
    np.testing.assert_allclose(_vectors(outcomes["fine"]), _alone(run.backend, "another fine text"), atol=1e-6)
    assert run.service.stats.jobs_failed == 4


def test_a_crash_suspect_runs_alone_and_shares_with_nobody():
    run = Run()
    run.submit(run.job("suspect", ["the text"], suspect=True), run.job("plain", ["the text"]),
               run.job("plain2", ["the text"]))
    outcomes = run.finish()
    assert run.items == 2 and run.service.stats.items_deduplicated == 1  # the suspect's run, the plain jobs' one
    for job_id in ("suspect", "plain", "plain2"):
        np.testing.assert_allclose(_vectors(outcomes[job_id]), _alone(run.backend, "the text"), atol=1e-6)


def test_each_rider_gets_its_own_copy_of_the_row():
    run = Run()
    rows: dict[str, list] = {}
    finish = run.backend.finish

    def finishing(kind, job_rows, prepared, options):  # what each job's finish gets, then a finish that writes to it
        rows[str(len(rows))] = job_rows
        for row in job_rows:
            row *= 2.0
        return finish(kind, job_rows, prepared, options)

    run.backend.finish = finishing
    run.submit(run.job("a", ["the same"]), run.job("b", ["the same"]), run.job("c", ["the same"]))
    outcomes = run.finish()
    assert run.items == 1
    first, second, third = (r[0] for r in rows.values())
    assert not np.shares_memory(first, second) and not np.shares_memory(second, third)
    for job_id in "abc":
        np.testing.assert_allclose(_vectors(outcomes[job_id]), _vectors(outcomes["a"]))


# -- lanes: a rider never waits longer than it would alone ------------------------------------------------------------
def _keys(dedupe: Dedupe, scheduler: TrafficScheduler, job: Job) -> list[tuple[Job, int]]:
    fresh = dedupe.add(job)
    scheduler.add_many([((job, i), job.cost(i)) for i in fresh], job.traffic_class, job.client)
    return [(job, i) for i in fresh]


def _take(dedupe: Dedupe, scheduler: TrafficScheduler, keys: list, exclude: frozenset[str] | None):
    """``keys`` taken from the scheduler as a micro-batch whose preemption is ``exclude``."""
    scheduler.discard(keys)
    return dedupe.take(keys, lambda batch: exclude)


def _lanes():
    backend = FakeBackend()
    scheduler = TrafficScheduler(max_tokens=256, max_items=64)
    dedupe = Dedupe(scheduler, Stats())

    def job(job_id: str, text: str, traffic_class: str, client: str = "") -> Job:
        j = Job(job_id, [text], traffic_class=traffic_class, client=client)  # type: ignore[arg-type]
        j.prepared = backend.prepare("embed", [text], EmbedOptions.parse({}))
        return j

    return scheduler, dedupe, job


def test_a_bulk_batch_takes_bulk_repeats_along_but_not_online_ones_that_could_pause_it():
    scheduler, dedupe, job = _lanes()
    bulk = _keys(dedupe, scheduler, job("bulk", "same", BULK, "indexer"))
    other_bulk = job("bulk2", "same", BULK, "other indexer")
    _keys(dedupe, scheduler, other_bulk)
    online = job("online", "same", ONLINE, "web")
    _keys(dedupe, scheduler, online)
    # a bulk micro-batch online ones may pause: the online repeat would be answered sooner on its own
    launch, jobs, _ = _take(dedupe, scheduler, bulk, frozenset())
    assert launch == bulk and set(jobs) == {bulk[0][0], other_bulk}
    assert len(scheduler) == 1 and scheduler.waiting(ONLINE) == 1  # the online one waits for its own turn
    launch, jobs, _ = dedupe.take([item.key for item in scheduler.next_batch()], lambda keys: None)
    assert launch == [(online, 0)] and jobs == [online]


def test_an_online_batch_takes_another_clients_repeat_along_only_where_that_client_could_not_pause_it():
    for exclude, pulled in ((frozenset({"flood"}), False), (None, True), (frozenset({"flood", "light"}), True)):
        scheduler, dedupe, job = _lanes()
        flood = _keys(dedupe, scheduler, job("flood", "same", ONLINE, "flood"))
        light = job("light", "same", ONLINE, "light")
        _keys(dedupe, scheduler, light)
        bulk = job("bulk", "same", BULK, "indexer")
        _keys(dedupe, scheduler, bulk)
        launch, jobs, _ = _take(dedupe, scheduler, flood, exclude)
        assert launch == flood
        assert (light in jobs) is pulled and bulk in jobs  # bulk repeats always ride along
        assert scheduler.waiting(ONLINE) == (0 if pulled else 1) and not scheduler.waiting(BULK)


def test_the_content_of_an_item_is_the_same_from_a_list_or_an_arena_view():
    ids = [101, 2000, 3000, 102]
    arena = np.zeros(16, dtype=np.int32)
    arena[4:8] = ids
    assert content_of(Encoded(ids, None, 0, "dense")) == content_of(Encoded(arena[4:8], None, 0, "dense"))
    assert content_of(Encoded(ids, None, 0, "dense")) != content_of(Encoded(ids, None, 1, "dense"))
    assert content_of(Encoded(ids, None, 0, "dense")) != content_of(Encoded(ids, [0, 0, 1, 1], 0, "dense"))
    assert content_of(Encoded(ids, None, 0, "dense")) != content_of(Encoded(ids, None, 0, "sparse"))
    assert content_of(Encoded(ids, None, 0, "dense")) != content_of(Encoded([*ids[:-1], 3, 102], None, 0, "dense"))


# -- acceptance (issue 57, a): a real worker held behind its gate ------------------------------------------------------
ONE_TEXT_JOBS, REPEATS, WIDE_JOBS, WIDE = 1000, 300, 4, 32


@pytest.mark.integration
@pytest.mark.slow
def test_a_held_worker_runs_each_distinct_text_once_and_every_job_equals_its_text_alone(redis_server,
                                                                                        tmp_path_factory, corpus):
    import random

    from conftest import gated_handle

    distinct = list(dict.fromkeys(text[:300] for text in corpus))[:ONE_TEXT_JOBS - REPEATS]
    rng = random.Random(57)
    ones = distinct + [rng.choice(distinct) for _ in range(REPEATS)]  # 300 one-text jobs repeat earlier texts
    rng.shuffle(ones)
    # 32-text jobs over the same texts, each sharing half of its texts with the next one
    wides = [[distinct[(m * WIDE // 2 + j) % len(distinct)] for j in range(WIDE)] for m in range(WIDE_JOBS)]
    queue = f"embedq.test.dedupe.{tmp_path_factory.mktemp('q').name}"
    settings = Settings(broker_url=redis_server.url, queue=queue, prefetch_window=ONE_TEXT_JOBS + 2 * WIDE_JOBS,
                        online_max_wait=0)
    worker = gated_handle(settings, tmp_path_factory.mktemp("logs") / "worker.log")
    try:
        before = worker.stats()
        with worker.gate_closed():
            handles = [worker.client.submit([text]) for text in ones] + [worker.client.submit(w) for w in wides]
            worker.wait_until(lambda st: st["held_messages"] == len(handles), f"{len(handles)} jobs held")
        got = [handle.result(timeout=300) for handle in handles]
        after = worker.stats()
        ran = after["items"] - before["items"]
        assert ran <= len(distinct), f"the model saw {ran} items for {len(distinct)} distinct texts"
        assert after["items_deduplicated"] - before["items_deduplicated"] == len(ones) + WIDE * WIDE_JOBS - ran
        # Each distinct text embedded alone by the same worker: one job at a time, nothing else waiting.
        alone = {text: worker.client.submit([text]).result(timeout=120)[0] for text in distinct}
        assert worker.stats()["items"] - after["items"] == len(distinct)
        for text, vector in zip(ones + [t for w in wides for t in w], [v for job in got for v in job]):
            assert np.abs(vector - alone[text]).max() <= 1e-6
    finally:
        worker.stop()
