"""A long-running worker's memory: flat RSS without a page-fault tax on every micro-batch.

A worker runs thousands of differently shaped micro-batches, and glibc's malloc serves their large
activation buffers from its heap once its dynamic mmap threshold has grown. Freed, those buffers leave
free space in the middle of the heap that glibc keeps: RSS creeps up by tens of KiB a job
(``bench/load.py``, issue 4). Three policies (``EMBEDQ_MEMORY_POLICY``):

``auto`` (default)
    ``mmap`` while the model loads (so the runtime tuner times PyTorch's kernels under the settings they
    would run with), then what the backend reports for the runtime chosen (``RuntimeFacts.auto_memory_policy``,
    embedq/backends/runtime.py's ``FACTS``): ``trim`` for ONNX Runtime, else ``mmap``. ONNX Runtime
    keeps its activations in its own arena, which it reuses from batch to batch: RSS stays flat without
    mapping anything per batch (measured under ``bench/load.py``: +0.0 % drift with glibc's malloc as it
    is). PyTorch's kernels allocate their activations from malloc, and only ``mmap`` kept them flat.
``trim``
    glibc with large fixed thresholds (blocks up to 32 MiB from its heap, reused without page faults) and
    ``malloc_trim(0)`` from the inference thread at most every ``malloc_trim_interval`` seconds between
    micro-batches and once when the worker falls idle, which hands free pages back. Flat with ONNX
    Runtime; with PyTorch's kernels it is not: under ``bench/load.py`` (60 s on the AVX2 machine) oneDNN's
    prepacked kernels ended at +16.3 % over their starting RSS at the peak (the free space is fragmented
    between live blocks, which no trim can return), PyTorch's own kernels at +6.5 % (inside issue 4's
    limit, but on one short soak only); a 10-minute soak of PyTorch's kernels (Zen 5, issue 36) ended level
    (-0.2 %) but peaked at +17.8 %, so ``auto`` keeps ``mmap`` for both.
``mmap``
    issue 4's fix: a fixed mmap threshold of 128 KiB, so every activation buffer is mapped and unmapped
    per use. Flat, but every batch pays its page faults (PyTorch's kernels lose a quarter of their speed
    on the AVX2 machine).
``glibc``
    nothing done: malloc and the oneDNN/ideep caches at their library defaults.

With ``trim`` and ``mmap`` the shape-keyed caches of oneDNN (primitives) and of PyTorch's ideep layer are
capped at 64 entries each (one entry per micro-batch shape, and a worker sees thousands of shapes). An
operator's own ``MALLOC_*``/cache variables always win. Other C libraries than glibc are left alone.
Measured: docs/BENCHMARKS.md, *Memory*.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # pragma: no cover
    from embedq.backends.base import RuntimeFacts

log = logging.getLogger(__name__)

MemoryPolicy = Literal["auto", "trim", "mmap", "glibc"]
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MMAP_THRESHOLD = 128 * 1024
#: ``trim``: blocks up to glibc's own dynamic maximum (32 MiB on 64-bit) from the heap, and no automatic
#: trimming of its top below twice that (the inference thread trims, on its own schedule).
HEAP_MMAP_THRESHOLD, HEAP_TRIM_THRESHOLD = 32 * 1024 * 1024, 64 * 1024 * 1024
CACHE_CAPACITY = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):  # glibc has both
            return None
    except (OSError, AttributeError):
        return None
    return libc


def _operator_set_malloc() -> bool:
    return any(os.environ.get(name) for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"))


def _mallopt(mmap_threshold: int, trim_threshold: int | None = None) -> None:
    libc = _libc()
    if libc is None or _operator_set_malloc():
        return
    libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
    if trim_threshold is not None:
        libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)


def configure(policy: MemoryPolicy) -> None:
    """Set the policy's process-wide knobs. Call before torch is imported (oneDNN reads its cache size once)."""
    if policy == "glibc":
        return
    for name, value in CACHE_CAPACITY.items():
        os.environ.setdefault(name, value)
    if policy in ("mmap", "auto"):
        _mallopt(MMAP_THRESHOLD)
    elif policy == "trim":
        _mallopt(HEAP_MMAP_THRESHOLD, HEAP_TRIM_THRESHOLD)


def settle(policy: MemoryPolicy, runtime: RuntimeFacts) -> MemoryPolicy:
    """The policy in force once the model is loaded with ``runtime`` (what its backend reports of it): ``auto``
    becomes the runtime's ``auto_memory_policy`` (``trim`` or ``mmap``). Returns the effective policy."""
    if policy != "auto":
        return policy
    if runtime.auto_memory_policy == "trim":
        _mallopt(HEAP_MMAP_THRESHOLD, HEAP_TRIM_THRESHOLD)
        return "trim"
    return "mmap"


class Trimmer:
    """``malloc_trim(0)`` at most every ``interval`` seconds of work, and once when work stops.

    Called from the inference thread only: ``after_batch`` after each micro-batch, ``idle`` when the
    thread is about to wait for work."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._libc = _libc()
        self._last = time.monotonic()
        self._dirty = False
        self.trims = 0
        self.seconds = 0.0

    @property
    def active(self) -> bool:
        return self._libc is not None

    def after_batch(self) -> None:
        self._dirty = True
        if time.monotonic() - self._last >= self.interval:
            self.trim()

    def idle(self) -> None:
        if self._dirty:
            self.trim()

    def trim(self) -> None:
        if self._libc is None:
            return
        t0 = time.monotonic()
        self._libc.malloc_trim(0)
        self._last = now = time.monotonic()
        self._dirty = False
        self.trims += 1
        self.seconds += now - t0


def trimmer(policy: MemoryPolicy, interval: float) -> Trimmer | None:
    """The inference thread's trimmer under ``policy`` (None: nothing to do)."""
    if policy != "trim":
        return None
    keeper = Trimmer(interval)
    return keeper if keeper.active else None
