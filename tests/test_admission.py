"""Online admission by expected wait (issue 50): the model's table, then a real gated worker holding a known backlog
at a measured throughput: the flooding client is refused at once (``overloaded`` with ``retry_after``, nothing sent),
a client with nothing outstanding is admitted, and the gateway answers 429 + Retry-After before sending anything."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest

from embedq import errors, monitor
from embedq.admission import MAX_RETRY_AFTER, Estimate, backlog
from embedq.producers.client import Client
from embedq.settings import Settings
from tests.conftest import GatewayHandle, gated_handle

BOUND = 1.0  # EMBEDQ_ONLINE_MAX_WAIT of these tests' producers
FLOOD = 1024  # texts client A holds in the gated worker: several seconds of work on any CPU this runs on


def _refusal(ahead, own, active, rate, texts, waiting=0, **settings):
    settings = Settings(**{"online_max_wait": BOUND, **settings})
    return Estimate(ahead, own, active, rate, waiting).refusal("q", texts, settings)


def test_the_model_table():
    # one client: first come, first served (wait = T / rate)
    assert _refusal(ahead=90, own=90, active=1, rate=100.0, texts=1) is None
    refused = _refusal(ahead=500, own=500, active=1, rate=100.0, texts=1)
    assert isinstance(refused, errors.Overloaded) and refused.retry_after == 4  # 5 s expected, 1 s allowed
    # a flood of one client does not hold back another with nothing outstanding: it waits for (n - 1) * s texts
    assert _refusal(ahead=5_000, own=0, active=2, rate=100.0, texts=1) is None
    assert _refusal(ahead=5_000, own=5_000, active=2, rate=100.0, texts=1) is not None
    # ... unless its own job is large: then what the others run meanwhile counts
    assert _refusal(ahead=5_000, own=0, active=2, rate=100.0, texts=512) is not None
    # nothing ahead: admitted however large; unknown throughput: only the cap in texts
    assert _refusal(ahead=0, own=0, active=1, rate=1.0, texts=2048) is None
    assert _refusal(ahead=9_000, own=9_000, active=1, rate=None, texts=1) is None
    capped = _refusal(ahead=9_000, own=9_000, active=1, rate=None, texts=2048, online_queue_texts=10_000)
    assert capped is not None and "EMBEDQ_ONLINE_QUEUE_TEXTS" in str(capped) and capped.retry_after == 1
    # the cap is of the client's fair share too: another client's flood does not refuse a client with nothing out
    assert _refusal(ahead=20_000, own=0, active=2, rate=None, texts=1, online_queue_texts=10_000) is None
    # a stalled worker (no throughput): refused, told to look again within a minute
    assert _refusal(ahead=10, own=10, active=1, rate=0.0, texts=1).retry_after == MAX_RETRY_AFTER
    # 0 turns the expected-wait rule off; the deprecated job cap still counts messages in the list
    assert _refusal(ahead=10**6, own=10**6, active=1, rate=1.0, texts=1, online_max_wait=0,
                    online_queue_texts=0) is None
    assert "EMBEDQ_ONLINE_QUEUE_LIMIT" in str(_refusal(ahead=0, own=0, active=1, rate=None, texts=1, waiting=1000))


def test_backlog_reads_the_ready_workers_records_projected_to_now():
    now = 1000.0
    records = [{"ready": True, "queues": ["q"], "backlog": {"online": 500}, "throughput": 100.0, "reported_at": 998.0},
               {"ready": True, "queues": ["q"], "backlog": {"online": 40}, "throughput": None, "reported_at": 990.0},
               {"ready": False, "queues": ["q"], "backlog": {"online": 10**6}, "throughput": 1.0},
               {"ready": True, "queues": ["other"], "backlog": {"online": 10**6}, "throughput": 1.0},
               {"ready": True, "queues": ["q"], "backlog": "junk", "throughput": "junk"}]
    found = backlog(records, "q", now=now)
    assert (found.buffered, found.rate, found.workers) == (300 + 40, 100.0, 3)


@pytest.fixture(scope="module")
def held(redis_server, tmp_path_factory):
    """A gated worker whose throughput has been measured, holding client A's FLOOD-text online job unstarted (its
    record says so), and a gateway on its queue; the gate opens on the way out."""
    queue = f"embedq.test.admit.{tmp_path_factory.mktemp('q').name}"
    settings = Settings(broker_url=redis_server.url, queue=queue, online_max_wait=BOUND)
    worker = gated_handle(settings, tmp_path_factory.mktemp("logs") / "worker.log")
    free = Client(settings.model_copy(update={"online_max_wait": 0}), client_id="warm-up")
    try:
        # Throughput is measured while texts wait at two reports in a row (a second apart): rounds of work, each
        # twice the last, until the worker reports it (a fast machine runs a small round between two reports).
        jobs, end = 4, time.monotonic() + 600
        while True:
            handles = [free.submit([f"warm-up text {j} of job {i}, some words" for j in range(256)])
                       for i in range(jobs)]
            for handle in handles:
                handle.result(timeout=300)
            # a rate is published by the report that measures it, so a round that spanned two reports shows it now
            records = monitor.serving(monitor.live_workers(free.redis()), queue).ready
            if records and records[0].get("throughput"):
                break
            assert time.monotonic() < end, f"the worker never reported a measured throughput; last {records}"
            jobs *= 2
        flooder = Client(settings, client_id="A")
        with worker.gate_closed():
            flood = flooder.submit([f"A's text {i}" for i in range(FLOOD)])  # nothing ahead: admitted
            record = _record(free, queue, lambda r: r["backlog"]["online"] >= FLOOD, "A's texts buffered")
            gateway = GatewayHandle(redis_server.url, queue, tmp_path_factory.mktemp("gw") / "gw.log",
                                    EMBEDQ_ONLINE_MAX_WAIT=str(BOUND))
            try:
                yield SimpleNamespace(worker=worker, flooder=flooder, record=record, gateway=gateway)
            finally:
                gateway.stop()
                flood.cancel()  # dropped before it costs compute: the test module ends sooner
        flooder.close()
    finally:
        free.close()
        worker.stop()


def _record(client: Client, queue: str, ready, what: str, timeout: float = 300.0) -> dict:
    """The queue's worker record once ``ready(record)``: a state the worker reports every second."""
    end = time.monotonic() + timeout
    while True:
        records = monitor.serving(monitor.live_workers(client.redis()), queue).ready
        if records and ready(records[0]):
            return records[0]
        assert time.monotonic() < end, f"the worker never reported {what}; last {records}"
        time.sleep(0.1)


