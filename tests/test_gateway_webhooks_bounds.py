"""Bounds of ``POST /jobs`` and its webhooks (issue 35), against a live gateway process, a real worker and webhook
receivers on real sockets: a job stores its validated request, not the raw body; a webhook URL is normalised before
the allow-list sees it and refused when parsers could read it two ways; ``GET /jobs/{id}`` shows what a receiver
answered no further than its status; a call has a total deadline and reads a bounded part of the answer; a URL the
HTTP client refuses ends the delivery as failed instead of leaving it owed."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from conftest import GatewayHandle as Gateway

from embedq.settings import Settings

pytestmark = pytest.mark.integration

#: The gateway's bounds in this module: a call of a webhook may take 2 s in all; one call, no retry.
DEADLINE = 2
RESPONSE_LIMIT = 65536
#: Bytes the flooding receiver offers; a gateway that reads it all takes every one.
FLOOD = 128 * 1024 * 1024


class RawReceiver:
    """A webhook receiver on a real socket, in a thread: reads each request (headers and body), records its path,
    then ``answer(receiver, connection)`` writes what it likes, counting in ``sent`` the bytes the kernel took.
    ``closed`` is set when a write fails because the gateway closed the connection, ``finished`` when the answer
    was written whole."""

    def __init__(self, answer: Callable[[RawReceiver, socket.socket], None]) -> None:
        self.answer = answer
        self.paths: list[str] = []
        self.sent = 0
        self.closed = threading.Event()
        self.finished = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(60)  # a gateway that neither reads nor closes must not hold this thread for ever
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                           if k.strip().lower() == "content-length"), 0)
            while len(body) < length:
                body += conn.recv(65536)
            self.paths.append(lines[0].split(" ")[1])
            self.answer(self, conn)
            self.finished.set()
        except (BrokenPipeError, ConnectionResetError) as exc:
            self.error = exc
            self.closed.set()
        except OSError as exc:
            self.error = exc
        finally:
            conn.close()

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def drip(receiver: RawReceiver, conn: socket.socket) -> None:
    """A 200 whose body comes a byte every 50 ms: each read gets something long before any per-read timeout."""
    receiver.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    for _ in range(100000):
        if receiver.stop.wait(0.05):
            return
        receiver.send(conn, b"x")


def flood(receiver: RawReceiver, conn: socket.socket) -> None:
    """A 200 with a 128 MiB body, written as fast as the gateway takes it."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # what the kernel holds here stays small
    receiver.send(conn, f"HTTP/1.1 200 OK\r\nContent-Length: {FLOOD}\r\n\r\n".encode())
    chunk = b"x" * 65536
    for _ in range(FLOOD // len(chunk)):
        receiver.send(conn, chunk)


def banner(receiver: RawReceiver, conn: socket.socket) -> None:
    """Not HTTP: a service's banner (what a webhook pointed at another port would read)."""
    receiver.send(conn, b"SECRET-BANNER of another service\r\n\r\n")


def ok_with_body(receiver: RawReceiver, conn: socket.socket) -> None:
    body = b"SECRET-BODY the receiver's own page"
    receiver.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


@pytest.fixture(scope="module")
def receivers():
    made = {name: RawReceiver(answer) for name, answer in
            (("drip", drip), ("flood", flood), ("banner", banner), ("ok", ok_with_body))}
    yield made
    for receiver in made.values():
        receiver.close()


@pytest.fixture(scope="module")
def gateway(worker, receivers, tmp_path_factory):
    allow = ",".join(f"{r.url}/hooks/" for r in receivers.values())
    g = Gateway(worker.settings.broker_url, worker.settings.queue_name, tmp_path_factory.mktemp("gw") / "gw.log",
                EMBEDQ_WEBHOOK_ALLOW=allow, EMBEDQ_WEBHOOK_ATTEMPTS="1", EMBEDQ_WEBHOOK_LEASE="1",
                EMBEDQ_WEBHOOK_TIMEOUT=str(DEADLINE), EMBEDQ_WEBHOOK_RESPONSE_LIMIT=str(RESPONSE_LIMIT))
    yield g
    g.stop()


@pytest.fixture(scope="module")
def redis(worker):
    from embedq.broker import redis_client

    client = redis_client(Settings(broker_url=worker.settings.broker_url))
    yield client
    client.close()


def _post(gateway, webhook: str | None = None, **body) -> httpx.Response:
    payload = {"kind": "embed", "body": body or {"inputs": ["a webhook's job"]}}
    if webhook is not None:
        payload["webhook"] = webhook
    return httpx.post(gateway.url + "/jobs", json=payload, timeout=60)


def _settled(gateway, job_id: str, timeout: float = 60) -> dict:
    """The job's state once its webhook is no longer pending (the bound only ends a wait that never ends)."""
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(f"{gateway.url}/jobs/{job_id}").json()
        if state.get("webhook", {}).get("state") != "pending":
            return state
        assert time.monotonic() < deadline, f"the webhook was still pending after {timeout} s: {state}"
        time.sleep(0.1)


def _wait(what: str, ready: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


# -- finding 5: what /jobs stores -----------------------------------------------------------------------------
def test_a_job_stores_its_validated_request_not_unknown_fields(gateway, redis):
    """Unknown fields are dropped, as every route ignores them (``extra="ignore"``): they are not stored."""
    from embedq.keys import GATEWAY_JOB_KEY

    pad = "A" * 2_000_000
    started = _post(gateway, inputs=["hello there"], truncate=True, pad=pad, parameters={"pad": pad})
    assert started.status_code == 202, started.text
    raw = redis.get(GATEWAY_JOB_KEY.format(started.json()["id"]))
    assert len(raw) < 2000, f"the job's record is {len(raw)} bytes"
    assert json.loads(raw)["body"] == {"inputs": ["hello there"], "truncate": True}
    nested = httpx.post(gateway.url + "/jobs", json={"kind": "similarity", "body": {
        "inputs": {"source_sentence": "a cat", "sentences": ["a dog"], "pad": pad},
        "parameters": {"truncate": False, "pad": pad}, "pad": pad}}, timeout=60)
    assert nested.status_code == 202, nested.text
    raw = redis.get(GATEWAY_JOB_KEY.format(nested.json()["id"]))
    assert len(raw) < 2000, f"the job's record is {len(raw)} bytes"
    assert json.loads(raw)["body"] == {"inputs": {"source_sentence": "a cat", "sentences": ["a dog"]},
                                       "parameters": {"truncate": False}}
    # the stored request still answers: the job's result is built from it
    deadline = time.monotonic() + 60
    while (state := httpx.get(f"{gateway.url}/jobs/{started.json()['id']}").json())["status"] == "queued":
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    assert state["status"] == "done" and len(state["result"]) == 1 and len(state["result"][0]) == 384


# -- finding 6: webhook URLs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("url", "normal"), [
    ("HTTP://Hooks.Example.COM:80/hooks/./a/../done?x=1#frag", "http://hooks.example.com/hooks/done?x=1"),
    ("https://hooks.example.com:443/hooks//x", "https://hooks.example.com/hooks/x"),
    ("http://hooks.example.com/hooks/%7e%41b%2a", "http://hooks.example.com/hooks/~Ab%2A"),
    ("http://hooks.example.com/hooks/%2e%2E/admin", "http://hooks.example.com/admin"),
    ("http://hooks.example.com/hooks/.%2e/admin", "http://hooks.example.com/admin"),
    ("http://hooks.example.com/hooks//../admin", "http://hooks.example.com/admin"),
    ("http://hooks.example.com/hooks/x/..", "http://hooks.example.com/hooks/"),
    ("http://hooks.example.com/hooks/é{x}", "http://hooks.example.com/hooks/%C3%A9%7Bx%7D"),
    ("http://[::1]:8080/hooks/x", "http://[::1]:8080/hooks/x"),
    ("http://hooks.example.com/hooks/..%2fadmin", None),  # an encoded separator: servers disagree
    ("http://hooks.example.com/hooks/..%5Cadmin", None),
    ("http://hooks.example.com/hooks/..\\admin", None),
    ("http://hooks.example.com\\@evil.example/hooks/", None),
    ("http://hooks.example.com/hooks/..;/admin", None),  # a dot segment to servlet containers
    ("http://hooks.example.com/hooks/\tx", None),  # urlsplit drops tabs and newlines; httpx refuses them
    ("http://hooks.example.com/hooks/x\n", None),
    ("http://hooks.example.com/hooks/x\x00", None),
    ("http://hooks.example.com/hooks/x y", None),
    ("http://hooks.example.com/hooks/%0d%0aX:1", None),
    ("http://hooks.example.com/hooks/%7F", None),
    ("http://hooks.example.com/hooks/%zz", None),
    ("http://hooks.example.com/hooks/" + "x" * 3000, None),
    ("http://%68ooks.example.com/hooks/", None),
    ("http://a@b@hooks.example.com/hooks/", None),  # httpx would send another userinfo than the one checked
])
def test_webhook_urls_are_normalised_or_refused(url, normal):
    from embedq.gateway.webhooks import allowed, normalize

    if normal is None:
        with pytest.raises(ValueError):
            normalize(url)
        assert not allowed(url, "*")
    else:
        assert normalize(url) == normal and normalize(normal) == normal
    under = normal is not None and normal.startswith("http://hooks.example.com/hooks/")
    assert allowed(url, "http://hooks.example.com/hooks/") is under
    assert allowed(url, "http://HOOKS.example.com:80/hooks/./") is under  # prefixes are normalised alike


