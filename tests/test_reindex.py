"""Each distinct text embedded once by ``embedq index`` (issue 57): re-indexing a changed corpus into the same Parquet
output, repeats within a run, ``--reuse`` of another output, and what is refused.

The bookkeeping runs use a worker of the fake model (the same queue path, vectors in microseconds; its ``items``
counter is what reached the model); one run uses the session's MiniLM worker, so re-indexed vectors are also checked
against a real model's. The database outputs run the same scenario in their own modules (tests/reindex.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import reindex
from conftest import load_corpus
from indexdb import cmd, env, run
from reindex import index, reindex_case, versions, write_jsonl

from embedq.producers.index.config import IndexConfig
from embedq.producers.index.precheck import nothing_to_embed
from embedq.producers.index.sources import Source

pytestmark = pytest.mark.integration
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(scope="module")
def fake_worker(redis_server, tmp_path_factory):
    yield from reindex.fake_worker(redis_server, tmp_path_factory.mktemp("reindex"), "embedq.test.reindex.fake")


def read_parquet(out: Path) -> dict[str, np.ndarray]:
    table = pq.read_table(out)
    vectors = table.column("vector").combine_chunks()
    matrix = np.asarray(vectors.flatten()).reshape(-1, vectors.type.list_size)
    ids = table.column("id").to_pylist()
    assert len(set(ids)) == len(ids), "an id is in the output twice"
    return dict(zip(ids, matrix))


def assert_same_output(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    ids = sorted(want)
    np.testing.assert_allclose(np.stack([got[i] for i in ids]), np.stack([want[i] for i in ids]), atol=1e-6)


def test_b_reindexing_a_changed_corpus_embeds_only_what_changed(fake_worker, tmp_path):
    case = reindex_case(fake_worker, tmp_path, str(tmp_path / "out.parquet"), str(tmp_path / "fresh.parquet"),
                        "--shard-rows", "500")
    second = case.second
    edited = sum(1 for doc_id, text in second if doc_id.startswith("doc-") and text.endswith(")")
                 and "(revised" in text)
    assert case.model_items <= 0.16 * len(second), case.model_items
    s = case.summary
    assert s["pruned"] == len(case.first) - (len(second) - sum(i.startswith("new-") for i, _ in second))
    assert s["replaced"] == edited
    assert s["skipped"] + s["texts"] + s["reused"] == len(second)
    assert s["rows"] == len(second)  # the manifest counts what the output holds (replaced and pruned rows gone)
    assert_same_output(read_parquet(tmp_path / "out.parquet"), read_parquet(tmp_path / "fresh.parquet"))
    assert not [p.name for p in (tmp_path / "out.parquet").iterdir() if p.name.startswith(".")]


def test_b_only_the_shards_that_hold_a_changed_row_are_rewritten(fake_worker, tmp_path):
    pairs = [(f"doc-{i}", text) for i, text in enumerate(load_corpus(1200))]
    out = tmp_path / "out.parquet"
    index(fake_worker.settings, write_jsonl(tmp_path / "v1.jsonl", pairs), str(out), "--shard-rows", "400")
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    assert len(before) == 3
    changed = [(i, f"{t} (revised)") if n == 5 else (i, t) for n, (i, t) in enumerate(pairs)]
    # the check before a private stack is started (no broker URL) sees the edited text, and the id to prune
    model, limit = fake_worker.settings.model, fake_worker.settings.max_chars
    assert nothing_to_embed(Source(str(tmp_path / "v1.jsonl")), out, None, IndexConfig(), model, limit) is not None
    write_jsonl(tmp_path / "v2.jsonl", changed)
    assert nothing_to_embed(Source(str(tmp_path / "v2.jsonl")), out, None, IndexConfig(), model, limit) is None
    write_jsonl(tmp_path / "fewer.jsonl", pairs[:-1])
    assert nothing_to_embed(Source(str(tmp_path / "fewer.jsonl")), out, None, IndexConfig(), model, limit) is not None
    pruning = IndexConfig(prune=True)
    assert nothing_to_embed(Source(str(tmp_path / "fewer.jsonl")), out, None, pruning, model, limit) is None
    summary = index(fake_worker.settings, write_jsonl(tmp_path / "v2.jsonl", changed), str(out), "--prune")
    assert (summary["replaced"], summary["texts"], summary["pruned"]) == (1, 1, 0)
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    kept = {name for name in before if after.get(name) == before[name]}
    assert len(kept) == 2, (before, after)  # the two shards without doc-5 are untouched
    assert len(read_parquet(out)) == len(pairs)


def test_b_a_reindex_killed_midway_ends_as_a_complete_one(fake_worker, tmp_path):
    """SIGKILL once the re-index has committed some of its rows (a shard of its own in the manifest), then the same
    command again: the output equals a fresh run on the second version."""
    first, second = versions()
    out = tmp_path / "out.parquet"
    index(fake_worker.settings, write_jsonl(tmp_path / "v1.jsonl", first), str(out))
    v2 = write_jsonl(tmp_path / "v2.jsonl", second)
    manifest = out / "_embedq.json"

    def parts() -> set[str]:
        return {p["file"] for p in json.loads(manifest.read_text())["parts"]}

    at_start = parts()
    args = ("--prune", "--checkpoint-seconds", "0.2", "--chunk-size", "8", "--max-in-flight", "2")
    with fake_worker.gate_closed():
        proc = subprocess.Popen(cmd(v2, str(out), *args), env=env(fake_worker.settings),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # one micro-batch at a time: the next one comes once the indexer has written the last and sent more
            while parts() == at_start:
                assert proc.poll() is None, proc.stderr.read()
                fake_worker.step()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(json.loads(manifest.read_text())["runs"]) == 1  # the re-index did not finish
    summary = index(fake_worker.settings, v2, str(out), "--prune")
    assert summary["pruned"] == 200
    index(fake_worker.settings, v2, str(tmp_path / "fresh.parquet"))
    assert_same_output(read_parquet(out), read_parquet(tmp_path / "fresh.parquet"))


def test_c_repeated_texts_are_embedded_once(fake_worker, tmp_path):
    texts = load_corpus(1000)
    rng = np.random.default_rng(57)
    repeats = [texts[int(k)] for k in rng.integers(0, len(texts), 430)]  # 30 % of 1,430 rows repeat a text
    rows = texts + repeats
    order = rng.permutation(len(rows))
    pairs = [(f"id-{n}", rows[k]) for n, k in enumerate(order)]
    fake_worker.settle()
    before = fake_worker.stats()["items"]
    summary = index(fake_worker.settings, write_jsonl(tmp_path / "in.jsonl", pairs), str(tmp_path / "out.parquet"),
                    "--chunk-size", "16")
    fake_worker.settle()
    items = fake_worker.stats()["items"] - before
    distinct = len(set(rows))
    assert items <= 0.71 * len(pairs), items
    assert items <= distinct + 1  # the probe is none here (a new output); every distinct text once at most
    assert summary["texts"] + summary["reused"] == len(pairs)
    got = read_parquet(tmp_path / "out.parquet")
    assert sorted(got) == sorted(i for i, _ in pairs)
    by_text: dict[str, np.ndarray] = {}
    for doc_id, text in pairs:  # every id of a text has that text's vector
        np.testing.assert_allclose(got[doc_id], by_text.setdefault(text, got[doc_id]), atol=1e-6)


def test_reuse_takes_stored_vectors_into_another_output(fake_worker, tmp_path):
    first, second = versions(1000)
    last_night = tmp_path / "last.parquet"
    index(fake_worker.settings, write_jsonl(tmp_path / "v1.jsonl", first), str(last_night))
    fake_worker.settle()
    before = fake_worker.stats()["items"]
    v2 = write_jsonl(tmp_path / "v2.jsonl", second)
    summary = index(fake_worker.settings, v2, str(tmp_path / "tonight.parquet"), "--reuse", str(last_night))
    fake_worker.settle()
    items = fake_worker.stats()["items"] - before
    assert items <= 0.16 * len(second) + 1, items  # the edited and new texts (and the probe)
    assert summary["reused"] >= 0.8 * len(second)
    index(fake_worker.settings, v2, str(tmp_path / "fresh.parquet"))
    assert_same_output(read_parquet(tmp_path / "tonight.parquet"), read_parquet(tmp_path / "fresh.parquet"))


def test_d_another_space_or_options_are_refused_before_anything_is_embedded(fake_worker, worker, tmp_path):
    pairs = [(f"doc-{i}", text) for i, text in enumerate(load_corpus(50))]
    src = write_jsonl(tmp_path / "in.jsonl", pairs)
    out = tmp_path / "out.parquet"
    index(fake_worker.settings, src, str(out))
    manifest = (out / "_embedq.json").read_text()
    for extra in (("--dimensions", "8"), ("--no-normalize",), ("--prompt", "query: ")):
        for args in ((src, str(out), *extra), (src, str(tmp_path / "other.parquet"), "--reuse", str(out), *extra)):
            fake_worker.settle()
            before = fake_worker.stats()["items"]
            code, _, out_text = run(fake_worker.settings, *args)
            assert code == 2, (extra, out_text)
            assert "OutputMismatch" in out_text or "output_mismatch" in out_text or "was written with" in out_text, \
                out_text
            assert fake_worker.stats()["items"] == before
    assert (out / "_embedq.json").read_text() == manifest
    # another model: MiniLM's worker against the fake model's output, as a target and as a --reuse source
    for args in ((src, str(out)), (src, str(tmp_path / "minilm.parquet"), "--reuse", str(out))):
        code, _, out_text = run(worker.settings, *args)
        assert code == 2, out_text
        assert "another embedding space" in out_text, out_text


def test_reindexed_vectors_of_a_real_model_equal_a_fresh_run(worker, tmp_path):
    first, second = versions(300)
    out = tmp_path / "out.parquet"
    index(worker.settings, write_jsonl(tmp_path / "v1.jsonl", first), str(out))
    v2 = write_jsonl(tmp_path / "v2.jsonl", second)
    summary = index(worker.settings, v2, str(out), "--prune")
    assert summary["texts"] <= 0.16 * len(second)
    index(worker.settings, v2, str(tmp_path / "fresh.parquet"))
    assert_same_output(read_parquet(out), read_parquet(tmp_path / "fresh.parquet"))


def test_prune_and_reuse_are_refused_for_outputs_that_keep_no_hashes(fake_worker, tmp_path):
    """NPY and JSONL keep no content hashes: --prune is refused before anything is embedded (the new output is removed),
    and such an output is no --reuse source."""
    src = write_jsonl(tmp_path / "in.jsonl", [(f"doc-{i}", text) for i, text in enumerate(load_corpus(20))])
    fake_worker.settle()
    before = fake_worker.stats()["items"]
    code, _, out_text = run(fake_worker.settings, src, str(tmp_path / "out.npy"), "--prune")
    assert code == 2 and "--prune" in out_text and "cannot remove rows" in out_text, out_text
    assert not (tmp_path / "out.npy").exists() and not (tmp_path / "out.npy.embedq.json").exists()
    index(fake_worker.settings, src, str(tmp_path / "made.jsonl"))
    code, _, out_text = run(fake_worker.settings, src, str(tmp_path / "other.parquet"), "--reuse",
                            str(tmp_path / "made.jsonl"))
    assert code == 2 and "keeps no content hashes" in out_text, out_text
    assert fake_worker.stats()["items"] - before == 20  # the one run that embedded (no probe: a new output)


def test_repeats_of_written_rows_are_read_back_while_the_run_goes_on(fake_worker, tmp_path, monkeypatch):
    """A run whose deferred repeats reach the bound (``DEFER_MAX``, lowered here) commits and writes them from the
    rows it stored, mid-run, instead of holding them to its end: each text once, every id with its text's vector."""
    from embedq.producers.client import Client
    from embedq.producers.index import runner

    monkeypatch.setattr(runner, "DEFER_MAX", 16)
    texts = load_corpus(200)
    pairs = [(f"a-{i}", t) for i, t in enumerate(texts)] + [(f"b-{i}", t) for i, t in enumerate(texts)]
    out = tmp_path / "out.parquet"
    fake_worker.settle()
    before = fake_worker.stats()["items"]
    with Client(fake_worker.settings) as client:
        summary = runner.run_index(client, str(write_jsonl(tmp_path / "in.jsonl", pairs)), out,
                                   config=IndexConfig(chunk_size=16, max_in_flight=2, progress=False))
    fake_worker.settle()
    assert fake_worker.stats()["items"] - before == len(set(texts))
    assert summary.texts == len(set(texts)) and summary.texts + summary.reused == len(pairs)
    parts = json.loads((out / "_embedq.json").read_text())["parts"]
    assert len(parts) > 2  # committed along the way (each resolve commits first), not only at the end
    got = read_parquet(out)
    for i, text in enumerate(texts):
        np.testing.assert_allclose(got[f"b-{i}"], got[f"a-{texts.index(text)}"], atol=1e-6)
