"""What embedq's tables take from outside the package: objects named by import paths in a setting (``EMBEDQ_KINDS``:
job kinds, ``embedq/kinds.py``; ``EMBEDQ_SINKS``: the indexer's sinks, ``embedq/producers/index/sinks/registry.py``)
or declared by installed packages under an entry-point group (``embedq.kinds``, ``embedq.sinks``). Each table
registers what :func:`load` returns through its own door."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from embedq import errors

T = TypeVar("T")


def load(paths: Iterable[str], *, kind: type[T], attr: str, group: str | None, what: str) -> list[T]:
    """The ``kind`` objects each of ``paths`` names — ``module`` (its ``attr``) or ``module:NAME``, each a ``kind`` or a
    list of them — then those of every entry point of ``group``. A path that cannot be imported, or names what is not
    one, raises :class:`~embedq.errors.InvalidOption` naming it (``what``: "kind plugin")."""
    loaded: list[T] = []
    for path in paths:
        module_name, _, name = path.strip().partition(":")
        if not module_name:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise errors.InvalidOption(f"{what} {path!r} cannot be imported: {exc}") from exc
        name = name or attr
        if not hasattr(module, name):
            raise errors.InvalidOption(f"{what} {path!r}: module {module_name} has no {name}")
        loaded += _of(kind, getattr(module, name), f"{what} {path!r}")
    if group:
        loaded += [one for where, value in _entry_points(group) for one in _of(kind, value, f"{what} {where}")]
    return loaded


def _of(kind: type[T], value: Any, where: str) -> list[T]:
    if isinstance(value, kind):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, kind) for v in value):
        return list(value)
    raise errors.InvalidOption(f"{where} holds {type(value).__name__}, not a {kind.__name__} or a list of them")


@functools.cache
def _entry_points(group: str) -> list[tuple[str, Any]]:
    """What installed packages declare under ``group``, loaded once per process (scanning every installed
    distribution's metadata costs milliseconds, and every ``make_app`` loads the plugins)."""
    return [(f"entry point {point.name!r}", point.load()) for point in entry_points(group=group)]
