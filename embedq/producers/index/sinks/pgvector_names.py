"""The names a pgvector target writes (schema, table, index), checked before any text is embedded.

PostgreSQL keeps ``NAMEDATALEN - 1`` = 63 bytes of a name and cuts a longer one without an error, takes no NUL in a
name, and drops a table in a session's temporary schema (``pg_temp``, ``pg_temp_N``) when that session ends: each
would turn into a raw server error after a batch was embedded, or into rows that are not where the summary says. So
``table=`` is checked when the URL is read (:func:`split_table`), the schema once connected (:func:`check_schema`),
and the names embedq derives (the HNSW index, the content hashes' btree) are made to fit (:func:`index_name`). A
database without pgvector is refused saying what to do (:func:`missing_extension`).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from typing import Any

from embedq import errors

#: PostgreSQL keeps NAMEDATALEN - 1 bytes of a name and silently cuts a longer one (a table, schema or index name).
MAX_NAME_BYTES = 63
#: A session's temporary schema: a table there vanishes with the session that made it (the writer's).
TEMP_SCHEMA = re.compile(r"pg_(toast_)?temp(_\d+)?")


def _temporary(schema: str, where: str) -> errors.InvalidOption:
    return errors.InvalidOption(f"{where}: schema {schema} is a session's temporary schema: its tables vanish when "
                                "the writer's session ends; name a schema of the database")


def split_table(table: str, where: str) -> tuple[str | None, str]:
    """``table=`` (``name`` or ``schema.name``) as (schema or None, name), each as PostgreSQL would keep it: not
    empty, no control character (NUL included), at most 63 bytes in UTF-8 (never cut), not a temporary schema."""
    schema, name = table.split(".", 1) if "." in table else (None, table)
    for part, what in ((schema, "schema"), (name, "table")):
        if part is None:
            continue
        if not part:
            raise errors.InvalidOption(f"{where}: table={table!r} has an empty {what} name")
        if any(unicodedata.category(c) == "Cc" for c in part):
            raise errors.InvalidOption(f"{where}: the {what} name {part!r} holds a control character (NUL, newline, "
                                       "...); PostgreSQL names cannot")
        size = len(part.encode("utf-8"))
        if size > MAX_NAME_BYTES:
            raise errors.InvalidOption(f"{where}: the {what} name {part[:24]!r}... is {size} bytes; PostgreSQL keeps "
                                       f"{MAX_NAME_BYTES} bytes of a name and would cut it: choose a shorter one")
    if schema is not None and TEMP_SCHEMA.fullmatch(schema):
        raise _temporary(schema, where)
    return schema, name


def check_schema(conn: Any, schema: str | None, *, where: str, creates: bool) -> None:
    """The schema the table is (or will be) in: it exists (unnamed: the first of the search_path that does), is not
    a session's temporary one, and, when the run creates the table, this user may create tables there."""
    with conn.cursor() as cur:
        if schema is None:
            cur.execute("SELECT current_schema(), current_setting('search_path')")
            schema, path = cur.fetchone()
            if schema is None:
                raise errors.InvalidOption(f"{where}: no schema of the search_path ({path}) exists to create the table "
                                           "in; name one: table=SCHEMA.NAME")
        else:
            cur.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,))
            if cur.fetchone() is None:
                raise errors.InvalidOption(f"{where}: schema {schema} does not exist; create it (CREATE SCHEMA "
                                           f"{schema}) or name another")
        if TEMP_SCHEMA.fullmatch(schema):
            raise _temporary(schema, where)
        if creates:
            cur.execute("SELECT has_schema_privilege(%s, 'CREATE')", (schema,))
            if not cur.fetchone()[0]:
                raise errors.InvalidOption(f"{where}: this user may not create tables in schema {schema} (GRANT "
                                           f"CREATE ON SCHEMA {schema} TO it, or name another schema)")
    conn.commit()


def index_name(table: str, column: str, kind: str = "hnsw") -> str:
    """The ``kind`` index of ``column`` (``hnsw``: the ANN index; ``btree``: the content hashes'):
    ``<table>_<column>_<kind>``, or, where that is over 63 bytes, the table's name cut (at a character's boundary) to
    leave room for a hash of the whole name: PostgreSQL would cut it silently, and two cut names could be one."""
    natural = f"{table}_{column}_{kind}"
    if len(natural.encode("utf-8")) <= MAX_NAME_BYTES:
        return natural
    tail = f"_{column}_{hashlib.sha256(natural.encode('utf-8')).hexdigest()[:8]}_{kind}"
    room = MAX_NAME_BYTES - len(tail.encode("utf-8"))
    assert room > 0, f"a column name too long for an index name: {column}"  # the kinds' names are short
    return table.encode("utf-8")[:room].decode("utf-8", "ignore") + tail


def missing_extension(where: str, exc: Exception) -> str:
    """What to do when ``CREATE EXTENSION vector`` failed: PostgreSQL's own words (its message, detail and hint),
    then where pgvector comes from and who may create it."""
    diag = getattr(exc, "diag", None)
    said = [getattr(diag, name, None) for name in ("message_primary", "message_detail", "message_hint")]
    said = [part.strip().rstrip(".") for part in said if part] or [str(exc).strip().splitlines()[0]]
    return (f"{where}: the database has no pgvector extension, and embedq could not create it (PostgreSQL said: "
            f"{'; '.join(said)}). pgvector is not part of PostgreSQL: install it on the database server (Debian and "
            "Ubuntu: the postgresql-<major>-pgvector package from PostgreSQL's own apt repository, apt.postgresql.org, "
            "or a build from source; docs/INDEXING.md), then have a superuser run CREATE EXTENSION vector in this "
            "database (it is not a trusted extension: an ordinary user cannot create it).")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def version_of(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])
