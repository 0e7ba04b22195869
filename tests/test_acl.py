"""Redis users per role (embedq/acl.py): each process kind works with only its role's rights, and a process that
steps outside them gets a typed, immediate ``broker_forbidden`` (a worker: exit status 78), never a hang.

A private redis-server loads ``ops/redis-acl.conf`` as it ships, its placeholders replaced by passwords (so the file
is checked as a whole: it loads, and it is what the code renders), plus a ``default`` user for the test's own
look at ``ACL LOG``. Then real processes, each logged in as its role: an ``embedq worker`` (the fake model), a
``Client`` (embed, cancel), ``embedq serve`` (POST /embed), ``embedq status`` and Flower. Every process logs in with a
user name and a password that only that user has, so a client that dropped the user name from the URL (logging in
as ``default``) fails here. After the working part the ACL LOG holds no refusal but redis-py's ``CLIENT SETINFO`` on
connecting (which it ignores): a right missing from a role fails the test even where its process only retries in the
background."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from urllib.parse import quote

import httpx
import pytest
import redis
from conftest import FAKE, ROOT_DIR, GatewayHandle, WorkerHandle

from embedq import acl, errors, monitor
from embedq.producers.client import Client
from embedq.producers.embedded import RedisServer, free_port, start_worker, stop_worker
from embedq.producers.status import take
from embedq.settings import Settings
from embedq.workers.refused import EXIT_STATUS

OPS_FILE = ROOT_DIR / "ops" / "redis-acl.conf"
ROOT_PASSWORD = "acl-test-root"
QUEUE = f"embedq.acltest-{uuid.uuid4().hex[:6]}"


def password(role: str) -> str:
    return f"{role}-acl-test-pw"


class Broker:
    """The private redis-server with the five users, and a URL per user."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.root = redis.Redis(port=server.port, username="default", password=ROOT_PASSWORD)

    def url(self, role: str, secret: str | None = None) -> str:
        return f"redis://{role}:{secret or password(role)}@127.0.0.1:{self.server.port}/0"

    def settings(self, role: str, **extra: object) -> Settings:
        return Settings(broker_url=self.url(role), queue=QUEUE, **{"model": FAKE["model"], **extra})

    def refusals(self) -> list[dict]:
        """ACL LOG, less redis-py's CLIENT SETINFO on connecting (refused: no role has ``client``; redis-py goes on)."""
        return [entry for entry in self.root.acl_log(count=10_000) if entry.get("object") != "client"]


def test_the_ops_file_is_what_the_code_renders():
    assert OPS_FILE.read_text() == acl.render(form="file"), \
        "ops/redis-acl.conf is stale: python -m embedq acl --file > ops/redis-acl.conf"
    cli = subprocess.run([sys.executable, "-m", "embedq", "acl", "--file"], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT_DIR)})
    assert cli.stdout == OPS_FILE.read_text()


def test_an_unedited_file_does_not_load(tmp_path):
    """A placeholder is not a valid password hash: Redis refuses the file rather than open a user anyone can guess."""
    assert set(acl.placeholders(OPS_FILE.read_text())) == {f"#<{role}-password-sha256>" for role in acl.ROLES}
    path = tmp_path / "users.acl"
    path.write_text(OPS_FILE.read_text())
    with pytest.raises(errors.Unavailable, match="exited"):
        RedisServer(extra_args=["--aclfile", str(path)]).start()
    path.write_text(re.sub(r"#<[a-z]+-password-sha256>", ">a-password", OPS_FILE.read_text()))
    RedisServer(extra_args=["--aclfile", str(path)]).start().stop()  # the placeholders were all it lacked


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("acl")
    text = OPS_FILE.read_text()
    for role in acl.ROLES:
        text = text.replace(acl.PLACEHOLDER.format(role=role), f">{password(role)}")
    (folder / "users.acl").write_text(text + f"user default on >{ROOT_PASSWORD} ~* &* +@all\n")
    server = RedisServer(dir=str(folder), extra_args=["--aclfile", str(folder / "users.acl"),
                                                      "--acllog-max-len", "10000"]).start()
    b = Broker(server)
    yield b
    b.root.close()
    server.stop()


@pytest.fixture(scope="module")
def worker(broker, tmp_path_factory):
    handle = WorkerHandle(broker.settings("worker", allow_fake_backend=True),
                          tmp_path_factory.mktemp("acl-worker") / "worker.log")
    yield handle
    handle.stop()


def _registry(broker) -> list[dict]:
    reader = redis.Redis.from_url(broker.url("monitor"))
    try:
        return monitor.live_workers(reader)
    finally:
        reader.close()


