"""A sink from outside the package (issue 56, point 3, acceptance a): a plugin module written here adds a ``sqlitevec://``
scheme (rows in a SQLite table, its record in a table of its own; sqlite3 is the standard library), registered by
``EMBEDQ_SINKS`` alone, and ``embedq index -o sqlitevec://...`` takes it through the check (a bad target refused
before any text is sent), a resume after a killed run (nothing written twice) and the summary — against a real Redis
and a real worker, with no edit to any module of ``embedq/``. The sink implements the contract of
``embedq/producers/index/sinks/contract.py`` and nothing more."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import FAKE, ROOT_DIR, WorkerHandle, gated_handle
from test_index import IN_FLIGHT, _index_cmd, _step_until, _wait, _write_jsonl

from embedq.settings import Settings

pytestmark = pytest.mark.integration

PLUGIN = '''
"""A sink embedq does not ship: ``sqlitevec:///absolute/path/file.db?table=NAME``, the ids and float32 vectors in a
SQLite table (no primary key: a row written twice would stay), the record in ``embedq_record``; a commit is one
SQLite transaction that holds the rows and the record."""
import sqlite3
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

import numpy as np

from embedq import errors
from embedq.producers.index.sinks import (Ledger, Manifest, OutputLock, Sink, SinkScheme, Target, check_manifest,
                                          database_errors_path)

RECORD = "CREATE TABLE IF NOT EXISTS embedq_record (name TEXT PRIMARY KEY, manifest TEXT NOT NULL)"


class SqliteTarget(Target):
    format = "sqlitevec"

    def __init__(self, url, config):
        parts = urlsplit(url)
        self.url, self.config = url, config
        self.path = Path(unquote(parts.path))
        self.table = dict(parse_qsl(parts.query)).get("table", "")
        if not self.table.isidentifier():
            raise errors.InvalidOption(f"{url}: name a table, ?table=NAME (letters, digits and _)")

    def describe(self):
        return self.url

    def _connect(self):
        return sqlite3.connect(self.path, timeout=30)

    def _holds(self, conn, name):
        return conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone() is not None

    def check(self):
        if not self.path.parent.is_dir():
            raise errors.InvalidOption(f"cannot write {self.path}: its folder {self.path.parent} does not exist")
        if not self.path.exists() or self.config.overwrite:
            return
        with self._connect() as conn:
            ours = self._holds(conn, "embedq_record") and conn.execute(
                "SELECT 1 FROM embedq_record WHERE name = ?", (self.table,)).fetchone() is not None
            foreign = self._holds(conn, self.table) and not ours
            if foreign and conn.execute(f"SELECT 1 FROM {self.table} LIMIT 1").fetchone() is not None:
                raise errors.OutputMismatch(f"table {self.table} of {self.path} was not written by embedq index")

    def refused_shapes(self):
        return {shape: "a sqlitevec table stores dense vectors only" for shape in ("sparse", "ragged", "scalar")}

    def lock(self):
        return OutputLock(self.path.with_name(f"{self.path.name}.{self.table}"), self.describe())

    def exists(self):
        if not self.path.exists():
            return False
        with self._connect() as conn:
            return self._holds(conn, self.table)

    def open(self, *, vector_dtype, options, shard_rows, overwrite):
        conn = self._connect()
        conn.execute(RECORD)
        if overwrite:
            conn.execute(f"DROP TABLE IF EXISTS {self.table}")
            conn.execute("DELETE FROM embedq_record WHERE name = ?", (self.table,))
        conn.commit()
        row = conn.execute("SELECT manifest FROM embedq_record WHERE name = ?", (self.table,)).fetchone()
        if row is None:
            manifest = Manifest(format=self.format, vector_dtype=vector_dtype, options=options)
        else:
            manifest = Manifest.model_validate_json(row[0])
            check_manifest(manifest, format=self.format, vector_dtype=vector_dtype, options=options,
                           where=self.describe(), container="table")
        sink = SqliteSink(self, conn, Ledger(manifest))
        if self._holds(conn, self.table):
            ids = (doc_id for (doc_id,) in conn.execute(f"SELECT id FROM {self.table}"))
            sink.ledger.take_committed(ids, where=sink.where, container="table")
        return sink

    def default_errors_path(self):
        return database_errors_path(self.table, self.describe())


class SqliteSink(Sink):
    arrow_columns = False
    container = "table"

    def __init__(self, target, conn, ledger):
        super().__init__(ledger, where=f"table {target.table} of {target.path}")
        self.target, self.conn = target, conn

    def write(self, ids, data, texts=None):
        self.conn.execute(f"CREATE TABLE IF NOT EXISTS {self.target.table} (id TEXT NOT NULL, vector BLOB NOT NULL)")
        rows = np.ascontiguousarray(data, dtype=np.float32)
        self.conn.executemany(f"INSERT INTO {self.target.table} VALUES (?, ?)",
                              [(doc_id, row.tobytes()) for doc_id, row in zip(ids, rows)])
        self.ledger.pending_rows += len(ids)
        return []

    def flush(self):
        """The rows are in the transaction that save_manifest commits with the record."""

    def save_manifest(self):
        if self.manifest.fingerprint is None:
            return
        self.conn.execute("INSERT OR REPLACE INTO embedq_record VALUES (?, ?)", (self.target.table,
                                                                               self.ledger.record()))
        self.conn.commit()

    def close(self):
        self.conn.rollback()
        self.conn.close()


SINKS = [SinkScheme("sqlitevec", SqliteTarget, "SQLite", "sqlitevec:///absolute/path/file.db?table=docs")]
'''

TEXTS = [f"text number {i}: " + "word " * (i % 23) for i in range(1200)]


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin")
    (root / "sqlitevec_sink.py").write_text(PLUGIN)
    return root


@pytest.fixture(scope="module")
def fake_worker(redis_server, tmp_path_factory):
    """A gated worker of the fake model (tests/controlled_worker.py): the killed run is stopped mid-way."""
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.sink.{uuid.uuid4().hex[:8]}", **FAKE)
    handle = gated_handle(settings, tmp_path_factory.mktemp("logs") / "worker.log")
    yield handle
    handle.stop()


def _env(plugin_dir: Path, settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith(("_CACHE", "_MAX_WAIT"))}
    return {**env, "EMBEDQ_BROKER_URL": settings.broker_url, "EMBEDQ_QUEUE": settings.queue_name,
            "EMBEDQ_SINKS": "sqlitevec_sink", "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(ROOT_DIR)])}


def _url(db: Path, table: str = "docs") -> str:
    return f"sqlitevec://{db}?table={table}"


def _run(worker: WorkerHandle, plugin_dir: Path, src: Path, url: str, *extra: str):
    proc = subprocess.run(_index_cmd(src, url, *extra), env=_env(plugin_dir, worker.settings), capture_output=True,
                          text=True, timeout=600, cwd=src.parent)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}, proc.stderr


def _committed(db: Path, table: str = "docs") -> int:
    """The rows the killed run had committed, as its record says (read with sqlite3 itself)."""
    try:
        with sqlite3.connect(db, timeout=30) as conn:
            row = conn.execute("SELECT manifest FROM embedq_record WHERE name = ?", (table,)).fetchone()
    except sqlite3.Error:
        return 0
    return json.loads(row[0])["rows"] if row else 0


def _ids(db: Path, table: str = "docs") -> list[str]:
    with sqlite3.connect(db) as conn:
        return [doc_id for (doc_id,) in conn.execute(f"SELECT id FROM {table}")]


@pytest.mark.parametrize("case", ["missing folder", "foreign table", "unknown option"])
def test_a_bad_plugin_target_is_refused_before_any_text_is_sent(fake_worker, plugin_dir, tmp_path, case):
    """The plugin's own check, the contract's ``check()``: exit 2 naming why, no text sent, nothing written."""
    fake_worker.settle()
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, TEXTS[:20])
    db = tmp_path / "foreign.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE docs (id TEXT, vector BLOB)")
        conn.execute("INSERT INTO docs VALUES ('x', x'00')")
    url, extra, says = {
        "missing folder": (_url(tmp_path / "missing" / "x.db"), (), "its folder"),
        "foreign table": (_url(db), (), "was not written by embedq index"),
        "unknown option": (_url(tmp_path / "x.db"), ("--build-index",), "is for an output with an ANN index"),
    }[case]
    before = fake_worker.stats()["items_received"]
    code, _, stderr = _run(fake_worker, plugin_dir, src, url, *extra)
    assert code == 2 and says in stderr, stderr
    assert fake_worker.stats()["items_received"] == before
    assert not (tmp_path / "missing").exists() and not (tmp_path / "x.db").exists() and _ids(db) == ["x"]


def test_a_plugin_sink_resumes_a_killed_run_and_prints_the_summary(fake_worker, plugin_dir, tmp_path):
    worker = fake_worker
    worker.settle()
    src = tmp_path / "in.jsonl"
    ids = _write_jsonl(src, TEXTS)
    db = tmp_path / "vectors.db"
    url = _url(db)
    args = ("--checkpoint-seconds", "1", "--chunk-size", "16", *IN_FLIGHT)
    with worker.gate_closed():  # the worker runs a micro-batch at a time: the run is killed mid-way, on any machine
        proc = subprocess.Popen(_index_cmd(src, url, *args), env=_env(plugin_dir, worker.settings),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        try:
            _step_until(worker, 26, proc)  # jobs of 16: at least 400 texts embedded (see test_index.IN_FLIGHT)
            _wait(lambda: _committed(db) >= 400, 300, "the first commits", proc)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    committed = _committed(db)
    assert 400 <= committed < len(ids) and len(_ids(db)) == committed  # whole commits only

    code, summary, stderr = _run(worker, plugin_dir, src, url, *args)
    assert code == 0, stderr
    assert summary["skipped"] == committed and summary["texts"] == len(ids) - committed  # only what was missing
    assert summary["rows"] == len(ids) and summary["output"] == url and summary["failed"] == 0
    got = _ids(db)
    assert len(got) == len(set(got)) == len(ids) and set(got) == set(ids)  # every id once: nothing written twice
    assert "embedq index: done in" in stderr and f"-> {url}" in stderr, stderr  # the summary, naming the target
    assert f"output     {len(ids):,} rows" in stderr and f"skipped    {committed:,} already in the output" in stderr

    # a third run has nothing left: every id skipped, nothing written
    code, summary, stderr = _run(worker, plugin_dir, src, url, *args)
    assert code == 0 and summary["texts"] == 0 and summary["skipped"] == len(ids), stderr
    assert len(_ids(db)) == len(ids)


def test_an_unknown_scheme_names_the_known_ones(fake_worker, plugin_dir, tmp_path):
    """Without the plugin its scheme is refused, naming the schemes there are (the plugin's is not among them)."""
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, TEXTS[:3])
    env = {k: v for k, v in _env(plugin_dir, fake_worker.settings).items() if k != "EMBEDQ_SINKS"}
    proc = subprocess.run(_index_cmd(src, _url(tmp_path / "x.db")), env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "no sink writes sqlitevec:// URLs" in proc.stderr and "postgresql://" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.db").exists()
