"""Fair share between clients with real processes (issue 50, acceptance b): one worker, a real Redis, two clients
with their own identities. Client A floods the worker with 10 online jobs of 2,048 texts; client B's one-text jobs,
sent one after the other, keep a median latency within twice the one B measured on the idle worker just before.

B's jobs are counted only while A's work is buffered in the worker before and after them (its ``buffered`` counter),
so they are measured under the flood on a fast machine or a slow one. A's client has admission off (no online queue
limit): the test is of the worker's fairness, not of refusing A."""

from __future__ import annotations

import random
import statistics
import time

import pytest
from conftest import WorkerHandle, load_corpus

from embedq.producers.client import Client
from embedq.settings import Settings

pytestmark = pytest.mark.integration

FLOOD_JOBS, FLOOD_TEXTS = 10, 2048
SAMPLES = 15  # B's jobs measured on the idle worker and under the flood


@pytest.fixture(scope="module")
def fair_worker(redis_server, tmp_path_factory):
    queue = f"embedq.test.fair.{tmp_path_factory.mktemp('fair').name}"
    settings = Settings(broker_url=redis_server.url, queue=queue, online_queue_limit=0)
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("logs") / "worker.log")
    yield handle
    handle.stop()


def _latency(client: Client, text: str) -> float:
    t0 = time.perf_counter()
    client.submit([text]).result(timeout=120)
    return time.perf_counter() - t0


def test_one_clients_flood_keeps_another_clients_one_text_jobs_within_twice_their_idle_latency(fair_worker):
    corpus = load_corpus()
    rng = random.Random(50)
    small = [rng.choice(corpus) for _ in range(SAMPLES)]
    settings = fair_worker.settings
    a = Client(settings.model_copy(update={"client_id": "tenant-a"}))  # as EMBEDQ_CLIENT_ID sets it
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
        for text in small * 3:
            before = fair_worker.stats()["buffered"]
            seconds = _latency(b, text)
            after = fair_worker.stats()["buffered"]
            if before > 1 and after > 1:  # A's texts waited all along (B's job has one)
                loaded.append(seconds)
            if len(loaded) == SAMPLES:
                break
        for handle in handles:  # what has not started is dropped unrun
            a.cancel(handle.id)
    finally:
        a.close()
        b.close()
    assert len(loaded) >= SAMPLES * 2 // 3, f"the flood drained before B's jobs were measured: {len(loaded)} jobs"
    p50_idle, p50_flood = statistics.median(idle), statistics.median(loaded)
    print(f"B one-text job p50: idle {p50_idle * 1e3:.1f} ms, under A's flood {p50_flood * 1e3:.1f} ms "
          f"({p50_flood / p50_idle:.2f}x; {len(loaded)} jobs; max {max(loaded) * 1e3:.0f} ms)")
    assert p50_flood <= 2 * p50_idle, (p50_idle, p50_flood)
