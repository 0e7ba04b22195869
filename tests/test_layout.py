"""The house stays readable (issue 38 d): no module of embedq/ over 500 lines, and the gateway's app factory, the
wiring alone, under 150."""

from __future__ import annotations

import ast
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


# -- issue 56 b: parts own their state ---------------------------------------------------------------------------

#: Bases whose attributes a subclass may read without assigning them (outside embedq: their members are not parsed).
_OPAQUE = object()
_PLAIN_BASES = {"object", "ABC", "Generic", "Protocol"}
_FIELD_DECORATORS = {"dataclass", "dataclasses.dataclass"}
_FIELD_BASES = {"NamedTuple", "TypedDict", "BaseModel", "BaseSettings", "Protocol"}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    if isinstance(node, ast.Subscript):
        return _name(node.value)
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


def _classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Every class of the package by its bare name: [(module path, class node)]."""
    out: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append((str(path.relative_to(PACKAGE)), node))
    return out


def _own(cls: ast.ClassDef) -> tuple[set[str], set[str]]:
    """(what the class gives its instances: members, class attributes, fields and what its methods assign to
    ``self``; what its methods read of ``self``)."""
    fields = (any(_name(d).split(".")[-1] in _FIELD_DECORATORS or _name(d) in _FIELD_DECORATORS
                  for d in cls.decorator_list)
              or any(_name(b).split(".")[-1] in _FIELD_BASES for b in cls.bases))
    given: set[str] = set()
    read: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            given.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            given.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and (stmt.value or fields):
            given.add(stmt.target.id)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (given if isinstance(node.ctx, ast.Store) else read).add(node.attr)
        elif isinstance(node, ast.Call) and _name(node.func) == "setattr" and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "self" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            given.add(node.args[1].value)
    return given, read


def test_no_base_class_reads_attributes_it_never_assigns():
    """A class that is a base of another class of the package gives itself every attribute its methods read (a
    member, a field, or an assignment in one of its methods or its own bases'), so no part reads the state of the
    class it is mixed into (issue 56: Worker, EmbeddingService, Client, Encoder and two sinks were mixins)."""
    classes = _classes()
    bases_used = {_name(b).split(".")[-1] for entries in classes.values() for _, node in entries for b in node.bases}

    def given_by(node: ast.ClassDef, seen: frozenset[str] = frozenset()) -> set[str] | object:
        given, _ = _own(node)
        for base in node.bases:
            name = _name(base).split(".")[-1]
            if name in _PLAIN_BASES:
                continue
            if name not in classes or len(classes[name]) != 1 or name in seen:
                return _OPAQUE  # outside the package (or ambiguous): what it gives is not known here
            inherited = given_by(classes[name][0][1], seen | {node.name})
            if inherited is _OPAQUE:
                return _OPAQUE
            given |= inherited
        return given

    found = {}
    for name in sorted(bases_used & set(classes)):
        for module, node in classes[name]:
            given = given_by(node)
            if given is _OPAQUE:
                continue
            missing = _own(node)[1] - given - {"__class__", "__dict__"}
            if missing:
                found[f"{module}:{name}"] = sorted(missing)
    assert len(bases_used & set(classes)) > 5  # the walk found the package's base classes
    assert found == {}