@pytest.mark.integration
def test_the_flooding_client_is_refused_at_once_and_a_quiet_one_admitted(held):
    worker, flooder = held.worker, held.flooder
    queue = worker.settings.queue_name
    r = flooder.redis()
    assert held.record["throughput"] > 0
    received = worker.stats()["jobs_received"]
    listed = monitor.waiting(r, queue)
    with pytest.raises(errors.Overloaded, match="EMBEDQ_ONLINE_MAX_WAIT") as refused:
        flooder.submit(["one more from A"])
    # about FLOOD / throughput seconds to wait, 1 allowed: told to come back after the difference, at least 1 s
    assert refused.value.retryable and 1 <= refused.value.retry_after <= MAX_RETRY_AFTER
    assert monitor.waiting(r, queue) == listed  # nothing sent
    with Client(worker.settings, client_id="B") as quiet:
        quiet.submit(["B's one text"])  # nothing outstanding: within its share, admitted
        worker.wait_until(lambda st: st["jobs_received"] >= received + 1, "B's job received")
    assert worker.stats()["jobs_received"] == received + 1  # B's, not A's refused one


@pytest.mark.integration
def test_the_gateway_answers_429_with_retry_after_before_sending_anything(held):
    worker = held.worker
    received = worker.stats()["jobs_received"]
    texts = [f"a large request's text {i}" for i in range(1000)]
    with httpx.Client(base_url=held.gateway.url, timeout=60) as http:
        tei = http.post("/embed", json={"inputs": texts}, headers={"Authorization": "Bearer client-c-secret"})
        assert tei.status_code == 429, tei.text
        assert int(tei.headers["retry-after"]) >= 1
        assert tei.json()["error_type"] == "Overloaded" and "EMBEDQ_ONLINE_MAX_WAIT" in tei.json()["error"]
        openai = http.post("/v1/embeddings", json={"input": texts, "model": "m"})
        assert openai.status_code == 429 and int(openai.headers["retry-after"]) >= 1, openai.text
        assert openai.json()["error"]["type"] == "Overloaded"
    assert worker.stats()["jobs_received"] == received  # neither request sent a job
    assert "client-c-secret" not in held.gateway.log.read_text(errors="replace")  # the key itself is never shown
