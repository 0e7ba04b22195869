"""The Redis Sentinel example of ops/sentinel/ (issue 59): the compose override, its env files, the example configs
and the script that starts every node.

The compose model is checked like docker-compose.yml's (tests/compose_cli.py, no engine). The example configs are
checked by running them: ops/sentinel/start.sh starts a primary, its replica and three sentinels from
redis.conf.example and sentinel.conf.example with the local redis-server (Redis 6.2 in CI's virtualenv, a system 7.x
elsewhere), on loopback ports, with passwords; embedq's own client then finds the primary through them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from embedq import sentinel
from embedq.broker import NoReplicas, redis_client
from embedq.producers.embedded import find_redis_server, free_port
from embedq.settings import Settings
from tests import compose_cli
from tests.compose_cli import ROOT, Runner
from tests.sentinel_cluster import _until

SENTINEL_DIR = ROOT / "ops" / "sentinel"
OVERRIDE = SENTINEL_DIR / "compose.yml"
FILES = [ROOT / "docker-compose.yml", OVERRIDE]
SENTINEL_CONF = SENTINEL_DIR / "sentinel.conf.example"
REDIS_CONF = SENTINEL_DIR / "redis.conf.example"
START = SENTINEL_DIR / "start.sh"
SYSTEMD_ENV = ROOT / "ops" / "systemd" / "embedq.sentinel.env.example"
REDIS_PASSWORD = "redis-pass-for-the-test"
SENTINEL_PASSWORD = "sentinel-pass-for-the-test"
#: Where ops/sentinel/compose.yml mounts ops/sentinel.
MOUNT = "/etc/embedq-redis"
#: How long a state may take to come (it comes in seconds; the bound only ends a test whose state never comes).
WAIT = 30.0


# ------------------------------------------------------------------------------------------- helpers
def _directives(path: Path) -> list[list[str]]:
    """The configuration lines of a redis.conf or sentinel.conf, split in words (comments left out)."""
    return [line.split() for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _sentinel_option(name: str) -> list[str]:
    """The arguments of ``sentinel <name> ...`` in sentinel.conf.example."""
    found = [words[2:] for words in _directives(SENTINEL_CONF) if words[:2] == ["sentinel", name]]
    assert len(found) == 1, f"sentinel {name}: {found}"
    return found[0]


def _monitor() -> tuple[str, str, int, int]:
    """(master name, host, port, quorum) of sentinel.conf.example's ``sentinel monitor`` line."""
    master, host, port, quorum = _sentinel_option("monitor")
    return master, host, int(port), int(quorum)


def _active_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def _env(svc: dict[str, Any]) -> dict[str, str]:
    return {k: ("" if v is None else str(v)) for k, v in (svc.get("environment") or {}).items()}


def _settings(env: dict[str, str]) -> Settings:
    """The settings an embedq process would read from these EMBEDQ_ variables (each must be a field)."""
    fields = set(Settings.model_fields)
    values = {}
    for key, value in env.items():
        if key.startswith("EMBEDQ_"):
            name = key[len("EMBEDQ_"):].lower()
            assert name in fields, f"{key} is not an embedq setting"
            values[name] = value
    return Settings(**values)


# ------------------------------------------------------------------------------------------- compose
@pytest.fixture(scope="module")
def compose_runners(tmp_path_factory: pytest.TempPathFactory) -> list[Runner]:
    return compose_cli.compose_runners(tmp_path_factory)


@pytest.fixture(scope="module")
def model(compose_runners: list[Runner]) -> dict[str, Any]:
    """The resolved model of docker-compose.yml with the Sentinel override, every profile, both passwords set."""
    result = compose_cli.run_compose(compose_runners[0], FILES, "--profile", "*", "config", "--format", "json",
                                     env={"REDIS_PASSWORD": REDIS_PASSWORD, "SENTINEL_PASSWORD": SENTINEL_PASSWORD})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _services_of(model: dict[str, Any], command: str) -> dict[str, dict[str, Any]]:
    """The services that run ``start.sh <command>`` (redis or sentinel)."""
    return {name: svc for name, svc in model["services"].items()
            if svc.get("command") == ["sh", f"{MOUNT}/start.sh", command]}


def test_the_override_is_valid(compose_runners: list[Runner]) -> None:
    for runner in compose_runners:
        for profiles in ([], ["--profile", "*"]):
            result = compose_cli.run_compose(runner, FILES, *profiles, "config", "-q")
            assert result.returncode == 0, f"{runner[0]} {' '.join(profiles)} config -q: {result.stderr}"


