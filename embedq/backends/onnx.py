"""ONNX Runtime as the encoder's forward pass on CPU (``EMBEDQ_LINEAR_KERNEL=onnxruntime``).

PyTorch runs an encoder op by op; ONNX Runtime runs the same graph with its transformer fusions
(embeddings + LayerNorm, attention, bias + GELU, residual + LayerNorm). The numbers stay fp32 with fp32
accumulation; nothing is quantised (scores within 2e-7 of CrossEncoder's). It is one of the candidates
``linear_kernel=auto`` times at load (:mod:`embedq.backends.runtime`), and can be forced.

The transformer is exported once per (weights, task, library versions) with ``torch.onnx.export``,
optimised with ``onnxruntime.transformers.optimizer`` and cached under ``EMBEDQ_ONNX_CACHE`` (default
``~/.cache/embedq/onnx``). Nothing is trusted blindly: before the worker serves a request, the ONNX
graph must reproduce the PyTorch model on a padded probe batch of mixed lengths (real positions only)
within :data:`PROBE_TOLERANCE` relative to the output's scale; the fused graph is tried first, then the
plain one, and a model neither reproduces is refused with a clear error.

CPU and float32 only, for encoders (right padding; no ``position_ids`` input): what a CrossEncoder or a
SentenceTransformer with BERT-family weights is. Needs the ``onnx`` extra (``onnxruntime``, ``onnx``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from embedq import errors
from embedq.settings import cache_dir

log = logging.getLogger(__name__)

#: Largest |Δ| between the ONNX graph and the PyTorch model on the probe, relative to max(1, |output|):
#: fp32 rounding of a reordered computation (measured ~3e-7), with room, and five times under the 1e-5 bar.
PROBE_TOLERANCE = 2e-6
OPSET = 17
#: ``config.model_type`` → ORT's optimizer model type (BERT-style encoders share one set of fusions).
ORT_MODEL_TYPES = {"bert": "bert", "roberta": "bert", "xlm-roberta": "bert", "camembert": "bert",
                   "distilbert": "bert", "electra": "bert", "mpnet": "bert", "deberta-v2": "bert"}


def cache_root() -> Path:
    return cache_dir("EMBEDQ_ONNX_CACHE", "onnx")


def _import_ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise errors.InvalidOption(
            f"linear_kernel=onnxruntime needs ONNX Runtime: {errors.install_hint('onnx')}") from exc
    return onnxruntime


class _Exported(nn.Module):
    """The model with positional inputs and one tensor out, as ``torch.onnx.export`` wants it."""

    def __init__(self, model: nn.Module, names: list[str], output: str) -> None:
        super().__init__()
        self.model, self.names, self.output = model, names, output

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(**dict(zip(self.names, tensors)), return_dict=True), self.output)


def _probe_inputs(names: list[str], vocab: int, pad_id: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A padded batch of mixed lengths (one row unpadded), with both segment ids in use."""
    rng = np.random.default_rng(seed)
    lengths = [23, 5, 14, 1]
    width = max(lengths)
    ids = np.full((len(lengths), width), pad_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    types = np.zeros_like(ids)
    high = max(2, min(vocab, 1000))
    for i, length in enumerate(lengths):
        ids[i, :length] = rng.integers(1, high, size=length)
        mask[i, :length] = 1
        types[i, length // 2:length] = 1
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    return {name: feeds[name] for name in names}


class OnnxModel:
    """An ONNX Runtime session called like the transformers model it replaces (the encoder's ``run``)."""

    def __init__(self, session: Any, names: list[str], output: str, path: Path, fused: bool) -> None:
        self.session, self.names, self.output, self.path, self.fused = session, names, output, path, fused

    def __call__(self, *, return_dict: bool = True, **inputs: torch.Tensor) -> SimpleNamespace:
        feeds = {name: inputs[name].numpy() for name in self.names}
        out = self.session.run([self.output], feeds)[0]
        return SimpleNamespace(**{self.output: torch.from_numpy(out)})


def _cache_key(weights: str, task: str, names: list[str], output: str) -> str:
    import onnxruntime
    import transformers

    parts = {"weights": weights, "task": task, "inputs": names, "output": output, "opset": OPSET, "export": 2,
             "torch": torch.__version__, "transformers": transformers.__version__, "ort": onnxruntime.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _export(model: nn.Module, names: list[str], output: str, vocab: int, pad_id: int, folder: Path,
            model_type: str | None, config: Any) -> None:
    """Write ``folder/plain.onnx`` and, when ORT's optimizer knows the architecture, ``folder/fused.onnx``."""
    import warnings

    sample = {k: torch.from_numpy(v) for k, v in _probe_inputs(names, vocab, pad_id, seed=1).items()}
    dynamic = {name: {0: "batch", 1: "length"} for name in names}
    dynamic[output] = {0: "batch", 1: "length"} if output == "last_hidden_state" else {0: "batch"}
    # Exported with eager attention: its MatMul/Softmax pattern is what ORT fuses into one Attention op
    # (in SDPA's graph the fusion finds nothing; in a worker, bench/rerank.py --small --jobs 20: 3,923
    # against 3,686 real tokens/s in the model). The model is put back as it was.
    attention = getattr(model.config, "_attn_implementation", None)
    switch = attention not in (None, "eager") and hasattr(model, "set_attn_implementation")
    with warnings.catch_warnings(), contextlib.ExitStack() as undo:
        warnings.simplefilter("ignore")
        if switch:
            model.set_attn_implementation("eager")
            undo.callback(model.set_attn_implementation, attention)
        torch.onnx.export(_Exported(model, names, output).eval(), tuple(sample[n] for n in names),
                          str(folder / "plain.onnx"), input_names=names, output_names=[output],
                          dynamic_axes=dynamic, opset_version=OPSET, dynamo=False)
    ort_type = ORT_MODEL_TYPES.get(model_type or "")
    if ort_type is None:
        return
    try:
        from onnxruntime.transformers.optimizer import optimize_model

        heads = int(getattr(config, "num_attention_heads", 0) or 0)
        hidden = int(getattr(config, "hidden_size", 0) or 0)
        for name in list(logging.root.manager.loggerDict):  # the optimizer's modules log each step at INFO
            if name.startswith(("fusion", "onnx_model")):
                logging.getLogger(name).setLevel(logging.WARNING)
        optimized = optimize_model(str(folder / "plain.onnx"), model_type=ort_type, num_heads=heads,
                                   hidden_size=hidden, opt_level=1, use_gpu=False)
        optimized.save_model_to_file(str(folder / "fused.onnx"))
        log.info("ONNX Runtime fusions: %s",
                 {k: v for k, v in optimized.get_fused_operator_statistics().items() if v})
    except Exception as exc:  # an architecture the fusions do not fit: the plain graph still runs
        log.info("ONNX Runtime's transformer optimizer failed (%s: %s); using the plain graph",
                 type(exc).__name__, exc)


def _session(ort: Any, path: Path, threads: int) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Shapes change with every micro-batch: the memory pattern planner only helps fixed shapes.
    options.enable_mem_pattern = False
    # No spinning: ORT's idle pool threads would otherwise busy-wait on the cores that run what comes next, PyTorch's
    # layers when bulk batches run there (issue 18) and the worker's tokenizer and results threads. Measured on 2
    # cores (AVX2), MiniLM, 2,048-token batches with three 1-text ORT batches after each: PyTorch 54.9 texts/s with
    # spinning, 61.4 without (61.7 alone); the 1-text ORT batches 6.75 ms against 5.02 ms.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _reproduces(model: nn.Module, onnx_model: OnnxModel, names: list[str], output: str, vocab: int,
                pad_id: int) -> float:
    """Largest relative |Δ| between the ONNX graph and the model on the probe (real positions only)."""
    worst = 0.0
    for seed in (0, 2):
        feeds = _probe_inputs(names, vocab, pad_id, seed=seed)
        tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}
        with torch.inference_mode():
            want = getattr(model(**tensors, return_dict=True), output).float().numpy()
            got = getattr(onnx_model(**tensors), output).float().numpy()
        if got.shape != want.shape:
            return float("inf")
        if output == "last_hidden_state":
            real = feeds["attention_mask"].astype(bool)
            want, got = want[real], got[real]
        scale = max(1.0, float(np.abs(want).max()))
        worst = max(worst, float(np.abs(got - want).max()) / scale)
    return worst


def load_onnx(model: nn.Module, *, weights: str, task: str, names: list[str], output: str, pad_id: int,
              threads: int) -> OnnxModel:
    """The ONNX Runtime session for ``model`` (exported and cached on first use), checked against it."""
    ort = _import_ort()
    config = model.config
    vocab = int(getattr(config, "vocab_size", 0) or 1000)
    folder = cache_root() / _cache_key(weights, task, names, output)
    if not (folder / "plain.onnx").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))  # renamed into place
        try:
            t0 = time.perf_counter()
            _export(model, names, output, vocab, pad_id, tmp, getattr(config, "model_type", None), config)
            log.info("exported the model to ONNX in %.1fs (%s)", time.perf_counter() - t0, folder)
            with contextlib.suppress(OSError):  # another worker got there first: its files are the same
                tmp.rename(folder)
        except errors.EmbedqError:
            raise
        except Exception as exc:
            raise errors.UnsupportedModel(f"cannot export the model to ONNX: {type(exc).__name__}: {exc}") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    failures = []
    for name, fused in (("fused.onnx", True), ("plain.onnx", False)):
        path = folder / name
        if not path.is_file():
            continue
        try:
            candidate = OnnxModel(_session(ort, path, threads), names, output, path, fused)
            delta = _reproduces(model, candidate, names, output, vocab, pad_id)
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if delta <= PROBE_TOLERANCE:
            log.info("ONNX Runtime %s graph reproduces PyTorch within %.1e (relative)",
                     "fused" if fused else "plain", delta)
            return candidate
        failures.append(f"{name}: relative |delta| {delta:.2e} over {PROBE_TOLERANCE:.0e}")
    raise errors.UnsupportedModel("ONNX Runtime does not reproduce this model's PyTorch outputs ("
                                  + "; ".join(failures) + "); use linear_kernel=auto or torch")