def test_a_prefix_takes_its_path_and_the_paths_below_it_only():
    from embedq.gateway.webhooks import allowed

    assert allowed("http://h.example/hooks", "http://h.example/hooks")
    assert allowed("http://h.example/hooks/x", "http://h.example/hooks")
    assert not allowed("http://h.example/hooks-admin", "http://h.example/hooks")
    assert not allowed("http://h.example/hooks", "http://h.example/hooks/")


def test_a_webhook_cannot_leave_its_prefix_and_is_called_at_its_normal_form(gateway, receivers):
    ok = receivers["ok"]
    for path in ("../admin", "%2e%2e/admin", "%2E./admin", "./..//admin", "x/../../admin", "..%2fadmin",
                 "..\\admin", "..;/admin", "\tx", "x\n", "%0ax"):
        refused = _post(gateway, f"{ok.url}/hooks/{path}")
        assert refused.status_code == 422 and "webhook" in refused.json()["error"], (path, refused.text)
    started = _post(gateway, f"HTTP://127.0.0.1:{ok.url.rsplit(':', 1)[1]}/hooks/./a/../done?x=1")
    assert started.status_code == 202, started.text
    state = _settled(gateway, started.json()["id"])
    assert state["webhook"]["url"] == f"{ok.url}/hooks/done?x=1"
    assert state["webhook"]["state"] == "delivered" and state["webhook"]["status_code"] == 200
    assert "/hooks/done?x=1" in ok.paths and all(p.startswith("/hooks/") for p in ok.paths), ok.paths


