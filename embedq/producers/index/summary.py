"""What an ``embedq index`` run reports: :class:`Summary`, and :class:`Failures`, the records it could not write.

The runner (``runner.py``) counts into it as the run goes (texts and tokens embedded, failures by code, records
skipped because the output has them, resubmissions, waits for room in the bulk queue, texts per worker) and fills in
the output's rows and embedding-space fingerprint at the end. ``render`` is what the CLI prints, ``as_dict`` what
``--json`` prints; the manifest records a few of the same counts per run.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedq import errors
from embedq.protocol import Fingerprint


@dataclass
class Summary:
    input: str = ""
    output: str = ""
    texts: int = 0  # embedded by this run
    tokens: int = 0
    failed: int = 0
    skipped: int = 0  # already in the output before this run, with the same text (content hash) where it keeps them
    reused: int = 0  # written from a vector the run had without embedding its text again (a repeat, a stored row)
    replaced: int = 0  # ids the output held whose text changed: written anew (embedded or reused)
    pruned: int = 0  # ids the output held that the input no longer has, removed (``--prune``)
    rows: int = 0  # committed rows in the output at the end
    seconds: float = 0.0
    resubmitted: int = 0
    bulk_waits: int = 0  # sends that waited for room in a full bulk queue (backpressure), and for how long
    bulk_waited_seconds: float = 0.0
    interrupted: bool = False
    workers: Counter[str] = field(default_factory=Counter)
    failures_by_code: Counter[str] = field(default_factory=Counter)
    fingerprint: Fingerprint | None = None
    errors_file: str | None = None
    ann_index: str | None = None  # a database's ANN index built after the load (``--build-index``), and its time
    ann_index_seconds: float | None = None
    notes: list[str] = field(default_factory=list)  # what the output could not take (an output left out, and why)
    output_removed: bool = False  # no record had a usable text: the run left no output, only its errors file
    #: ``--long-inputs windows`` (``windowed.py``): rows are windows; ``texts`` counts documents, ``windows`` the
    #: windows of the documents this run embedded, ``documents`` the documents the output holds at the end
    windowed: bool = False
    windows: int = 0
    documents_before: int = 0  # documents the output held when the run started
    new_documents: int = 0  # documents written by this run that the output did not hold

    @property
    def documents(self) -> int:
        return self.documents_before + self.new_documents - self.pruned

    @property
    def texts_per_second(self) -> float:
        return self.texts / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "fingerprint"}
        out["workers"] = dict(self.workers)
        out["failures_by_code"] = dict(self.failures_by_code)
        out["fingerprint"] = self.fingerprint.model_dump() if self.fingerprint else None
        out["texts_per_second"] = round(self.texts_per_second, 2)
        out["tokens_per_second"] = round(self.tokens_per_second, 1)
        if self.windowed:
            out["documents"] = self.documents
        return out

    def run_record(self, complete: bool) -> dict[str, Any]:
        """The run's line in the output's manifest (``runs``)."""
        return {"finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "input": self.input, "texts": self.texts,
                **({"windows": self.windows} if self.windowed else {}), "skipped": self.skipped, "failed": self.failed,
                "reused": self.reused, "replaced": self.replaced, "pruned": self.pruned,
                "seconds": round(self.seconds, 1), "interrupted": not complete, "workers": dict(self.workers)}

    def render(self) -> str:
        state = "interrupted" if self.interrupted else "done"
        codes = ", ".join(f"{code}: {n:,}" for code, n in self.failures_by_code.most_common())
        texts = f"{self.texts:,} documents in {self.windows:,} windows" if self.windowed else f"{self.texts:,} texts"
        lines = [
            f"embedq index: {state} in {self.seconds:.1f}s: {self.input} -> {self.output}",
            f"  embedded   {texts}, {self.tokens:,} tokens ({self.texts_per_second:,.1f} texts/s, "
            f"{self.tokens_per_second:,.0f} tokens/s)",
            f"  skipped    {self.skipped:,} already in the output",
            *([f"  reused     {self.reused:,} texts written from vectors of the same text (repeats, stored rows)"]
              if self.reused else []),
            *([f"  replaced   {self.replaced:,} ids whose text changed"] if self.replaced else []),
            *([f"  pruned     {self.pruned:,} ids the input no longer has"] if self.pruned else []),
            f"  failed     {self.failed:,}" + (f" -> {self.errors_file} ({codes})" if self.failed else ""),
            f"  output     {self.rows:,} rows"
            + (f" (the windows of {self.documents:,} documents)" if self.windowed else "")
            + (f"; {self.fingerprint.describe()}" if self.fingerprint else "")
            + ("; none written: no record had a usable text" if self.output_removed else ""),
        ]
        if self.ann_index is not None:
            lines.append(f"  ann index  {self.ann_index} built in {self.ann_index_seconds or 0:.1f}s (not in the "
                         f"{self.seconds:.1f}s above)")
        for note in self.notes:
            lines.append(f"  note       {note}")
        if self.resubmitted:
            lines.append(f"  resubmitted {self.resubmitted} jobs (timeouts or retryable errors)")
        if self.bulk_waits:
            lines.append(f"  waited     {self.bulk_waits} times, {self.bulk_waited_seconds:.1f}s in all, for room "
                         "in the bulk queue (EMBEDQ_BULK_QUEUE_LIMIT)")
        for i, (worker, n) in enumerate(self.workers.most_common()):
            lines.append(f"  {'workers' if i == 0 else '':10} {worker}: {n:,} texts")
        if self.interrupted:
            lines.append("  run the same command again to continue where this run stopped")
        return "\n".join(lines)


class Failures:
    """The records a run could not write: counted in its :class:`Summary` and listed in its errors file (the failures of
    the latest run: earlier ones are retried). A run whose first ``fail_fast`` records are all unusable stops (a wrong
    ``--text-field``)."""

    def __init__(self, summary: Summary, path: Path, describe_input: str, fail_fast: int) -> None:
        self.summary, self.path, self.describe_input, self.fail_fast = summary, path, describe_input, fail_fast
        self.records = 0  # records read
        self.usable = 0  # records with a usable text
        self.bar: Any = None  # the run's progress bar, once it has one
        self._errors: list[dict[str, Any]] = []
        self._started = False
        self._first: str | None = None

    def fail(self, doc_id: str, exc: errors.EmbedqError) -> None:
        self.summary.failed += 1
        self.summary.failures_by_code[exc.code] += 1
        self._errors.append({"id": doc_id, "code": exc.code, "message": exc.message})
        if self.bar is not None:
            self.bar.update(1)
        if self._first is None:
            self._first = exc.message
        if self.usable == 0 and self.records >= self.fail_fast and self.summary.failed >= self.records:
            raise errors.InvalidOption(
                f"none of the first {self.records} records of {self.describe_input} has a usable text "
                f"(first error: {self._first}); check --text-field, --id-field and --input-format")

    def flush(self, final: bool = False) -> None:
        """Append the failures since the last flush to the errors file (``final``: none at all, the file goes)."""
        if not self._errors and not self._started:
            if final:
                self.path.unlink(missing_ok=True)
            return
        with open(self.path, "a" if self._started else "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in self._errors)
        self._started = True
        self._errors.clear()
