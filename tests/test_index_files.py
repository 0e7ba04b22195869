"""The indexer's inputs and outputs without a worker: formats, crash repair, refusals."""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embedq import errors
from embedq.producers.index.idset import IdSet, digest
from embedq.producers.index.sinks import Manifest, OutputLock, open_sink
from embedq.producers.index.sources import Source, detect_format
from embedq.protocol import Fingerprint

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [{"id": "a", "text": "first"}, {"id": 7, "text": "second"}, {"text": "no id here"},
        {"id": "d", "text": "fourth", "extra": 1}]


def _records(source: Source) -> list[tuple[str, object, str | None]]:
    return [(r.id, r.text, r.error.code if r.error else None) for r in source]


# -- sources -------------------------------------------------------------------------------------
def test_jsonl_ids_from_field_or_line_number_and_bad_lines(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps(r) for r in ROWS[:2]] + ["", "{not json", json.dumps(ROWS[2]), "[1, 2]",
                                                  json.dumps({"id": "x"}), json.dumps({"id": 1.5, "text": "t"})]
    src.write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")
    assert _records(Source(str(src))) == [
        ("a", "first", None), ("7", "second", None),
        ("4", None, "invalid_record"),  # line numbers count the blank line: they point into the file
        ("5", "no id here", None), ("6", None, "invalid_record"), ("x", None, "invalid_record"),
        ("8", None, "invalid_record"),
    ]
    assert Source(str(src)).count() == 7


def test_explicit_id_field_is_required_and_text_field_configurable(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"key": f"k{i}", "body": f"text {i}"}) + "\n" for i in range(3))
                   + json.dumps({"body": "orphan"}) + "\n")
    got = _records(Source(str(src), text_field="body", id_field="key"))
    assert got[:3] == [("k0", "text 0", None), ("k1", "text 1", None), ("k2", "text 2", None)]
    assert got[3][2] == "invalid_record"


