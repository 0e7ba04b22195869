"""A long-running worker's memory: flat RSS without a page-fault tax on every micro-batch.

A worker runs thousands of differently shaped micro-batches, and glibc's malloc serves their large
activation buffers from its heap once its dynamic mmap threshold has grown. Freed, those buffers leave
free space in the middle of the heap that glibc keeps: RSS creeps up by tens of KiB a job
(``bench/load.py``, issue 4). Three policies (``EMBEDQ_MEMORY_POLICY``):

``trim`` (default)
    glibc as it is (its buffers are reused, no page faults per batch), and ``malloc_trim(0)`` from the
    inference thread at most every ``malloc_trim_interval`` seconds between micro-batches and once when
    the worker falls idle: the free pages go back to the system, so RSS stays flat, and the page-fault
    cost is paid once an interval instead of once a batch.
``mmap``
    issue 4's fix: a fixed mmap threshold of 128 KiB, so every activation buffer is mapped and unmapped
    per use. Flat, but every batch pays its page faults (PyTorch's kernels lose up to a third of their
    speed on some CPUs; ONNX Runtime keeps its own arena and does not care).
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
from typing import Any, Literal

log = logging.getLogger(__name__)

MemoryPolicy = Literal["trim", "mmap", "glibc"]
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 128 * 1024
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


def configure(policy: MemoryPolicy) -> None:
    """Set the policy's process-wide knobs. Call before torch is imported (oneDNN reads its cache size once)."""
    if policy == "glibc":
        return
    for name, value in CACHE_CAPACITY.items():
        os.environ.setdefault(name, value)
    if policy == "mmap" and not os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        libc = _libc()
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


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
