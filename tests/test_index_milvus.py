"""`embedq index -o milvus://...`: Milvus Lite's own engine, both as its gRPC server (``milvus-lite server``, the
``milvus://host:port`` form) and as a local file (``milvus:///path/file.db``), a real worker, the real MiniLM model,
real kills (issue 40: a, b, c, d for Milvus)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
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
    milvus_client,
    milvus_server_at,
    query_texts,
    random_rows,
    run,
    run_without,
    text_hash,
    write_jsonl,
)

from embedq import errors
from embedq.producers.embedded import free_port
from embedq.producers.index.content import SCHEME
from embedq.producers.index.idset import IdSet, digest
from embedq.producers.index.runner import IndexConfig
from embedq.producers.index.sinks.milvus import Target as MilvusTarget

pytestmark = pytest.mark.integration
pymilvus = pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``milvus-lite server`` on a free port of 127.0.0.1 (``indexdb.milvus_server_at``)."""
    yield from milvus_server_at(tmp_path_factory.mktemp("milvus-server"))


@contextlib.contextmanager
def _client(uri: str):
    """A client of a server (``http://...``) or of a Milvus Lite file, which is closed after: Milvus Lite holds a
    file's database for one process at a time, so the indexer could not open it while the test holds it."""
    client = milvus_client(uri)
    try:
        yield client
    finally:
        client.close()
        if not uri.startswith("http"):
            from milvus_lite.server_manager import server_manager_instance

            server_manager_instance.release_server(os.path.abspath(uri))


def _rows(uri: str, collection: str = "docs") -> int:
    with _client(uri) as client:
        if not client.has_collection(collection):
            return 0
        rows = client.query(collection, filter="", output_fields=["count(*)"], consistency_level="Strong")
    return int(rows[0]["count(*)"])


def _all(uri: str, collection: str, fields: list[str]) -> list[dict]:
    with _client(uri) as client:
        client.load_collection(collection)
        it = client.query_iterator(collection, batch_size=1000, output_fields=fields, consistency_level="Strong")
        out = []
        while batch := it.next():
            out += batch
        it.close()
    return out


def _fields(uri: str, collection: str) -> dict[str, dict]:
    with _client(uri) as client:
        return {f["name"]: f for f in client.describe_collection(collection)["fields"]}


def _kind_fields(uri: str, collection: str) -> dict[str, dict]:
    """The fields but ``content_hash`` (issue 57: a collection made by a run that records content hashes has it)."""
    return {name: f for name, f in _fields(uri, collection).items() if name != "content_hash"}


def _index(uri: str, collection: str, field: str) -> dict:
    with _client(uri) as client:
        return client.describe_index(collection, field)


def _state(uri: str, collection: str = "docs") -> tuple[int, str]:
    """The row count and a checksum of every stored id and vector."""
    rows = sorted(_all(uri, collection, ["*"]), key=lambda r: r["id"])
    digest = hashlib.md5()
    for row in rows:
        digest.update(json.dumps({k: (np.asarray(v, np.float32).tolist() if k == "vector" else v)
                                  for k, v in sorted(row.items())}, default=str).encode())
    return len(rows), digest.hexdigest()


def _manifest(uri: str, collection: str = "docs") -> dict:
    with _client(uri) as client:
        return json.loads(client.describe_collection(collection)["properties"]["embedq.manifest"])


@pytest.fixture(scope="module")
def loaded(worker, corpus, server, tmp_path_factory):
    """a. N corpus texts into a Milvus server's ``docs``: SIGKILL once it holds >= 200 rows, resume with
    --build-index."""
    url, uri = server
    tmp = tmp_path_factory.mktemp("milvus_a")
    texts = corpus_texts(corpus)
    ids = write_jsonl(tmp / "in.jsonl", texts)
    target = f"{url}?collection=docs"
    args = ("--checkpoint-seconds", "1", "--chunk-size", "16", "--build-index")
    t0 = time.monotonic()
    committed = kill_after_rows(cmd(tmp / "in.jsonl", target, *args), env(worker.settings), tmp, lambda: _rows(uri))
    code, summary, out = run(worker.settings, tmp / "in.jsonl", target, *args, cwd=tmp)
    assert code == 0, out
    print(f"\nmilvus acceptance a: {len(texts)} texts, killed at {committed} rows, {time.monotonic() - t0:.1f}s in all")
    return uri, target, ids, texts, committed, summary, out


