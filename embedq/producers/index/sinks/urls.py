"""What the database sinks share of their URLs: the password masked in what is shown, embedq's own query parameters
taken out, and where a database target's failed records go by default."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit


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
