"""The scheme table of ``embedq index -o``: which sink writes a URL ``scheme://...`` (anything else is a path: a file
output, ``files.py``).

A :class:`SinkScheme` names a scheme's target class (``contract.py``'s :class:`~.contract.Target`, constructed with
``(url, config)``), imported only when a URL of it is used, so a producer install without a database's client
library runs everything else (a missing one is refused naming the extra to install); and the URL form and name the
CLI's help shows. The built-ins are PostgreSQL with pgvector, LanceDB and Milvus. More come from plugins
(:func:`load_sinks`), as kinds do (``embedq/kinds.py``): a module named in ``EMBEDQ_SINKS`` (``package.module``, its
``SINKS`` list, or ``package.module:NAME``, a scheme or a list of them) or an entry point of the group
``embedq.sinks``, registered with :func:`register_sink`. A URL of a scheme the table does not hold is refused,
naming those it holds.

Light on purpose (no sink, no numpy): the CLI reads the table to build its help.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedq import errors, plugins

if TYPE_CHECKING:
    from embedq.producers.index.sinks.contract import Target

ENTRY_POINT_GROUP = "embedq.sinks"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class SinkScheme:
    """One sink of the table, under its URL scheme and aliases."""

    scheme: str  # the URL's scheme, lower case (``postgresql``)
    #: the target: "package.module:Class", imported when a URL of the scheme is used, or the class (any callable)
    #: itself; called with (the URL as given, the run's ``IndexConfig``)
    target: str | Callable[[str, Any], Target]
    name: str  # what the help calls it (``pgvector``)
    example: str  # the URL form the help shows
    extra: str | None = None  # embedq's install extra that brings ``needs`` (a plugin's: None)
    needs: tuple[str, ...] = ()  # modules checked before the target is imported (named when one is missing)
    aliases: tuple[str, ...] = ()  # other schemes of the same sink (``postgres``)

    @property
    def schemes(self) -> tuple[str, ...]:
        return (self.scheme, *self.aliases)

    def open_target(self, url: str, config: Any) -> Target:
        """The target of ``url``, its needs checked first."""
        for module in self.needs:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                how = errors.install_hint(self.extra) if self.extra else f"install {module}"
                what = f"the {self.extra} extra" if self.extra else module
                raise errors.InvalidOption(f"a {self.scheme}:// output needs {what} ({module} is not installed: "
                                           f"{exc}); {how}") from None
        make = self.target
        if isinstance(make, str):
            module_name, _, attr = make.partition(":")
            make = getattr(importlib.import_module(module_name), attr)
        return make(url, config)


BUILT_IN = (
    SinkScheme("postgresql", "embedq.producers.index.sinks.pgvector:Target", "pgvector",
               "postgresql://user@host:5432/db?table=docs", "pgvector", ("psycopg",), aliases=("postgres",)),
    SinkScheme("lancedb", "embedq.producers.index.sinks.lancedb:Target", "LanceDB",
               "lancedb:///absolute/path/to/db?table=docs", "lancedb", ("lancedb",)),
    SinkScheme("milvus", "embedq.producers.index.sinks.milvus:Target", "Milvus",
               "milvus://host:19530?collection=docs or, Milvus Lite's file, "
               "milvus:///absolute/path/file.db?collection=docs", "milvus", ("pymilvus",)),
)

#: Each scheme (and alias) of the table -> its sink.
SCHEMES: dict[str, SinkScheme] = {}


def register_sink(entry: SinkScheme) -> SinkScheme:
    """Add a sink to the table (a plugin's, or the built-ins at import). Registering the same one again does nothing;
    one whose scheme or alias another holds is refused."""
    if not isinstance(entry, SinkScheme):
        raise errors.InvalidOption(f"a sink must be an embedq.producers.index.sinks.SinkScheme, got "
                                   f"{type(entry).__name__}")
    if not entry.target or not all(_URL.match(f"{s}://") and s == s.lower() for s in entry.schemes):
        raise errors.InvalidOption(f"sink {entry.name!r}: a scheme is lower-case letters, digits, +, - and ., and "
                                   "names its target")
    for scheme in entry.schemes:
        if scheme in SCHEMES and SCHEMES[scheme] != entry:
            raise errors.InvalidOption(f"scheme {scheme}:// is already {SCHEMES[scheme].name}'s; {entry.name} "
                                       "cannot take it")
    for scheme in entry.schemes:
        SCHEMES[scheme] = entry
    return entry


for _entry in BUILT_IN:
    register_sink(_entry)


def sink_schemes() -> list[SinkScheme]:
    """Each sink of the table once, built-ins first."""
    return list(dict.fromkeys(SCHEMES.values()))


def schemes_help() -> str:
    """The URL forms ``embedq index -o`` takes, for its help."""
    forms = [f"{s.example} ({s.name}" + (f", the {s.extra} extra)" if s.extra else ")") for s in sink_schemes()]
    return "; ".join(forms) + "; or a plugin's scheme (EMBEDQ_SINKS)"


def load_sinks(paths: Iterable[str] = (), *, entry_point_group: str | None = ENTRY_POINT_GROUP) -> list[SinkScheme]:
    """Import and register sinks: each of ``paths`` is ``module`` (its ``SINKS`` list) or ``module:NAME`` (a
    :class:`SinkScheme` or a list of them); then every entry point of ``entry_point_group``. Returns those loaded. A
    path that cannot be imported or holds no scheme raises :class:`~embedq.errors.InvalidOption` naming it."""
    loaded = plugins.load(paths, kind=SinkScheme, attr="SINKS", group=entry_point_group, what="sink plugin")
    for entry in loaded:
        register_sink(entry)
    return loaded


def url_scheme(output: Any) -> str | None:
    """The scheme of a URL (``scheme://...``, lower case), None for a path."""
    match = _URL.match(output) if isinstance(output, str) else None
    return match.group(1).lower() if match else None


def output_target(output: str | Path | Target, fmt: str | None = None, config: Any = None) -> Target:
    """The target ``-o`` names: a URL of a scheme of the table, or a path; a target made already is returned."""
    if not isinstance(output, (str, Path)):
        return output
    scheme = url_scheme(output)
    if scheme is None:
        from embedq.producers.index.sinks.files import FileTarget  # numpy and the file sinks: not for the CLI's help

        return FileTarget(Path(output), fmt)
    entry = SCHEMES.get(scheme)
    if entry is None:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise errors.InvalidOption(f"no sink writes {scheme}:// URLs; the schemes are {known} (a plugin's sink: "
                                   "EMBEDQ_SINKS), and any other output is a file path")
    if fmt is not None and fmt != "parquet":
        raise errors.InvalidOption(f"--output-format {fmt} is for files; a {scheme}:// output is a database")
    return entry.open_target(str(output), config)