def test_the_env_examples_select_the_override(compose_runners: list[Runner], tmp_path: Path) -> None:
    """`cat ops/compose.env.example ops/sentinel/sentinel.env.example > .env`, then a plain `docker compose`."""
    env_file = tmp_path / ".env"
    env_file.write_text((ROOT / "ops" / "compose.env.example").read_text(encoding="utf-8")
                        + (SENTINEL_DIR / "sentinel.env.example").read_text(encoding="utf-8"), encoding="utf-8")
    result = compose_cli.run_compose(compose_runners[0], [], "config", "--format", "json", env_file=env_file)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert "redis" not in services and {"redis-1", "redis-2", "sentinel-1", "sentinel-2", "sentinel-3"} <= set(services)
    for key in _active_env(SENTINEL_DIR / "sentinel.env.example"):
        assert key == "COMPOSE_FILE" or f"${{{key}" in OVERRIDE.read_text(encoding="utf-8"), f"{key} is not used"


def test_the_data_nodes_are_a_primary_and_its_replica(model: dict[str, Any]) -> None:
    assert "redis" not in model["services"], "the one Redis of docker-compose.yml is replaced"
    servers = _services_of(model, "redis")
    assert sorted(servers) == ["redis-1", "redis-2"]
    _master, host, port, _quorum = _monitor()
    replicaof = {name: _env(svc).get("REPLICAOF", "") for name, svc in servers.items()}
    assert replicaof == {host: "", "redis-2": f"{host} {port}"}, "the monitored primary and its one replica"
    data_volumes = set()
    for name, svc in servers.items():
        env = _env(svc)
        assert svc["image"].startswith("redis:") and svc["user"] == "redis", name
        assert env["ANNOUNCE"] == name, f"{name}: announce the name the others reach it by"
        assert env["REDIS_PASSWORD"] == REDIS_PASSWORD, name
        mounts = {v["target"]: v for v in svc["volumes"]}
        assert Path(mounts[MOUNT]["source"]).resolve() == SENTINEL_DIR.resolve() and mounts[MOUNT]["read_only"]
        assert mounts["/data"]["type"] == "volume"
        data_volumes.add(mounts["/data"]["source"])
        assert "redis-cli" in " ".join(svc["healthcheck"]["test"])
        assert svc["restart"] == "unless-stopped"
    assert len(data_volumes) == 2, "each server its own data"
    mounts = {v["target"]: v["source"] for v in servers[host]["volumes"]}
    assert mounts["/data"] == "redis-data", "the first primary keeps the one Redis's data"


def test_the_sentinels_watch_the_primary_by_name(model: dict[str, Any]) -> None:
    sentinels = _services_of(model, "sentinel")
    master, host, _port, quorum = _monitor()
    assert len(sentinels) == 3
    assert 2 * quorum > len(sentinels) and quorum <= len(sentinels), "a majority of the sentinels, and no more"
    volumes = set()
    for name, svc in sentinels.items():
        env = _env(svc)
        assert env["ANNOUNCE"] == name
        assert (env["REDIS_PASSWORD"], env["SENTINEL_PASSWORD"]) == (REDIS_PASSWORD, SENTINEL_PASSWORD), name
        assert host in svc["depends_on"], f"{name} resolves {host} at its start"
        assert f"ckquorum {master}" in " ".join(svc["healthcheck"]["test"]), name
        volumes.add(next(v["source"] for v in svc["volumes"] if v["target"] == "/data"))
    assert len(volumes) == 3, "each sentinel rewrites its own config file"


def test_every_client_finds_the_primary_through_the_sentinels(model: dict[str, Any]) -> None:
    """Every service of docker-compose.yml that had a broker URL (workers, Flower, gateway) has the sentinels'."""
    master, *_ = _monitor()
    sentinels = _services_of(model, "sentinel")
    clients = {name: svc for name, svc in model["services"].items() if "EMBEDQ_BROKER_URL" in _env(svc)}
    assert {"worker", "worker-gpu7", "flower", "gateway"} <= set(clients)
    for name, svc in model["services"].items():
        for key in _env(svc):
            assert not key.startswith("EMBEDQ_") or key[len("EMBEDQ_"):].lower() in Settings.model_fields, (name, key)
    for name, svc in clients.items():
        env = _env(svc)
        spec = sentinel.parse(env["EMBEDQ_BROKER_URL"])
        assert spec.hosts == tuple((s, sentinel.DEFAULT_PORT) for s in sorted(sentinels)), name
        assert (spec.db, spec.password) == (0, REDIS_PASSWORD), name
        assert env["EMBEDQ_SENTINEL_MASTER"] == master, f"{name}: the name of `sentinel monitor`"
        settings = _settings(env)
        assert settings.sentinel_password.get_secret_value() == SENTINEL_PASSWORD
        assert "EMBEDQ_RESULT_BACKEND" not in env, "the result store takes the broker's URL"
        assert set(svc["depends_on"]) == set(sentinels), f"{name}: waits for the sentinels only"
        assert all(dep["condition"] == "service_healthy" for dep in svc["depends_on"].values())


