"""`embedq index -o lancedb:///...`: LanceDB's own engine (embedded, in this process and the indexer's), a real
worker, the real MiniLM model, real kills (issue 40: a, b, c, d for LanceDB)."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from indexdb import (
    SPACE4,
    bulk_vectors,
    cmd,
    corpus_texts,
    env,
    items_received,
    kill_after_rows,
    query_texts,
    random_rows,
    run,
    run_without,
    text_hash,
    write_jsonl,
)

from embedq import errors
from embedq.producers.index.content import SCHEME
from embedq.producers.index.idset import IdSet, digest
from embedq.producers.index.runner import IndexConfig
from embedq.producers.index.sinks.lancedb import Target as LanceTarget
from embedq.settings import Settings

pytestmark = pytest.mark.integration
lancedb = pytest.importorskip("lancedb")
pa = pytest.importorskip("pyarrow")

def _url(db: Path, table: str = "docs") -> str:
    return f"lancedb://{db}?table={table}"


def _table(db: Path, table: str = "docs"):
    """A fresh handle (a LanceDB table handle does not see later commits by itself)."""
    conn = lancedb.connect(str(db))
    return conn.open_table(table) if table in conn.list_tables().tables else None


def _rows(db: Path, table: str = "docs") -> int:
    if not db.exists():
        return 0
    try:
        tbl = _table(db, table)
    except ValueError:  # listed but not yet openable: the first commit is creating it (seen once in CI)
        return 0
    return 0 if tbl is None else tbl.count_rows()


def _state(db: Path, table: str = "docs") -> tuple[int, int, str]:
    """The table's version, row count and a checksum of every stored id and vector."""
    tbl = _table(db, table)
    data = tbl.to_arrow().sort_by("id")
    digest = hashlib.md5()
    for name in data.column_names:
        digest.update(json.dumps(data.column(name).to_pylist(), default=bytes.hex).encode())
    return tbl.version, data.num_rows, digest.hexdigest()


def _columns(data) -> list[str]:
    """The columns but ``content_hash`` (issue 57: a table made by a run that records content hashes has it)."""
    return [c for c in data.column_names if c != "content_hash"]


def _manifest(tbl) -> dict:
    return json.loads(tbl.schema.field("id").metadata[b"embedq.manifest"])


@pytest.fixture(scope="module")
def loaded(worker, corpus, tmp_path_factory):
    """a. N corpus texts into ``docs``: SIGKILL once LanceDB holds >= 200 committed rows, resume with
    --build-index."""
    tmp = tmp_path_factory.mktemp("lance_a")
    db = tmp / "db"
    texts = corpus_texts(corpus)
    ids = write_jsonl(tmp / "in.jsonl", texts)
    args = ("--checkpoint-seconds", "1", "--chunk-size", "16", "--build-index")
    t0 = time.monotonic()
    committed = kill_after_rows(cmd(tmp / "in.jsonl", _url(db), *args), env(worker.settings), tmp,
                                lambda: _rows(db))
    code, summary, out = run(worker.settings, tmp / "in.jsonl", _url(db), *args, cwd=tmp)
    assert code == 0, out
    print(f"\nlancedb acceptance a: {len(texts)} texts, killed at {committed} rows, {time.monotonic() - t0:.1f}s "
          "in all")
    return db, ids, texts, committed, summary, out


def test_a_killed_run_resumes_into_exactly_the_texts_with_client_vectors(worker, loaded):
    db, ids, texts, committed, summary, _ = loaded
    assert 200 <= committed < len(ids)
    assert summary["skipped"] == committed and summary["texts"] == len(ids) - committed
    assert summary["rows"] == len(ids) and summary["failed"] == 0
    tbl = _table(db)
    data = tbl.to_arrow()
    assert data.schema.field("vector").type == lancedb.vector(384)  # LanceDB's vector type: fixed-size float32
    got = data.column("id").to_pylist()
    assert len(got) == len(ids) and sorted(got) == sorted(ids)  # no gaps, no duplicates
    manifest = _manifest(tbl)
    assert manifest["rows"] == len(ids) and manifest["fingerprint"] == summary["fingerprint"]
    vectors = np.asarray(data.column("vector").to_pylist(), dtype=np.float32)
    by_id = dict(zip(ids, texts))
    want = bulk_vectors(worker, [by_id[i] for i in got])
    assert np.abs(vectors - want).max() <= 1e-6


