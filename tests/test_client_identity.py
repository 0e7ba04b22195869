"""The producer identity on the wire (issue 50): every job a :class:`Client` sends carries its client id in the
``embedq_client`` header, by the direct path and through ``send_task`` alike, and a worker reads it back
(``protocol.client_of``) whatever the header holds."""

from __future__ import annotations

import json
import os
import socket

import pytest

from embedq import errors
from embedq.producers.client import Client
from embedq.protocol import CLIENT_HEADER, MAX_CLIENT_CHARS, client_of
from embedq.settings import Settings

pytestmark = pytest.mark.integration  # the session's redis-server


def _client(redis_server, name: str, **kwargs) -> Client:
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.identity.{name}", online_queue_limit=0)
    return Client(settings, **kwargs)


def _sent(client: Client) -> list[dict]:
    """The messages waiting in the client's online queue, oldest first (and the queue emptied)."""
    r, queue = client.redis(), client.settings.queue_name
    messages = [json.loads(raw) for raw in reversed(r.lrange(queue, 0, -1))]
    r.delete(queue)
    return messages


@pytest.mark.parametrize("direct", [True, False])
def test_every_job_carries_the_clients_identity_and_a_call_may_name_another(redis_server, direct):
    client = _client(redis_server, f"ids.{direct}", client_id="tenant-a")
    if not direct:  # no direct route: every job goes through app.send_task
        client.writer.routes[("embedq.embed", client.settings.queue_name)] = None
    client.submit(["one"])
    client.submit_many([["a"], ["b"]])
    client.submit(["two"], client="tenant-b")
    client.submit_many([["c"]], client="tenant-c")
    client.submit_rerank("q", ["x"], client="tenant-d", queue=client.settings.queue_name)
    assert [m["headers"][CLIENT_HEADER] for m in _sent(client)] == [
        "tenant-a", "tenant-a", "tenant-a", "tenant-b", "tenant-c", "tenant-d"]
    assert client_of({CLIENT_HEADER: "tenant-b", "origin": "gen1@host"}) == "tenant-b"


def test_the_default_identity_is_the_setting_else_host_and_process(redis_server, monkeypatch):
    assert _client(redis_server, "default").client_id == f"{socket.gethostname()}:{os.getpid()}"
    monkeypatch.setenv("EMBEDQ_CLIENT_ID", "from-env")
    assert Client(Settings(broker_url=redis_server.url)).client_id == "from-env"
    # the constructor's keyword wins over the setting
    assert Client(Settings(broker_url=redis_server.url), client_id="mine").client_id == "mine"


@pytest.mark.parametrize("bad", ["", "x" * (MAX_CLIENT_CHARS + 1), "tab\there", 7, ["a"]])
def test_an_unusable_identity_is_refused_at_the_edge_and_nothing_is_sent(redis_server, bad):
    client = _client(redis_server, "bad")
    with pytest.raises(errors.InvalidOption, match="client id"):
        client.submit(["one"], client=bad)
    with pytest.raises(errors.InvalidOption, match="client id"):
        client.submit_many([["one"]], client=bad)
    assert _sent(client) == []
    with pytest.raises(errors.InvalidOption):
        Client(client.settings, client_id=bad if bad != "" else "\x00")


@pytest.mark.parametrize(("headers", "expected"), [
    ({CLIENT_HEADER: "tenant-a", "origin": "gen1@host"}, "tenant-a"),
    ({"origin": "gen1@host"}, "gen1@host"),  # a plain Celery producer: its node name
    ({CLIENT_HEADER: "x" * (MAX_CLIENT_CHARS + 1), "origin": "gen1@host"}, "gen1@host"),  # overlong
    ({CLIENT_HEADER: ["tenant-a"], "origin": "gen1@host"}, "gen1@host"),  # not a string
    ({CLIENT_HEADER: {"a": 1}, "origin": 12}, ""),
    ({CLIENT_HEADER: "", "origin": ""}, ""),
    ({CLIENT_HEADER: "new\nline"}, ""),
    ({}, ""),
    (None, ""),
    ("not a dict", ""),
])
def test_the_worker_reads_an_identity_from_any_header_without_raising(headers, expected):
    assert client_of(headers) == expected
