"""The gateway's result waiter (:class:`embedq.gateway.results.AsyncResults`) with a real Redis that goes away."""

from __future__ import annotations

import asyncio

import pytest

from embedq.gateway.results import AsyncResults
from embedq.producers.client import Client
from embedq.producers.embedded import RedisServer
from embedq.results import ResultStore
from embedq.settings import Settings

pytestmark = pytest.mark.integration  # a redis-server of its own


def test_a_waiter_that_finds_redis_away_waits_for_it_and_gets_its_record():
    """A request whose job was sent just before Redis went away starts waiting while it is away (its SUBSCRIBE and
    GET fail): it waits on, and gets the record once Redis is back and the job is stored (the poller reads it), not a
    503 (CI went red so: tests/faults/test_broker.py, a request between sending and subscribing)."""
    server = RedisServer().start()
    client = Client(Settings(broker_url=server.url, queue="embedq.test.results"), follow_results=False)

    async def scenario() -> dict:
        results = AsyncResults(client.app, server.url)
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
