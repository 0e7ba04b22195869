"""The narrow contract between the worker and a backend: three calls and the items between them.

A backend is an *encoder* (``encoder.py``: reads the model folder, tokenizes texts or pairs, pads and
runs the transformer) plus *heads*, one per kind of job it serves (``dense.py``: embed; ``classify.py``:
rerank and predict; ``tokens.py``: tokenize). The worker knows only:

* ``prepare(kind, items, options)`` on the consumer thread: check the options, tokenize. Returns a
  :class:`Prepared` whose ``items`` the scheduler packs by token cost (none: nothing to run);
* ``forward(batch)`` on the inference thread: one micro-batch of :class:`Encoded` items from any jobs
  and kinds, one forward pass, one row (a numpy array, or a tuple of them) per item;
* ``finish(kind, rows, prepared, options)`` on the results thread: post-process, check and encode the
  job's result payload.

Only this subpackage imports torch.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from embedq import errors
from embedq.protocol import Fingerprint, encode_result
from embedq.settings import BackendSettings
from embedq.version import __version__


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is; feeds the fingerprints and the worker's identity."""

    model_id: str
    path: str
    dimension: int  # embed: the vector size; classifiers: the number of labels
    max_seq_length: int
    pooling: str
    normalizes: bool
    weights_sha256: str
    dtype: str
    device: str
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    linear_kernel: str = "torch"  # the runtime of the forward pass: "torch", "onednn" or "onnxruntime" (CPU)
    runtime_choice: str = ""  # how linear_kernel=auto chose it (candidates, timings); "" when it was forced
    kinds: tuple[str, ...] = ("embed", "tokenize", "decode")  # the job kinds this model serves
    labels: tuple[str, ...] = ()  # classifiers: the label of each logit (``id2label``)


@dataclass(frozen=True)
class RuntimeFacts:
    """What a worker needs to know of the runtime that runs a backend's forward pass, as the backend reports it
    (:meth:`Backend.runtime_facts`): no runtime is tested by name outside this subpackage."""

    name: str  # the runtime (``ModelInfo.linear_kernel``): "torch", "onednn", "onnxruntime"; "none": no model
    #: what ``memory_policy=auto`` settles on (workers/memory.py): ``trim`` where the runtime keeps its activations
    #: in an arena of its own that it reuses batch after batch, ``mmap`` where they come from malloc
    auto_memory_policy: str = "mmap"
    #: the runtime runs the forward pass on a thread pool of its own (PyTorch's threads only compete with it)
    own_threads: bool = False
    #: where this runtime runs the graph whole: the layered runtime preemptible bulk micro-batches run on instead
    #: (None: every micro-batch runs on this one)
    bulk_runtime: str | None = None


@dataclass
class Encoded:
    """One item as the model takes it: token ids (special tokens included, no padding), segment ids for
    pairs (None: all zeros) and the length of a prompt at its start (pooling may leave it out)."""

    ids: list[int]
    type_ids: list[int] | None = None
    prompt_length: int = 0
    head: str = ""  # which head turns this item's output into its row (set by prepare)


@dataclass
class Tokenized:
    """Token ids of a job's texts (special tokens included, no padding)."""

    ids: list[list[int]]
    prompt_length: int = 0


@dataclass
class Prepared:
    """A job after ``prepare``: its items for the scheduler and what its head needs to finish it."""

    items: list[Encoded]
    tokens: int  # real tokens of the job (its usage)
    state: dict[str, Any] = field(default_factory=dict)


class Head(ABC):
    """Turns the encoder's output for some items into rows, and a job's rows into its result."""

    name: str = ""
    kinds: tuple[str, ...] = ()
    #: the head pools the rows of a text's windows into one (:meth:`pool`): its jobs may ask
    #: ``long_inputs="windows"`` (embedq/backends/windowing.py)
    pools_windows: bool = False

    @abstractmethod
    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared: ...

    def pool(self, rows: list[Any], weights: list[int], options: Any) -> Any:
        """One text's row from its windows' rows (``weights``: each window's tokens); no rows: the row of a text
        that failed (zeros, or nothing)."""
        raise errors.UnsupportedTask(f"long_inputs='windows' is not available for {self.name} jobs")

    def rows(self, output: Any, mask: Any, index: Any, batch: Sequence[Encoded]) -> list[np.ndarray]:
        """Inference thread: rows of the items at ``index`` (a LongTensor of batch positions)."""
        raise errors.BackendError(f"the {self.name} head runs no model")

    @abstractmethod
    def finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]: ...


