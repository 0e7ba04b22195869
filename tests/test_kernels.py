"""The oneDNN Linear kernel (backends/kernels.py): same vectors as PyTorch's own, or not used at all."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from embedq import errors  # noqa: E402
from embedq.backends import load_backend, postprocess  # noqa: E402
from embedq.backends.cpu import cpu_flags  # noqa: E402
from embedq.backends.kernels import OneDNNLinear, onednn_available, pack_linears  # noqa: E402

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN linear ops")


class _ScaledLinear(torch.nn.Linear):
    """A Linear subclass doing more than x @ W.T + b: must never be swapped."""

    def forward(self, x):
        return super().forward(x) * 2


def _toy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8, bias=False), _ScaledLinear(8, 8)
    ).eval()


@needs_onednn
def test_pack_linears_swaps_plain_linears_and_keeps_the_maths():
    model = _toy()
    x = torch.randn(3, 5, 16)
    with torch.inference_mode():
        want = model(x)
    assert pack_linears(model) == "onednn"
    kinds = [type(m) for m in model]
    assert kinds[0] is OneDNNLinear and kinds[2] is OneDNNLinear  # with and without bias
    assert kinds[3] is _ScaledLinear  # subclasses are left alone
    with torch.inference_mode():
        got = model(x)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5


def _cpu_runs_onednn_bf16() -> bool:
    """Whether oneDNN can run bfloat16 products on this CPU, asked of the CPU rather than assumed.

    PyTorch's own check (``_is_mkldnn_bf16_supported``: oneDNN's ISA, on x86 AVX-512 core with bw/vl/dq or
    AVX-NE-CONVERT) is the rule ``_reorder_linear_weight`` enforces for bf16; /proc/cpuinfo is the fallback
    where this PyTorch lacks the query. Either way it cannot say yes on a CPU whose flags lack those ISAs.
    """
    flags = cpu_flags()
    capable_flags = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    query = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if query is None:
        return capable_flags
    supported = bool(query())
    if flags and not capable_flags:  # an x86 CPU (only x86 lists "flags") without those ISAs
        assert not supported, f"PyTorch claims bf16 oneDNN on a CPU with only {sorted(flags)}"
    return supported


@needs_onednn
def test_bfloat16_is_packed_too():
    """bf16 is packed where the CPU runs oneDNN's bf16 kernels; elsewhere auto keeps PyTorch's (untouched)."""
    model = _toy().bfloat16()
    x = torch.randn(4, 16).bfloat16()
    with torch.inference_mode():
        want = model(x).float()
    if not _cpu_runs_onednn_bf16():  # e.g. AVX2-only CPUs: the documented fallback, and insisting is an error
        assert pack_linears(model) == "torch"
        assert all(type(m) is not OneDNNLinear for m in model)
        with torch.inference_mode():
            assert torch.equal(model(x).float(), want)
        with pytest.raises(errors.InvalidOption):
            pack_linears(model, "onednn")
        return
    assert pack_linears(model) == "onednn"
    assert type(model[0]) is OneDNNLinear and type(model[2]) is OneDNNLinear
    with torch.inference_mode():
        got = model(x).float()
    assert (got - want).abs().max().item() <= 2e-2 * max(1.0, want.abs().max().item())


def test_torch_kernel_and_unsupported_dtype():
    model = _toy()
    assert pack_linears(model, "torch") == "torch"
    assert all(type(m) is not OneDNNLinear for m in model)
    half = _toy().half()
    assert pack_linears(half) == "torch"  # auto: fp16 on CPU stays with PyTorch
    with pytest.raises(errors.InvalidOption):
        pack_linears(half, "onednn")  # insisting where it cannot work is a clear error


@needs_onednn
def test_minilm_kernels_agree():
    """The real model: oneDNN and PyTorch kernels give the same vectors (same embedding space)."""
    fast = load_backend("all-MiniLM-L6-v2", linear_kernel="onednn")
    slow = load_backend("all-MiniLM-L6-v2", linear_kernel="torch")
    assert fast.info.linear_kernel == "onednn" and slow.info.linear_kernel == "torch"
    assert fast.info.weights_sha256 == slow.info.weights_sha256
    texts = ["short", "a somewhat longer sentence about embeddings and queues", "x " * 300]
    ids = fast.tokenize(texts).ids
    assert fast.info.normalizes
    # Compared as served, normalised (DESIGN.md's 1e-5 is on unit vectors; ``embed`` returns the pooled vectors
    # before MiniLM's Normalize module).
    served = [postprocess(backend.embed(ids), normalize=True, dimensions=None) for backend in (fast, slow)]
    assert np.abs(served[0] - served[1]).max() <= 1e-5
