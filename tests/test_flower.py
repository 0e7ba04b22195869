"""``embedq flower`` listens on this machine only unless told, and never serves off loopback without basic auth.

Real processes: a private redis-server and ``python -m embedq flower`` on a free port; where it listens is read
from the process's own sockets (psutil), what it answers from a real HTTP request.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest

from embedq.producers.embedded import free_port

pytest.importorskip("flower")
pytestmark = pytest.mark.integration


def _env(redis_server, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBEDQ_FLOWER_", "FLOWER_"))}
    return {**env, "EMBEDQ_BROKER_URL": redis_server.url, **extra}


def _flower(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "embedq", "flower", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _listening(proc: subprocess.Popen, port: int) -> list[str]:
    """The addresses ``proc`` listens on at ``port``, once it does (the timeout bounds a start that never comes)."""
    end = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"flower exited ({proc.returncode}): {proc.stdout.read()}"
        ips = [c.laddr.ip for c in psutil.Process(proc.pid).net_connections(kind="inet")
               if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        if ips:
            return ips
        assert time.monotonic() < end, "flower never listened"
        time.sleep(0.1)


def _status(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_flower_listens_on_loopback_by_default_and_refuses_other_addresses_without_auth(redis_server):
    port = free_port()
    # Off loopback without auth, by flag or by setting: exit 2 with the reason, and nothing ever listened.
    for args, extra in (([f"--port={port}", "--address=0.0.0.0"], {}),
                        ([f"--port={port}"], {"EMBEDQ_FLOWER_ADDRESS": "0.0.0.0"})):
        refused = subprocess.run([sys.executable, "-m", "embedq", "flower", *args], env=_env(redis_server, **extra),
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2, refused.stderr
        assert "refusing to listen on '0.0.0.0' without basic auth" in refused.stderr
        assert "EMBEDQ_FLOWER_BASIC_AUTH" in refused.stderr
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass

    # By default: 127.0.0.1 only (no auth needed there).
    local = _flower([f"--port={port}"], _env(redis_server))
    try:
        assert _listening(local, port) == ["127.0.0.1"]
        assert _status(port) == 200
    finally:
        _stop(local)

    # Off loopback with basic auth (as ops/ runs it): it listens everywhere and its pages ask who is there.
    port = free_port()
    shared = _flower([f"--port={port}", "--address=0.0.0.0"],
                     _env(redis_server, EMBEDQ_FLOWER_BASIC_AUTH="ops:a-test-password"))
    try:
        assert _listening(shared, port) == ["0.0.0.0"]
        assert _status(port) == 401
    finally:
        _stop(shared)
