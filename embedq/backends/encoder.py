"""The encoder: the part of every backend that loads a model folder (:mod:`~embedq.backends.transformer`, one step a
function: where it runs, its tokenizer, its model), owns the :class:`~embedq.backends.tokenizing.Tokenization` that
tokenizes texts or text pairs as sentence-transformers does, pads a micro-batch and runs the transformer on the runtime
chosen for it (:mod:`~embedq.backends.runtime`). Heads (``dense.py``, ``classify.py``, ``tokens.py``) turn its output
into one kind's rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedq import errors
from embedq.backends.base import Encoded, RuntimeFacts
from embedq.backends.folder import FEATURES, TASK_OUTPUTS, check_remote_code, weights_sha256
from embedq.backends.kernels import pack_linears, swaps_generation
from embedq.backends.runtime import LAYERED, Candidate, check, choose, facts
from embedq.backends.tokenizing import Tokenization
from embedq.backends.transformer import load_tokenizer, load_transformer, pad_id, placement
from embedq.settings import BackendSettings

log = logging.getLogger(__name__)


def attention_kernels(device: torch.device) -> Any:
    """The attention kernels a forward pass may use: on CUDA, every kernel but cuDNN's fused attention.

    PyTorch picks cuDNN attention for fp16/bf16 on Hopper GPUs, and cuDNN builds a graph for each new input
    shape: measured on an H100 (torch 2.11), 45-130 ms the first time a shape is seen against 3 ms after,
    and a coalescing worker meets a new (batch, width) shape in almost every micro-batch. Flash and
    memory-efficient attention need no per-shape step (4.5 ms for a new shape). Returns a context factory;
    a no-op on CPU and on PyTorch without ``torch.nn.attention``.
    """
    if device.type != "cuda":
        return contextlib.nullcontext
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # PyTorch < 2.3
        return contextlib.nullcontext
    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return lambda: sdpa_kernel(kernels)


class Encoder:
    """A transformer folder loaded for inference: its tokenizer (and the :class:`Tokenization` that calls it as
    sentence-transformers does), its model, padding and the forward pass on the runtime chosen for it."""

    def __init__(self, folder: Path, st_config: dict[str, Any], settings: BackendSettings, *, task: str = FEATURES,
                 allow_chat_template: bool = False,
                 on_runtime_chosen: Callable[[RuntimeFacts], None] | None = None) -> None:
        self.folder = folder
        self.task = task
        self.device, self.dtype = placement(settings)
        self.dtype_name = settings.dtype
        self._attention = attention_kernels(self.device)
        trust = check_remote_code(folder, settings.trust_remote_code)
        self.config, self.tokenizer = load_tokenizer(folder, st_config, trust=trust,
                                                     allow_chat_template=allow_chat_template)
        self.model = load_transformer(folder, st_config, self.config, task=task, device=self.device,
                                      dtype=self.dtype, trust=trust)
        params = inspect.signature(self.model.forward).parameters
        self.max_seq_length = int(self.tokenizer.model_max_length)
        self.takes_token_type_ids = "token_type_ids" in params and "token_type_ids" in self.tokenizer.model_input_names
        self._position_ids = "position_ids" in params
        self._pad_id = pad_id(self.tokenizer)
        self.left_padding = self.tokenizer.padding_side == "left"
        self.tokenization = Tokenization(self.tokenizer, self.max_seq_length, self.takes_token_type_ids,
                                         max_windows=settings.max_windows)
        # Bulk micro-batches that may be preempted run here when the chosen runtime cannot stop between layers
        # (runtime.preemptible_alternative); None: they run on the chosen one.
        self._preempt_forward: Any = None
        self.preempt_runtime: str | None = None
        self._override: Any = None  # the forward pass run() uses inside between_layers (not in its callback)
        self.runtime_choice: Any = None  # runtime.Choice when linear_kernel=auto chose by measurement
        self._forward: Any = self.model
        self.linear_kernel = "torch"
        self._layers: Any = False  # the layer stack, once looked for (layers())
        self._points: tuple[int, list[Any]] | None = None  # the preemption points, by swaps generation
        self._choose_runtime(settings, on_runtime_chosen)

    def _choose_runtime(self, settings: BackendSettings, on_chosen: Callable[[RuntimeFacts], None] | None) -> None:
        """The runtime of the forward pass: measured where ``linear_kernel=auto`` on a CPU in float32 or bfloat16
        (:func:`~embedq.backends.runtime.choose`; a layered one kept for bulk micro-batches where the chosen one runs
        the graph whole and the measurements say it is nearly as fast on them), else the one asked for (a GPU or
        float16: PyTorch's own kernels)."""
        kernel = settings.linear_kernel
        if kernel == "auto" and self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16):
            self.runtime_choice, candidate = choose(self, weights=weights_sha256(self.folder),
                                                    tokens=settings.batch_tokens, online_tokens=settings.online_tokens,
                                                    on_chosen=on_chosen)
            self._forward, self.linear_kernel = candidate.forward, self.runtime_choice.runtime
            if self.runtime_choice.bulk_runtime is not None:
                self.layered_for_bulk(self.runtime_choice.bulk_runtime)
        elif kernel == "onnxruntime":
            self._forward, self.linear_kernel = self._onnx(), "onnxruntime"
        else:
            self.linear_kernel = pack_linears(self.model, kernel)

    def layered_for_bulk(self, name: str) -> bool:
        """Run preemptible bulk micro-batches (inside :meth:`between_layers`) on the layered runtime ``name``
        (``torch`` or ``onednn``) while the chosen runtime runs the graph whole; checked for fidelity first.
        Returns whether it is in place."""
        if name not in LAYERED or self.linear_kernel in LAYERED:
            raise errors.InvalidOption(f"a layered runtime for bulk batches is {LAYERED}, beside onnxruntime")
        candidate = self.make_runtime(name)
        if candidate is None:
            return False
        trial = check(self, [candidate], Candidate("torch", self.model))[0]
        if not trial.faithful:
            log.warning("runtime: %s for preemptible bulk micro-batches is not faithful here (%s)", name,
                        trial.describe())
            return False
        candidate.enter()
        self._preempt_forward, self.preempt_runtime = candidate.forward, name
        log.info("runtime: bulk micro-batches that online ones may preempt run on %s (nearly as fast on token-budget "
                 "batches, and it stops between layers); the rest on %s", name, self.linear_kernel)
        return True

    def make_runtime(self, name: str) -> Any:
        """A :class:`~embedq.backends.runtime.Candidate` running this model with runtime ``name``; None where
        that runtime does not apply (raises with the reason where it should but cannot)."""
        from embedq.backends.kernels import onednn_swaps

        if name == "torch":
            return Candidate("torch", self.model)
        if name == "onednn":
            swaps = onednn_swaps(self.model)
            return None if swaps is None else Candidate("onednn", self.model, swaps.apply, swaps.undo)
        if name == "onnxruntime":
            if self.device.type != "cpu" or self.dtype != torch.float32 or self.left_padding:
                return None
            return Candidate("onnxruntime", self._onnx())
        raise errors.InvalidOption(f"unknown runtime {name!r}")

    def _onnx(self) -> Any:
        """The forward pass in ONNX Runtime (onnx.py), checked against this model before it serves."""
        from embedq.backends.onnx import load_onnx

        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise errors.InvalidOption("linear_kernel=onnxruntime runs on the CPU in float32 only")
        if self.left_padding:
            raise errors.InvalidOption("linear_kernel=onnxruntime serves right-padded encoders; this tokenizer "
                                       "pads on the left")
        names = ["input_ids", "attention_mask"] + (["token_type_ids"] if self.takes_token_type_ids else [])
        output = TASK_OUTPUTS[self.task]
        return load_onnx(self.model, weights=weights_sha256(self.folder), task=self.task, names=names, output=output,
                         pad_id=self._pad_id, threads=torch.get_num_threads())

    def runtime_facts(self) -> RuntimeFacts:
        """What the worker needs to know of the runtime chosen (:data:`~embedq.backends.runtime.FACTS`), with the
        layered runtime kept for preemptible bulk micro-batches."""
        return dataclasses.replace(facts(self.linear_kernel), bulk_runtime=self.preempt_runtime)

    def start_serving(self, *, preempt: bool) -> None:
        """PyTorch keeps one thread where the runtime runs the forward pass on a pool of its own and no layered runtime
        runs bulk micro-batches: PyTorch is left with the heads' small ops, and its idle OpenMP workers would compete
        with the runtime's for every core (bench/peers.py on 2 cores: 0.85x the raw ONNX Runtime loop with PyTorch's
        2 threads, 1.03x with 1)."""
        if facts(self.linear_kernel).own_threads and (not preempt or self.preemption_blocker() is not None):
            torch.set_num_threads(1)

    # -- inference ------------------------------------------------------------------------------------------
    def layers(self) -> Any:
        """The model's stack of transformer layers (the ``nn.ModuleList`` of ``num_hidden_layers`` blocks: BERT's
        ``encoder.layer``, a decoder's ``layers``, ...), or None where there is none to find."""
        if self._layers is False:
            count = int(getattr(self.model.config, "num_hidden_layers", 0) or 0)
            stacks = [m for _, m in self.model.named_modules()
                      if isinstance(m, torch.nn.ModuleList) and count and len(m) == count]
            self._layers = stacks[0] if len(stacks) == 1 else None
        return self._layers

    def preemption_blocker(self) -> str | None:
        """None when :meth:`between_layers` can stop this model's forward pass between two layers; else why not."""
        if self.linear_kernel == "onnxruntime" and self._preempt_forward is None:
            return "ONNX Runtime runs the model's graph whole (and no layered runtime is nearly as fast here)"
        if self.layers() is None:
            return (f"its layer stack was not found (no single nn.ModuleList of num_hidden_layers="
                    f"{getattr(self.model.config, 'num_hidden_layers', None)} blocks)")
        return None

    def preemption_points(self) -> list[Any]:
        """The modules a forward pass may stop before: each layer of the stack, and inside it each leaf module that
        holds weights (the projections and norms), so a pause waits at most about one matrix product, not a whole
        layer. Kept until a runtime swaps modules (the oneDNN runtime swaps the Linear layers: kernels.Swaps); every
        bulk micro-batch asks, and walking the modules costs 50 µs for one layer, 12 times that for BERT-base's."""
        generation = swaps_generation()
        if self._points is not None and self._points[0] == generation:
            return self._points[1]
        points: list[Any] = []
        for layer in self.layers() or ():
            points.append(layer)
            for module in layer.modules():
                if module is not layer and not any(True for _ in module.children()) and (
                        any(True for _ in module.parameters(recurse=False))
                        or any(True for _ in module.buffers(recurse=False))):
                    points.append(module)
        self._points = (generation, points)
        return points

    @contextlib.contextmanager
    def between_layers(self, callback: Callable[[], None]) -> Iterator[bool]:
        """While inside: ``callback()`` runs before each preemption point (:meth:`preemption_points`: each layer,
        and each weight-holding module in it) of every forward pass on this thread's model, except in forward
        passes ``callback`` itself starts (they run through, unhooked, on the chosen runtime). Forward passes inside
        run on the layered runtime kept for them where the chosen one runs the graph whole. Yields whether the
        hooks are in place: False where no layered runtime runs this model or no layer stack was found."""
        if self.preemption_blocker() is not None:
            yield False
            return
        inside = [False]

        def hook(module: Any, args: Any) -> None:
            if inside[0]:
                return
            inside[0] = True
            override, self._override = self._override, None  # the callback's passes: the chosen runtime
            try:
                callback()
            finally:
                inside[0] = False
                self._override = override

        handles = [point.register_forward_pre_hook(hook) for point in self.preemption_points()]
        self._override = self._preempt_forward
        try:
            yield True
        finally:
            self._override = None
            for handle in handles:
                handle.remove()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """An input array on the model's device. On CUDA through pinned host memory (PyTorch's caching host
        allocator reuses its blocks, and keeps one until the copies from it are done) with a non-blocking copy:
        the copy is queued behind the work already on the device instead of waiting for it."""
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def run(self, batch: Sequence[Encoded], forward: Any = None) -> tuple[Any, torch.Tensor]:
        """One padded forward pass: (the model's output, the attention mask). Call under inference_mode.
        ``forward``: another runtime than the encoder's own (the runtime tuner's candidates)."""
        n = len(batch)
        lengths = [len(item.ids) for item in batch]
        width = max(max(lengths), 1)
        ids = np.full((n, width), self._pad_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        types = np.zeros((n, width), dtype=np.int64) if self.takes_token_type_ids else None
        for i, item in enumerate(batch):
            length = lengths[i]
            if not length:
                continue
            cols = slice(width - length, width) if self.left_padding else slice(0, length)
            ids[i, cols] = item.ids
            mask[i, cols] = 1
            if types is not None and item.type_ids is not None:
                types[i, cols] = item.type_ids
        with self._attention():
            input_ids, attention_mask = self._to_device(ids), self._to_device(mask)
            inputs: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask}
            if types is not None:
                inputs["token_type_ids"] = self._to_device(types)
            if self.left_padding and self._position_ids and min(lengths) < width:
                # Positions as the unpadded text would have them (left padding only).
                inputs["position_ids"] = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
            return (forward or self._override or self._forward)(**inputs, return_dict=True), attention_mask