def test_without_passwords(compose_runners: list[Runner]) -> None:
    """Both passwords unset (the compose network only): no credentials anywhere, and the settings still valid."""
    result = compose_cli.run_compose(compose_runners[0], FILES, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    env = _env(services["worker"])
    assert sentinel.parse(env["EMBEDQ_BROKER_URL"]).password is None
    assert not _settings(env).sentinel_password.get_secret_value()
    for name in ("redis-1", "sentinel-1"):
        assert not _env(services[name])["REDIS_PASSWORD"], name


# --------------------------------------------------------------------------------------- the examples
def test_the_example_configs() -> None:
    directives = {tuple(words[:1]): words[1:] for words in _directives(REDIS_CONF)}
    for option, value in (("appendonly", "yes"), ("appendfsync", "everysec"), ("maxmemory-policy", "noeviction"),
                          ("min-replicas-to-write", "1"), ("min-replicas-max-lag", "10")):
        assert directives.get((option,)) == [value], option
    assert ("replicaof",) not in directives, "the replica's line is its own (start.sh: REPLICAOF)"
    master, _host, _port, quorum = _monitor()
    assert quorum == 2
    assert _sentinel_option("down-after-milliseconds") == [master, "5000"]
    assert _sentinel_option("failover-timeout") == [master, "60000"]
    lines = [words[:2] for words in _directives(SENTINEL_CONF)]
    monitor = lines.index(["sentinel", "monitor"])
    for name in ("resolve-hostnames", "announce-hostnames"):
        assert _sentinel_option(name) == ["yes"]
        assert lines.index(["sentinel", name]) < monitor, f"{name} before the monitor line, which names a host"


def test_the_systemd_env_example() -> None:
    env = _active_env(SYSTEMD_ENV)
    settings = _settings(env)
    spec = sentinel.parse(settings.broker_url or "")
    assert len(spec.hosts) == 3 and spec.password
    assert settings.sentinel_master == _monitor()[0]
    assert settings.sentinel_password is not None
    assert "EMBEDQ_DEVICE" not in env and "EMBEDQ_METRICS_PORT" not in env, "per instance, set by the unit"


# ---------------------------------------------------------------------------- the examples, running
class Nodes:
    """Nodes started by ops/sentinel/start.sh on loopback ports, from the example configs copied to ``examples``;
    each node's data folder and log (``<name>.log``) under ``root``."""

    def __init__(self, root: Path, examples: Path) -> None:
        self.root, self.examples = root, examples
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    def start(self, kind: str, name: str, port: int, *extra: str, **env: str) -> None:
        data = self.root / name
        data.mkdir(exist_ok=True)
        full_env = {"PATH": os.environ.get("PATH", ""), "EXAMPLES": str(self.examples), "DATA": str(data),
                    "REDIS_SERVER": find_redis_server(), "PORT": str(port), "BIND": "127.0.0.1",
                    "ANNOUNCE": "localhost", "REDIS_PASSWORD": REDIS_PASSWORD,
                    "SENTINEL_PASSWORD": SENTINEL_PASSWORD, **env}
        log = (self.root / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(["sh", str(START), kind, "--loglevel", "warning", *extra], env=full_env,
                                            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.ports[name] = port

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def client(self, name: str) -> redis.Redis:
        password = SENTINEL_PASSWORD if name.startswith("sentinel") else REDIS_PASSWORD
        return redis.Redis(port=self.ports[name], password=password, socket_timeout=5, socket_connect_timeout=5,
                           decode_responses=True)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    examples = tmp_path / "examples"
    examples.mkdir()
    shutil.copy(REDIS_CONF, examples / REDIS_CONF.name)
    master, host, port, _quorum = _monitor()
    text = SENTINEL_CONF.read_text(encoding="utf-8")
    primary = free_port()
    # The loopback address in place of the compose service's, and a shorter wait before the primary counts as down
    # (the test's failover); every other line as written.
    text, n = re.subn(rf"^sentinel monitor {master} {host} {port} ",
                      f"sentinel monitor {master} localhost {primary} ", text, flags=re.M)
    text, m = re.subn(rf"^sentinel down-after-milliseconds {master} \d+$",
                      f"sentinel down-after-milliseconds {master} 1000", text, flags=re.M)
    assert n == m == 1
    (examples / SENTINEL_CONF.name).write_text(text, encoding="utf-8")
    started = Nodes(tmp_path, examples)
    started.ports["redis-1"] = primary
    try:
        yield started
    finally:
        for name in sorted(started.procs, key=lambda n: not n.startswith("sentinel")):  # sentinels first
            started.stop(name)


@pytest.mark.integration
def test_the_example_configs_run_a_primary_a_replica_and_three_sentinels(nodes: Nodes) -> None:
    master, *_ = _monitor()
    # Redis 7's replicas wait 5 s (repl-diskless-sync-delay) for more replicas before a full sync: none here.
    nodes.start("redis", "redis-1", nodes.ports["redis-1"], "--repl-diskless-sync-delay", "0")
    nodes.start("redis", "redis-2", free_port(), REPLICAOF=f"localhost {nodes.ports['redis-1']}")
    _until(lambda: nodes.client("redis-2").info("replication")["master_link_status"] == "up", "the replica in sync",
           WAIT)
    # The sentinels after: the first INFO of the primary names the replica (the next comes 10 s later).
    for n in (1, 2, 3):
        nodes.start("sentinel", f"sentinel-{n}", free_port())
    sentinels = [f"sentinel-{n}" for n in (1, 2, 3)]

    def knows_all(name: str) -> bool:
        state = nodes.client(name).sentinel_master(master)
        return state["num-slaves"] == 1 and state["num-other-sentinels"] == 2

    for name in sentinels:
        _until(lambda name=name: knows_all(name), f"{name} sees the replica and the two other sentinels", WAIT)
    state = nodes.client("sentinel-1").sentinel_master(master)
    assert (state["ip"], state["port"], state["quorum"]) == ("localhost", nodes.ports["redis-1"], 2)
    assert state["is_master"] and not state["is_sdown"] and not state["is_odown"]
    assert nodes.client("sentinel-1").execute_command("SENTINEL", "CKQUORUM", master).startswith("OK")
    replicas = nodes.client("sentinel-1").sentinel_slaves(master)
    assert [(r["ip"], r["port"]) for r in replicas] == [("localhost", nodes.ports["redis-2"])], "by name"

    # embedq's client, configured as ops/sentinel/compose.yml configures the workers, reaches the primary.
    url = ";".join(f"sentinel://:{REDIS_PASSWORD}@127.0.0.1:{nodes.ports[s]}" for s in sentinels) + "/0"
    client = redis_client(Settings(broker_url=url, sentinel_master=master, sentinel_password=SENTINEL_PASSWORD))
    assert client.set("embedq:ops-test", "1")

    # min-replicas-to-write: no replica in sync, no write.
    nodes.stop("redis-2")
    _until(lambda: _refused(client), "the primary refusing writes without its replica", WAIT)
    nodes.start("redis", "redis-2", nodes.ports["redis-2"])  # its config file, kept: a replica again
    _until(lambda: not _refused(client), "writes accepted with the replica back in sync", WAIT)

    # A failover: the sentinels promote the replica and rewrite its config file (start.sh copied it once, so a
    # restart keeps the role); embedq's client follows. The new primary has no replica: it refuses writes.
    _until(lambda: all(not r["is_sdown"] for r in nodes.client("sentinel-1").sentinel_slaves(master)),
           "the sentinels see the replica back", WAIT)
    nodes.stop("redis-1", signal.SIGKILL)
    new = nodes.ports["redis-2"]
    _until(lambda: all(nodes.client(s).sentinel_get_master_addr_by_name(master) == ("localhost", new)
                       for s in sentinels), "every sentinel naming the replica as the primary", WAIT)
    _until(lambda: nodes.client("redis-2").info("replication")["role"] == "master", "the replica promoted", WAIT)
    _until(lambda: _refused(client), "the new primary, without a replica, refusing writes", WAIT)
    config = [line.split() for line in (nodes.root / "redis-2" / "redis.conf").read_text().splitlines()]
    assert not [words for words in config if words[:1] in (["replicaof"], ["slaveof"])], "the promotion was saved"


def _refused(client: redis.Redis) -> bool:
    """Whether the primary refuses a write for want of a replica in sync (NOREPLICAS)."""
    try:
        client.set("embedq:ops-test", "1")
    except NoReplicas:  # embedq.broker names redis-py's NOREPLICAS reply
        return True
    return False