def test_a_nearest_neighbours_through_the_ann_index_match_exact_search(worker, corpus, loaded):
    db, _, _, _, summary, out = loaded
    assert summary["ann_index"] == "IVF_HNSW_SQ vector_idx (vector, vector, cosine)", summary
    assert "ann index" in out and summary["ann_index_seconds"] >= 0
    queries = query_texts(corpus)
    qv = np.asarray(worker.client.embed(queries, timeout=300), dtype=np.float32)
    tbl = _table(db)
    [index] = [i for i in tbl.list_indices() if i.columns != ["content_hash"]]  # issue 57's BTREE beside it
    assert index.index_type == "IvfHnswSq" and index.columns == ["vector"] and index.num_unindexed_rows == 0
    plan = tbl.search(qv[0]).distance_type("cosine").limit(10).explain_plan(True)
    assert "ANNSubIndex: name=vector_idx" in plan and "metric=Cosine" in plan, plan
    # ef 100: HNSW's candidate list (LanceDB's default is 1.5 k; 100 is pgvector's documented ef_search here too)
    found = [tbl.search(q).distance_type("cosine").ef(100).limit(10).select(["id"]).to_arrow().column("id")
             .to_pylist() for q in qv]
    data = tbl.to_arrow()
    base_ids = data.column("id").to_pylist()
    base = np.asarray(data.column("vector").to_pylist(), dtype=np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    exact = [[base_ids[k] for k in np.argsort(-(base @ q))[:10]] for q in qv]
    recall = np.mean([len(set(f) & set(e)) / 10 for f, e in zip(found, exact)])
    print(f"\nlancedb recall@10 through the index: {recall:.3f}")
    assert recall >= 0.95, recall


@pytest.mark.parametrize("extra", [("--prompt", "query: "), ("--dimensions", "128"), ("--no-normalize",),
                                   ("--kind", "multi"), ("--vector-dtype", "float16")])
def test_c_other_options_or_kind_are_refused_and_the_table_untouched(worker, loaded, tmp_path, extra):
    db = loaded[0]
    src = tmp_path / "more.jsonl"
    src.write_text('{"id": "new-1", "text": "a new document"}\n{"id": "doc-5", "text": "already there"}\n')
    before = _state(db)
    received = items_received(worker)
    code, _, out = run(worker.settings, src, _url(db), *extra, cwd=tmp_path)
    assert code == 2 and "[output_mismatch]" in out and "was written with" in out, out
    assert _state(db) == before and items_received(worker) == received  # refused before anything was embedded


def test_c_another_pooling_is_refused_before_writing(cls_worker, loaded, tmp_path):
    """Another embedding space (the same weights, CLS pooling): the probe's fingerprint is refused."""
    db = loaded[0]
    settings = cls_worker.settings
    src = tmp_path / "more.jsonl"
    src.write_text('{"id": "new-1", "text": "a new document"}\n')
    before = _state(db)
    code, _, out = run(settings, src, _url(db), cwd=tmp_path)
    assert code == 2 and "another embedding space" in out and "cls pooling" in out, out
    assert _state(db) == before


def test_b_multi_vectors_into_lancedb_equal_the_client(worker, corpus, tmp_path):
    """--kind multi (embed_all's per-token states): a LanceDB multivector column, equal to Client.embed_all, and its
    ANN index; a second run continues it (nothing to embed)."""
    texts = [" ".join(t.split()[:12]) for t in corpus[:40]]
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, texts)
    db = tmp_path / "db"
    code, summary, out = run(worker.settings, src, _url(db, "multi"), "--kind", "multi", "--store-text",
                             "--chunk-size", "8", "--build-index", cwd=tmp_path)
    assert code == 0 and summary["rows"] == len(texts), out
    assert summary["ann_index"] == "IVF_HNSW_SQ vectors_idx (vectors, multivector, cosine)", summary
    tbl = _table(db, "multi")
    data = tbl.to_arrow()
    assert data.schema.field("vectors").type == pa.list_(lancedb.vector(384))  # LanceDB's multivector
    assert _columns(data) == ["id", "vectors", "text"]
    assert _manifest(tbl)["options"]["kind"] == "multi"
    rows = {i: (v, t) for i, v, t in zip(*(data.column(c).to_pylist() for c in ("id", "vectors", "text")))}
    assert sorted(rows) == sorted(ids)
    want = worker.client.embed_all(texts, timeout=300)
    for doc, text, mine in zip(ids, texts, want):
        got, stored = rows[doc]
        assert stored == text
        assert np.abs(np.asarray(got, np.float32) - mine).max() <= 1e-6 * max(1.0, float(np.abs(mine).max()))
    hit = tbl.search(want[3], vector_column_name="vectors").limit(1).select(["id"]).to_arrow()
    assert hit.column("id").to_pylist() == [ids[3]]  # a multivector query (MaxSim) through the index
    before = _state(db, "multi")
    code, summary, out = run(worker.settings, src, _url(db, "multi"), "--kind", "multi", "--store-text",
                             cwd=tmp_path)
    assert code == 0 and summary["skipped"] == len(texts) and summary["texts"] == 0, out
    assert _state(db, "multi")[1:] == before[1:]  # the same rows (the record gained the run: a new version)
    assert len(_manifest(_table(db, "multi"))["runs"]) == 2