def test_get_job_shows_no_byte_a_webhook_receiver_sent(gateway, receivers):
    """A webhook pointed at something that is not the receiver meant (another service's port) must not become a
    way to read it: ``GET /jobs/{id}`` keeps the outcome's kind and status code only."""
    for name, outcome in (("banner", "failed"), ("ok", "delivered")):
        started = _post(gateway, receivers[name].url + "/hooks/read")
        assert started.status_code == 202, started.text
        state = _settled(gateway, started.json()["id"])
        assert state["webhook"]["state"] == outcome, state
        assert "SECRET" not in httpx.get(f"{gateway.url}/jobs/{started.json()['id']}").text, state


# -- finding 7: bounded calls ---------------------------------------------------------------------------------
def test_a_dripping_receiver_is_cut_off_by_the_call_s_total_deadline(gateway, receivers):
    dripper = receivers["drip"]
    started = _post(gateway, dripper.url + "/hooks/slow")
    assert started.status_code == 202, started.text
    state = _settled(gateway, started.json()["id"])
    assert state["webhook"]["state"] == "failed" and "EMBEDQ_WEBHOOK_TIMEOUT" in state["webhook"]["error"], state
    _wait("the gateway closed the dripping connection", dripper.closed.is_set)
    assert dripper.sent < 100000  # it had a body's worth more to send


def test_a_large_answer_is_read_up_to_the_limit_and_its_connection_closed(gateway, receivers):
    flooder = receivers["flood"]
    started = _post(gateway, flooder.url + "/hooks/big")
    assert started.status_code == 202, started.text
    state = _settled(gateway, started.json()["id"])
    assert state["webhook"]["state"] == "delivered" and state["webhook"]["status_code"] == 200, state
    _wait("the answer ended, cut or whole", lambda: flooder.closed.is_set() or flooder.finished.is_set())
    # what the receiver could write: the gateway's reads (the limit plus one read of 64 KiB) and what the two
    # kernels buffer (about 256 KiB on a Linux loopback; the receiving one can autotune up to net.ipv4.tcp_rmem's
    # max); a gateway that read the whole answer takes all 128 MiB
    assert flooder.sent < 16 * 1024 * 1024, f"the receiver wrote {flooder.sent} bytes"
    assert flooder.closed.is_set()


def test_an_owed_webhook_with_a_url_the_client_refuses_fails_instead_of_staying_owed(gateway, receivers, redis):
    """A record stored before this check (or by a gateway with another allow-list) names a URL with a tab: its
    delivery ends as failed, not retried under a lease for the job's lifetime."""
    from embedq.keys import GATEWAY_JOB_KEY, WEBHOOK_LEASE_KEY, WEBHOOKS_KEY

    job_id = _post(gateway).json()["id"]
    key = GATEWAY_JOB_KEY.format(job_id)
    record = json.loads(redis.get(key))
    record["webhook"] = {"url": receivers["ok"].url + "/hooks/a\tb", "state": "pending"}  # allowed but for its tab
    redis.set(key, json.dumps(record), keepttl=True)
    redis.sadd(WEBHOOKS_KEY, job_id)  # owed; no replica holds its lease: the next sweep claims it
    state = _settled(gateway, job_id)
    assert state["webhook"]["state"] == "failed", state
    _wait("the webhook is no longer owed",
          lambda: not redis.sismember(WEBHOOKS_KEY, job_id) and not redis.exists(WEBHOOK_LEASE_KEY.format(job_id)))


def test_an_exception_of_the_http_client_ends_the_call_as_failed():
    """``_call`` itself, given a URL httpx refuses (``InvalidURL`` is no ``HTTPError``): one call, failed."""
    from embedq.gateway.webhooks import Webhooks

    async def call() -> tuple[str, dict]:
        async def nothing(*args):
            return None

        hooks = Webhooks(None, secret=None, attempts=5, lease=60, record=nothing, wait=nothing, state=nothing,
                         save=nothing)
        await hooks.start()
        try:
            return await hooks._call("job", "http://127.0.0.1:9/hooks/a\tb", {"id": "job"})
        finally:
            await hooks.close()

    outcome, detail = asyncio.run(call())
    assert outcome == "failed" and detail["attempts"] == 1 and "InvalidURL" in detail["error"], detail
