"""``embedq worker``: one Celery worker process per device."""

from __future__ import annotations

import logging
import os
import socket
import sys

from embedq.broker import make_app
from embedq.settings import Settings
from embedq.workers import consumer, observe, transport

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def worker_argv(settings: Settings, *, hostname: str | None = None, loglevel: str = "INFO") -> list[str]:
    name = hostname or f"embedq-{settings.device.replace(':', '')}-{os.getpid()}@{socket.gethostname()}"
    return [
        "worker",
        # No forking: CUDA must never be initialised before a fork, and the model lives in this
        # process. Messages never reach the pool anyway (see consumer.coalescing_strategy).
        "--pool=solo",
        "--concurrency=1",
        f"--queues={','.join(settings.queues)}",  # online first
        f"--prefetch-multiplier={settings.prefetch_window}",
        f"--hostname={name}",
        f"--loglevel={loglevel}",
        "--task-events",
        "--without-gossip",
        "--without-mingle",
    ]


#: Shape-keyed caches of oneDNN (primitives) and of PyTorch's ideep layer: one entry per micro-batch shape,
#: and a worker sees thousands of shapes. 64 entries each hold memory flat at the same throughput
#: (measured: 5,000 one-text jobs in 74.5 s vs 73.3 s with the defaults of 1,024; RSS +0.7 % vs +24 %).
CACHE_CAPACITY = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def steady_memory() -> None:
    """Keep a long-running worker's memory flat (call before torch is imported).

    Two things grew RSS by ~90 KiB per job under load (bench/load.py, CPU): oneDNN's and ideep's
    per-shape caches (capped in :data:`CACHE_CAPACITY`), and glibc's malloc, which serves the large,
    differently sized activation buffers from its heap once its *dynamic* mmap threshold has grown,
    where the freed space fragments. A fixed threshold sends every block over 128 KiB to mmap and back
    to the system when freed. An operator's own environment variables win; other C libraries are
    left alone."""
    for name, value in CACHE_CAPACITY.items():
        os.environ.setdefault(name, value)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    except (OSError, AttributeError):  # not glibc
        pass


def run_worker(settings: Settings, *, hostname: str | None = None, loglevel: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, loglevel.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    steady_memory()
    transport.install()
    worker = consumer.Worker(settings)
    worker.load_service()  # fail fast (non-zero exit) on a model that cannot load
    observe.serve_metrics(worker)  # and on a metrics port that is taken
    app = make_app(settings)
    consumer.register(app, worker)
    app.worker_main(worker_argv(settings, hostname=hostname, loglevel=loglevel))
