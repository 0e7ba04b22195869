"""Which runtime runs the encoder on this CPU: chosen by measurement, never at the cost of fidelity.

Three runtimes can run an encoder's forward pass on a CPU: PyTorch's own kernels (``torch``: MKL's sgemm for
the Linear layers), PyTorch with the Linear layers' weights prepacked for oneDNN (``onednn``,
:mod:`embedq.backends.kernels`) and ONNX Runtime with its transformer fusions (``onnxruntime``,
:mod:`embedq.backends.onnx`). Which is fastest depends on the CPU (AVX2 or AVX-512, its cache sizes), on the
model and on the process' memory settings, by a third of the throughput either way (docs/BENCHMARKS.md), so
``linear_kernel=auto`` measures instead of guessing:

1. **Fidelity first.** Each candidate runs one padded probe batch of mixed lengths; its output on the real
   positions must be within :data:`FIDELITY` (relative to the output's scale) of the untouched PyTorch model's,
   which is what sentence-transformers runs. A candidate that is not is never chosen, however fast.
2. **Then speed, on the shapes a worker runs.** Every faithful candidate runs the same sequence of micro-batches:
   token-budget batches of several widths (rows × width ≈ the worker's ``max_batch_tokens``) and small online
   batches. Every shape is new to every candidate, as it is in a worker that meets a new shape in nearly every
   batch: a runtime that is fast on a shape it has seen but slow to meet one (oneDNN builds a primitive per
   shape) is timed as a worker would see it. Candidates take turns shape by shape. The fastest total wins.
   A candidate that is already :data:`DROP_BEHIND` times the fastest faithful one after :data:`DROP_AFTER`
   batches cannot catch up and is timed no further (the log says after how many batches and how far behind),
   which keeps the measurement to a few seconds where the runtimes differ by half (the usual case on a CPU).
3. **Once per machine and model.** The choice and its timings are written to a JSON file under
   ``EMBEDQ_RUNTIME_CACHE`` (default ``~/.cache/embedq/runtime``), keyed by the CPU (model name, flags,
   cores, threads), the library versions, the weights, the task, the dtype and the token budget. A later
   load reads it, checks the chosen runtime's fidelity again, and times nothing. Delete the file to measure
   again.

The choice and every candidate's timing are logged; an operator who sets ``linear_kernel`` to ``torch``,
``onednn`` or ``onnxruntime`` gets that runtime and no measurement at all.

**Preemption (issue 18).** ONNX Runtime runs the graph whole, so a bulk micro-batch on it cannot stop between two
layers for an online one. When it is the choice, each faithful runtime that runs PyTorch's layers (``torch``,
``onednn``) is timed again head to head against it on the token-budget batches, once the worker's memory policy has
settled for ONNX Runtime (:func:`choose`'s ``on_chosen``): the first measurement ran under the policy PyTorch
gets when it is the choice, and PyTorch's bulk batches will run under ONNX Runtime's (on a 2-core AVX2 machine the
same batches took PyTorch 1.81 s under the first and 1.36 s under the second, ONNX Runtime 1.36 and 1.29 s). If one
keeps at least :data:`PREEMPT_KEEP` of ONNX Runtime's speed there (:func:`preemptible_alternative`), the encoder
runs bulk micro-batches on it (they can be preempted) and everything else, online micro-batches included, on ONNX
Runtime, where small batches are fastest.
Both are checked for fidelity against the same PyTorch model, so a text's vector is within the fidelity bar
whichever ran it. The duels are cached with the choice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from embedq import errors
from embedq.backends.base import Encoded, RuntimeFacts
from embedq.backends.cpu import cpu_description, cpu_summary
from embedq.backends.folder import TASK_OUTPUTS
from embedq.settings import cache_dir

log = logging.getLogger(__name__)


class Encoder(Protocol):
    """What the choice reads of an encoder and runs it with (:class:`embedq.backends.encoder.Encoder` is one, and
    calls :func:`choose` while it loads: this module does not import it)."""

    task: str
    dtype: torch.dtype
    dtype_name: str
    config: Any
    tokenizer: Any
    model: Any
    max_seq_length: int
    left_padding: bool

    def run(self, batch: Sequence[Encoded], forward: Any = None) -> tuple[Any, torch.Tensor]: ...

    def make_runtime(self, name: str) -> Candidate | None: ...

#: The fidelity bar a candidate must meet against the untouched PyTorch model, relative to max(1, |output|):
#: DESIGN.md's 1e-5 in float32; in bfloat16, two bf16 ulps (8 mantissa bits).
FIDELITY = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
RUNTIMES = ("torch", "onednn", "onnxruntime")
#: Runtimes that run PyTorch's layer modules (a forward pass on them can stop between two layers).
LAYERED = ("torch", "onednn")
#: What a worker needs to know of each runtime (the encoder reports it: ``Encoder.runtime_facts``). ONNX Runtime keeps
#: its activations in an arena it reuses batch after batch, so ``memory_policy=auto`` keeps glibc's heap and trims it
#: (PyTorch's kernels allocate theirs from malloc: ``mmap``), and it runs on a thread pool of its own.
FACTS = {"torch": RuntimeFacts("torch"), "onednn": RuntimeFacts("onednn"),
         "onnxruntime": RuntimeFacts("onnxruntime", auto_memory_policy="trim", own_threads=True)}
#: The least share of the chosen runtime's speed on token-budget batches a layered runtime must keep to run bulk
#: micro-batches in its place (what issue 18 asks bulk to keep while online traffic is about).
PREEMPT_KEEP = 0.85
#: Bumped when what is timed changes, so older cached choices are measured again.
TUNER_VERSION = 6
#: Widths of the token-budget batches timed (each capped at the model's max_seq_length) and of the online ones.
BULK_WIDTHS = (41, 77, 123, 199)
ONLINE_SHAPES = ((1, 13), (2, 29), (4, 22))
#: A candidate this many times the fastest faithful candidate's time over the same batches, after DROP_AFTER
#: of them, is dropped: the shapes left cannot make up such a gap (the runtimes' ratios hold across widths:
#: docs/BENCHMARKS.md, CPU section).
DROP_BEHIND = 1.4
DROP_AFTER = 2


def facts(runtime: str) -> RuntimeFacts:
    """The facts of ``runtime`` (:data:`FACTS`; a runtime it does not list, a test's candidate, has the defaults)."""
    return FACTS.get(runtime) or RuntimeFacts(runtime)


@dataclass
class Candidate:
    """One runtime: ``forward`` is called like the transformers model (``**inputs, return_dict=True``);
    ``enter``/``leave`` put the model in the state this runtime needs and back (oneDNN swaps layers)."""

    name: str
    forward: Callable[..., Any]
    enter: Callable[[], None] = lambda: None
    leave: Callable[[], None] = lambda: None


@dataclass
class Trial:
    name: str
    delta: float | None = None  # largest relative |Δ| against the PyTorch model on the probe
    faithful: bool = False
    seconds: float | None = None  # all timed batches
    online_seconds: float | None = None  # of which the small online batches
    error: str | None = None
    batches: int | None = None  # batches timed
    dropped: float | None = None  # timed no further: this many times the fastest faithful time by then

    @property
    def complete(self) -> bool:
        """Timed on every batch (not dropped early)."""
        return self.seconds is not None and self.dropped is None

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.name}: unavailable ({self.error})"
        if self.seconds is None:
            timing = "not timed"
        elif self.dropped is not None:
            timing = (f"dropped after {self.batches} batches, {self.dropped:.2f}x the fastest "
                      f"({self.seconds:.3f} s by then)")
        else:
            timing = f"{self.seconds:.3f} s"
        online = (f", online batches {self.online_seconds * 1e3:.1f} ms"
                  if self.online_seconds is not None and self.dropped is None else "")
        verdict = "" if self.faithful else ", NOT faithful: never chosen"
        return f"{self.name}: {timing}{online} (relative |delta| {self.delta:.1e}{verdict})"