def test_csv_tsv_text_parquet_gzip_and_stdin(tmp_path):
    want = [("a", "first, with a comma", None), ("b", "multi\nline", None)]
    for fmt, delim in (("csv", ","), ("tsv", "\t")):
        buf = io.StringIO()
        w = csv.writer(buf, delimiter=delim)
        w.writerows([["id", "text"], ["a", "first, with a comma"], ["b", "multi\nline"]])
        path = tmp_path / f"in.{fmt}"
        path.write_text(buf.getvalue(), newline="")
        assert _records(Source(str(path))) == want
        assert Source(str(path)).count() == 2

    txt = tmp_path / "in.txt.gz"
    with gzip.open(txt, "wt", encoding="utf-8") as fh:
        fh.write("one\r\n\ntwo\nthree")
    assert detect_format(str(txt)) == "text"
    assert _records(Source(str(txt))) == [("1", "one", None), ("3", "two", None), ("4", "three", None)]

    table = pa.table({"id": [10, 11], "text": ["x", None], "other": [1, 2]})
    pq.write_table(table, tmp_path / "in.parquet")
    assert _records(Source(str(tmp_path / "in.parquet"))) == [("10", "x", None), ("11", None, None)]
    with pytest.raises(errors.InvalidOption, match="no column 'body'"):
        list(Source(str(tmp_path / "in.parquet"), text_field="body"))

    code = ("import sys; from embedq.producers.index.sources import Source; "
            "print([(r.id, r.text) for r in Source('-', 'text')])")
    out = subprocess.run([sys.executable, "-c", code], input="alpha\nbeta\n", capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "[('1', 'alpha'), ('2', 'beta')]", out.stderr



@pytest.mark.parametrize(("given", "fmt", "want"), [
    ("\n  \nalpha\nbeta\n", "text", [("3", "alpha"), ("4", "beta")]),
    ('\ufeff{"id": "a", "text": "x"}\n\n{"text": "y"}\n', "jsonl", [("a", "x"), ("3", "y")]),
    ("[1, 2]\n", "text", [("1", "[1, 2]")]),
])
def test_stdin_without_a_format_is_told_by_its_first_line(given, fmt, want):
    """Issue 51, item 2: JSONL when stdin's first non-blank line is a JSON object, else one text per line; the lines
    read to tell are read again."""
    code = ("import sys; from embedq.producers.index.sources import Source; s = Source('-'); "
            "print([(r.id, r.text) for r in s], s.describe())")
    out = subprocess.run([sys.executable, "-c", code], input=given, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"{want} stdin ({fmt})", out.stderr


def test_a_line_that_is_not_json_names_the_text_format(tmp_path):
    src = tmp_path / "lines.jsonl"
    src.write_text("one text\n")
    [record] = Source(str(src))
    assert record.error is not None and "--input-format text" in record.error.message

def test_source_refusals(tmp_path):
    with pytest.raises(errors.InvalidOption, match="--input-format"):
        Source(str(tmp_path / "x.unknown"))
    with pytest.raises(errors.InvalidOption, match="does not exist"):
        Source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(errors.InvalidOption, match="stdin"):
        Source("-", "parquet")


def test_idset_against_a_python_set():
    rng = np.random.default_rng(0)
    ids = [str(x) for x in rng.integers(0, 5000, 3000)]
    s, ref = IdSet(merge_at=100), set()
    for i in ids[:2000]:
        s.add(digest(i))
        ref.add(i)
    s.update(digest(i) for i in ids[2000:2500])
    ref.update(ids[2000:2500])
    assert len(s) == len(ref)
    assert all((digest(str(i)) in s) == (str(i) in ref) for i in range(5000))


# -- sinks ---------------------------------------------------------------------------------------
FP = Fingerprint(model="m", weights_sha256="ab" * 32, pooling="mean", normalize=True, dimensions=4,
                 dtype="float32", embedq_version="0")


def _vectors(n: int, start: int = 0) -> np.ndarray:
    return (np.arange(start * 4, (start + n) * 4, dtype=np.float32).reshape(n, 4) + 0.5) / 7


def _read(path: Path, fmt: str) -> tuple[list[str], np.ndarray]:
    if fmt == "parquet":
        table = pq.read_table(path)
        return table.column("id").to_pylist(), np.asarray(table.column("vector").to_pylist(), np.float32)
    if fmt == "npy":
        return path.with_suffix(".ids.txt").read_text().splitlines(), np.load(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["id"] for r in rows], np.asarray([r["vector"] for r in rows], np.float32)


@pytest.mark.parametrize("fmt", ["parquet", "npy", "jsonl"])
def test_crash_between_commits_is_cut_back_on_resume(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    sink = open_sink(out, fmt, vector_dtype="float32", options={})
    sink.accept(FP)
    sink.write(["r0", "r1", "r2"], _vectors(3))
    sink.commit()
    sink.write(["r3", "r4"], _vectors(2, 3))
    sink.commit()
    sink.write(["lost5", "lost6"], _vectors(2, 5))  # written, never committed: the process "dies" here
    if fmt == "parquet":
        sink._write_group()  # a half-written shard is on disk under its hidden name
    sink.close()

    again = open_sink(out, fmt, vector_dtype="float32", options={})
    assert again.manifest.rows == 5
    assert all(digest(f"r{i}") in again.committed for i in range(5))
    assert digest("lost5") not in again.committed
    ids, vecs = _read(out, fmt)
    assert ids == [f"r{i}" for i in range(5)]
    np.testing.assert_array_equal(vecs, _vectors(5))
    again.accept(FP)
    again.write(["r5"], _vectors(1, 5))
    again.commit()
    again.close()
    ids, vecs = _read(out, fmt)
    assert ids == [f"r{i}" for i in range(6)]
    np.testing.assert_array_equal(vecs, _vectors(6))
    if fmt == "parquet":
        assert sorted(p.name for p in out.iterdir()) == ["_embedq.json", "part-00000.parquet",
                                                         "part-00001.parquet", "part-00002.parquet"]
        assert json.loads(pq.read_table(out).schema.metadata[b"embedq.fingerprint"]) == FP.model_dump()


@pytest.mark.parametrize("fmt", ["parquet", "npy", "jsonl"])
def test_float16_storage(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    sink = open_sink(out, fmt, vector_dtype="float16", options={})
    sink.accept(FP)
    sink.write(["a", "b"], _vectors(2))
    sink.commit()
    sink.close()
    ids, vecs = _read(out, fmt)
    assert ids == ["a", "b"]
    # JSONL writes the shortest decimals that read back as the same float16
    np.testing.assert_array_equal(vecs.astype(np.float16), _vectors(2).astype(np.float16))
    if fmt == "parquet":
        assert pq.read_table(out).schema.field("vector").type.value_type == pa.float16()


def _snapshot(tmp_path: Path) -> dict[str, str]:
    return {str(p.relative_to(tmp_path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tmp_path.rglob("*")) if p.is_file() and not p.name.endswith(".lock")}


@pytest.mark.parametrize("fmt", ["parquet", "npy", "jsonl"])
def test_other_options_or_space_are_refused_and_nothing_changes(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    sink = open_sink(out, fmt, vector_dtype="float32", options={})
    sink.accept(FP)
    sink.write(["a"], _vectors(1))
    sink.commit()
    sink.close()
    before = _snapshot(tmp_path)

    with pytest.raises(errors.OutputMismatch, match="options"):
        open_sink(out, fmt, vector_dtype="float32", options={"dimensions": 2})
    with pytest.raises(errors.OutputMismatch, match="vector_dtype"):
        open_sink(out, fmt, vector_dtype="float16", options={})
    other = open_sink(out, fmt, vector_dtype="float32", options={})
    with pytest.raises(errors.OutputMismatch, match="another embedding space"):
        other.accept(FP.model_copy(update={"weights_sha256": "cd" * 32}))
    other.close()
    assert _snapshot(tmp_path) == before
    # the same weights under another name, or another embedq version, are the same space
    same = open_sink(out, fmt, vector_dtype="float32", options={})
    same.accept(FP.model_copy(update={"model": "/local/copy", "embedq_version": "9"}))
    same.close()


def test_foreign_files_are_never_overwritten_without_asking(tmp_path):
    out = tmp_path / "out.npy"
    np.save(out, np.zeros((2, 2)))
    with pytest.raises(errors.InvalidOption, match="not written by embedq index"):
        open_sink(out, "npy", vector_dtype="float32", options={})
    sink = open_sink(out, "npy", vector_dtype="float32", options={}, overwrite=True)
    assert not out.exists() and Manifest.model_validate_json((tmp_path / "out.npy.embedq.json").read_text())
    sink.close()


def test_one_writer_per_output(tmp_path):
    out = tmp_path / "out.parquet"
    with OutputLock(out):
        code = ("from pathlib import Path; from embedq.producers.index.sinks import OutputLock; "
                f"OutputLock(Path({str(out)!r})).__enter__()")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and "another embedq index is writing" in proc.stderr
    lock = OutputLock(out)
    assert not lock.path.exists()  # issue 51, item 7: no empty lock file is left beside the output
    with OutputLock(out):  # released on exit, and a dead holder's lock is released by the kernel
        assert lock.path.exists()
    code = ("from pathlib import Path; from embedq.producers.index.sinks import OutputLock; "
            f"OutputLock(Path({str(out)!r})).__enter__(); print('held')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "held" and lock.path.exists()  # a killed holder leaves the file: it is reused
    with OutputLock(out):
        pass
    assert not lock.path.exists()


def test_a_writer_that_locked_a_file_deleted_meanwhile_locks_the_new_one(tmp_path, monkeypatch):
    """The holder deletes the lock file when done: a writer that opened the old file before the deletion and locks it
    after would hold a lock nobody else sees, so it takes the path's new file instead. The holder ends exactly between
    the writer's open and its flock (the writer's first flock call lets it end first)."""
    import fcntl

    out = tmp_path / "out.parquet"
    holder = OutputLock(out).__enter__()
    real, calls = fcntl.flock, []

    def flock(fd: int, operation: int) -> None:
        if not calls:
            holder.__exit__(None, None, None)  # deletes the file the writer has just opened, and releases it
        calls.append(fd)
        real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    writer = OutputLock(out).__enter__()
    try:
        assert len(calls) == 2  # the deleted file, then the path's new one
        assert os.fstat(writer._fh.fileno()).st_ino == os.stat(writer.path).st_ino
    finally:
        writer.__exit__(None, None, None)


@pytest.mark.parametrize("fmt", ["npy", "jsonl"])
def test_a_write_cut_short_is_never_committed(tmp_path, fmt):
    """Bytes of a write that did not complete (a forced quit mid-write) are not counted by the commit."""
    out = tmp_path / f"out.{fmt}"
    sink = open_sink(out, fmt, vector_dtype="float32", options={})
    sink.accept(FP)
    sink.write(["a"], _vectors(1))
    (sink._data if fmt == "npy" else sink._fh).write(b"\x01" * 10)  # half a row, and no id for it
    sink.commit()
    sink.close()
    again = open_sink(out, fmt, vector_dtype="float32", options={})
    again.accept(FP)
    again.write(["b"], _vectors(1, 1))
    again.commit()
    again.close()
    ids, vecs = _read(out, fmt)
    assert ids == ["a", "b"]
    np.testing.assert_array_equal(vecs, _vectors(2))