def _foreign_tables(db: Path) -> None:
    conn = lancedb.connect(str(db))
    existing = conn.list_tables().tables
    if "other_schema" not in existing:
        conn.create_table("other_schema", schema=pa.schema([("id", pa.int64()), ("body", pa.string())]))
    if "dim768" not in existing:
        conn.create_table("dim768", schema=pa.schema([("id", pa.string()), ("vector", lancedb.vector(768))]))
    if "foreign_rows" not in existing:
        conn.create_table("foreign_rows", pa.table({"id": ["x"], "vector": pa.array([[0.1] * 384],
                                                                                  lancedb.vector(384))}))


@pytest.mark.parametrize("case", ["missing parent", "parent is a file", "unwritable", "another schema",
                                  "another dimension", "foreign rows", "no table", "relative path"])
def test_d_bad_targets_are_refused_before_any_text_is_embedded(worker, corpus, tmp_path_factory, tmp_path, case):
    shared = tmp_path_factory.getbasetemp() / "lance_d"
    db = shared / "db"
    db.mkdir(parents=True, exist_ok=True)
    _foreign_tables(db)
    (tmp_path / "a-file").write_text("not a folder")
    url, says, probe = {
        "missing parent": (_url(tmp_path / "missing" / "db"), "parent folder of the database", 0),
        "parent is a file": (_url(tmp_path / "a-file" / "db"), "is not a folder", 0),
        "unwritable": ("lancedb:///proc/embedq-db?table=docs", "is not writable", 0),
        "another schema": (_url(db, "other_schema"), "has another schema: id is int64, this run writes string", 1),
        "another dimension": (_url(db, "dim768"), "vector is fixed_size_list<float>[768], this run writes "
                              "fixed_size_list<float>[384]", 1),
        "foreign rows": (_url(db, "foreign_rows"), "holds rows that embedq index did not write", 0),
        "no table": (f"lancedb://{db}", "names no table", 0),
        "relative path": ("lancedb://db?table=docs", "absolute path", 0),
    }[case]
    src = tmp_path / "in.jsonl"
    write_jsonl(src, corpus[:50])
    before = items_received(worker)
    states = {t: _state(db, t) for t in ("other_schema", "dim768", "foreign_rows")}
    code, _, out = run(worker.settings, src, url, cwd=tmp_path)
    assert code == 2 and says in out, out
    assert items_received(worker) - before <= probe  # no text of the input was sent (at most the one-text probe)
    assert {t: _state(db, t) for t in states} == states
    assert not (tmp_path / "missing").exists() and not Path("/proc/embedq-db").exists()