@dataclass
class Choice:
    runtime: str
    trials: list[Trial] = field(default_factory=list)
    cached: bool = False
    path: str | None = None
    tokens: int = 0  # real tokens in the timed batches, per candidate
    #: layered runtime -> [its trial, the chosen runtime's trial], timed head to head (only where ``runtime``
    #: runs the graph whole)
    duels: dict[str, list[Trial]] = field(default_factory=dict)

    @property
    def bulk_runtime(self) -> str | None:
        """The layered runtime preemptible bulk micro-batches run on (None: they run on ``runtime``). Only duels
        against the chosen runtime count (a cache file edited to name another runtime keeps old duels)."""
        if self.runtime in LAYERED:
            return None
        return preemptible_alternative({name: pair for name, pair in self.duels.items()
                                        if len(pair) == 2 and pair[1].name == self.runtime})

    def describe_duels(self) -> str:
        return "; ".join(f"{name} against {self.runtime} on token-budget batches: {_bulk(a):.3f} s against "
                         f"{_bulk(b):.3f} s" for name, (a, b) in self.duels.items())

    def describe(self) -> str:
        how = "cached choice" if self.cached else "measured"
        return f"{self.runtime} ({how}; " + "; ".join(t.describe() for t in self.trials) + ")"


def pick(trials: Sequence[Trial]) -> str:
    """The fastest faithful candidate timed on every batch; ``torch`` (the reference itself) when none was."""
    timed = [t for t in trials if t.error is None and t.faithful and t.complete]
    return min(timed, key=lambda t: t.seconds).name if timed else "torch"  # type: ignore[arg-type,return-value]