def test_a_killed_run_resumes_into_exactly_the_texts_with_client_vectors(worker, loaded):
    uri, _, ids, texts, committed, summary, _ = loaded
    assert 200 <= committed < len(ids)
    assert summary["skipped"] == committed and summary["texts"] == len(ids) - committed
    assert summary["rows"] == len(ids) and summary["failed"] == 0
    fields = _kind_fields(uri, "docs")
    assert list(fields) == ["id", "vector"] and fields["vector"]["type"] == pymilvus.DataType.FLOAT_VECTOR
    assert fields["vector"]["params"]["dim"] == 384 and fields["id"]["is_primary"]
    rows = _all(uri, "docs", ["id", "vector"])
    got = [r["id"] for r in rows]
    assert len(got) == len(ids) and sorted(got) == sorted(ids)  # no gaps, no duplicates
    manifest = _manifest(uri)
    assert manifest["rows"] == len(ids) and manifest["fingerprint"] == summary["fingerprint"]
    vectors = np.asarray([r["vector"] for r in rows], dtype=np.float32)
    by_id = dict(zip(ids, texts))
    want = bulk_vectors(worker, [by_id[i] for i in got])
    assert np.abs(vectors - want).max() <= 1e-6


def test_a_nearest_neighbours_through_the_hnsw_index_match_exact_search(worker, corpus, loaded):
    uri, _, _, _, _, summary, out = loaded
    assert summary["ann_index"] == "HNSW vector (COSINE, M=16, efConstruction=200)", summary
    assert "ann index" in out and summary["ann_index_seconds"] >= 0
    index = _index(uri, "docs", "vector")
    assert index["index_type"] == "HNSW" and index["metric_type"] == "COSINE", index
    qv = np.asarray(worker.client.embed(query_texts(corpus), timeout=300), dtype=np.float32)
    with _client(uri) as client:
        client.load_collection("docs")
        hits = client.search("docs", data=qv.tolist(), anns_field="vector", limit=10,
                             search_params={"metric_type": "COSINE", "params": {"ef": 100}})
    found = [[h["id"] for h in hit] for hit in hits]
    rows = _all(uri, "docs", ["id", "vector"])
    base_ids = [r["id"] for r in rows]
    base = np.asarray([r["vector"] for r in rows], dtype=np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    exact = [[base_ids[k] for k in np.argsort(-(base @ q))[:10]] for q in qv]
    recall = np.mean([len(set(f) & set(e)) / 10 for f, e in zip(found, exact)])
    print(f"\nmilvus recall@10 through the HNSW index: {recall:.3f}")
    assert recall >= 0.95, recall


@pytest.mark.parametrize("extra", [("--prompt", "query: "), ("--dimensions", "128"), ("--no-normalize",),
                                   ("--kind", "sparse")])
def test_c_other_options_or_kind_are_refused_and_the_collection_untouched(worker, loaded, tmp_path, extra):
    uri, target = loaded[:2]
    src = tmp_path / "more.jsonl"
    src.write_text('{"id": "new-1", "text": "a new document"}\n{"id": "doc-5", "text": "already there"}\n')
    before = _state(uri)
    items = items_received(worker)
    code, _, out = run(worker.settings, src, target, *extra, cwd=tmp_path)
    assert code == 2 and "[output_mismatch]" in out and "was written with" in out, out
    assert _state(uri) == before and items_received(worker) == items  # refused before anything was embedded


def test_c_another_pooling_is_refused_before_writing(cls_worker, loaded, tmp_path):
    """Another embedding space (the same weights, CLS pooling): the probe's fingerprint is refused."""
    uri, target = loaded[:2]
    settings = cls_worker.settings
    src = tmp_path / "more.jsonl"
    src.write_text('{"id": "new-1", "text": "a new document"}\n')
    before = _state(uri)
    code, _, out = run(settings, src, target, cwd=tmp_path)
    assert code == 2 and "another embedding space" in out and "cls pooling" in out, out
    assert _state(uri) == before


def _lite(path: Path, collection: str) -> str:
    return f"milvus://{path}?collection={collection}"


def test_b_sparse_into_milvus_lite_is_a_sparse_float_vector_equal_to_the_client(splade_worker, corpus, tmp_path):
    """--kind sparse (a tiny SPLADE): a SPARSE_FLOAT_VECTOR field with its inverted index (inner product), equal to
    Client.embed_sparse, and a sparse search finds a text by its own vector."""
    from conftest import sparse_delta

    texts = [" ".join(t.split()[:20]) for t in corpus[:40]]
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, texts)
    db = tmp_path / "sparse.db"
    code, summary, out = run(splade_worker.settings, src, _lite(db, "splade"), "--kind", "sparse", "--chunk-size", "8",
                             cwd=tmp_path)
    assert code == 0 and summary["rows"] == len(texts) and summary["failed"] == 0, out
    fields = {name: f["type"] for name, f in _kind_fields(str(db), "splade").items()}
    assert fields == {"id": pymilvus.DataType.VARCHAR, "sparse": pymilvus.DataType.SPARSE_FLOAT_VECTOR}
    assert _index(str(db), "splade", "sparse")["index_type"] == "SPARSE_INVERTED_INDEX"
    assert _manifest(str(db), "splade")["options"]["kind"] == "sparse"
    rows = {r["id"]: r["sparse"] for r in _all(str(db), "splade", ["id", "sparse"])}
    assert sorted(rows) == sorted(ids)
    want = splade_worker.client.embed_sparse(texts)
    for doc, mine in zip(ids, want):
        got = rows[doc]
        assert sparse_delta(list(got), list(got.values()), mine.indices, mine.values) <= 1e-5
    # a sparse search through the inverted index scores by inner product: its best 5 are numpy's
    query = {int(i): float(v) for i, v in zip(want[7].indices, want[7].values)}
    with _client(str(db)) as client:
        client.load_collection("splade")
        [hits] = client.search("splade", data=[query], anns_field="sparse", limit=5,
                               search_params={"metric_type": "IP"})
    exact = sorted((sum(query.get(int(i), 0.0) * float(v) for i, v in zip(m.indices, m.values)) for m in want),
                   reverse=True)[:5]
    assert np.allclose([h["distance"] for h in hits], exact, rtol=1e-5), (hits, exact)