class Backend(ABC):
    #: padded backends cost ``longest × count`` per batch, unpadded ones ``sum`` of lengths.
    is_padded: bool = True
    #: a lower token budget than the worker's, when a head's tensors grow with it (SPLADE's vocabulary logits)
    max_batch_tokens: int | None = None

    def __init__(self, info: ModelInfo) -> None:
        self.info = info

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.info.kinds

    def check_kind(self, kind: str) -> None:
        """:class:`~embedq.errors.UnsupportedTask` unless this model serves ``kind``."""
        if kind not in self.info.kinds:
            raise errors.UnsupportedTask(
                f"this worker's model ({self.info.model_id}) does not serve {kind!r} jobs; it serves "
                f"{', '.join(self.info.kinds)}"
            )

    def head_names(self) -> tuple[str, ...]:
        """Every head name an item of this backend may carry (``Encoded.head``): what a host process tells its
        device process once, so that items name their head by a small code (embedq/workers/channel.py)."""
        return ()

    @abstractmethod
    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared: ...

    def prepare_many(self, kind: str, jobs: list[tuple[list[Any], Any]]) -> list[Prepared | errors.EmbedqError]:
        """:meth:`prepare` for several jobs of ``kind`` ((items, options) each): each job's Prepared, or the typed
        error of that job alone. Backends whose tokenizer can take the texts of many jobs in one call override it;
        the result must be what :meth:`prepare` gives each job."""
        out: list[Prepared | errors.EmbedqError] = []
        for items, options in jobs:
            try:
                out.append(self.prepare(kind, items, options))
            except errors.EmbedqError as exc:
                out.append(exc)
        return out

    @abstractmethod
    def forward(self, batch: Sequence[Encoded]) -> list[np.ndarray]: ...

    #: :meth:`launch` returns before the device has finished (CUDA): the worker then launches the next micro-batch
    #: before it waits for this one, so the device always has work queued. False: ``launch`` computes the rows.
    launches_async: bool = False

    def launch(self, batch: Sequence[Encoded]) -> Callable[[], list[Any]]:
        """Start :meth:`forward` on ``batch``; the returned call waits for its rows (and raises what it raised).
        Here the rows are computed at once; a device backend may queue the work and return first."""
        rows = self.forward(batch)
        return lambda: rows

    @abstractmethod
    def finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]: ...

    def preemption_blocker(self) -> str | None:
        """None when :meth:`between_layers` can stop a forward pass between two layers; else why not."""
        return "this backend runs no layer stack"

    def between_layers(self, callback: Callable[[], None]) -> ContextManager[bool]:
        """While inside, ``callback()`` runs before each layer of a forward pass on this thread (not inside
        forward passes it starts itself); yields whether it does (see :meth:`preemption_blocker`)."""
        return contextlib.nullcontext(False)

    def runtime_facts(self) -> RuntimeFacts:
        """What the worker needs to know of the runtime this backend runs its forward pass on."""
        return RuntimeFacts(self.info.linear_kernel)

    def start_serving(self, *, preempt: bool) -> None:
        """Called once, after the load and before the first micro-batch, with whether the worker will preempt bulk
        micro-batches between layers: the backend settles its threads for how it will serve. Here, nothing to settle."""
        return None

    def health(self) -> dict[str, Any]:
        return {"model": self.info.model_id, "device": self.info.device, "dtype": self.info.dtype,
                "linear_kernel": self.info.linear_kernel, "kinds": list(self.info.kinds)}


def backend_settings(settings: BackendSettings | None, overrides: dict[str, Any]) -> BackendSettings:
    """``settings`` (default: :class:`~embedq.settings.BackendSettings`' defaults) with the fields named in
    ``overrides`` replaced; a value it refuses is :class:`~embedq.errors.InvalidOption`, a name it lacks a TypeError."""
    unknown = sorted(set(overrides) - set(BackendSettings.model_fields))
    if unknown:
        raise TypeError(f"unknown backend settings {unknown} (known: {sorted(BackendSettings.model_fields)})")
    base = settings or BackendSettings()
    if not overrides:
        return base
    try:
        return BackendSettings.model_validate({**base.model_dump(), **overrides})
    except ValidationError as exc:
        raise errors.InvalidOption(f"invalid backend settings: {exc}") from exc


def row_is_finite(row: Any) -> bool:
    """A row is an array or a tuple of arrays (a sparse row: ids, values); all its floats must be finite."""
    parts = row if isinstance(row, tuple) else (row,)
    return all(np.isfinite(part).all() for part in parts if np.asarray(part).dtype.kind in "fc")


def per_token_result(kind: str, rows: list[np.ndarray], info: ModelInfo, hidden: int, prepared: Prepared,
                     encoding: Any) -> dict[str, Any]:
    """The result of a per-token job (``embed_all``): each item's rows (tokens × ``hidden``) as token offsets and one
    float32 array, with their fingerprint (no pooling, not normalized). The per-token head's and the fake model's."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    tokens = np.concatenate(rows) if rows else np.zeros((0, hidden), np.float32)
    fingerprint = Fingerprint(kind=kind, model=info.model_id, weights_sha256=info.weights_sha256, pooling="none",
                              normalize=False, dimensions=hidden, dtype=info.dtype,
                              prompt=prepared.state.get("prompt"), embedq_version=__version__)
    return encode_result(kind, {"offsets": offsets, "tokens": tokens.astype(np.float32, copy=False)}, fingerprint,
                         items=len(rows), tokens=prepared.tokens, encoding=encoding)


def postprocess(vectors: np.ndarray, *, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Matryoshka truncation, then L2 normalization (so truncated vectors stay unit length)."""
    out = np.asarray(vectors, dtype=np.float32)
    if dimensions is not None:
        out = out[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.maximum(norms, 1e-12)
    return np.ascontiguousarray(out, dtype=np.float32)