def _bulk(t: Trial) -> float:
    """Seconds on the token-budget batches alone."""
    return float(t.seconds or 0.0) - float(t.online_seconds or 0.0)


def preemptible_alternative(duels: dict[str, list[Trial]]) -> str | None:
    """The layered runtime whose duel against the chosen one went best, if it kept :data:`PREEMPT_KEEP` of the
    chosen runtime's speed on the token-budget batches (faithful and timed on every batch)."""
    speeds = {name: _bulk(theirs) / _bulk(mine) for name, (mine, theirs) in duels.items()
              if name in LAYERED and mine.faithful and mine.complete and theirs.complete and _bulk(mine) > 0}
    if not speeds:
        return None
    best = max(speeds, key=speeds.__getitem__)
    return best if speeds[best] >= PREEMPT_KEEP else None


def duel(encoder: Encoder, candidates: Sequence[Candidate], trials: Sequence[Trial], chosen: str, tokens: int,
         online_tokens: int) -> dict[str, list[Trial]]:
    """Where ``chosen`` runs the graph whole: each faithful layered candidate timed head to head against it."""
    if chosen in LAYERED:
        return {}
    by_name = {c.name: c for c in candidates}
    faithful = {t.name for t in trials if t.error is None and t.faithful}
    if chosen not in by_name or chosen not in faithful:
        return {}
    out = {}
    for name in [n for n in LAYERED if n in by_name and n in faithful]:
        pair = [Trial(name, faithful=True), Trial(chosen, faithful=True)]
        measure(encoder, [by_name[name], by_name[chosen]], pair, tokens, online_tokens)
        out[name] = pair
    return out


# -- the machine and the cache ----------------------------------------------------------------------------------
def cache_root() -> Path:
    return cache_dir("EMBEDQ_RUNTIME_CACHE", "runtime")