def test_b_bge_m3_into_milvus_is_dense_and_lexical_equal_to_the_client(m3_worker, corpus, tmp_path):
    """--kind bge-m3 (a tiny BGE-M3): ``dense`` FLOAT_VECTOR and ``lexical`` SPARSE_FLOAT_VECTOR in one collection
    (a hybrid search), equal to Client.embed_hybrid; ColBERT is left out with a note, and asked for it is refused."""
    from conftest import sparse_delta

    m3 = m3_worker
    settings = m3.settings
    texts = [" ".join(t.split()[:20]) for t in corpus[400:430]]
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, texts)
    db = tmp_path / "m3.db"
    before = m3.stats()["items_received"]
    code, _, out = run(settings, src, _lite(db, "m3"), "--kind", "bge-m3", "--outputs", "dense,colbert",
                       cwd=tmp_path)
    assert code == 2 and "colbert (ragged) cannot be stored in" in out and "no field for a list of vectors" \
        in out, out
    assert m3.stats()["items_received"] == before and not db.exists()
    code, summary, out = run(settings, src, _lite(db, "m3"), "--kind", "bge-m3", "--chunk-size", "8",
                             "--build-index", cwd=tmp_path)
    want = m3.client.embed_hybrid(texts, outputs=["dense", "lexical"])
    # the tiny random model gives some texts no lexical weight: Milvus refuses an empty sparse vector, so those
    # records are errors (the errors file), the others rows
    empty = [doc for doc, lexical in zip(ids, want.lexical) if not len(lexical.indices)]
    assert code == (1 if empty else 0) and summary["rows"] == len(texts) - len(empty), out
    assert summary["failed"] == len(empty) and len(empty) < len(texts) // 2
    if empty:
        errors_file = Path(summary["errors_file"])  # in the current folder, named after the collection
        assert errors_file.parent == tmp_path and errors_file.name.startswith("m3."), errors_file
        errors = [json.loads(line) for line in errors_file.read_text().splitlines()]
        assert sorted(e["id"] for e in errors) == sorted(empty)
        assert all("Milvus refuses an empty sparse vector" in e["message"] for e in errors), errors
    assert summary["notes"] == [f"colbert is not written to {_lite(db, 'm3')}: Milvus has no field for a list "
                                "of vectors per text (ColBERT's, --kind multi's); write it to LanceDB or Parquet "
                                "(the other outputs are; --outputs chooses)"], summary
    fields = {name: f["type"] for name, f in _kind_fields(str(db), "m3").items()}
    assert fields == {"id": pymilvus.DataType.VARCHAR, "dense": pymilvus.DataType.FLOAT_VECTOR,
                      "lexical": pymilvus.DataType.SPARSE_FLOAT_VECTOR}
    assert _manifest(str(db), "m3")["options"]["outputs"] == ["dense", "lexical"]
    rows = {r["id"]: r for r in _all(str(db), "m3", ["id", "dense", "lexical"])}
    assert sorted(rows) == sorted(set(ids) - set(empty))
    for k, doc in enumerate(ids):
        if doc in empty:
            continue
        assert np.abs(np.asarray(rows[doc]["dense"], np.float32) - want.dense[k]).max() <= 1e-6
        mine = want.lexical[k]
        got = rows[doc]["lexical"]
        assert sparse_delta(list(got), list(got.values()), mine.indices, mine.values) <= 1e-5
    k = next(k for k, doc in enumerate(ids) if doc not in empty)
    lexical = {int(i): float(v) for i, v in zip(want.lexical[k].indices, want.lexical[k].values)}
    with _client(str(db)) as client:
        client.load_collection("m3")
        hybrid = client.hybrid_search("m3", [
            pymilvus.AnnSearchRequest([want.dense[k].tolist()], "dense", {"metric_type": "COSINE"}, limit=5),
            pymilvus.AnnSearchRequest([lexical], "lexical", {"metric_type": "IP"}, limit=5)],
            pymilvus.RRFRanker(), limit=3)
    assert ids[k] in [h["id"] for h in hybrid[0]]  # one query, both fields: the text itself is among the best


