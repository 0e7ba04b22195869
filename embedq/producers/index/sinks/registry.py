"""Where ``embedq index`` writes: a file output (Parquet, NPY, JSONL; ``sinks.py``) or a database named by a URL.

``-o`` takes a path or a URL; the URL's scheme picks the database sink, imported only when used, so a producer
install without the database's client library runs everything else (a missing one is refused naming the extra
to install). A *target* is what the runner needs before and around a :class:`~embedq.producers.index.sinks.Sink`:

* ``check()``: reach the target and check what it holds against the run's options, before any text is embedded
  (the CLI calls it before it starts a private broker; the runner again, which costs nothing the second time);
* ``lock()``: one writer per target (a second run on it fails at once);
* ``open(...)``: the sink, continuing what the target holds (its committed ids), or a new one;
* ``exists()`` / ``remove()``: a refused run that created the target leaves nothing behind.

A database sink has the file sinks' contract: rows are committed at checkpoints (a commit is one transaction that
also records the manifest), resumed from the ids the target holds, each id once (the primary key), and the
embedding-space fingerprint and options are kept beside the data and checked before anything is written. To add a
database: a module with a ``Target`` class (constructor ``(url, config)``) and a line in :data:`SCHEMES`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from embedq import errors
from embedq.producers.index.sinks import OutputLock, Sink, detect_output_format, open_sink, remove_output


@dataclass(frozen=True)
class Backend:
    module: str  # embedq.producers.index.<module>, holding a ``Target`` class
    extra: str  # the install extra (errors.install_hint)
    needs: tuple[str, ...]  # the modules the extra installs (checked before the sink module is imported)


#: URL scheme -> the database sink that writes there.
SCHEMES: dict[str, Backend] = {
    "postgresql": Backend("pgvector", "pgvector", ("psycopg",)),
    "postgres": Backend("pgvector", "pgvector", ("psycopg",)),
    "lancedb": Backend("lancedb", "lancedb", ("lancedb",)),
    "milvus": Backend("milvus", "milvus", ("pymilvus",)),
}


class Target(Protocol):
    format: str

    def describe(self) -> str: ...
    def check(self) -> None: ...
    def lock(self) -> contextlib.AbstractContextManager[Any]: ...
    def exists(self) -> bool: ...
    def remove(self) -> None: ...
    def open(self, *, vector_dtype: str, options: dict[str, Any], shard_rows: int, overwrite: bool) -> Sink: ...
    def default_errors_path(self) -> Path: ...


def is_url(output: str | Path) -> bool:
    """A database URL (``scheme://...``), not a path."""
    return isinstance(output, str) and "://" in output and urlsplit(output).scheme.lower() in SCHEMES


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (what logs, errors and the summary show)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = quote(unquote(parts.username or ""), safe="")
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def split_param(url: str, name: str) -> tuple[str, str | None]:
    """``url`` without the query parameter ``name`` (embedq's own, e.g. ``table``), and its value. The other
    parameters stay, in order, for the database's client (libpq's ``sslmode``, ``application_name``, ...)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    values = [v for k, v in query if k == name]
    rest = urlencode([(k, v) for k, v in query if k != name])
    return urlunsplit(parts._replace(query=rest)), (values[-1] if values else None)


def database_errors_path(name: str, target: str) -> Path:
    """Where a database target's failed records go by default: the working folder, never elsewhere, whatever the
    table or collection is called (``table=/abs/x`` or ``../../x`` included). The file is named after ``name`` made
    safe (letters, digits, ``_``, ``-`` and single dots; no path separator, no ``..``, no leading dot or dash; at
    most 64 characters) and a short hash of ``target`` (the URL as shown, password masked: two targets whose names
    read alike never share a file): ``docs.1f2e3d4c.errors.jsonl``."""
    safe = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9_.-]+", "_", name)).lstrip(".-")[:64].rstrip(".") or "target"
    tag = hashlib.sha256(target.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return Path.cwd() / f"{safe}.{tag}.errors.jsonl"


def _require(backend: Backend, scheme: str) -> None:
    for module in backend.needs:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise errors.InvalidOption(
                f"a {scheme}:// output needs the {backend.extra} extra ({module} is not installed: {exc}); "
                f"{errors.install_hint(backend.extra)}") from None


class FileTarget:
    """A Parquet dataset, an NPY matrix or a JSONL file (``sinks.py``)."""

    def __init__(self, path: Path, fmt: str | None = None) -> None:
        self.path = path
        self.format = fmt or detect_output_format(path)

    def describe(self) -> str:
        return str(self.path)

    def check(self) -> None:
        """Checked when opened (the manifest beside the output)."""

    def check_input(self, input_path: str) -> None:
        if input_path != "-" and Path(input_path).resolve() == self.path.resolve():
            raise errors.InvalidOption("the output would overwrite the input")

    def lock(self) -> OutputLock:
        return OutputLock(self.path)

    def exists(self) -> bool:
        return self.path.exists()

    def remove(self) -> None:
        remove_output(self.path, self.format)

    def remove_empty(self) -> None:
        """A run that wrote no row (every record failed): the output made of nothing goes, its errors file stays."""
        remove_output(self.path, self.format, keep_errors=True)

    def open(self, *, vector_dtype: Any, options: dict[str, Any], shard_rows: int, overwrite: bool) -> Sink:
        return open_sink(self.path, self.format, vector_dtype=vector_dtype, options=options, shard_rows=shard_rows,
                         overwrite=overwrite)

    def default_errors_path(self) -> Path:
        from embedq.producers.index.sinks import sidecar

        return sidecar(self.path, ".errors.jsonl")


def output_target(output: str | Path | Any, fmt: str | None = None, config: Any = None) -> Any:
    """The target ``-o`` names: a database URL (:data:`SCHEMES`) or a path; a target made already is returned."""
    if not isinstance(output, (str, Path)):
        return output
    if not is_url(output):
        return FileTarget(Path(output), fmt)
    scheme = urlsplit(str(output)).scheme.lower()
    if fmt is not None and fmt != "parquet":
        raise errors.InvalidOption(f"--output-format {fmt} is for files; a {scheme}:// output is a database")
    backend = SCHEMES[scheme]
    _require(backend, scheme)
    module = importlib.import_module(f"embedq.producers.index.{backend.module}")
    return module.Target(str(output), config)
