"""What an ``embedq index`` run reports: :class:`Summary`.

The runner (``runner.py``) counts into it as the run goes (texts and tokens embedded, failures by code, records
skipped because the output has them, resubmissions, waits for room in the bulk queue, texts per worker) and fills in
the output's rows and embedding-space fingerprint at the end. ``render`` is what the CLI prints, ``as_dict`` what
``--json`` prints; the manifest records a few of the same counts per run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from embedq.protocol import Fingerprint


@dataclass
class Summary:
    input: str = ""
    output: str = ""
    texts: int = 0  # embedded by this run
    tokens: int = 0
    failed: int = 0
    skipped: int = 0  # already in the output before this run
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
        return out

    def render(self) -> str:
        state = "interrupted" if self.interrupted else "done"
        codes = ", ".join(f"{code}: {n:,}" for code, n in self.failures_by_code.most_common())
        lines = [
            f"embedq index: {state} in {self.seconds:.1f}s: {self.input} -> {self.output}",
            f"  embedded   {self.texts:,} texts, {self.tokens:,} tokens ({self.texts_per_second:,.1f} texts/s, "
            f"{self.tokens_per_second:,.0f} tokens/s)",
            f"  skipped    {self.skipped:,} already in the output",
            f"  failed     {self.failed:,}" + (f" -> {self.errors_file} ({codes})" if self.failed else ""),
            f"  output     {self.rows:,} rows" + (f"; {self.fingerprint.describe()}" if self.fingerprint else "")
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
