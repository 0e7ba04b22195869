"""The gateway's result waiter (:class:`embedq.gateway.results.AsyncResults`) with a real Redis that goes away."""

from __future__ import annotations

import asyncio
import time

import pytest

from embedq.broker import async_redis_client
from embedq.gateway.results import MAX_CONNECTIONS, POOL_WAIT, AsyncResults
from embedq.producers.client import Client
from embedq.producers.embedded import RedisServer
from embedq.results import ResultStore
from embedq.settings import Settings

pytestmark = pytest.mark.integration  # a redis-server of its own


def _results(client: Client) -> AsyncResults:
    url = client.settings.broker_url
    return AsyncResults(client.app, async_redis_client(client.settings, url, max_connections=MAX_CONNECTIONS,
                                                       pool_wait=POOL_WAIT))


def test_a_waiter_that_finds_redis_away_waits_for_it_and_gets_its_record():
    """A request whose job was sent just before Redis went away starts waiting while it is away (its SUBSCRIBE and
    GET fail): it waits on, and gets the record once Redis is back and the job is stored (the poller reads it), not a
    503 (CI went red so: tests/faults/test_broker.py, a request between sending and subscribing)."""
    server = RedisServer().start()
    client = Client(Settings(broker_url=server.url, queue="embedq.test.results"), follow_results=False)

    async def scenario() -> dict:
        results = _results(client)
        await results.start()
        try:
            server.stop()
            waiting = asyncio.ensure_future(results.wait("job-away", timeout=120))
            # Before the fix the waiter failed within milliseconds (connection refused); it must still wait.
            done, _ = await asyncio.wait({waiting}, timeout=2.0)
            assert not done, waiting.exception()
            server.start()
            await asyncio.to_thread(ResultStore(client.app).store, "job-away", {"answer": 42})
            return await asyncio.wait_for(waiting, 60)
        finally:
            await results.close()

    try:
        assert asyncio.run(scenario()) == {"answer": 42}
    finally:
        client.close()
        server.stop()


def test_waiters_that_subscribe_while_the_listener_reconnects_get_their_records():
    """Redis restarts while requests wait, and new requests start waiting while the result listener reconnects and
    re-subscribes its channels on the same pub/sub connection: each gets its record, none an error. A SUBSCRIBE sent
    on that half-reconnected connection raised AttributeError ('NoneType' object has no attribute 'writelines',
    redis-py 8.1) out of ``wait`` (a gateway 500 in tests/faults/test_broker.py with the fake model); now the key is
    polled and subscribed again once Redis answers. Several restarts, with the new waits at different moments of the
    reconnection, because the moment that fails is short."""
    keys = [f"old-{i}" for i in range(40)] + [f"new-{r}-{i}" for r in range(12) for i in range(20)]
    server = RedisServer().start()
    client = Client(Settings(broker_url=server.url, queue="embedq.test.results"), follow_results=False)
    store = ResultStore(client.app)

    async def scenario() -> list[dict]:
        results = _results(client)
        await results.start()
        waiting: list[asyncio.Future] = []
        try:
            # 40 at once on a fresh gateway, more than the pool's 32 connections: each unconnected SUBSCRIBE took a
            # connection of its own, and the 40 waited for the pool (POOL_WAIT) with all 32 taken
            old = [asyncio.ensure_future(results.wait(f"old-{i}", timeout=120)) for i in range(40)]
            end = time.monotonic() + 20
            while len(results.pubsub.channels) < len(old):  # all subscribed before the first restart
                assert time.monotonic() < end, f"{len(results.pubsub.channels)} of {len(old)} waiters subscribed"
                await asyncio.sleep(0.01)
            waiting += old
            for round_ in range(12):
                server.proc.kill()  # SIGKILL: the listener's connection breaks under it
                await asyncio.to_thread(server.proc.wait, 30)
                await asyncio.sleep(0.6)  # the listener has met the closed connection
                server.start()
                await asyncio.sleep(round_ * 0.05)  # new waits at a different point of the reconnection each round
                waiting += [asyncio.ensure_future(results.wait(f"new-{round_}-{i}", timeout=120)) for i in range(20)]
                await asyncio.sleep(0.3)
            await asyncio.to_thread(lambda: [store.store(k, {"key": k}) for k in keys])
            return await asyncio.wait_for(asyncio.gather(*waiting), 60)
        finally:
            for future in waiting:
                future.cancel()
            await results.close()

    try:
        got = asyncio.run(scenario())
        assert [g["key"] for g in got] == keys
    finally:
        client.close()
        server.stop()
