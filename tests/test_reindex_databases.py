"""Issue 57 b for the databases: a changed corpus re-indexed into the same pgvector table, LanceDB table and Milvus Lite
collection with ``--prune`` embeds only what changed and ends equal to a fresh full run; a re-index SIGKILLed midway
and run again ends the same. (Parquet, and repeats and ``--reuse``: tests/test_reindex.py; each sink's own calls:
its tests/test_index_<db>.py.) A gated worker of the fake model (its ``items`` counter is what reached the model)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import reindex
from indexdb import MilvusCollections, cmd, env, milvus_server_at
from reindex import index, reindex_case, versions, write_jsonl

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fake_worker(redis_server, tmp_path_factory):
    yield from reindex.fake_worker(redis_server, tmp_path_factory.mktemp("reindex-db"), "embedq.test.reindex.db")


class Pgvector:
    def __init__(self, cluster, tmp: Path) -> None:
        self.cluster = cluster
        self.db = cluster.create_database(f"reindex_{tmp.name[-12:].lower().replace('-', '_')}")

    def url(self, name: str) -> str:
        return self.cluster.url(self.db, table=name)

    def count(self, name: str) -> int:
        with self.cluster.connect(self.db) as conn:
            return conn.execute(f"SELECT count(*) FROM {name}").fetchone()[0]

    def read(self, name: str) -> dict[str, np.ndarray]:
        import pgvector.psycopg as pgvector_psycopg

        with self.cluster.connect(self.db) as conn:
            pgvector_psycopg.register_vector(conn)
            rows = conn.execute(f"SELECT id, embedding FROM {name}").fetchall()
        return _unique({i: e.to_numpy() for i, e in rows}, len(rows))


class Lance:
    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "lance"

    def url(self, name: str) -> str:
        return f"lancedb://{self.path}?table={name}"

    def count(self, name: str) -> int:
        import lancedb

        return lancedb.connect(str(self.path)).open_table(name).count_rows()

    def read(self, name: str) -> dict[str, np.ndarray]:
        import lancedb

        table = lancedb.connect(str(self.path)).open_table(name).to_arrow()
        vectors = table.column("vector").combine_chunks()
        matrix = np.asarray(vectors.flatten()).reshape(-1, vectors.type.list_size)
        ids = table.column("id").to_pylist()
        return _unique(dict(zip(ids, matrix)), len(ids))


class Milvus(MilvusCollections):
    def read(self, name: str) -> dict[str, np.ndarray]:
        rows = self.scan(name, ["id", "vector"])
        return _unique({r["id"]: np.asarray(r["vector"], dtype=np.float32) for r in rows}, len(rows))


def _unique(rows: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    assert len(rows) == count, "an id is in the output twice"
    return rows


@pytest.fixture(scope="module")
def milvus_server(tmp_path_factory):
    pytest.importorskip("pymilvus")
    yield from milvus_server_at(tmp_path_factory.mktemp("milvus-server"))


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    ids = sorted(want)
    np.testing.assert_allclose(np.stack([got[i] for i in ids]), np.stack([want[i] for i in ids]), atol=1e-6)


@pytest.fixture
def store(request, tmp_path):
    if request.param == "pgvector":
        return Pgvector(request.getfixturevalue("pg"), tmp_path)
    if request.param == "lancedb":
        pytest.importorskip("lancedb")
        return Lance(tmp_path)
    return Milvus(request.getfixturevalue("milvus_server"), tmp_path)


@pytest.mark.parametrize("store", ["pgvector", "lancedb", "milvus"], indirect=True)
def test_b_a_changed_corpus_reindexed_into_a_database_equals_a_fresh_run(fake_worker, store, tmp_path):
    case = reindex_case(fake_worker, tmp_path, store.url("docs"), store.url("fresh"))
    assert case.model_items <= 0.16 * len(case.second), case.model_items
    assert case.summary["pruned"] == 200 and case.summary["replaced"] == 400
    assert case.summary["rows"] == len(case.second)
    _assert_same(store.read("docs"), store.read("fresh"))


@pytest.mark.parametrize("store", ["pgvector", "lancedb", "milvus"], indirect=True)
def test_b_a_reindex_killed_midway_then_run_again_equals_a_fresh_run(fake_worker, store, tmp_path):
    """SIGKILL once the re-index has committed rows of its own (the input's order mixes the new ids in, so the table
    grows at its first commit), then the same command again: the output equals a fresh run on the second version."""
    first, second = versions(1200)
    second = random.Random(57).sample(second, len(second))
    index(fake_worker.settings, write_jsonl(tmp_path / "v1.jsonl", first), store.url("docs"))
    v2 = write_jsonl(tmp_path / "v2.jsonl", second)
    args = ("--prune", "--checkpoint-seconds", "0.2", "--chunk-size", "8", "--max-in-flight", "2")
    with fake_worker.gate_closed():
        proc = subprocess.Popen(cmd(v2, store.url("docs"), *args), env=env(fake_worker.settings),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # one micro-batch at a time: the next one comes once the indexer has written the last and sent more
            while store.count("docs") <= len(first):
                assert proc.poll() is None, proc.stderr.read()
                fake_worker.step()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    summary = index(fake_worker.settings, v2, store.url("docs"), "--prune")
    assert summary["pruned"] == 60
    index(fake_worker.settings, v2, store.url("fresh"))
    _assert_same(store.read("docs"), store.read("fresh"))


def test_reuse_last_nights_parquet_into_tonights_pgvector_table(fake_worker, pg, tmp_path):
    """--reuse across formats: the first version in Parquet, the second into a new pgvector table, taking the stored
    rows of every unchanged text: only the edited and new texts (and the probe) reach the model."""
    first, second = versions(1000)
    parquet = tmp_path / "last.parquet"
    index(fake_worker.settings, write_jsonl(tmp_path / "v1.jsonl", first), str(parquet))
    table = Pgvector(pg, tmp_path)
    v2 = write_jsonl(tmp_path / "v2.jsonl", second)
    fake_worker.settle()
    before = fake_worker.stats()["items"]
    summary = index(fake_worker.settings, v2, table.url("docs"), "--reuse", str(parquet))
    fake_worker.settle()
    assert fake_worker.stats()["items"] - before <= 0.16 * len(second) + 1
    assert summary["reused"] >= 0.8 * len(second)
    index(fake_worker.settings, v2, table.url("fresh"))
    _assert_same(table.read("docs"), table.read("fresh"))
    with pg.connect(table.db) as conn:  # the manifest records the run
        record = conn.execute("SELECT manifest FROM embedq_index WHERE name = 'docs'").fetchone()[0]
    record = json.loads(record) if isinstance(record, str) else record
    assert record["runs"][-1]["reused"] == summary["reused"]