def cache_key(encoder: Encoder, weights: str, tokens: int) -> str:
    import transformers

    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:
        ort = None
    cpu = cpu_description()
    parts = {"cpu": [cpu["model_name"], cpu["family"], cpu["model"], cpu["cores"]],
             "flags": hashlib.sha256(" ".join(cpu["flags"]).encode()).hexdigest()[:16],
             "threads": torch.get_num_threads(), "torch": torch.__version__, "ort": ort,
             "transformers": transformers.__version__, "weights": weights, "task": encoder.task,
             "dtype": encoder.dtype_name, "tokens": tokens, "isa_cap": os.environ.get("ONEDNN_MAX_CPU_ISA"),
             "tuner": TUNER_VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("runtime") in RUNTIMES else None


def _write(path: Path, choice: Choice) -> None:
    data = {"runtime": choice.runtime, "trials": [asdict(t) for t in choice.trials], "tokens": choice.tokens,
            "duels": {name: [asdict(t) for t in pair] for name, pair in choice.duels.items()},
            "cpu": cpu_summary(), "threads": torch.get_num_threads(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}-", delete=False) as fh:
            json.dump(data, fh, indent=2)
        os.replace(fh.name, path)
    except OSError as exc:  # a read-only home: the choice still stands for this process
        log.warning("cannot cache the runtime choice in %s: %s", path, exc)


# -- probe and timing batches ----------------------------------------------------------------------------------
def _vocab(encoder: Encoder) -> tuple[int, int]:
    vocab = int(getattr(encoder.config, "vocab_size", 0) or len(encoder.tokenizer))
    return (min(100, vocab // 2), max(vocab, 2))


def _batch(rng: np.random.Generator, lengths: Sequence[int], low: int, high: int, head: str) -> list[Encoded]:
    return [Encoded([int(x) for x in rng.integers(low, high, size=n)], None, 0, head) for n in lengths]


def probe_batch(encoder: Encoder) -> list[Encoded]:
    """Mixed lengths, one row unpadded: real padding in play, as in every coalesced micro-batch."""
    low, high = _vocab(encoder)
    width = min(37, encoder.max_seq_length)
    lengths = [width, max(1, width // 5), max(1, width * 2 // 3), 1]
    return _batch(np.random.default_rng(7), lengths, low, high, "")


def timing_batches(encoder: Encoder, tokens: int, online_tokens: int) -> tuple[list[list[Encoded]], int]:
    """(batches, how many of them at the end are online batches): shapes like a worker's, none repeated."""
    low, high = _vocab(encoder)
    rng = np.random.default_rng(11)
    limit = encoder.max_seq_length
    batches = []
    widths = sorted({min(w, limit) for w in BULK_WIDTHS})
    for width in widths:
        rows = max(1, tokens // width)
        # length-sorted packing: rows of nearly one length, the longest sets the width
        lengths = [width] + [int(n) for n in rng.integers(max(1, width * 4 // 5), width + 1, size=rows - 1)]
        batches.append(_batch(rng, lengths, low, high, ""))
    online = 0
    for rows, width in ONLINE_SHAPES:
        width = min(width, limit, max(1, online_tokens // rows))
        lengths = [width] + [int(n) for n in rng.integers(max(1, width // 2), width + 1, size=rows - 1)]
        batches.append(_batch(rng, lengths, low, high, ""))
        online += 1
    return batches, online


# -- choosing --------------------------------------------------------------------------------------------------
def _output(encoder: Encoder, out: Any) -> np.ndarray:
    name = TASK_OUTPUTS[encoder.task]
    return getattr(out, name).float().numpy()


def _run(encoder: Encoder, candidate: Candidate, batch: list[Encoded]) -> Any:
    with torch.inference_mode():
        return encoder.run(batch, forward=candidate.forward)[0]


def check(encoder: Encoder, candidates: Sequence[Candidate], reference: Candidate) -> list[Trial]:
    """Each candidate's relative |Δ| against ``reference`` (the untouched PyTorch model) on the probe."""
    batch = probe_batch(encoder)
    want = _output(encoder, _run(encoder, reference, batch))
    if want.ndim == 3:  # hidden states: real positions only
        real = np.zeros(want.shape[:2], dtype=bool)
        for i, item in enumerate(batch):
            cols = slice(want.shape[1] - len(item.ids), None) if encoder.left_padding else slice(0, len(item.ids))
            real[i, cols] = True
        want_real = want[real]
    scale = max(1.0, float(np.abs(want).max()))
    tolerance = FIDELITY.get(encoder.dtype, 0.0)
    trials = []
    for candidate in candidates:
        trial = Trial(candidate.name)
        try:
            candidate.enter()
            try:
                got = _output(encoder, _run(encoder, candidate, batch))
            finally:
                candidate.leave()
            if got.shape != want.shape:
                raise ValueError(f"output shape {got.shape} != {want.shape}")
            diff = np.abs((got[real] - want_real) if want.ndim == 3 else (got - want))
            trial.delta = float(diff.max()) / scale if diff.size else 0.0
            trial.faithful = bool(np.isfinite(trial.delta)) and trial.delta <= tolerance
        except Exception as exc:  # a runtime that cannot run this model is not a candidate
            trial.error = f"{type(exc).__name__}: {exc}"
        trials.append(trial)
    return trials


def measure(encoder: Encoder, candidates: Sequence[Candidate], trials: Sequence[Trial], tokens: int,
            online_tokens: int) -> int:
    """Time every candidate that ran on the same fresh shapes, taking turns; fills ``trials``' seconds (an
    unfaithful one too, so the log tells what fidelity costs). A candidate :data:`DROP_BEHIND` times the fastest
    faithful one after :data:`DROP_AFTER` batches is timed no further. Returns the real tokens per candidate
    in the timed batches."""
    by_name = {t.name: t for t in trials}
    timed = [c for c in candidates if by_name[c.name].error is None]
    if not timed:
        return 0
    batches, online = timing_batches(encoder, tokens, online_tokens)
    warm = probe_batch(encoder)
    for candidate in timed:  # first calls (lazy allocation, thread pools) are not what a worker pays per batch
        candidate.enter()
        try:
            _run(encoder, candidate, warm)
        finally:
            candidate.leave()
    seconds = {c.name: 0.0 for c in timed}
    online_seconds = {c.name: 0.0 for c in timed}
    counted = {c.name: 0 for c in timed}
    active = list(timed)
    for i, batch in enumerate(batches):
        order = active[i % len(active):] + active[:i % len(active)]  # nobody always goes first
        for candidate in order:
            candidate.enter()
            try:
                t0 = time.perf_counter()
                _run(encoder, candidate, batch)
                elapsed = time.perf_counter() - t0
            finally:
                candidate.leave()
            seconds[candidate.name] += elapsed
            counted[candidate.name] += 1
            if i >= len(batches) - online:
                online_seconds[candidate.name] += elapsed
        faithful = [seconds[c.name] for c in active if by_name[c.name].faithful]
        if i + 1 >= DROP_AFTER and i + 1 < len(batches) and faithful:
            lead = min(faithful)
            for candidate in [c for c in active if seconds[c.name] > DROP_BEHIND * lead]:
                by_name[candidate.name].dropped = seconds[candidate.name] / lead
                active.remove(candidate)
    for name, total in seconds.items():
        by_name[name].seconds = total
        by_name[name].batches = counted[name]
        by_name[name].online_seconds = online_seconds[name]
    return sum(len(item.ids) for batch in batches for item in batch)


def candidates_for(encoder: Encoder, names: Sequence[str] = RUNTIMES) -> tuple[list[Candidate], list[Trial]]:
    """The runtimes this encoder can try (and a Trial with the reason for each one it cannot)."""
    out, unavailable = [], []
    for name in names:
        try:
            candidate = encoder.make_runtime(name)
        except (errors.EmbedqError, ImportError) as exc:
            unavailable.append(Trial(name, error=str(exc)))
            continue
        if candidate is None:
            unavailable.append(Trial(name, error="does not apply to this model"))
        else:
            out.append(candidate)
    return out, unavailable


def _trial(data: dict[str, Any]) -> Trial:
    """A Trial read back from the cache file (fields it does not know are left out)."""
    return Trial(**{k: v for k, v in data.items() if k in Trial.__dataclass_fields__})


def choose(encoder: Encoder, *, weights: str, tokens: int = 2048, online_tokens: int = 256,
           extra: Sequence[Candidate] = (), use_cache: bool = True,
           on_chosen: Callable[[RuntimeFacts], None] | None = None) -> tuple[Choice, Candidate]:
    """Pick the runtime for ``encoder`` (see the module's docstring): (the choice, its candidate, entered).

    ``on_chosen`` is called with the chosen runtime's facts (:func:`facts`) as soon as it is measured, before the
    duels. The worker settles its memory policy there (workers/memory.settle: ONNX Runtime's heap settings), so the
    layered runtimes duel under the allocator settings their bulk batches will run under: PyTorch's many temporaries
    cost a third more under the mmap settings (measured on 2 cores, AVX2: 1.81 s against 1.36 s for the same batches).

    ``extra`` candidates (tests, experiments) compete with the built-in ones and are never cached."""
    path = cache_root() / f"{cache_key(encoder, weights, tokens)}.json"
    reference = Candidate("torch", encoder.model)
    cached = _read(path) if use_cache and not extra else None
    if cached is not None:
        names = [cached["runtime"]]
        candidates, unavailable = candidates_for(encoder, names)
        if candidates:
            trial = check(encoder, candidates, reference)[0]
            if trial.faithful:
                trials = [_trial(t) for t in cached.get("trials", []) if isinstance(t, dict) and t.get("name")]
                duels = {name: [_trial(t) for t in pair]
                         for name, pair in (cached.get("duels") or {}).items() if isinstance(pair, list)}
                choice = Choice(cached["runtime"], trials, cached=True, path=str(path),
                                tokens=int(cached.get("tokens", 0)), duels=duels)
                candidates[0].enter()
                log.info("runtime: %s, the cached choice for this machine and model (%s); measured: %s%s",
                         choice.runtime, path, "; ".join(t.describe() for t in trials),
                         f"; {choice.describe_duels()}" if duels else "")
                return choice, candidates[0]
            log.warning("runtime: the cached choice %s no longer reproduces PyTorch (%s); measuring again",
                        cached["runtime"], trial.describe())
        else:
            log.info("runtime: the cached choice %s is unavailable now (%s); measuring again", cached["runtime"],
                     unavailable[0].error if unavailable else "?")
    t0 = time.perf_counter()
    candidates, unavailable = candidates_for(encoder)
    candidates += list(extra)
    trials = check(encoder, candidates, reference)
    real = measure(encoder, candidates, trials, tokens, online_tokens)
    trials += unavailable
    runtime = pick(trials)
    if on_chosen is not None:
        on_chosen(facts(runtime))
    duels = duel(encoder, candidates, trials, runtime, tokens, online_tokens)
    choice = Choice(runtime, trials, cached=False, path=None if extra else str(path), tokens=real, duels=duels)
    if not extra:
        _write(path, choice)
    chosen = next((c for c in candidates if c.name == runtime), reference)
    chosen.enter()
    log.info("runtime: %s, measured in %.1f s on %s real tokens per candidate (%s, %d threads): %s%s",
             runtime, time.perf_counter() - t0, real, cpu_summary(), torch.get_num_threads(),
             "; ".join(t.describe() for t in trials), f"; {choice.describe_duels()}" if duels else "")
    return choice, chosen