@pytest.mark.parametrize("table", ["..", ".", "a" * 129, "a%20b"])
def test_d_an_invalid_table_name_is_refused_before_anything_is_sent(redis_server, tmp_path, table):
    """Issue 50 item 6: a table name LanceDB cannot take is an invalid target (exit 2, named), not an [unavailable]
    '... run again' after a batch was embedded. No worker is needed to show that no job was sent: none listens, and
    --wait-for-worker 0 would make a run that got past the check stop on that instead."""
    import redis

    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.lancenames.{uuid.uuid4().hex[:8]}")
    src = tmp_path / "in.jsonl"
    write_jsonl(src, ["one text", "another text"])
    db = tmp_path / "db"
    code, _, out = run(settings, src, _url(db, table), "--wait-for-worker", "0", cwd=tmp_path)
    assert code == 2 and "invalid table name" in out and "[unavailable]" not in out, out
    assert "Traceback" not in out
    assert not redis.Redis.from_url(redis_server.url).exists(settings.queue_name, settings.bulk_queue_name)
    assert not db.exists() and not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob("*.errors.jsonl"))


def test_d_a_missing_extra_names_it(worker, tmp_path):
    """lancedb made unimportable in the CLI's own process: the run is refused naming the extra."""
    proc = run_without("lancedb", worker.settings, _url(tmp_path / "db"), tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "pip install -e '.[lancedb]' in embedq's checkout" in proc.stderr and not (tmp_path / "db").exists()


def test_a_second_writer_is_refused_and_an_adopted_empty_table_gets_the_record(worker, corpus, tmp_path):
    """One writer per table (the lock beside the database's folder); an empty table made by someone else with
    exactly the columns is used, and carries embedq's record from its first commit."""
    from embedq.producers.index.sinks.registry import output_target

    db = tmp_path / "db"
    db.mkdir()
    lancedb.connect(str(db)).create_table("docs", schema=pa.schema([("id", pa.string()),
                                                                             ("vector", lancedb.vector(384))]))
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, [t for t in corpus if len(t) < 200][:30])
    target = output_target(_url(db), None, None)
    with target.lock():
        code, _, out = run(worker.settings, src, _url(db), cwd=tmp_path)
        assert code == 2 and "another embedq index is writing" in out, out
        assert (tmp_path / "db.docs.embedq.lock").exists()
    assert not (tmp_path / "db.docs.embedq.lock").exists()  # deleted by its holder when done
    code, summary, out = run(worker.settings, src, _url(db), cwd=tmp_path)
    assert code == 0 and summary["rows"] == len(ids), out
    tbl = _table(db)
    assert sorted(tbl.to_arrow().column("id").to_pylist()) == sorted(ids)
    assert _manifest(tbl)["fingerprint"] == summary["fingerprint"]


def test_b_bge_m3_into_lancedb_dense_sparse_and_colbert_equal_the_client(m3_worker, corpus, tmp_path):
    """--kind bge-m3 (a tiny BGE-M3, tests/tiny_models.py): ``dense`` a vector column, ``lexical_indices`` /
    ``lexical_values`` plain lists, ``colbert`` a multivector column, each equal to Client.embed_hybrid."""
    from conftest import sparse_delta

    m3 = m3_worker
    settings = m3.settings
    texts = [" ".join(t.split()[:20]) for t in corpus[400:430]]
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, texts)
    db = tmp_path / "db"
    code, summary, out = run(settings, src, _url(db, "m3"), "--kind", "bge-m3", "--chunk-size", "8",
                             cwd=tmp_path)
    assert code == 0 and summary["rows"] == len(texts), out
    data = _table(db, "m3").to_arrow()
    want = m3.client.embed_hybrid(texts)
    dim = want.dense.shape[1]
    assert _columns(data) == ["id", "dense", "lexical_indices", "lexical_values", "colbert"]
    assert data.schema.field("dense").type == lancedb.vector(dim)
    assert data.schema.field("colbert").type == pa.list_(lancedb.vector(want.colbert[0].shape[1]))
    assert data.schema.field("lexical_indices").type == pa.list_(pa.int32())
    order = [ids.index(i) for i in data.column("id").to_pylist()]
    assert sorted(order) == list(range(len(texts)))
    dense = np.asarray(data.column("dense").to_pylist(), np.float32)
    assert np.abs(dense - want.dense[order]).max() <= 1e-6
    for k, got_ids, got_values, got_colbert in zip(order, *(data.column(c).to_pylist() for c in
                                                          ("lexical_indices", "lexical_values", "colbert"))):
        mine = want.lexical[k]
        assert sparse_delta(got_ids, got_values, mine.indices, mine.values) <= 1e-5  # test_index_kinds.py's bar
        assert np.abs(np.asarray(got_colbert, np.float32) - want.colbert[k]).max() <= 1e-6


