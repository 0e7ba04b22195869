"""Faster CPU matrix products for the transformer's ``nn.Linear`` layers: oneDNN with prepacked weights.

On CPU three quarters of an encoder's time is in its Linear layers. PyTorch runs them with MKL's
sgemm, which on some CPUs (AMD Zen among them) reaches well under half of what the cores can do;
oneDNN — already inside every PyTorch CPU build, and what ``torch.compile`` uses for frozen CPU
models — runs the same fp32 products with weights reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``). The arithmetic stays fp32
with fp32 accumulation, so vectors move by rounding only (measured: ≤ 3e-7 on all-MiniLM-L6-v2).

These are PyTorch's internal ops, so nothing here is trusted blindly: :func:`pack_linears` checks that
the ops exist and that every packed layer reproduces its ``nn.Linear`` on a probe input before it
swaps anything, and leaves the model untouched otherwise.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from embedq import errors
from embedq.settings import LinearKernel  # onnxruntime: see onnx.py

log = logging.getLogger(__name__)

#: Largest |Δ| allowed between a packed layer and its nn.Linear on the probe, relative to the output's
#: scale: fp32 rounding noise, or about two bf16 ulps (bf16 outputs are rounded to 8 mantissa bits).
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class OneDNNLinear(nn.Module):
    """``nn.Linear`` whose weight is prepacked for oneDNN (CPU, inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _probe(linear: nn.Linear, packed: OneDNNLinear) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, linear.in_features, generator=generator).to(linear.weight.dtype)
    with torch.inference_mode():
        want = linear(x).float()
        got = packed(x).float()
    scale = max(1.0, float(want.abs().max()))
    tolerance = _PROBE_TOLERANCE[linear.weight.dtype]
    return got.shape == want.shape and bool(((got - want).abs().max() / scale) <= tolerance)


_generation = 0


def swaps_generation() -> int:
    """A number that changes whenever :class:`Swaps` puts layers in or takes them out of any model: what caches of a
    model's modules (the encoder's preemption points) compare to know they still hold."""
    return _generation


class Swaps:
    """The oneDNN layers for a model, prepared and probed, that can be put in and taken out again (the
    runtime tuner times the model both ways before it keeps one)."""

    def __init__(self, swaps: list[tuple[nn.Module, str, nn.Linear, OneDNNLinear]]) -> None:
        self.swaps = swaps

    def apply(self) -> None:
        global _generation
        for parent, name, _, packed in self.swaps:
            setattr(parent, name, packed)
        _generation += 1

    def undo(self) -> None:
        global _generation
        for parent, name, linear, _ in self.swaps:
            setattr(parent, name, linear)
        _generation += 1


def onednn_swaps(model: nn.Module, *, insist: bool = False) -> Swaps | None:
    """Every plain ``nn.Linear`` of ``model`` as a probed :class:`OneDNNLinear`, not yet swapped in.

    None when oneDNN cannot serve this model (not on CPU in float32/bfloat16, ops missing, a layer that does
    not reproduce its ``nn.Linear`` on the probe, or no Linear layers at all); with ``insist`` that is an
    :class:`~embedq.errors.InvalidOption` instead."""
    params = list(model.parameters())
    on_cpu = bool(params) and all(p.device.type == "cpu" for p in params)
    dtype_ok = bool(params) and all(p.dtype in _PROBE_TOLERANCE for p in params)
    if not (on_cpu and dtype_ok and onednn_available()):
        if insist:
            raise errors.InvalidOption("the oneDNN linear kernel needs a CPU model in float32/bfloat16 and a PyTorch "
                                       "build with oneDNN")
        return None
    swaps: list[tuple[nn.Module, str, nn.Linear, OneDNNLinear]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is not nn.Linear:  # subclasses may do more than x @ W.T + b
                continue
            try:
                packed = OneDNNLinear(child)
                ok = _probe(child, packed)
            except RuntimeError as exc:  # an op this PyTorch lacks for this shape or dtype
                log.info("oneDNN linear unavailable (%s); keeping PyTorch's kernels", exc)
                ok = False
            if not ok:
                if insist:
                    raise errors.InvalidOption(f"the oneDNN linear kernel does not reproduce {name}; not using it")
                return None
            swaps.append((parent, name, child, packed))
    return Swaps(swaps) if swaps else None


def pack_linears(model: nn.Module, kernel: LinearKernel = "auto") -> str:
    """Swap ``model``'s ``nn.Linear`` layers for :class:`OneDNNLinear` where that is safe.

    ``auto`` packs on CPU in float32 or bfloat16 when oneDNN is there and every packed layer matches its
    original on a probe; ``onednn`` insists (:class:`~embedq.errors.InvalidOption` when it cannot);
    ``torch`` leaves the model as it is. Returns the kernel in use: ``"onednn"`` or ``"torch"``. (A worker's
    ``auto`` chooses by measurement instead: :mod:`embedq.backends.runtime`.)
    """
    if kernel in ("torch", "onnxruntime"):  # onnxruntime: the encoder runs no PyTorch Linear layers at all
        return "torch"
    swaps = onednn_swaps(model, insist=kernel == "onednn")
    if swaps is None:
        return "torch"
    swaps.apply()
    return "onednn"
