"""Documents longer than the model through ``embedq index --long-inputs windows`` (issue 58, point 3 and acceptance
b): one row per window, keyed by (id, window), in Parquet, pgvector, LanceDB and Milvus.

The rows and resume checks use a gated worker of the fake model (windows of 128 tokens, its tokens words and
punctuation) on 500 documents of 4-20 windows built from the corpus; what each document's windows are comes from the
same worker through the client (``pool_windows=False``), so "rows = windows" is checked against the worker's own
answer. The indexer is SIGKILLed once it has committed rows (one micro-batch at a time through the gate, never a
fixed sleep), then run again. The nearest-neighbour check uses the session's MiniLM worker (windows of 256 tokens):
a passage from the middle of a long document, embedded as a query, finds that document's window that holds it.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import FAKE, gated_handle
from indexdb import MilvusCollections, cmd, env, milvus_server_at, run
from reindex import write_jsonl

from embedq.settings import Settings

pytestmark = pytest.mark.integration

WINDOWS = ("--long-inputs", "windows")
FAKE_WINDOW = 126  # the fake model's window: 128 tokens, [CLS] and [SEP] included
MAX_WINDOWS = 24  # the module's worker: a document of more windows fails alone (too_many_windows)
_TOKENS = re.compile(r"\w+|[^\w\s]")  # the fake model's tokens


def build_documents(corpus: list[str], n: int, tokens: tuple[int, int], seed: int = 58) -> list[tuple[str, str]]:
    """``n`` documents (id, text) of corpus texts put one after another, each of about ``tokens`` (low, high)
    tokens of the fake model."""
    rng = random.Random(seed)
    docs = []
    for k in range(n):
        want, parts, count = rng.randint(*tokens), [], 0
        while count < want:
            text = rng.choice(corpus)
            parts.append(text)
            count += len(_TOKENS.findall(text))
        docs.append((f"doc-{k}", "\n\n".join(parts)))
    return docs


Key = tuple[str, int, int, int]  # (id, window, start, end)


def expected_windows(worker, docs: list[tuple[str, str]]) -> list[Key]:
    """Each document's windows as the worker cuts them (the client's ``pool_windows=False`` result)."""
    out: list[Key] = []
    for i in range(0, len(docs), 50):
        part = docs[i:i + 50]
        windows = worker.client.submit([t for _, t in part], long_inputs="windows", pool_windows=False).result(600)
        out += [(doc_id, w.window, w.start, w.end) for (doc_id, _), ws in zip(part, windows) for w in ws]
    return out


# -- the four outputs, read with their own clients -------------------------------------------------------------------
class ParquetOut:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def url(self, name: str) -> str:
        return str(self.tmp / f"{name}.parquet")

    def count(self, name: str) -> int:
        manifest = self.tmp / f"{name}.parquet" / "_embedq.json"
        return json.loads(manifest.read_text())["rows"] if manifest.exists() else 0

    def rows(self, name: str) -> tuple[list[Key], np.ndarray]:
        import pyarrow.parquet as pq

        table = pq.read_table(self.url(name))
        vectors = table.column("vector").combine_chunks()
        matrix = np.asarray(vectors.flatten()).reshape(-1, vectors.type.list_size)
        return _keys(table.to_pydict()), matrix

    def nearest(self, name: str, query: np.ndarray) -> tuple[str, int]:
        keys, matrix = self.rows(name)
        return keys[int(np.argmax(matrix @ query))][:2]  # unit vectors: cosine


class PgvectorOut:
    def __init__(self, cluster, tmp: Path) -> None:
        self.cluster = cluster
        self.db = cluster.create_database(f"win_{tmp.name[-12:].lower().replace('-', '_')}")

    def url(self, name: str) -> str:
        return self.cluster.url(self.db, table=name)

    def count(self, name: str) -> int:
        with self.cluster.connect(self.db) as conn:
            if conn.execute("SELECT to_regclass(%s)", (name,)).fetchone()[0] is None:
                return 0
            return conn.execute(f"SELECT count(*) FROM {name}").fetchone()[0]

    def rows(self, name: str) -> tuple[list[Key], np.ndarray]:
        import pgvector.psycopg as pgvector_psycopg

        with self.cluster.connect(self.db) as conn:
            pgvector_psycopg.register_vector(conn)
            rows = conn.execute(f'SELECT id, "window", start, "end", embedding FROM {name}').fetchall()
        return [tuple(r[:4]) for r in rows], np.stack([r[4].to_numpy() for r in rows])

    def nearest(self, name: str, query: np.ndarray) -> tuple[str, int]:
        import pgvector.psycopg as pgvector_psycopg
        from pgvector import Vector

        with self.cluster.connect(self.db) as conn:
            pgvector_psycopg.register_vector(conn)
            return tuple(conn.execute(f'SELECT id, "window" FROM {name} ORDER BY embedding <=> %s LIMIT 1',
                                      (Vector(query),)).fetchone())


class LanceOut:
    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "lance"

    def url(self, name: str) -> str:
        return f"lancedb://{self.path}?table={name}"

    def count(self, name: str) -> int:
        import lancedb

        if not self.path.exists():
            return 0
        try:
            return lancedb.connect(str(self.path)).open_table(name).count_rows()
        except ValueError:  # no such table yet
            return 0

    def rows(self, name: str) -> tuple[list[Key], np.ndarray]:
        import lancedb

        table = lancedb.connect(str(self.path)).open_table(name).to_arrow()
        vectors = table.column("vector").combine_chunks()
        return _keys(table.to_pydict()), np.asarray(vectors.flatten()).reshape(-1, vectors.type.list_size)

    def nearest(self, name: str, query: np.ndarray) -> tuple[str, int]:
        import lancedb

        tbl = lancedb.connect(str(self.path)).open_table(name)
        hit = tbl.search(query).distance_type("cosine").select(["id", "window"]).limit(1).to_list()[0]
        return hit["id"], hit["window"]


class MilvusOut(MilvusCollections):
    def rows(self, name: str) -> tuple[list[Key], np.ndarray]:
        rows = self.scan(name, ["key", "id", "window", "start", "end", "windows", "vector"])
        assert all(r["key"] == f"{r['id']}#{r['window']}" for r in rows)
        return _keys({c: [r[c] for r in rows] for c in ("id", "window", "start", "end")}), \
            np.asarray([r["vector"] for r in rows], np.float32)

    def nearest(self, name: str, query: np.ndarray) -> tuple[str, int]:
        client = self.client()
        try:
            client.load_collection(f"{self.prefix}_{name}")
            hits = client.search(f"{self.prefix}_{name}", data=[query.tolist()], anns_field="vector", limit=1,
                                 output_fields=["id", "window"], search_params={"metric_type": "COSINE"},
                                 consistency_level="Strong")
        finally:
            client.close()
        return hits[0][0]["entity"]["id"], hits[0][0]["entity"]["window"]


def _keys(columns: dict[str, list]) -> list[Key]:
    return list(zip(columns["id"], columns["window"], columns["start"], columns["end"]))


@pytest.fixture(scope="module")
def milvus_server(tmp_path_factory):
    pytest.importorskip("pymilvus")
    yield from milvus_server_at(tmp_path_factory.mktemp("milvus-windows"))


@pytest.fixture
def out(request, tmp_path):
    if request.param == "parquet":
        return ParquetOut(tmp_path)
    if request.param == "pgvector":
        return PgvectorOut(request.getfixturevalue("pg"), tmp_path)
    if request.param == "lancedb":
        pytest.importorskip("lancedb")
        return LanceOut(tmp_path)
    return MilvusOut(request.getfixturevalue("milvus_server"), tmp_path)


SINKS = ["parquet", "pgvector", "lancedb", "milvus"]


# -- the fake model's documents --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fake_worker(redis_server, tmp_path_factory):
    settings = Settings(broker_url=redis_server.url, queue="embedq.test.index.windows", max_windows=MAX_WINDOWS, **FAKE)
    handle = gated_handle(settings, tmp_path_factory.mktemp("index-windows") / "worker.log")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def documents(corpus) -> list[tuple[str, str]]:
    """500 documents of 4-20 windows of the fake model."""
    return build_documents(corpus, 500, (3 * FAKE_WINDOW + 60, 14 * FAKE_WINDOW))


@pytest.fixture(scope="module")
def expected(fake_worker, documents) -> list[Key]:
    keys = expected_windows(fake_worker, documents)
    per_doc = np.bincount([int(k[0][4:]) for k in keys], minlength=len(documents))
    assert per_doc.min() >= 4 and per_doc.max() <= 20, (per_doc.min(), per_doc.max())
    return keys


def assert_whole_documents(got: list[Key], expected: list[Key]) -> None:
    """Every (id, window) once, and each document that is there has all its windows, as the worker cut them."""
    assert len(set(got)) == len(got), "a window is in the output twice"
    ids = {k[0] for k in got}
    assert sorted(got) == sorted(k for k in expected if k[0] in ids)


@pytest.mark.parametrize("out", SINKS, indirect=True)
def test_b_windows_into_each_sink_after_a_sigkill_and_a_resume(fake_worker, documents, expected, out, tmp_path):
    """Acceptance b: 500 documents of 4-20 windows, the indexer SIGKILLed once it has committed some documents'
    windows, then run again: rows = windows, every (id, window) once, each document's windows exactly the worker's;
    then an edited corpus (a document shorter, one longer, one removed) re-indexed with --prune: the edited
    documents' windows are replaced whole."""
    src = write_jsonl(tmp_path / "docs.jsonl", documents)
    args = (*WINDOWS, "--checkpoint-seconds", "0.2", "--chunk-size", "4", "--max-in-flight", "2")
    with fake_worker.gate_closed():
        proc = subprocess.Popen(cmd(src, out.url("docs"), *args), env=env(fake_worker.settings),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:  # one micro-batch at a time: the next one comes once the indexer has written the last and sent more
            while out.count("docs") < 100:
                assert proc.poll() is None, proc.stderr.read()
                fake_worker.step()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed = out.count("docs")
    assert 100 <= killed < len(expected)
    if not isinstance(out, MilvusOut):  # a transaction per commit: whole documents even before the resume
        assert_whole_documents(out.rows("docs")[0], expected)
    code, summary, text = run(fake_worker.settings, src, out.url("docs"), *WINDOWS)
    assert code == 0, text
    got, vectors = out.rows("docs")
    assert len(got) == len(expected) == summary["rows"] and sorted(got) == sorted(expected)
    assert summary["documents"] == len(documents) and summary["texts"] + summary["skipped"] == len(documents)
    assert summary["texts"] >= 1 and summary["windows"] < len(expected)
    assert vectors.shape == (len(expected), 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert "windows of 500 documents" in text

    # re-indexing: doc-0 shorter, doc-1 longer, doc-2 gone; the others unchanged
    edited = [(doc_id, text[: len(text) // 3] if doc_id == "doc-0" else text + "\n\n" + documents[3][1]
               if doc_id == "doc-1" else text) for doc_id, text in documents if doc_id != "doc-2"]
    code, summary, text = run(fake_worker.settings, write_jsonl(tmp_path / "v2.jsonl", edited), out.url("docs"),
                              *WINDOWS, "--prune")
    assert code == 0, text
    assert (summary["texts"], summary["replaced"], summary["pruned"], summary["skipped"]) == (2, 2, 1, 497)
    want = [k for k in expected if k[0] not in ("doc-0", "doc-1", "doc-2")] + expected_windows(fake_worker, edited[:2])
    got = out.rows("docs")[0]
    assert len(got) == summary["rows"] and sorted(got) == sorted(want)


def test_a_document_over_max_windows_fails_alone_and_its_job_mates_are_written(fake_worker, documents, expected,
                                                                               tmp_path):
    """A document that needs more windows than the worker's max_windows is the errors file's (too_many_windows),
    read from the result's ``failed`` list: the other documents of its job are written, with --store-text each
    window's own text."""
    huge = ("huge", "\n\n".join(text for _, text in documents[:6]))  # far more than MAX_WINDOWS windows
    docs = [*documents[:3], huge, documents[3]]
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "out.parquet"
    code, summary, text = run(fake_worker.settings, src, str(out), *WINDOWS, "--chunk-size", "8", "--store-text")
    assert code == 1, text  # some records failed
    assert summary["failed"] == 1 and summary["failures_by_code"] == {"too_many_windows": 1}
    errors_file = [json.loads(line) for line in Path(summary["errors_file"]).read_text().splitlines()]
    assert [(e["id"], e["code"]) for e in errors_file] == [("huge", "too_many_windows")]
    import pyarrow.parquet as pq

    table = pq.read_table(out).to_pydict()
    want = [k for k in expected if k[0] in ("doc-0", "doc-1", "doc-2", "doc-3")]
    assert sorted(_keys(table)) == sorted(want) and summary["texts"] == 4 and summary["windows"] == len(want)
    texts = dict(docs)
    assert all(t == texts[i][s:e] for i, s, e, t in zip(table["id"], table["start"], table["end"], table["text"]))
    assert list(pq.read_schema(next(out.glob("part-*.parquet"))).names)[:4] == ["id", "window", "start", "end"]


def test_window_settings_and_outputs_that_cannot_hold_windows_are_refused(fake_worker, documents, tmp_path):
    """An output made with other window settings is refused before anything is embedded (its manifest's options,
    then the workers' fingerprint); NPY and JSONL cannot hold windows (output_unsupported); --window-overlap without
    windows, --reuse with windows and --no-truncate with windows are refused."""
    src = write_jsonl(tmp_path / "docs.jsonl", documents[:3])
    out = str(tmp_path / "out.parquet")
    code, _, text = run(fake_worker.settings, src, out, *WINDOWS)
    assert code == 0, text
    code, _, text = run(fake_worker.settings, src, out, *WINDOWS, "--window-overlap", "16")
    assert code == 2 and "window_overlap" in text and "--overwrite" in text, text
    code, _, text = run(fake_worker.settings, src, out)  # today's truncation into a windows output
    assert code == 2 and "long_inputs" in text, text
    for name in ("out.npy", "out.jsonl"):
        code, _, text = run(fake_worker.settings, src, str(tmp_path / name), *WINDOWS)
        assert code == 2 and "cannot store them" in text, text
        assert not (tmp_path / name).exists()
    for extra in (("--window-overlap", "8"), (*WINDOWS, "--reuse", out), (*WINDOWS, "--no-truncate")):
        code, _, text = run(fake_worker.settings, src, str(tmp_path / "other.parquet"), *extra)
        assert code == 2, text
    help_text = subprocess.run([*cmd(src, out)[:4], "--help"], capture_output=True, text=True,
                               env=env(fake_worker.settings)).stdout
    assert "--long-inputs {truncate,error,windows}" in help_text and "--window-overlap" in help_text


@pytest.mark.parametrize("out", SINKS, indirect=True)
def test_b_a_passage_from_the_middle_of_a_long_document_finds_its_window(worker, corpus, out, tmp_path):
    """Acceptance b's query, with a real model (the session's MiniLM worker, windows of 256 tokens): 20 long
    documents indexed with windows; a passage from the middle of one of them, embedded as a query, has as nearest
    row (the database's own nearest-neighbour query) that document's window whose [start, end) holds it."""
    docs = build_documents(corpus, 20, (1500, 2500), seed=7)
    code, summary, text = run(worker.settings, write_jsonl(tmp_path / "long.jsonl", docs), out.url("long"), *WINDOWS)
    assert code == 0, text
    keys = out.rows("long")[0]
    assert summary["rows"] == len(keys) > 2 * len(docs)  # several windows a document
    parts = [p for _, t in docs for p in t.split("\n\n")]
    checked = 0
    for doc_id, text in docs:
        pieces = text.split("\n\n")
        starts = np.cumsum([0] + [len(p) + 2 for p in pieces])
        # from the middle on: a passage of 80+ words (a third of a window) no other document has, inside one window
        for k in range(len(pieces) // 2, len(pieces)):
            a, b = int(starts[k]), int(starts[k]) + len(pieces[k])
            holding = [w for i, w, s, e in keys if i == doc_id and s <= a and b <= e]
            if len(pieces[k].split()) >= 80 and parts.count(pieces[k]) == 1 and holding:
                break
        else:
            continue
        assert text[a:b] == pieces[k]
        query = np.asarray(worker.client.embed([pieces[k]]))[0]
        assert out.nearest("long", query) == (doc_id, holding[0])
        checked += 1
        if checked == 4:
            break
    assert checked == 4


def test_a_part_of_a_document_is_told_from_a_whole_one():
    """What a Milvus collection a run was killed in while sending holds (its rows' window and window count): the
    documents with every window once are whole, the others are parts, deleted by the next run."""
    from embedq.producers.index.windowed import whole_documents

    rows = [("a", 0, 2), ("a", 1, 2), ("b", 0, 3), ("b", 2, 3), ("c", 0, 1), ("d", 1, 2), ("e", 0, 2), ("e", 1, 3)]
    assert whole_documents(rows) == ({"a", "c"}, {"b", "d", "e"})


def test_sparse_windows_are_rows_of_their_own(splade_worker, corpus, tmp_path):
    """``--kind sparse --long-inputs windows`` (a tiny SPLADE model: windows of 64 tokens): one row per window, each
    window's weights what the client gets for that window."""
    docs = build_documents(corpus, 6, (200, 400), seed=11)
    out = tmp_path / "sparse.parquet"
    code, summary, text = run(splade_worker.settings, write_jsonl(tmp_path / "docs.jsonl", docs), str(out),
                              "--kind", "sparse", *WINDOWS)
    assert code == 0, text
    import pyarrow.parquet as pq

    table = pq.read_table(out).to_pydict()
    want = splade_worker.client.embed_sparse([t for _, t in docs], long_inputs="windows", pool_windows=False)
    by_key = {(i, w): (idx, val) for i, w, idx, val in zip(table["id"], table["window"], table["indices"],
                                                           table["values"])}
    assert summary["rows"] == len(by_key) == sum(len(w) for w in want) > 3 * len(docs)
    for (doc_id, _), windows in zip(docs, want):
        for w in windows:
            indices, values = by_key[(doc_id, w.window)]
            assert indices == w.output.indices.tolist()
            np.testing.assert_allclose(values, w.output.values, atol=1e-6)


def test_milvus_deletes_a_part_of_a_document_a_killed_run_left(fake_worker, documents, expected, milvus_server,
                                                                tmp_path):
    """Milvus has no transaction: a run killed while sending a document's windows leaves a part of it. The next
    run deletes that part and embeds the document again, whole (a real collection; the part made by deleting
    windows of a written document, as a kill between two inserts leaves it)."""
    out = MilvusOut(milvus_server, tmp_path)
    docs = documents[:4]
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    code, summary, text = run(fake_worker.settings, src, out.url("parts"), *WINDOWS)
    assert code == 0, text
    client = out.client()
    try:
        client.delete(f"{out.prefix}_parts", filter='id == "doc-1" and window >= 2')
    finally:
        client.close()
    want = sorted(k for k in expected if k[0] in {d for d, _ in docs})
    assert sorted(out.rows("parts")[0]) != want
    code, summary, text = run(fake_worker.settings, src, out.url("parts"), *WINDOWS)
    assert code == 0, text
    assert summary["texts"] == 1 and summary["skipped"] == 3  # doc-1 again, the whole ones skipped
    assert sorted(out.rows("parts")[0]) == want