def test_store_text_and_a_row_milvus_refuses_goes_to_the_errors_file(worker, tmp_path):
    """--store-text into Milvus Lite: a text over VARCHAR's 65,535 bytes is that record's error (errors file), the
    other rows are written with their texts."""
    texts = ["a short text", "x" * 70_000, "another short one"]
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, texts)
    db = tmp_path / "text.db"
    code, summary, out = run(worker.settings, src, _lite(db, "docs"), "--store-text", cwd=tmp_path)
    assert code == 1 and summary["rows"] == 2 and summary["failed"] == 1, out
    assert summary["failures_by_code"] == {"invalid_record": 1}
    errors_file = Path(summary["errors_file"])  # in the current folder, named after the collection
    assert errors_file.parent == tmp_path and errors_file.name.startswith("docs."), errors_file
    [error] = [json.loads(line) for line in errors_file.read_text().splitlines()]
    assert error["id"] == ids[1] and "over 65,535 bytes" in error["message"], error
    rows = {r["id"]: r["text"] for r in _all(str(db), "docs", ["id", "text"])}
    assert rows == {ids[0]: texts[0], ids[2]: texts[2]}


def _foreign(db: Path) -> None:
    with _client(str(db)) as client:
        _make_foreign(client)


def _make_foreign(client) -> None:
    existing = set(client.list_collections())
    dtype = pymilvus.DataType

    def make(name: str, fields: list[tuple], rows: list[dict] | None = None) -> None:
        if name in existing:
            return
        schema = pymilvus.MilvusClient.create_schema(auto_id=False)
        for field_name, ftype, kwargs in fields:
            schema.add_field(field_name, ftype, **kwargs)
        params = client.prepare_index_params()
        params.add_index(field_name="vector", index_type="FLAT", metric_type="COSINE")
        client.create_collection(name, schema=schema, index_params=params)
        if rows:
            client.insert(name, rows)

    key = ("id", dtype.VARCHAR, {"is_primary": True, "max_length": 64})
    make("dim768", [key, ("vector", dtype.FLOAT_VECTOR, {"dim": 768})])
    make("other_schema", [("id", dtype.INT64, {"is_primary": True}), ("vector", dtype.FLOAT_VECTOR, {"dim": 384})])
    make("foreign_rows", [key, ("vector", dtype.FLOAT_VECTOR, {"dim": 384})], [{"id": "x", "vector": [0.1] * 384}])


@pytest.mark.parametrize("case", ["unreachable server", "another dimension", "another schema", "foreign rows",
                                  "no collection", "missing folder", "float16"])
