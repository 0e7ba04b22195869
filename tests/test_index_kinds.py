"""`embedq index --kind sparse|multi|bge-m3`: Parquet columns equal to what the Client returns, a killed run
resumed without gaps or duplicates, and an output never continued with another kind."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import sparse_delta
from test_index import _kill_after_commits, _run, _write_jsonl

from embedq import errors
from embedq.producers.index import IndexConfig, run_index

pytestmark = pytest.mark.integration
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _short(corpus, n, seed=0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(t.split()[:rng.randint(1, 40)]) for t in rng.sample(corpus, n)]


def _lists(table, name: str) -> list[np.ndarray]:
    return [np.asarray(v, dtype=np.float32) for v in table.column(name).to_pylist()]


def test_d_sparse_index_resumes_after_a_kill_and_equals_the_client(splade_worker, corpus, tmp_path):
    texts = _short(corpus, 2000)
    ids = _write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "out.parquet"
    args = ("--kind", "sparse", "--checkpoint-seconds", "0.5", "--chunk-size", "4", "--max-in-flight", "2")
    committed = _kill_after_commits(splade_worker.settings, tmp_path / "in.jsonl", out, 100, *args)
    assert 100 <= committed < len(texts)
    code, summary, stderr = _run(splade_worker.settings, tmp_path / "in.jsonl", out, *args)
    assert code == 0, stderr
    # a text repeated in the input is embedded once (issue 57): written from its row under the other ids
    assert summary["skipped"] == committed and summary["texts"] + summary["reused"] == len(texts) - committed
    table = pq.read_table(out)
    got_ids = table.column("id").to_pylist()
    assert sorted(got_ids) == sorted(ids), "no gaps, no duplicates"
    assert table.schema.field("indices").type.value_type == pa.int32()  # list<int32>: what vector databases take
    assert table.schema.field("values").type.value_type == pa.float32()
    by_id = dict(zip(ids, texts))
    sample = got_ids[::40]
    want = splade_worker.client.embed_sparse([by_id[i] for i in sample])
    rows = {i: k for k, i in enumerate(got_ids)}
    indices, values = table.column("indices").to_pylist(), _lists(table, "values")
    for doc, vector in zip(sample, want):
        # other micro-batches than the index run's: the tiny model's vocabulary logits are ~10 in size, where
        # fp32's spacing is 1e-6, so the fidelity bar (1e-5), not bit equality; and an id whose weight is within
        # that noise of 0 may be kept in one run and not the other, so the vectors are compared densely
        assert sparse_delta(indices[rows[doc]], values[rows[doc]], vector.indices, vector.values) <= 1e-5
        assert len(set(indices[rows[doc]]) ^ set(vector.indices.tolist())) <= 2  # at most a near-zero id or two
    fingerprint = table.schema.metadata[b"embedq.fingerprint"]
    assert b'"kind":"embed_sparse"' in fingerprint

    # another kind never continues this output (its manifest records the kind); nothing is touched
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(errors.OutputMismatch, match="kind"):
        run_index(splade_worker.client, str(tmp_path / "in.jsonl"), out,
                  config=IndexConfig(kind="multi", progress=False))
    assert sorted(p.name for p in out.iterdir()) == before
    with pytest.raises(errors.InvalidOption, match="writes Parquet \\(list columns\\) or a database"):
        run_index(splade_worker.client, str(tmp_path / "in.jsonl"), tmp_path / "out.npy",
                  config=IndexConfig(kind="sparse", progress=False))


@pytest.mark.parametrize("vector_dtype", ["float32", "float16"])
def test_d_bge_m3_and_multi_vector_columns_equal_the_client(m3_worker, corpus, tmp_path, vector_dtype):
    texts = _short(corpus, 120, seed=1)
    ids = _write_jsonl(tmp_path / "in.jsonl", texts)
    client = m3_worker.client
    tol = 1e-6 if vector_dtype == "float32" else 2e-3
    config = IndexConfig(kind="bge-m3", chunk_size=16, vector_dtype=vector_dtype, progress=False)
    summary = run_index(client, str(tmp_path / "in.jsonl"), tmp_path / "m3.parquet", config=config)
    assert summary.rows == len(texts) and summary.fingerprint.kind == "embed_hybrid"
    table = pq.read_table(tmp_path / "m3.parquet")
    order = [ids.index(i) for i in table.column("id").to_pylist()]
    want = client.embed_hybrid([texts[k] for k in order])
    dense = np.stack(_lists(table, "dense"))
    assert table.schema.field("dense").type.list_size == want.dense.shape[1]
    assert np.abs(dense - want.dense).max() <= tol
    for got_ids, got_values, mine in zip(table.column("lexical_indices").to_pylist(),
                                         _lists(table, "lexical_values"), want.lexical):
        assert sparse_delta(got_ids, got_values, mine.indices, mine.values) <= 1e-5  # see test_d_sparse_index...
    for got, mine in zip(table.column("colbert").to_pylist(), want.colbert):
        assert np.abs(np.asarray(got, np.float32) - mine).max() <= tol

    config = IndexConfig(kind="multi", chunk_size=16, vector_dtype=vector_dtype, progress=False)
    run_index(client, str(tmp_path / "in.jsonl"), tmp_path / "multi.parquet", config=config)
    table = pq.read_table(tmp_path / "multi.parquet")
    order = [ids.index(i) for i in table.column("id").to_pylist()]
    for got, mine in zip(table.column("vectors").to_pylist(), client.embed_all([texts[k] for k in order])):
        assert np.abs(np.asarray(got, np.float32) - mine).max() <= tol * max(1.0, float(np.abs(mine).max()))


def test_outputs_choose_what_a_kind_makes_and_another_choice_is_refused(m3_worker, corpus, tmp_path):
    """--outputs dense,lexical: the jobs ask for those alone, the Parquet output has their columns only, the manifest
    records them, and a second run asking for other outputs is refused before it writes; an unknown output and
    --outputs on a kind with one output are refused."""
    texts = _short(corpus, 24, seed=3)
    ids = _write_jsonl(tmp_path / "in.jsonl", texts)
    client = m3_worker.client
    out = tmp_path / "m3.parquet"
    config = IndexConfig(kind="bge-m3", outputs=["lexical", "dense"], chunk_size=8, progress=False)
    summary = run_index(client, str(tmp_path / "in.jsonl"), out, config=config)
    assert summary.rows == len(texts) and summary.fingerprint.pooling == "m3:dense+lexical"
    table = pq.read_table(out)
    assert table.column_names == ["id", "content_hash", "dense", "lexical_indices", "lexical_values"]
    order = [ids.index(i) for i in table.column("id").to_pylist()]
    want = client.embed_hybrid([texts[k] for k in order], outputs=["dense", "lexical"])
    assert np.abs(np.stack(_lists(table, "dense")) - want.dense).max() <= 1e-6
    for refused in (["dense", "lexical", "colbert"], ["dense"]):
        with pytest.raises(errors.OutputMismatch, match="was written with options"):
            run_index(client, str(tmp_path / "in.jsonl"), out,
                      config=IndexConfig(kind="bge-m3", outputs=refused, progress=False))
    assert pq.read_table(out).equals(table)
    with pytest.raises(errors.InvalidOption, match="bge-m3's outputs are dense, lexical, colbert"):
        run_index(client, str(tmp_path / "in.jsonl"), tmp_path / "x.parquet",
                  config=IndexConfig(kind="bge-m3", outputs=["sparse"], progress=False))
    with pytest.raises(errors.InvalidOption, match="--outputs is for a kind with several outputs"):
        run_index(client, str(tmp_path / "in.jsonl"), tmp_path / "y.parquet",
                  config=IndexConfig(kind="multi", outputs=["vectors"], progress=False))
    assert not (tmp_path / "x.parquet").exists() and not (tmp_path / "y.parquet").exists()
