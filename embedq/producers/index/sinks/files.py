"""The file outputs of ``embedq index`` as a target: ``-o OUT.parquet`` (a dataset directory of shards), ``OUT.npy``
(+ ``OUT.ids.txt``) or ``OUT.jsonl``, the format from the suffix or ``--output-format``. :class:`FileTarget` is what
the runner sees (``contract.py``); :func:`open_sink` opens the sink of ``fileformats.py`` that writes it, new or
continued (cut back to its last commit). One writer per output: :class:`~embedq.producers.index.sinks.locks.OutputLock`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

from embedq import errors
from embedq.producers.index.sinks.contract import Target
from embedq.producers.index.sinks.fileformats import FILE_SINKS, FileSink, ParquetSink, sidecar
from embedq.producers.index.sinks.locks import OutputLock
from embedq.producers.index.sinks.manifests import Manifest, VectorDtype, check_manifest, check_reusable

OUTPUT_FORMATS = ("parquet", "npy", "jsonl")
_OUT_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".npy": "npy", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def detect_output_format(path: Path) -> str:
    fmt = _OUT_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise errors.InvalidOption(f"cannot tell the output format of {str(path)!r}; name it .parquet, .npy or "
                                   ".jsonl, or pass --output-format")
    return fmt

def remove_output(path: Path, fmt: str, *, keep_errors: bool = False) -> None:
    """Delete an output and its sidecars (``--overwrite``); ``keep_errors``: not its errors file (a run that wrote no
    row leaves only the list of what failed)."""
    cls = FILE_SINKS[fmt]
    if path.is_dir() and fmt == "parquet":
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    for side in [*cls.sidecars(path), *([] if keep_errors else [sidecar(path, ".errors.jsonl")])]:
        side.unlink(missing_ok=True)


def open_sink(path: Path, fmt: str, *, vector_dtype: VectorDtype, options: dict[str, Any],
              shard_rows: int = 100_000, overwrite: bool = False) -> FileSink:
    """A new output, or an existing one to continue (cut back to its last commit).

    Refuses with :class:`~embedq.errors.OutputMismatch`, touching nothing, when the existing output
    was made in another format, vector dtype or with other options. The embedding space itself is
    checked by :meth:`FileSink.accept` against the first result, before the first write.
    """
    if fmt not in FILE_SINKS:
        raise errors.InvalidOption(f"unknown output format {fmt!r}; use one of {', '.join(OUTPUT_FORMATS)}")
    cls = FILE_SINKS[fmt]
    if overwrite:
        remove_output(path, fmt)
    mpath = cls.manifest_path(path)
    if mpath.exists():
        try:
            manifest = Manifest.model_validate_json(mpath.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise errors.InvalidOption(f"{mpath} is not a readable embedq manifest ({exc}); pass --overwrite "
                                       "to start the output afresh") from None
        check_manifest(manifest, format=fmt, vector_dtype=vector_dtype, options=options, where=str(path))
        sink = cls(path, manifest, shard_rows=shard_rows)
        sink.repair()
        return sink
    if path.exists() and not (fmt == "parquet" and path.is_dir() and not any(path.iterdir())):
        raise errors.InvalidOption(f"{path} exists and was not written by embedq index (no {mpath.name}); "
                                   "choose another output or pass --overwrite")
    if fmt == "parquet":
        path.mkdir(parents=True, exist_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(format=fmt, vector_dtype=vector_dtype, options=options)
    sink = cls(path, manifest, shard_rows=shard_rows)
    sink.save_manifest()  # from now on the output is ours: a run killed before its first commit resumes it
    return sink


class FileTarget(Target):
    """A Parquet dataset, an NPY matrix or a JSONL file (``fileformats.py``)."""

    precheck: ClassVar[bool] = True  # read under its lock in an instant: a rerun with nothing missing starts nothing

    @property  # type: ignore[override]
    def stores_windows(self) -> bool:  # --long-inputs windows: Parquet only (columns id, window, start, end, ...)
        return self.format == "parquet"

    @property  # type: ignore[override]
    def stores_text(self) -> bool:  # --store-text: Parquet's text column
        return self.format == "parquet"

    def __init__(self, path: Path, fmt: str | None = None) -> None:
        self.path = path
        self.format = fmt or detect_output_format(path)

    def describe(self) -> str:
        return str(self.path)

    def check_input(self, input_path: str) -> None:
        if input_path != "-" and Path(input_path).resolve() == self.path.resolve():
            raise errors.InvalidOption("the output would overwrite the input")

    def lock(self) -> OutputLock:
        return OutputLock(self.path)

    def exists(self) -> bool:
        return self.path.exists()

    def remove(self) -> None:
        remove_output(self.path, self.format)

    def remove_empty(self) -> bool:
        """A run that wrote no row (every record failed): the output made of nothing goes, its errors file stays."""
        remove_output(self.path, self.format, keep_errors=True)
        return True

    def open(self, *, vector_dtype: Any, options: dict[str, Any], shard_rows: int, overwrite: bool) -> FileSink:
        return open_sink(self.path, self.format, vector_dtype=vector_dtype, options=options, shard_rows=shard_rows,
                         overwrite=overwrite)

    def default_errors_path(self) -> Path:
        return sidecar(self.path, ".errors.jsonl")

    def open_reader(self, *, vector_dtype: str, options: dict[str, Any]) -> FileSink:
        """``--reuse``: the committed shards of a Parquet dataset, read as they are (nothing is cut back or
        locked; NPY and JSONL keep no content hashes and are refused)."""
        cls = FILE_SINKS[self.format]
        mpath = cls.manifest_path(self.path)
        manifest = None
        if mpath.exists():
            try:
                manifest = Manifest.model_validate_json(mpath.read_text(encoding="utf-8"))
            except ValueError:
                manifest = None
        manifest = check_reusable(manifest, vector_dtype=vector_dtype, options=options, where=str(self.path))
        sink = cls(self.path, manifest, shard_rows=1)
        if isinstance(sink, ParquetSink):
            sink.load()
        return sink