@pytest.mark.integration
def test_each_role_works_with_its_rights_alone(broker, worker, tmp_path):
    # the producer: a job end to end, and a cancelled one
    with Client(broker.settings("producer"), require_worker=True) as client:
        vectors = client.embed(["hello", "world"], timeout=60)
        assert vectors.shape[0] == 2
        bulk = client.submit(["bulk text"], traffic_class="bulk")
        assert bulk.result(60).shape[0] == 1
        handle = client.submit(["cancel me"], deadline=300)
        handle.cancel()
        with pytest.raises(errors.Cancelled):
            handle.result(60)
    # the producer again: `embedq index` of a small file, every row written (its overdue-job check reads the
    # registry, not Celery's remote control, which the producer's user may not use)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_")}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"doc-{i}", "text": f"indexed as the producer {i}"}) + "\n"
                           for i in range(50)))
    index = subprocess.run([sys.executable, "-m", "embedq", "index", str(src), "-o", str(out), "-q", "--json",
                            "--chunk-size", "8"], capture_output=True, text=True, timeout=300,
                           env={**env, "PYTHONPATH": str(ROOT_DIR), "EMBEDQ_BROKER_URL": broker.url("producer"),
                                "EMBEDQ_QUEUE": QUEUE, "EMBEDQ_MODEL": FAKE["model"]})
    assert index.returncode == 0, index.stderr
    assert json.loads(index.stdout)["rows"] == 50
    # the gateway: a TEI request, answered
    gateway = GatewayHandle(broker.url("gateway"), QUEUE, tmp_path / "gw.log", EMBEDQ_MODEL=FAKE["model"])
    try:
        answer = httpx.post(gateway.url + "/embed", json={"inputs": ["through the gateway"]}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()) == 1
    finally:
        gateway.stop()
    # the monitor: embedq status
    status = subprocess.run([sys.executable, "-m", "embedq", "status", "--json"], capture_output=True, text=True,
                            env={**env, "PYTHONPATH": str(ROOT_DIR), "EMBEDQ_BROKER_URL": broker.url("monitor")},
                            timeout=120)
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert QUEUE in shown["queues"] and any(QUEUE in w["queues"] for w in shown["workers"])
    # the worker did everything above as the worker user, and the registry shows it
    assert any(record.get("ready") for record in _registry(broker))
    # nothing any of them did was refused (a background thread's refusal shows only here)
    assert broker.refusals() == []


@pytest.mark.integration
def test_flower_sees_the_worker_and_the_queue(broker, worker, tmp_path):
    pytest.importorskip("flower")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBEDQ_", "FLOWER_"))}
    env.update({"PYTHONPATH": str(ROOT_DIR), "EMBEDQ_BROKER_URL": broker.url("flower"),
                "EMBEDQ_FLOWER_BASIC_AUTH": "acl:test", "EMBEDQ_QUEUE": QUEUE})
    log = tmp_path / "flower.log"
    proc = subprocess.Popen([sys.executable, "-m", "embedq", "flower", f"--port={port}", "--inspect_timeout=30000"],
                            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    node = next(r["hostname"] for r in _registry(broker) if f"-{worker.proc.pid}@" in r["hostname"])
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:  # asked by name, Flower returns with the worker's replies, not after the whole inspect timeout
                workers = httpx.get(f"http://127.0.0.1:{port}/api/workers?refresh=1&workername={quote(node)}",
                                    auth=("acl", "test"), timeout=60)
                break
            except httpx.HTTPError:
                assert time.monotonic() < end, log.read_text()
                time.sleep(0.2)
        assert workers.status_code == 200 and node in workers.json(), \
            workers.text  # remote control (inspect) broadcast and replies
        queues = httpx.get(f"http://127.0.0.1:{port}/api/queues/length", auth=("acl", "test"), timeout=60)
        assert queues.status_code == 200 and QUEUE in {q["name"] for q in queues.json()["active_queues"]}, queues.text
    finally:
        proc.terminate()
        try:
            proc.wait(3)
        except subprocess.TimeoutExpired:  # Flower's own stop may wait for its inspect timeout
            proc.kill()
            proc.wait()
    assert broker.refusals() == []


# -- outside a role: refused at once, with the typed error ---------------------------------------------------------
def _refused(call) -> errors.BrokerForbidden:
    with pytest.raises(errors.BrokerForbidden) as caught:
        call()
    error = caught.value
    assert not error.retryable and error.http_status == 503
    assert "refused Redis user" in error.message and "embedq acl" in error.message
    return error


@pytest.mark.integration
def test_a_monitor_or_flower_user_cannot_send_a_job(broker, worker):
    for role in ("monitor", "flower"):
        with Client(broker.settings(role)) as client:
            error = _refused(lambda client=client: client.embed(["not allowed"], timeout=60))
        assert f"user {role!r}" in error.message
        if role == "monitor":
            assert "(SET: " in error.message  # the refused command named, not its arguments (a message's texts)
    pusher = redis.Redis.from_url(broker.url("monitor"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        pusher.lpush(QUEUE, "a job")
    pusher.close()


@pytest.mark.integration
def test_a_producer_or_gateway_user_cannot_read_what_only_monitors_and_workers_read(broker, worker):
    for role in ("producer", "gateway"):
        error = _refused(lambda role=role: take(broker.settings(role), []))  # embedq status: kombu's unacked hash
        assert f"user {role!r}" in error.message
    consumer = redis.Redis.from_url(broker.url("producer"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        consumer.brpop([QUEUE], timeout=1)
    consumer.close()


@pytest.mark.integration
def test_a_wrong_password_is_forbidden_not_unreachable(broker):
    settings = broker.settings("producer").model_copy(update={"broker_url": broker.url("producer", "wrong")})
    with Client(settings) as client:
        error = _refused(lambda: client.embed(["x"], timeout=60))
    assert "does not accept the user's password" in error.message and "wrong" not in error.message  # no password


@pytest.mark.integration
def test_a_worker_without_the_worker_role_stops_with_status_78(broker, tmp_path):
    """A producer's user cannot consume: the worker says so once and exits, instead of reconnecting for ever."""
    log = tmp_path / "worker.log"
    proc = start_worker(broker.settings("producer", allow_fake_backend=True), log_path=log)
    try:
        code = proc.wait(120)
    finally:
        stop_worker(proc)
    text = log.read_text(errors="replace")
    assert code == EXIT_STATUS, text[-3000:]
    lines = [line for line in text.splitlines() if "[broker_forbidden]" in line]
    assert len(lines) == 1 and "user 'producer'" in lines[0] and "exit status 78" in lines[0], text[-3000:]
    assert not re.search(r"Trying to reconnect", text), text[-3000:]