def test_d_bad_targets_are_refused_before_any_text_is_embedded(worker, corpus, tmp_path_factory, tmp_path, case):
    db = tmp_path_factory.getbasetemp() / "milvus_d.db"
    _foreign(db)
    url, says, probe = {
        "unreachable server": (f"milvus://127.0.0.1:{free_port()}?collection=docs", "cannot reach Milvus at", 0),
        "another dimension": (_lite(db, "dim768"), "vector is FLOAT_VECTOR(768), this run writes FLOAT_VECTOR(384)",
                              1),
        "another schema": (_lite(db, "other_schema"), "id is INT64, this run writes VARCHAR", 1),
        "foreign rows": (_lite(db, "foreign_rows"), "holds rows that embedq index did not write", 0),
        "no collection": (f"milvus://{db}", "names no collection", 0),
        "missing folder": (_lite(tmp_path / "missing" / "x.db", "docs"), "does not exist", 0),
        "float16": (_lite(tmp_path / "f16.db", "docs"), "--vector-dtype float16", 0),
    }[case]
    extra = ("--vector-dtype", "float16") if case == "float16" else ()
    src = tmp_path / "in.jsonl"
    write_jsonl(src, corpus[:50])
    before = items_received(worker)
    states = {c: _state(str(db), c) for c in ("dim768", "other_schema", "foreign_rows")}
    code, _, out = run(worker.settings, src, url, *extra, cwd=tmp_path)
    assert code == 2 and says in out, out
    assert items_received(worker) - before <= probe  # no text of the input was sent (at most the one-text probe)
    assert {c: _state(str(db), c) for c in states} == states
    assert not (tmp_path / "missing").exists() and not (tmp_path / "f16.db").exists()


