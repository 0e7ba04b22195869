"""The deployment files: docker-compose.yml, Dockerfile and ops/ (Prometheus, alert rules, Grafana, systemd).

No Docker engine is needed: ``docker compose config`` only reads and validates the file (tests/compose_cli.py).
The Sentinel example of ops/sentinel/: tests/test_ops_sentinel.py.
"""

from __future__ import annotations

import configparser
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from embedq.settings import Settings
from embedq.workers.metrics import CATALOG, DEFAULT_PORTS, PREFIX, exported_names
from tests import compose_cli
from tests.compose_cli import FLOWER_AUTH, Runner

ROOT = Path(__file__).resolve().parents[1]
OPS = ROOT / "ops"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DASHBOARD = OPS / "grafana" / "embedq-dashboard.json"
WORKER_UNIT = OPS / "systemd" / "embedq-worker@.service"
FLOWER_UNIT = OPS / "systemd" / "embedq-flower.service"
ENV_EXAMPLE = OPS / "systemd" / "embedq.env.example"
PROMQL_FILES = [OPS / "alerts.yml", OPS / "prometheus.yml", OPS / "prometheus.compose.yml", DASHBOARD]

SHUTDOWN_TIMEOUT = Settings.model_fields["shutdown_timeout"].default
METRICS_PORT = DEFAULT_PORTS[0]  # a worker without EMBEDQ_METRICS_PORT takes the first free one of DEFAULT_PORTS
#: The ports of one compose service: its worker's and its replicas' (at most 4 by default), one container each.
COMPOSE_PORTS = set(range(METRICS_PORT, METRICS_PORT + 4))
JOB = "embedq-workers"
REQUIRED_ALERTS = {"EmbedqQueueGrowing", "EmbedqNoLiveWorkers", "EmbedqJobErrorRate", "EmbedqPaddingRatioHigh",
                   "EmbedqWorkerDown", "EmbedqDeadLetters", "EmbedqBrokerUnreachable"}
