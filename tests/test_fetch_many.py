"""Many messages per round trip (issue 36): the worker's transport takes a burst of messages with one Lua script and
records each in kombu's ``unacked`` hash in the same atomic step, so kombu's redelivery sees them as it sees a
message from BRPOP; acknowledgements go in one pipeline.

Transport-level, against a real redis-server and messages sent by Celery itself; the worker-level behaviour (jobs
answered, SIGKILL loses none) is in tests/faults.
"""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from kombu import Consumer

from embedq.broker import make_app
from embedq.producers.embedded import RedisServer
from embedq.protocol import TASK_NAME
from embedq.settings import Settings
from embedq.workers import transport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture()
def setup():
    transport.install()
    with RedisServer() as server:
        queue = f"embedq.fetch.{uuid.uuid4().hex[:8]}"
        settings = Settings(broker_url=server.url, queue=queue)
        app = make_app(settings)
        yield app, queue, redis.Redis.from_url(server.url)
    transport.install()


def _consume(app, queue, plan, admits=None, fetch_bytes=transport.FetchPolicy.fetch_bytes):
    """Deliveries of one event-loop turn of a consumer on ``queue`` with ``plan`` as the worker's fetch plan."""
    transport.install(transport.FetchPolicy(plan=plan, admits=admits, fetch_bytes=fetch_bytes))
    got: list = []
    conn = app.connection_for_read()
    channel = conn.default_channel
    consumer = Consumer(channel, queues=[app.amqp.queues[queue]], accept=["json"],
                        on_message=got.append)
    consumer.consume()
    conn.drain_events(timeout=5)
    return conn, channel, got


def test_a_burst_is_taken_in_one_turn_and_recorded_as_kombu_records(setup):
    app, queue, r = setup
    ids = [app.send_task(TASK_NAME, args=[[f"text {i}"]], queue=queue).id for i in range(10)]
    r.lpush(queue, b"not an envelope")  # taken with the burst, dropped, never recorded
    ids += [app.send_task(TASK_NAME, args=[["last"]], queue=queue).id]
    sent = {json.loads(raw)["headers"]["id"]: json.loads(raw) for raw in r.lrange(queue, 0, -1) if raw[:1] == b"{"}

    conn, channel, got = _consume(app, queue, lambda queues: [(queues, 100)])
    try:
        assert [m.headers["id"] for m in got] == ids  # oldest first, one BRPOP and one script
        assert all(isinstance(m, transport.Message) for m in got)
        assert r.llen(queue) == 0
        unacked = r.hgetall(channel.unacked_key)
        assert sorted(unacked) == sorted(m.delivery_tag.encode() for m in got)
        assert r.zcard(channel.unacked_index_key) == len(got)
        for m in got:  # the record kombu's QoS.append writes: [envelope, exchange, routing key]
            envelope, exchange, routing_key = json.loads(unacked[m.delivery_tag.encode()])
            assert envelope == sent[m.headers["id"]]
            assert (exchange, routing_key) == (m.delivery_info["exchange"], m.delivery_info["routing_key"])

        # kombu's restore (the visibility timeout's path) reads the scripted records like its own.
        channel.qos.restore_by_tag(got[3].delivery_tag)
        assert r.llen(queue) == 1 and json.loads(r.lindex(queue, 0))["headers"]["id"] == ids[3]
        assert not r.hexists(channel.unacked_key, got[3].delivery_tag)

        # The rest acknowledged in one pipeline.
        rest = [m for i, m in enumerate(got) if i != 3]
        assert transport.ack_many(rest) == []
        assert all(m.acknowledged for m in rest)
        assert r.hlen(channel.unacked_key) == 0 and r.zcard(channel.unacked_index_key) == 0
    finally:
        conn.release()


def test_the_plan_bounds_the_burst(setup):
    app, queue, r = setup
    for i in range(10):
        app.send_task(TASK_NAME, args=[[f"text {i}"]], queue=queue)
    conn, channel, got = _consume(app, queue, lambda queues: [(queues, 3)])
    try:
        assert len(got) == 4  # the BRPOP's message and three more
        assert r.llen(queue) == 6 and r.hlen(channel.unacked_key) == 4
    finally:
        conn.release()
    assert r.llen(queue) == 10 and r.hlen(channel.unacked_key) == 0  # kombu's close handed the four back
    conn, channel, got = _consume(app, queue, None)  # no plan: one message per round trip, as kombu
    try:
        assert len(got) == 1 and r.llen(queue) == 9
    finally:
        conn.release()


def test_what_the_window_no_longer_admits_goes_back_unseen_and_in_order(setup):
    app, queue, r = setup
    ids = [app.send_task(TASK_NAME, args=[[f"text {i}"]], queue=queue).id for i in range(10)]
    before = r.lrange(queue, 0, -1)
    asked: list[str] = []
    conn, channel, got = _consume(app, queue, lambda queues: [(queues, 100)],
                                  admits=lambda q: asked.append(q) or len(asked) < 4)  # the BRPOP's + 3 more
    try:
        assert [m.headers["id"] for m in got] == ids[:4]
        assert r.hlen(channel.unacked_key) == 4 and r.zcard(channel.unacked_index_key) == 4
        # the six others are back at the head of the queue, byte for byte, oldest next (not marked redelivered)
        assert r.lrange(queue, 0, -1) == before[:6]
        assert transport.ack_many(got) == [] and r.hlen(channel.unacked_key) == 0
    finally:
        conn.release()


def test_a_fetch_brings_a_bounded_number_of_bytes(setup):
    """A burst of large entries: one fetch takes no more bytes than ``fetch_bytes`` beyond its BRPOP's message (the
    worker's memory and Redis's time in the script are bounded by bytes, not only by a count); the entry that would
    pass the bound stays in its place, oldest next, and a later round trip takes it."""
    app, queue, r = setup
    ids = [app.send_task(TASK_NAME, args=[["x" * 30_000]], queue=queue).id for _ in range(6)]
    sizes = [len(raw) for raw in r.lrange(queue, 0, -1)]
    room = 2 * max(sizes) + 100  # room for two beyond the BRPOP's
    before = r.lrange(queue, 0, -1)
    conn, channel, got = _consume(app, queue, lambda queues: [(queues, 100)], fetch_bytes=room)
    try:
        assert [m.headers["id"] for m in got] == ids[:3]
        assert r.lrange(queue, 0, -1) == before[:3]  # untouched, in order
        assert r.hlen(channel.unacked_key) == 3
        assert transport.ack_many(got) == []
    finally:
        conn.release()
    # smaller than any entry: one message per round trip
    conn, channel, got = _consume(app, queue, lambda queues: [(queues, 100)], fetch_bytes=100)
    try:
        assert [m.headers["id"] for m in got] == ids[3:4]
        assert r.lrange(queue, 0, -1) == before[:2]
    finally:
        conn.release()
