"""The house stays readable (issue 38 d): no module of embedq/ over 500 lines, and the gateway's app factory, the
wiring alone, under 150."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import embedq

PACKAGE = Path(embedq.__file__).parent
MAX_MODULE_LINES = 500
MAX_FACTORY_LINES = 150


def test_no_module_of_the_package_is_over_500_lines():
    sizes = {str(path.relative_to(PACKAGE)): len(path.read_text(encoding="utf8").splitlines())
             for path in PACKAGE.rglob("*.py")}
    assert len(sizes) > 50  # the walk found the package
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_the_gateways_app_factory_is_under_150_lines():
    pytest.importorskip("fastapi")
    from embedq.gateway.app import create_app

    lines, _ = inspect.getsourcelines(create_app)
    assert len(lines) < MAX_FACTORY_LINES, len(lines)