def test_float16_into_lancedb_is_a_half_vector_with_its_index(worker, corpus, tmp_path):
    texts = [t for t in corpus if len(t) < 200][:40]
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, texts)
    db = tmp_path / "db"
    code, summary, out = run(worker.settings, src, _url(db, "half"), "--vector-dtype", "float16", "--build-index",
                             cwd=tmp_path)
    assert code == 0 and summary["ann_index"].startswith("IVF_HNSW_SQ vector_idx"), out
    data = _table(db, "half").to_arrow()
    assert data.schema.field("vector").type == lancedb.vector(384, pa.float16())
    rows = dict(zip(data.column("id").to_pylist(), data.column("vector").to_pylist()))
    got = np.asarray([rows[i] for i in ids], np.float32)
    want = np.asarray(worker.client.embed(texts, timeout=300, traffic_class="bulk"), dtype=np.float32)
    assert np.abs(got - want).max() <= 1e-3  # float16's rounding of values under 1


# -- issue 57: content hashes, replacing, pruning, reading back (the sink itself: LanceDB's engine, no worker) ------
def _open(db: Path, *, table: str = "docs", dtype: str = "float32", options: dict | None = None, hashes: bool = True):
    """The sink as the runner opens it: a new table records the content-hash scheme before its first write."""
    target = LanceTarget(_url(db, table), IndexConfig(vector_dtype=dtype))
    sink = target.open(vector_dtype=dtype, options=options or {}, shard_rows=1000, overwrite=False)
    if hashes and not target.exists():
        sink.manifest.content_hash = SCHEME
    return sink


def _write(sink, ids: list[str], data, *, texts: list[str] | None = None) -> None:
    sink.accept(SPACE4)
    assert sink.write(ids, data, None, [text_hash(t) for t in (texts or ids)]) == []
    sink.commit()
    sink.close()


def _reader(db: Path, table: str = "docs", dtype: str = "float32", options: dict | None = None):
    return LanceTarget(_url(db, table), IndexConfig(vector_dtype=dtype)).open_reader(vector_dtype=dtype,
                                                                                   options=options or {})


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_57_rows_carry_their_content_hash_and_read_back_exactly(tmp_path, dtype):
    db = tmp_path / "db"
    ids = [f"d{i}" for i in range(300)]
    vectors = random_rows(300, 1)
    _write(_open(db, dtype=dtype), ids, vectors)
    tbl = _table(db)
    assert tbl.schema.field("content_hash").type == pa.binary(16)
    assert tbl.schema.names == ["id", "content_hash", "vector"]
    assert [i.columns for i in tbl.list_indices()] == [["content_hash"]]
    stored = dict(zip(*(tbl.to_arrow().column(c).to_pylist() for c in ("id", "content_hash"))))
    assert stored == {i: text_hash(i) for i in ids}
    assert _manifest(tbl)["content_hash"] == SCHEME
    again = _open(db, dtype=dtype)  # continuing: the ledger has each committed id's hash
    assert all(again.ledger.hashes.get(digest(i)) == text_hash(i) for i in ids)
    want = [text_hash("d7"), text_hash("nowhere"), text_hash("d250"), text_hash("d7"), text_hash("d3")]
    for sink in (again, _reader(db, dtype=dtype)):
        found, rows = sink.rows_by_hash(want)
        assert found == [text_hash("d7"), text_hash("d250"), text_hash("d3")]
        assert rows.dtype == np.dtype(dtype) and rows.shape == (3, 4)
        np.testing.assert_array_equal(rows, vectors[[7, 250, 3]].astype(dtype))  # as stored, exactly
        assert sink.rows_by_hash([text_hash("nowhere")]) == ([], None)
        sink.close()


