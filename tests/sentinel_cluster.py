"""A Redis primary, a replica and three sentinels on loopback ports, for the tests of failover (tests/test_sentinel*.py)
and bench/failover.py: real ``redis-server`` processes, the sentinels ``redis-server <conf> --sentinel``."""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from embedq.producers.embedded import RedisServer, find_redis_server, free_port

MASTER = "embedq-primary"


def _until(check, what: str, timeout: float) -> None:
    """Poll ``check()`` until it is true; the timeout only bounds a state that never comes."""
    end = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            if check():
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise AssertionError(f"never reached: {what} (last error: {last!r})")


class SentinelCluster:
    """Primary + replica + three sentinels watching them as :data:`MASTER` (quorum 2).

    ``down_after_ms``: Sentinel's ``down-after-milliseconds`` (how long a primary must not answer before it is
    considered down). ``data_args``: more arguments of both Redis servers (``--requirepass``, ``--aclfile``...);
    ``sentinel_conf``: more lines of each sentinel's configuration (``requirepass``, ``sentinel auth-pass``...).
    """

    def __init__(self, *, down_after_ms: int = 1000, failover_timeout_ms: int = 10_000,
                 data_args: list[str] | None = None, sentinel_conf: list[str] | None = None,
                 auth: dict[str, str] | None = None, sentinel_auth: dict[str, str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="embedq-sentinel-"))
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.data_args = data_args or []
        self.sentinel_conf = sentinel_conf or []
        self.auth = auth or {}  # redis-py credentials of the data servers (this harness's own checks)
        self.sentinel_auth = sentinel_auth or {}  # ... and of the sentinels
        self.servers: list[RedisServer] = []
        self.sentinels: list[tuple[int, subprocess.Popen[bytes]]] = []

    # -- the processes ------------------------------------------------------------------------------

    def start(self) -> SentinelCluster:
        (self.dir / "primary").mkdir()
        primary = RedisServer(extra_args=self.data_args, dir=str(self.dir / "primary")).start()
        (self.dir / "replica").mkdir()
        replica = RedisServer(extra_args=[*self.data_args, "--replicaof", "127.0.0.1", str(primary.port)],
                              dir=str(self.dir / "replica")).start()
        self.servers = [primary, replica]
        _until(lambda: self.data(replica.port).info("replication").get("master_link_status") == "up",
               "the replica in sync with the primary", 30)
        for n in range(3):
            port = free_port()
            conf = self.dir / f"sentinel-{n}.conf"
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {self.dir}",
                f"sentinel monitor {MASTER} 127.0.0.1 {primary.port} 2",
                f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}",
                f"sentinel failover-timeout {MASTER} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {MASTER} 1", *self.sentinel_conf, ""]))
            log = open(self.dir / f"sentinel-{n}.log", "wb")  # noqa: SIM115 - the process writes it until stopped
            proc = subprocess.Popen([find_redis_server(), str(conf), "--sentinel"], stdout=log, stderr=log)
            self.sentinels.append((port, proc))
        # Each sentinel knows the replica and the two others (learnt through the primary's hello channel).
        for port, _ in self.sentinels:
            _until(lambda port=port: self._knows_all(port), f"sentinel {port} sees the replica and two sentinels", 60)
        return self

    def _knows_all(self, port: int) -> bool:
        state = self.sentinel(port).sentinel_master(MASTER)
        return int(state.get("num-slaves", 0)) >= 1 and int(state.get("num-other-sentinels", 0)) >= 2

    def stop(self) -> None:
        for _, proc in self.sentinels:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for server in self.servers:
            server.stop()

    def __enter__(self) -> SentinelCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what clients use ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The broker URL (Celery's form), the sentinels in order."""
        return ";".join(f"sentinel://127.0.0.1:{port}" for port, _ in self.sentinels) + "/0"

    def sentinel(self, port: int | None = None) -> redis.Redis:
        port = port or self.sentinels[0][0]
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2, decode_responses=True,
                           **self.sentinel_auth)

    def data(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2, decode_responses=True, **self.auth)

    def primary_port(self) -> int:
        """The primary's port as a majority of the sentinels see it now."""
        seen = [int(self.sentinel(port).sentinel_get_master_addr_by_name(MASTER)[1]) for port, _ in self.sentinels]
        return max(set(seen), key=seen.count)

    def server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    # -- failover -----------------------------------------------------------------------------------

    def kill_primary(self) -> tuple[int, float]:
        """SIGKILL the primary (no shutdown, nothing flushed). Returns its port and the monotonic time of the kill."""
        port = self.primary_port()
        proc = self.server(port).proc
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return port, time.monotonic()

    def wait_promoted(self, old_port: int, timeout: float = 60.0) -> int:
        """Wait until every sentinel names a new primary and it answers as one; returns its port."""

        def promoted() -> bool:
            ports = {int(self.sentinel(p).sentinel_get_master_addr_by_name(MASTER)[1]) for p, _ in self.sentinels}
            if len(ports) != 1 or old_port in ports:
                return False
            return self.data(ports.pop()).info("replication").get("role") == "master"

        _until(promoted, "a replica promoted by the sentinels", timeout)
        return self.primary_port()

    def revive(self, old_port: int, timeout: float = 60.0) -> None:
        """Start the primary :meth:`kill_primary` killed again, on its port, as a replica of the new primary, and wait
        until it is in sync and every sentinel counts it as a live replica: the cluster can fail over once more (the
        sentinels start no second failover of the same primary within 2 × ``failover_timeout_ms`` of the first)."""
        new_port = self.primary_port()
        old = self.server(old_port)
        revived = RedisServer(port=old_port, extra_args=[*self.data_args, "--replicaof", "127.0.0.1", str(new_port)],
                              dir=old.dir).start()
        self.servers[self.servers.index(old)] = revived
        _until(lambda: self.data(old_port).info("replication").get("master_link_status") == "up",
               "the old primary in sync with the new one", timeout)

        def counted(port: int) -> bool:
            replicas = self.sentinel(port).sentinel_slaves(MASTER)
            return any(int(r["port"]) == old_port and not (r.get("is_sdown") or r.get("is_disconnected"))
                       for r in replicas)

        for port, _ in self.sentinels:
            _until(lambda port=port: counted(port), f"sentinel {port} sees the old primary as a live replica", timeout)
