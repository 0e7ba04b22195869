"""Issue 57 b for the databases: a changed corpus re-indexed into the same pgvector table, LanceDB table and Milvus Lite
collection with ``--prune`` embeds only what changed and ends equal to a fresh full run; a re-index SIGKILLed midway
and run again ends the same. (Parquet, and repeats and ``--reuse``: tests/test_reindex.py; each sink's own calls:
its tests/test_index_<db>.py.) A gated worker of the fake model (its ``items`` counter is what reached the model)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import FAKE, gated_handle
from reindex import env, index, index_cmd, reindex_case, versions, write_jsonl

from embedq.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fake_worker(redis_server, tmp_path_factory):
    settings = Settings(broker_url=redis_server.url, queue="embedq.test.reindex.db", **FAKE)
    handle = gated_handle(settings, tmp_path_factory.mktemp("reindex-db") / "worker.log")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def pg(tmp_path_factory):
    pytest.importorskip("psycopg")
    from pgcluster import PgCluster

    cluster = PgCluster(tmp_path_factory.mktemp("pg") / "cluster").start()
    yield cluster
    cluster.stop()


class Pgvector:
    def __init__(self, cluster, tmp: Path) -> None:
        self.cluster = cluster
        self.db = cluster.create_database(f"reindex_{tmp.name[-12:].lower().replace('-', '_')}")

    def url(self, name: str) -> str:
        return self.cluster.url(self.db, table=name)

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

    def read(self, name: str) -> dict[str, np.ndarray]:
        import lancedb

        table = lancedb.connect(str(self.path)).open_table(name).to_arrow()
        vectors = table.column("vector").combine_chunks()
        matrix = np.asarray(vectors.flatten()).reshape(-1, vectors.type.list_size)
        ids = table.column("id").to_pylist()
        return _unique(dict(zip(ids, matrix)), len(ids))


class Milvus:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def url(self, name: str) -> str:
        return f"milvus://{self.tmp}/{name}.db?collection=docs"

    def read(self, name: str) -> dict[str, np.ndarray]:
        import os

        import pymilvus
        from milvus_lite.server_manager import server_manager_instance

        path = str(self.tmp / f"{name}.db")
        client = pymilvus.MilvusClient(uri=path)
        try:
            client.load_collection("docs")
            it = client.query_iterator("docs", batch_size=1000, output_fields=["id", "vector"],
                                       consistency_level="Strong")
            rows = []
            while batch := it.next():
                rows += batch
            it.close()
        finally:
            client.close()
            server_manager_instance.release_server(os.path.abspath(path))
        return _unique({r["id"]: np.asarray(r["vector"], dtype=np.float32) for r in rows}, len(rows))


def _unique(rows: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    assert len(rows) == count, "an id is in the output twice"
    return rows


def _store(name: str, pg_cluster, tmp: Path):
    if name == "pgvector":
        return Pgvector(pg_cluster, tmp)
    if name == "lancedb":
        pytest.importorskip("lancedb")
        return Lance(tmp)
    pytest.importorskip("pymilvus")
    return Milvus(tmp)


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    ids = sorted(want)
    np.testing.assert_allclose(np.stack([got[i] for i in ids]), np.stack([want[i] for i in ids]), atol=1e-6)


@pytest.fixture
def store(request, tmp_path):
    name = request.param
    return _store(name, request.getfixturevalue("pg") if name == "pgvector" else None, tmp_path)


@pytest.mark.parametrize("store", ["pgvector", "lancedb", "milvus"], indirect=True)
def test_b_a_changed_corpus_reindexed_into_a_database_equals_a_fresh_run(fake_worker, store, tmp_path):
    case = reindex_case(fake_worker, tmp_path, store.url("docs"), store.url("fresh"))
    assert case.model_items <= 0.16 * len(case.second), case.model_items
    assert case.summary["pruned"] == 200 and case.summary["replaced"] == 400
    _assert_same(store.read("docs"), store.read("fresh"))


@pytest.mark.parametrize("store", ["pgvector", "lancedb", "milvus"], indirect=True)
def test_b_a_reindex_killed_midway_then_run_again_equals_a_fresh_run(fake_worker, store, tmp_path):
    first, second = versions(1200)
    index(fake_worker.settings, write_jsonl(tmp_path / "v1.jsonl", first), store.url("docs"))
    v2 = write_jsonl(tmp_path / "v2.jsonl", second)
    args = ("--prune", "--checkpoint-seconds", "0.2", "--chunk-size", "8", "--max-in-flight", "2")
    with fake_worker.gate_closed():
        proc = subprocess.Popen(index_cmd(v2, store.url("docs"), *args), env=env(fake_worker.settings),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(12):  # a dozen of its micro-batches (its commits come between them), then the kill
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