def test_d_a_missing_extra_names_it(worker, tmp_path):
    """pymilvus made unimportable in the CLI's own process: the run is refused naming the extra."""
    proc = run_without("pymilvus", worker.settings, _lite(tmp_path / "x.db", "docs"), tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "pip install -e '.[milvus]' in embedq's checkout" in proc.stderr and not (tmp_path / "x.db").exists()


def test_a_second_writer_is_refused(worker, corpus, tmp_path):
    """One writer per collection: the lock beside a Milvus Lite file."""
    from embedq.producers.index.sinks.registry import output_target

    db = tmp_path / "lock.db"
    src = tmp_path / "in.jsonl"
    ids = write_jsonl(src, [t for t in corpus if len(t) < 200][:30])
    target = output_target(_lite(db, "docs"), None, None)
    with target.lock():
        code, _, out = run(worker.settings, src, _lite(db, "docs"), cwd=tmp_path)
        assert code == 2 and "another embedq index is writing collection docs" in out, out
    code, summary, out = run(worker.settings, src, _lite(db, "docs"), cwd=tmp_path)
    assert code == 0 and summary["rows"] == len(ids), out


# -- issue 57: content hashes, replacing, pruning, reading back (the sink itself, on the module's server) ------------
def _target(url: str, collection: str):
    if url.startswith("milvus://127.0.0.1"):
        # this process's channel to the module's server may have been sent a GOAWAY while idle (``_client``): made
        # afresh first, so the sink's client is not the one to find it dropped
        with _client(f"http://{url.removeprefix('milvus://')}"):
            pass
    return MilvusTarget(f"{url}?collection={collection}", IndexConfig())


def _open(url: str, collection: str, *, hashes: bool = True, options: dict | None = None):
    """The sink as the runner opens it: a new collection records the content-hash scheme before its first write."""
    target = _target(url, collection)
    sink = target.open(vector_dtype="float32", options=options or {}, shard_rows=1000, overwrite=False)
    if hashes and not target.exists():
        sink.manifest.content_hash = SCHEME
    return sink


def _write(sink, ids: list[str], data, *, texts: list[str] | None = None) -> None:
    sink.accept(SPACE4)
    assert sink.write(ids, data, None, [text_hash(t) for t in (texts or ids)]) == []
    sink.commit()
    sink.close()


def _reader(url: str, collection: str, *, options: dict | None = None, dtype: str = "float32"):
    return _target(url, collection).open_reader(vector_dtype=dtype, options=options or {})


def test_57_rows_carry_their_content_hash_and_read_back_exactly(server):
    url, uri = server
    ids = [f"d{i}" for i in range(300)]
    vectors = random_rows(300, 1)
    _write(_open(url, "h57"), ids, vectors)
    fields = _fields(uri, "h57")
    assert list(fields) == ["id", "content_hash", "vector"]
    assert fields["content_hash"]["type"] == pymilvus.DataType.VARCHAR
    assert fields["content_hash"]["params"]["max_length"] == 32
    assert _index(uri, "h57", "content_hash")["index_type"] == "INVERTED"
    assert {r["id"]: r["content_hash"] for r in _all(uri, "h57", ["id", "content_hash"])} == \
        {i: text_hash(i).hex() for i in ids}
    assert _manifest(uri, "h57")["content_hash"] == SCHEME
    again = _open(url, "h57")  # continuing: the ledger has each committed id's hash
    assert all(again.ledger.hashes.get(digest(i)) == text_hash(i) for i in ids)
    want = [text_hash("d7"), text_hash("nowhere"), text_hash("d250"), text_hash("d7"), text_hash("d3")]
    for sink in (again, _reader(url, "h57")):
        found, rows = sink.rows_by_hash(want)
        assert found == [text_hash("d7"), text_hash("d250"), text_hash("d3")]
        assert rows.dtype == np.float32 and rows.shape == (3, 4)
        np.testing.assert_array_equal(rows, vectors[[7, 250, 3]])  # FLOAT_VECTOR: as written, exactly
        assert sink.rows_by_hash([text_hash("nowhere")]) == ([], None)
        sink.close()


def test_57_a_committed_id_written_again_replaces_its_row_and_prune_deletes_the_rest(server):
    url, uri = server
    _write(_open(url, "r57"), ["a", "b", "c", "it's", "né"], random_rows(5, 2))
    new = random_rows(2, 3)
    _write(_open(url, "r57"), ["b", "d"], new, texts=["b edited", "d"])
    rows = {r["id"]: r for r in _all(uri, "r57", ["id", "content_hash", "vector"])}
    assert sorted(rows) == sorted(["a", "b", "c", "d", "it's", "né"])  # b once, with its new vector and hash
    np.testing.assert_array_equal(np.asarray(rows["b"]["vector"], np.float32), new[0])
    assert rows["b"]["content_hash"] == text_hash("b edited").hex() and _manifest(uri, "r57")["rows"] == 6
    reader = _reader(url, "r57")
    assert reader.rows_by_hash([text_hash("b")]) == ([], None)  # the old row is gone
    assert reader.ledger.hashes.get(digest("b")) == text_hash("b edited")
    reader.close()
    keep = IdSet()
    for doc_id in ("a", "d", "zz"):
        keep.add(digest(doc_id))
    sink = _open(url, "r57")
    assert sink.prune(keep) == 4
    sink.commit()
    sink.close()
    assert sorted(r["id"] for r in _all(uri, "r57", ["id"])) == ["a", "d"] and _rows(uri, "r57") == 2
    assert _manifest(uri, "r57")["rows"] == 2


def test_57_reuse_refuses_other_options_a_collection_without_hashes_and_a_missing_one(server, tmp_path):
    url, _ = server
    _write(_open(url, "o57"), ["a"], random_rows(1, 5))
    _write(_open(url, "legacy57", hashes=False), ["a"], random_rows(1, 5))
    with pytest.raises(errors.OutputMismatch, match="was written with options"):
        _reader(url, "o57", options={"prompt": "query: "})
    with pytest.raises(errors.InvalidOption, match="keeps no content hashes"):
        _reader(url, "legacy57")
    with pytest.raises(errors.InvalidOption, match="does not exist"):
        _reader(url, "nothing57")
    with pytest.raises(errors.InvalidOption, match="does not exist"):
        _reader(f"milvus://{tmp_path}/none.db", "docs")
    assert not list(tmp_path.iterdir())


def test_57_a_collection_made_before_hashes_continues_by_id_alone(server):
    url, uri = server
    _write(_open(url, "l57", hashes=False), ["a", "b"], random_rows(2, 6))
    sink = _open(url, "l57")  # an existing collection: the runner records no scheme in its manifest
    assert not sink.ledger.keeps_hashes and len(sink.committed) == 2
    _write(sink, ["c"], random_rows(1, 7))
    assert list(_fields(uri, "l57")) == ["id", "vector"] and _rows(uri, "l57") == 3
    assert _manifest(uri, "l57")["content_hash"] is None
