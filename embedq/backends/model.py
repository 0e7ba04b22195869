"""What every model backend shares: :class:`ModelBackend` (an encoder and its heads by kind) and the reading of a
model folder its loaders need (:func:`read_modules`, :func:`model_task`, :func:`check_modality`, :func:`base_info`).
Which heads a folder gets: :mod:`embedq.backends.loader`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedq import errors
from embedq.backends.base import Backend, Encoded, Head, ModelInfo, Prepared, RuntimeFacts
from embedq.backends.encoder import Encoder
from embedq.backends.folder import CLASSIFY, FEATURES, FILL_MASK, sentence_bert_config, weights_sha256
from embedq.backends.modules import module_kind, read_json
from embedq.backends.windowing import finish_windows


class ModelBackend(Backend):
    """An :class:`Encoder` and its heads by kind. One forward pass serves items of every head."""

    is_padded = True

    def __init__(self, encoder: Encoder, heads: dict[str, Head], info: ModelInfo,
                 more_heads: Sequence[Head] = ()) -> None:
        super().__init__(info)
        self.encoder = encoder
        self.heads = heads  # kind -> the head that prepares its jobs
        # every head an item may name (a kind's head may hand its items to variants of itself: BGE-M3's outputs)
        self._by_name = {head.name: head for head in [*heads.values(), *more_heads]}
        self.max_seq_length = encoder.max_seq_length

    def head_names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def add_plugin_heads(self, specs: Sequence[Any]) -> None:
        """Serve the plugin kinds ``specs`` (:class:`~embedq.kinds.TaskSpec`) that name a head (``TaskSpec.head``):
        its factory is called with this backend and returns the :class:`Head` that serves the kind here."""
        from embedq.kinds import resolve_head

        for spec in specs:
            if spec.head is None or spec.kind in self.heads:
                continue
            head = resolve_head(spec)(self)
            if not isinstance(head, Head):
                raise errors.UnsupportedModel(f"{spec.head} returned {type(head).__name__}, not a Head")
            self.heads[spec.kind] = head
            self._by_name.setdefault(head.name or spec.kind, head)
            self.info = dataclasses.replace(self.info, kinds=(*self.info.kinds, spec.kind))

    def _check_windows(self, head: Head, options: Any) -> None:
        if getattr(options, "windows", False) and not head.pools_windows:
            raise errors.UnsupportedTask(f"long_inputs='windows' is not available for {head.name or 'these'} jobs")

    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared:
        self.check_kind(kind)
        head = self.heads[kind]
        self._check_windows(head, options)
        prepared = head.prepare(kind, items, options)
        for item in prepared.items:
            item.head = item.head or head.name
        return prepared

    def prepare_many(self, kind: str, jobs: list[tuple[list[Any], Any]]) -> list[Prepared | errors.EmbedqError]:
        head = self.heads.get(kind)
        batched = getattr(head, "prepare_many", None)
        if batched is None or len(jobs) < 2:
            return super().prepare_many(kind, jobs)
        self.check_kind(kind)
        if any(getattr(options, "windows", False) for _, options in jobs) and not head.pools_windows:
            return super().prepare_many(kind, jobs)
        out = batched(kind, jobs)
        for prepared in out:
            if isinstance(prepared, Prepared):
                for item in prepared.items:
                    item.head = item.head or head.name
        return out

    def forward(self, batch: Sequence[Encoded]) -> list[np.ndarray]:
        if not batch:
            return []
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(batch):
            groups.setdefault(item.head, []).append(i)
        rows: list[Any] = [None] * len(batch)
        with _forward_errors(), torch.inference_mode():
            output, mask = self.encoder.run(batch)
            for name, positions in groups.items():
                index = None if len(groups) == 1 else torch.tensor(positions, device=mask.device)
                for i, row in zip(positions, self._by_name[name].rows(output, mask, index, batch)):
                    rows[i] = row
        return rows

    @property
    def launches_async(self) -> bool:  # type: ignore[override]
        return self.encoder.device.type == "cuda"

    def launch(self, batch: Sequence[Encoded]) -> Callable[[], list[Any]]:
        """On CUDA, a batch of dense items only: the forward pass and pooling are queued on the device, the vectors
        copied (non-blocking) into pinned host memory behind them, and the returned call waits for that copy
        alone. Everything else computes its rows at once (:meth:`forward`)."""
        head = self._by_name.get("dense")
        if not self.launches_async or not batch or head is None or any(item.head != "dense" for item in batch):
            return super().launch(batch)
        with _forward_errors(), torch.inference_mode():
            output, mask = self.encoder.run(batch)
            vectors = head.vectors(output, mask, None, batch)  # type: ignore[attr-defined]
            host = torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=True)
            host.copy_(vectors, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()

        def rows() -> list[Any]:
            with _forward_errors():
                copied.synchronize()  # an error of the queued work surfaces here
            # Out of the pinned block at once: rows live until their job's result is written, pinned memory is dear.
            return list(host.numpy().copy())

        return rows

    def finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]:
        head = self.heads[kind]
        if "windows" not in prepared.state:
            return head.finish(kind, rows, prepared, options)
        return finish_windows(rows, prepared, lambda r: head.finish(kind, r, prepared, options),
                              lambda r, w: head.pool(r, w, options))

    def preemption_blocker(self) -> str | None:
        return self.encoder.preemption_blocker()

    def between_layers(self, callback: Callable[[], None]) -> ContextManager[bool]:
        return self.encoder.between_layers(callback)

    def runtime_facts(self) -> RuntimeFacts:
        return self.encoder.runtime_facts()

    def start_serving(self, *, preempt: bool) -> None:
        self.encoder.start_serving(preempt=preempt)

    def health(self) -> dict[str, Any]:
        return {**super().health(), "max_seq_length": self.max_seq_length, "pooling": self.info.pooling}


@contextlib.contextmanager
def _forward_errors() -> Iterator[None]:
    """What a forward pass raises, as the typed error of its micro-batch (an EmbedqError passes as it is)."""
    try:
        yield
    except errors.EmbedqError:
        raise
    except (RuntimeError, ValueError) as exc:
        raise errors.BackendError(f"the forward pass failed: {exc}") from exc


def read_modules(folder: Path) -> list[tuple[str, Path]]:
    """``modules.json`` as [(Transformer|Pooling|Dense|Normalize, folder)]; [] when there is none."""
    if not folder.is_dir():
        raise errors.UnknownModel(f"model folder {folder} does not exist")
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return []
    try:
        modules = json.loads(modules_file.read_text(encoding="utf8"))
    except (OSError, ValueError) as exc:
        raise errors.UnsupportedModel(f"cannot read {modules_file}: {exc}") from exc
    if not isinstance(modules, list) or not modules:
        raise errors.UnsupportedModel(f"{modules_file} is not a non-empty list")
    modules = sorted(modules, key=lambda m: m.get("idx", 0)) if all("idx" in m for m in modules) else modules
    out: list[tuple[str, Path]] = []
    for entry in modules:
        kind = module_kind(entry.get("type"))
        rel = entry.get("path", "") or ""
        sub = (folder / rel).resolve()
        if sub != folder and folder not in sub.parents:
            raise errors.UnsupportedModel(f"module path {rel!r} leaves the model folder")
        out.append((kind, sub))
    if out[0][0] not in ("Transformer", "MLMTransformer"):
        raise errors.UnsupportedModel(f"embedq needs a Transformer module first; got {[k for k, _ in out]}")
    return out


def model_task(folder: Path, modules: list[tuple[str, Path]], pooling: str | None = None,
               ) -> tuple[Path, dict[str, Any], str]:
    """(transformer folder, its sentence-transformers config, what the encoder runs).

    A bare ``*ForMaskedLM`` folder is read as sentence-transformers' ``SentenceTransformer`` reads it (mean
    pooling over hidden states) unless ``pooling="splade"`` (TEI's ``--pooling splade``, what
    ``SparseEncoder`` makes of the same folder)."""
    if modules:
        transformer_dir = modules[0][1]
        st_config = sentence_bert_config(transformer_dir)
        default = FILL_MASK if modules[0][0] == "MLMTransformer" else FEATURES
        task = st_config.get("transformer_task", default)
        if task not in (FEATURES, CLASSIFY, FILL_MASK):
            raise errors.UnsupportedModel(f"Transformer transformer_task={task!r} is not supported")
        if pooling == "splade" and task != FILL_MASK:
            raise errors.UnsupportedModel(f"pooling=splade needs a masked-language model; {folder} is a {task} model")
        return transformer_dir, st_config, task
    archs = read_json(folder / "config.json").get("architectures") or []
    arch = str(archs[0]) if archs else ""
    if pooling == "splade":
        if not arch.endswith("ForMaskedLM"):
            raise errors.UnsupportedModel(f"pooling=splade needs a *ForMaskedLM model; {folder} is {arch or 'unknown'}")
        return folder, {}, FILL_MASK
    task = CLASSIFY if arch.endswith("ForSequenceClassification") else FEATURES
    return folder, {}, task


def check_modality(st_config: dict[str, Any], output_name: str) -> None:
    """The Transformer module's modality config must be plain text through ``forward``."""
    modality = st_config.get("modality_config")
    if modality is not None:
        text = modality.get("text") if isinstance(modality, dict) else None
        if (
            not isinstance(text, dict)
            or text.get("method") != "forward"
            or text.get("method_output_name") not in (output_name, [output_name])
        ):
            raise errors.UnsupportedModel(f"Transformer modality_config {modality!r} is not supported")
        if "message" in modality:
            raise errors.UnsupportedModel(
                "Transformer modality_config has a 'message' (chat template) modality, which embedq "
                "does not implement"
            )


def base_info(folder: Path, encoder: Encoder, **fields: Any) -> ModelInfo:
    return ModelInfo(path=str(folder), max_seq_length=encoder.max_seq_length, weights_sha256=weights_sha256(folder),
                     dtype=encoder.dtype_name, device=str(encoder.device), linear_kernel=encoder.linear_kernel,
                     runtime_choice=encoder.runtime_choice.describe() if encoder.runtime_choice else "", **fields)
