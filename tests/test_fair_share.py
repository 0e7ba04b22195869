"""Fair share between clients with real processes (issue 50, acceptance b): one worker, a real Redis, two clients
with their own identities. Client A floods the worker with 10 online jobs of 2,048 texts; client B's one-text jobs,
sent one after the other, are each answered while A's flood is still buffered: B never waits for A's jobs to drain
(on main at 6d258d3 B's first job waited in Redis behind A's messages and timed out). Each B job must leave most of
A's flood waiting: a state read from the worker (its ``buffered`` counter), so the test holds on a fast machine or a
slow one. The latency ratio the issue asks for (B's p50 under the flood within 2x its idle p50) depends on the
machine and is printed, not asserted: it is measured by ``bench/fair_share.py`` and recorded in docs/BENCHMARKS.md.

A's client has admission off (no online queue limit, no text cap, no wait bound), as a raw Celery client would have:
the test is of the worker's fairness, not of refusing A; B's client keeps its admission (the suite's), which must
not refuse B for A's flood. The texts are generated (deterministic English-like sentences of 8 to 60 words), so the
test needs no corpus."""

from __future__ import annotations

import random
import statistics
import time

import pytest
from conftest import WorkerHandle

from embedq.producers.client import Client
from embedq.settings import Settings

pytestmark = pytest.mark.integration

FLOOD_JOBS, FLOOD_TEXTS = 10, 2048
SAMPLES = 15  # B's jobs measured on the idle worker and under the flood
_VOCABULARY = ("the of and to in is was for on that with as by at from an were are which this be or had not "
         "but what all when we there can one has been if more will their would who so no time people year way day "
         "man thing "
         "woman life child world school state family student group country problem hand part place case week "
         "company system program question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head house service friend "
         "father power hour game line end member law car city community name president team minute idea kid body "
         "information back parent face others level office door health person art war history party result change "
         "morning reason research girl guy moment air teacher force education queue worker model vector batch")
WORDS = _VOCABULARY.split()


def _texts(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def fair_worker(redis_server, tmp_path_factory):
    queue = f"embedq.test.fair.{tmp_path_factory.mktemp('fair').name}"
    # A named runtime that stops between layers (auto may pick ONNX Runtime, which cannot: the runtime is chosen by
    # timing, and preemption then falls back to the online cap, which a flood of online jobs does not trigger).
    settings = Settings(broker_url=redis_server.url, queue=queue, linear_kernel="torch")
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("logs") / "worker.log")
    yield handle
    handle.stop()


def _latency(client: Client, text: str) -> float:
    t0 = time.perf_counter()
    client.submit([text]).result(timeout=120)
    return time.perf_counter() - t0


def test_one_clients_flood_does_not_hold_back_another_clients_one_text_jobs(fair_worker):
    rng = random.Random(50)
    corpus = _texts(rng, 4000)
    small = [rng.choice(corpus) for _ in range(SAMPLES)]
    settings = fair_worker.settings
    a = Client(settings.model_copy(update={"client_id": "tenant-a", "online_queue_limit": 0,  # as EMBEDQ_CLIENT_ID
                                           "online_queue_texts": 0, "online_max_wait": 0}))  # sets it
    b = Client(settings.model_copy(update={"client_id": "tenant-b"}))
    try:
        for text in small[:3]:  # warm: connections, the result channel, the model's first shapes
            _latency(b, text)
        idle = [_latency(b, text) for text in small]
        assert fair_worker.stats()["buffered"] == 0

        flood = [[rng.choice(corpus) for _ in range(FLOOD_TEXTS)] for _ in range(FLOOD_JOBS)]
        handles = a.submit_many(flood)
        fair_worker.wait_until(lambda s: s["buffered"] >= FLOOD_TEXTS, "A's flood buffered in the worker")
        loaded: list[float] = []
        for text in small[:5]:
            loaded.append(_latency(b, text))
            left = fair_worker.stats()["buffered"]
            # B's job is done and A's flood is not: at most a few of its 10 jobs have run meanwhile
            assert left >= FLOOD_TEXTS * FLOOD_JOBS // 2, (left, loaded)
        for handle in handles:  # what has not started is dropped unrun
            a.cancel(handle.id)
    finally:
        a.close()
        b.close()
    p50_idle, p50_flood = statistics.median(idle), statistics.median(loaded)
    print(f"B one-text job p50: idle {p50_idle * 1e3:.1f} ms, under A's flood {p50_flood * 1e3:.1f} ms "
          f"({p50_flood / p50_idle:.2f}x; {len(loaded)} jobs; max {max(loaded) * 1e3:.0f} ms)")