def test_57_a_committed_id_written_again_replaces_its_row(tmp_path):
    db = tmp_path / "db"
    _write(_open(db), ["a", "b", "c"], random_rows(3, 2))
    sink = _open(db)
    new = random_rows(2, 3)
    _write(sink, ["b", "d"], new, texts=["b edited", "d"])
    data = _table(db).to_arrow().sort_by("id")
    assert data.column("id").to_pylist() == ["a", "b", "c", "d"]  # b once, with its new vector and hash
    got = dict(zip(data.column("id").to_pylist(), np.asarray(data.column("vector").to_pylist(), np.float32)))
    np.testing.assert_array_equal(got["b"], new[0])
    assert data.column("content_hash").to_pylist()[1] == text_hash("b edited")
    assert _manifest(_table(db))["rows"] == 4
    reader = _reader(db)
    assert reader.rows_by_hash([text_hash("b")]) == ([], None)  # the old row is gone
    assert reader.ledger.hashes.get(digest("b")) == text_hash("b edited") and reader.manifest.rows == 4


def test_57_prune_deletes_the_ids_not_kept(tmp_path):
    db = tmp_path / "db"
    ids = ["a", "b", "it's", "c", "d"]
    _write(_open(db), ids, random_rows(5, 4))
    keep = IdSet()
    for doc_id in ("a", "c", "zz"):
        keep.add(digest(doc_id))
    sink = _open(db)
    assert sink.prune(keep) == 3
    sink.commit()
    sink.close()
    tbl = _table(db)
    assert sorted(tbl.to_arrow().column("id").to_pylist()) == ["a", "c"]
    assert _manifest(tbl)["rows"] == 2


def test_57_a_kinds_rows_read_back_as_its_columns(tmp_path):
    """A kind's columns (here a multivector, ``--kind multi``) come back as the pyarrow table ``write`` takes."""
    db = tmp_path / "db"
    rows = [np.random.default_rng(k).standard_normal((k + 1, 4)).astype(np.float32) for k in range(3)]
    data = pa.table({"vectors": pa.array([r.tolist() for r in rows], pa.list_(pa.list_(pa.float32(), 4)))})
    _write(_open(db, options={"kind": "multi"}), ["x", "y", "z"], data)
    found, got = _reader(db, options={"kind": "multi"}).rows_by_hash([text_hash("z"), text_hash("x")])
    assert found == [text_hash("z"), text_hash("x")]
    assert got.equals(data.take([2, 0]))


def test_57_reuse_refuses_other_options_a_table_without_hashes_and_a_missing_one(tmp_path):
    db = tmp_path / "db"
    _write(_open(db), ["a"], random_rows(1, 5))
    _write(_open(db, table="legacy", hashes=False), ["a"], random_rows(1, 5))
    with pytest.raises(errors.OutputMismatch, match="was written with options"):
        _reader(db, options={"prompt": "query: "})
    with pytest.raises(errors.OutputMismatch, match="was written with vector_dtype"):
        _reader(db, dtype="float16")
    with pytest.raises(errors.InvalidOption, match="keeps no content hashes"):
        _reader(db, table="legacy")
    with pytest.raises(errors.InvalidOption, match="does not exist"):
        _reader(db, table="nothing")
    with pytest.raises(errors.InvalidOption, match="does not exist"):
        _reader(tmp_path / "no-db")
    assert not (tmp_path / "no-db").exists() and not list(tmp_path.glob("*.lock"))


def test_57_a_table_made_before_hashes_continues_by_id_alone(tmp_path):
    db = tmp_path / "db"
    _write(_open(db, hashes=False), ["a", "b"], random_rows(2, 6))
    sink = _open(db)  # an existing table: the runner records no scheme in its manifest
    assert not sink.ledger.keeps_hashes and len(sink.committed) == 2
    _write(sink, ["c"], random_rows(1, 7))
    tbl = _table(db)
    assert tbl.schema.names == ["id", "vector"] and tbl.count_rows() == 3 and _manifest(tbl)["content_hash"] is None


def test_57_an_adopted_empty_table_gets_the_hash_column_with_its_first_rows(tmp_path):
    db = tmp_path / "db"
    db.mkdir()
    lancedb.connect(str(db)).create_table("docs", schema=pa.schema([("id", pa.string()), ("vector",
                                                                                          lancedb.vector(4))]))
    sink = _open(db)
    sink.manifest.content_hash = SCHEME  # a new output to the runner: nothing of embedq's in it
    _write(sink, ["a", "b"], random_rows(2, 8))
    tbl = _table(db)
    assert sorted(tbl.schema.names) == ["content_hash", "id", "vector"] and tbl.count_rows() == 2
    assert _reader(db).rows_by_hash([text_hash("b")])[0] == [text_hash("b")]