#: Metrics that are not embedq's own but may be used: Prometheus' own and prometheus_client's process
#: collector (every worker exports them).
OTHER_METRICS = {"up", "process_resident_memory_bytes", "process_virtual_memory_bytes", "process_start_time_seconds",
                 "process_cpu_seconds_total", "process_open_fds", "process_max_fds"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
QUEUE_GAUGES = ("embedq_queue_depth", "embedq_queue_waiting", "embedq_queue_unacked")


# ------------------------------------------------------------------------------------------- helpers
def _load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def _alert_rules() -> list[dict[str, Any]]:
    return [rule for group in _load_yaml(OPS / "alerts.yml")["groups"] for rule in group["rules"]]


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # panels of a collapsed row
    return out


def _promql_expressions() -> list[tuple[str, str]]:
    """(where, expression) for every PromQL expression in the alert rules and the dashboard."""
    exprs = [(f"alerts.yml:{rule['alert']}", rule["expr"]) for rule in _alert_rules()]
    dashboard = _dashboard()
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            exprs.append((f"dashboard:{panel['title']}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        match = re.fullmatch(r"\s*label_values\((.+),\s*\w+\)\s*", text)
        if var.get("type") == "query":
            assert match, f"dashboard variable {var['name']}: expected label_values(selector, label), got {text!r}"
            exprs.append((f"dashboard variable {var['name']}", match.group(1)))
    return exprs


_PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                    "offset", "inf", "nan"}


def _metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (a lexical scan: strings, label sets, ranges, grouping
    clauses and function calls are removed first)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)\b(?!\s*\()", text):
        name = match.group(1)
        if name.lower() not in _PROMQL_KEYWORDS:
            names.add(name)
    return names


def _grafana_to_promql(expr: str) -> str:
    """Grafana's variables made into something a PromQL parser accepts."""
    expr = re.sub(r"\$__\w+", "5m", expr)  # $__rate_interval, $__interval (only used as ranges)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)  # $instance, $queue (only used inside regex matchers)


def _unit_values(path: Path, section: str, key: str) -> list[str]:
    """Every value of a (repeatable) key of a systemd unit section, in order."""
    values, current = [], None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
        elif current == section and "=" in line:
            name, value = line.split("=", 1)
            if name.strip() == key:
                values.append(value.strip())
    return values


def _unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(path.read_text(encoding="utf-8"), source=str(path))
    return parser


def _seconds(duration: Any) -> float:
    """A duration in seconds: a number or bare number string (seconds, as systemd reads it) or a compose /
    Go duration ("1m0s", "90s")."""
    text = str(duration).strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|min|m|s|us|ns)", text)
    assert parts and "".join(v + u for v, u in parts) == text, f"unreadable duration {duration!r}"
    units = {"h": 3600, "min": 60, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    return sum(float(value) * units[unit] for value, unit in parts)


def _port_range(spec: str) -> range:
    """The ports of a compose port spec: "9808" or "9808-9811" (a protocol suffix left out)."""
    first, _, last = spec.split("/")[0].partition("-")
    return range(int(first), int(last or first) + 1)


def _env_dict(environment: Any) -> dict[str, str]:
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment)
    return {k: ("" if v is None else str(v)) for k, v in (environment or {}).items()}


# ------------------------------------------------------------------------------------------- compose
@pytest.fixture(scope="module")
def compose_runners(tmp_path_factory: pytest.TempPathFactory) -> list[Runner]:
    return compose_cli.compose_runners(tmp_path_factory)


def _compose(runner: Runner, *args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    return compose_cli.run_compose(runner, [COMPOSE_FILE], *args, env=env)


@pytest.fixture(scope="module")
def compose(compose_runners: list[Runner]) -> dict[str, Any]:
    """The resolved model of docker-compose.yml with every profile active."""
    result = _compose(compose_runners[0], "--profile", "*", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _workers(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if (svc.get("command") or [None])[0] == "worker"}


def test_compose_config_is_valid(compose_runners: list[Runner]) -> None:
    for runner in compose_runners:
        for profiles in ([], ["--profile", "*"]):
            result = _compose(runner, *profiles, "config", "-q")
            assert result.returncode == 0, f"{runner[0]} {' '.join(profiles)} config -q: {result.stderr}"


def test_compose_requires_flower_basic_auth(compose_runners: list[Runner]) -> None:
    for runner in compose_runners:
        result = _compose(runner, "config", "-q", env={"FLOWER_BASIC_AUTH": None})
        assert result.returncode != 0, f"{runner[0]}: compose accepted a stack without Flower's basic auth"
        assert "FLOWER_BASIC_AUTH" in result.stderr


def test_compose_redis_is_durable_and_never_evicts(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert redis["image"].startswith("redis:")
    for option, value in (("--appendonly", "yes"), ("--maxmemory-policy", "noeviction"),
                          ("--appendfsync", "everysec")):
        assert option in command and command[command.index(option) + 1] == value, command
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])
    assert "redis-cli" in " ".join(redis["healthcheck"]["test"])


def test_compose_redis_password_reaches_workers(compose_runners: list[Runner]) -> None:
    result = _compose(compose_runners[0], "config", "--format", "json", env={"REDIS_PASSWORD": "s3cret"})
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    command = services["redis"]["command"]
    assert command[command.index("--requirepass") + 1] == "s3cret"
    for name in ("worker", "flower"):
        assert _env_dict(services[name]["environment"])["EMBEDQ_BROKER_URL"] == "redis://:s3cret@redis:6379/0"


def test_compose_one_gpu_per_worker(compose: dict[str, Any]) -> None:
    workers = _workers(compose)
    assert "worker" in workers and len(workers) >= 2, sorted(workers)
    seen: dict[str, str] = {}
    for name, svc in workers.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        device = devices[0]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        # `count: 1` would give every container GPU 0 (the engine maps count N to devices 0..N-1).
        assert "count" not in device and len(device["device_ids"]) == 1, f"{name}: pin exactly one GPU by id"
        gpu = device["device_ids"][0]
        assert gpu not in seen, f"{name} and {seen.get(gpu)} share GPU {gpu}"
        seen[gpu] = name
        env = _env_dict(svc["environment"])
        assert env["EMBEDQ_DEVICE"] == "cuda:0", f"{name}: the container's only GPU is cuda:0"
        assert re.fullmatch(r"redis://(:[^@/]+@)?redis:6379/0", env["EMBEDQ_BROKER_URL"]), env["EMBEDQ_BROKER_URL"]
        # No port: the worker and its replicas take the first free ones; on every address, for Prometheus.
        assert "EMBEDQ_METRICS_PORT" not in env and env["EMBEDQ_METRICS_ADDR"] == "0.0.0.0", name
        exposed = {p for spec in svc["expose"] for p in _port_range(str(spec))}
        assert exposed >= COMPOSE_PORTS, f"{name}: expose the metrics ports {sorted(COMPOSE_PORTS)}"
        shutdown = float(env.get("EMBEDQ_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT))
        assert _seconds(svc["stop_grace_period"]) > shutdown, f"{name}: SIGKILL before the hand-back completes"
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM"
        assert svc["restart"] == "unless-stopped"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert name == "worker" or svc.get("profiles"), f"{name}: extra GPUs are opt-in (a profile)"
    assert sorted(seen) == [str(i) for i in range(len(seen))], f"GPU ids should be 0..N-1: {sorted(seen)}"
    hostnames = [svc["command"][svc["command"].index("--hostname") + 1] for svc in workers.values()]
    assert len(set(hostnames)) == len(hostnames), hostnames


def test_compose_flower_requires_auth_and_is_published(compose: dict[str, Any]) -> None:
    flower = compose["services"]["flower"]
    assert flower["command"][0] == "flower"
    assert "--address=0.0.0.0" in flower["command"], "published: embedq flower listens on 127.0.0.1 by default"
    assert _env_dict(flower["environment"])["EMBEDQ_FLOWER_BASIC_AUTH"] == FLOWER_AUTH
    assert any(int(p["target"]) == 5555 and p.get("published") for p in flower["ports"])
    assert flower["image"] == compose["services"]["worker"]["image"]
    assert "deploy" not in flower or not flower["deploy"].get("resources"), "Flower needs no GPU"


def test_compose_gateway_serves_http_and_is_scraped(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["command"][:1] == ["serve"] and gateway["image"] == compose["services"]["worker"]["image"]
    assert any(int(p["target"]) == 8080 and p.get("published") for p in gateway["ports"])
    assert "deploy" not in gateway or not gateway["deploy"].get("resources"), "the gateway needs no GPU"
    config = _load_yaml(OPS / "prometheus.compose.yml")
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "embedq-gateway")
    assert [sd["names"] for sd in job["dns_sd_configs"]] == [["gateway"]] and job["dns_sd_configs"][0]["port"] == 8080


def test_compose_prometheus_mounts_config_and_scrapes_every_worker(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    mounts = {v["target"]: Path(v["source"]) for v in prometheus["volumes"] if v["type"] == "bind"}
    config_path = mounts["/etc/prometheus/prometheus.yml"]
    assert config_path.resolve() == (OPS / "prometheus.compose.yml").resolve()
    assert mounts["/etc/prometheus/alerts.yml"].resolve() == (OPS / "alerts.yml").resolve()
    assert any(int(p["target"]) == 9090 for p in prometheus["ports"])
    config = _load_yaml(config_path)
    assert "alerts.yml" in config["rule_files"]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == JOB)
    assert all(sd["type"] == "A" for sd in job["dns_sd_configs"])
    # Every worker service, and only those, is scraped by name on each port its worker and replicas may take.
    for port in COMPOSE_PORTS:
        names = {name for sd in job["dns_sd_configs"] if sd["port"] == port for name in sd["names"]}
        assert names == set(_workers(compose)), f"port {port}: {sorted(names)}"


def test_compose_grafana_is_provisioned_with_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    assert grafana.get("profiles"), "Grafana is optional"
    mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"] if v["type"] == "bind"}
    dashboard_target = next(t for t, src in mounts.items() if src.resolve() == DASHBOARD.resolve())
    provisioning = next(src for t, src in mounts.items() if t == "/etc/grafana/provisioning")
    providers = [p for f in (provisioning / "dashboards").glob("*.yml") for p in _load_yaml(f)["providers"]]
    assert any(str(Path(dashboard_target).parent) == p["options"]["path"] for p in providers)
    sources = [d for f in (provisioning / "datasources").glob("*.yml") for d in _load_yaml(f)["datasources"]]
    assert any(d["type"] == "prometheus" and d["url"] == "http://prometheus:9090" for d in sources)


def test_compose_embedq_variables_are_settings(compose: dict[str, Any]) -> None:
    fields = set(Settings.model_fields)
    for name, svc in compose["services"].items():
        for key in _env_dict(svc.get("environment")):
            if key.startswith("EMBEDQ_"):
                assert key[len("EMBEDQ_"):].lower() in fields, f"{name}: {key} is not an embedq setting"


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:\S+-cuda\d+\.\d+-cudnn\d+-runtime$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["embedq"\]$', text, re.M)
    assert re.search(r'^CMD \["worker"\]$', text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0"), "the container runs as a non-root user"
    install = next(line for line in text.splitlines() if "pip install" in line and not line.startswith("#"))
    assert ".[worker,flower,gateway]" in install and "--constraint" in install, "keep the base image's torch"
    assert f"EXPOSE {METRICS_PORT}" in text
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*" or ".venv" in patterns, "keep .venv (and everything but the package) out of the image"


# ---------------------------------------------------------------------------------------- prometheus
def _scraped(config: dict[str, Any]) -> dict[str, set[int]]:
    """The ports the workers' job of a bare-metal configuration scrapes, by machine."""
    job = next(j for j in config["scrape_configs"] if j["job_name"] == JOB)
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert len(set(targets)) == len(targets), "a target listed twice"
    out: dict[str, set[int]] = {}
    for target in targets:
        host, port = target.rsplit(":", 1)
        out.setdefault(host, set()).add(int(port))
    return out


def test_prometheus_bare_metal_config() -> None:
    config = _load_yaml(OPS / "prometheus.yml")
    assert "alerts.yml" in config["rule_files"]
    scraped = _scraped(config)
    assert len(scraped) >= 2, "example: several machines"
    # Two workers started alike on one machine (embedq-worker@0 and @1, or the README's command twice) take the
    # first two free default ports, their replicas the next ones: every machine is scraped on all of them.
    first_two = set(DEFAULT_PORTS[:2])
    for machine, ports in scraped.items():
        assert first_two <= ports, f"{machine}: both workers' endpoints ({sorted(first_two)}) are not scraped"
        assert ports == set(DEFAULT_PORTS), f"{machine}: scrape every default port, {DEFAULT_PORTS}"
    job = next(j for j in config["scrape_configs"] if j["job_name"] == JOB)
    assert all(group.get("labels", {}).get("machine") for group in job["static_configs"]), "label the machine"


def test_alert_rules_are_complete() -> None:
    data = _load_yaml(OPS / "alerts.yml")
    assert [g["name"] for g in data["groups"]] == ["embedq"]
    rules = _alert_rules()
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names), "duplicate alert names"
    assert set(names) >= REQUIRED_ALERTS, REQUIRED_ALERTS - set(names)
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule["alert"]
        assert rule["expr"].strip(), rule["alert"]
        assert re.fullmatch(r"\d+[smhd]", str(rule["for"])), f"{rule['alert']}: for: {rule['for']!r}"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"].get("runbook", "").strip(), f"{rule['alert']}: add a runbook hint"
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
    by_name = {r["alert"]: r["expr"] for r in rules}
    assert "deriv(" in by_name["EmbedqQueueGrowing"] and "embedq_queue_depth" in by_name["EmbedqQueueGrowing"]
    assert "absent(embedq_worker_info)" in by_name["EmbedqNoLiveWorkers"]
    assert {"embedq_jobs_failed_total", "embedq_jobs_received_total"} <= _metric_names(by_name["EmbedqJobErrorRate"])
    assert {"embedq_real_tokens_total", "embedq_padded_tokens_total"} <= _metric_names(
        by_name["EmbedqPaddingRatioHigh"]) or "embedq_padding_ratio" in by_name["EmbedqPaddingRatioHigh"]
    assert "embedq_broker_up" in by_name["EmbedqBrokerUnreachable"]
    assert "up{" in by_name["EmbedqWorkerDown"] and JOB in by_name["EmbedqWorkerDown"]
    assert "embedq_dead_letters_total" in by_name["EmbedqDeadLetters"]
    # The codes that are the clients' fault are named for whoever gets the error-rate page.
    description = " ".join(_alert_rules()[names.index("EmbedqJobErrorRate")]["annotations"].values())
    for code in ("invalid_option", "too_many_texts", "backend_error", "dead_letter"):
        assert code in description


def test_queue_gauges_are_never_summed() -> None:
    """Every worker reports every queue's depth: a sum counts each queue once per worker."""
    for where, expr in _promql_expressions():
        if not any(g in expr for g in QUEUE_GAUGES):
            continue
        flat = re.sub(r"\s+", " ", expr)
        for gauge in QUEUE_GAUGES:
            for match in re.finditer(rf"\b(sum|avg|count)\b[^()]*\(\s*(rate\(|increase\()?{gauge}\b", flat):
                pytest.fail(f"{where}: {match.group(0)}: use max by (queue)")
            if gauge in flat and "variable" not in where:
                assert re.search(rf"max by \(queue\) \(\s*{gauge}\b", flat), f"{where}: aggregate {gauge} with max"


def test_every_metric_used_exists() -> None:
    """Every embedq_* name in the ops files (queries, descriptions, comments) is one a worker exports; in
    queries, with the suffix its type gets (counters _total, histograms _bucket/_sum/_count). Other metric
    names come from an allow-list."""
    exported = exported_names()
    allowed_forms = {PREFIX + name + suffix for name, (kind, _help) in CATALOG.items() for suffix in SUFFIXES[kind]}
    for path in PROMQL_FILES:
        for name in set(re.findall(r"(?<![\w.-])embedq_[a-z0-9_]+", path.read_text(encoding="utf-8"))):
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert name in exported or base in exported, f"{path.name}: {name} is not an embedq metric"
    used = set()
    for where, expr in _promql_expressions():
        names = _metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for name in names:
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            kind = CATALOG.get(base[len(PREFIX):], ("?",))[0] if base.startswith(PREFIX) else "?"
            assert name in allowed_forms or name in OTHER_METRICS, f"{where}: unknown metric {name} ({kind}?)"
        used |= names
    assert {"up", "process_resident_memory_bytes"} <= used


def test_promql_parses() -> None:
    promql_parser = pytest.importorskip("promql_parser")
    for where, expr in _promql_expressions():
        try:
            ast = promql_parser.parse(_grafana_to_promql(expr))
        except Exception as exc:
            pytest.fail(f"{where}: {exc}: {expr}")
        selected: set[str] = set()

        def visit(node: Any, selected: set[str] = selected) -> None:
            if isinstance(node, promql_parser.VectorSelector) and node.name:
                selected.add(node.name)

        promql_parser.walk(ast, visit)
        assert selected == _metric_names(expr), f"{where}: the lexical scan disagrees with the parser"


# ---------------------------------------------------------------------------------------------- grafana
def test_grafana_dashboard() -> None:
    dashboard = _dashboard()
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds_vars = [v for v in variables.values() if v["type"] == "datasource" and v["query"] == "prometheus"]
    assert len(ds_vars) == 1
    ds_ref = "${" + ds_vars[0]["name"] + "}"
    assert {"instance", "queue"} <= set(variables)
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids), "panel ids must be unique"
    exprs = []
    for panel in panels:
        assert panel.get("title", "").strip(), f"panel {panel['id']} has no title"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == ds_ref, f"{panel['title']}: use the data source variable"
        targets = [t for t in panel.get("targets", []) if t.get("expr", "").strip()]
        assert targets, f"{panel['title']}: no target with an expr"
        for target in panel["targets"]:
            assert target.get("datasource", {"uid": ds_ref})["uid"] == ds_ref, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), f"{panel['title']}: duplicate refId"
        exprs.extend(t["expr"] for t in targets)
    text = "\n".join(exprs)
    for needed in ("embedq_queue_waiting", "embedq_queue_unacked", "embedq_worker_info",
                   "embedq_items_succeeded_total", "embedq_real_tokens_total", "embedq_jobs_failed_total",
                   "embedq_padded_tokens_total", "embedq_batch_items_bucket", "embedq_batch_tokens_bucket",
                   "embedq_queue_seconds_bucket", "embedq_buffer_seconds_bucket", "embedq_job_seconds_bucket",
                   "embedq_inference_seconds_bucket", "embedq_items_in_flight", "embedq_model_load_seconds",
                   "process_resident_memory_bytes"):
        assert needed in text, f"the dashboard has no panel on {needed}"
    for quantile in ("histogram_quantile(0.5,", "histogram_quantile(0.95,", "histogram_quantile(0.99,"):
        assert quantile in text


def test_grafana_panels_do_not_overlap() -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in _dashboard()["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


# ---------------------------------------------------------------------------------------------- systemd
@pytest.mark.parametrize("path", [WORKER_UNIT, FLOWER_UNIT], ids=lambda p: p.name)
def test_systemd_units_parse(path: Path) -> None:
    unit = _unit(path)
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    assert unit["Unit"]["Description"].strip()
    assert unit["Service"]["ExecStart"].startswith("/opt/embedq/.venv/bin/embedq ")
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert unit["Service"]["User"] not in ("root", "0")
    assert unit["Service"]["Restart"] == "always"
    assert "/etc/embedq/embedq.env" in _unit_values(path, "Service", "EnvironmentFile")


def test_systemd_worker_unit() -> None:
    unit = _unit(WORKER_UNIT)["Service"]
    exec_start = unit["ExecStart"].split()
    assert exec_start[1] == "worker"
    assert exec_start[exec_start.index("--device") + 1] == "cuda:%i"
    assert exec_start[exec_start.index("--hostname") + 1] == "embedq-gpu%i@%H"
    assert unit["KillSignal"] == "SIGTERM"
    assert _seconds(unit["TimeoutStopSec"]) > SHUTDOWN_TIMEOUT, "systemd would SIGKILL the worker before the hand-back"
    assert "PrivateDevices" not in unit, "PrivateDevices hides /dev/nvidia*"
    # No per-instance port (each instance takes the first free default one, which ops/prometheus.yml scrapes); on
    # every address, so that Prometheus reaches it (the worker's own default is 127.0.0.1).
    env = " ".join(_unit_values(WORKER_UNIT, "Service", "Environment")).split()
    assert not [v for v in env if v.startswith("EMBEDQ_METRICS_PORT=")]
    assert "EMBEDQ_METRICS_ADDR=0.0.0.0" in env


def test_systemd_flower_unit() -> None:
    unit = _unit(FLOWER_UNIT)["Service"]
    assert unit["ExecStart"].split()[1] == "flower"
    assert "basic" not in unit["ExecStart"].lower(), "the password belongs in an environment file, not argv"


def test_env_example() -> None:
    fields = set(Settings.model_fields)
    active = {}
    for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            active[key.strip()] = value.strip()
    assert active["EMBEDQ_BROKER_URL"].startswith(("redis://", "rediss://"))
    for key in active:
        assert key.startswith("EMBEDQ_") and key[len("EMBEDQ_"):].lower() in fields, f"{key} is not a setting"
    assert "EMBEDQ_DEVICE" not in active and "EMBEDQ_METRICS_PORT" not in active, "per-instance, set by the unit"
