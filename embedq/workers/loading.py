"""Loading a worker's model: the one code path of an ``embedq worker`` process and of the device process of the split
layout (embedq/workers/split.py), so both serve the same model the same way.

``load_model`` loads the backend with the worker's settings, logs what it loaded and how long it took, gives PyTorch a
single thread where ONNX Runtime runs the forward pass on its own pool, and settles the memory policy.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from embedq.kinds import load_plugins
from embedq.settings import Settings
from embedq.workers import memory

log = logging.getLogger(__name__)


def load_model(settings: Settings, *, device: str | None = None) -> tuple[Any, str, float]:
    """The backend of ``settings.model`` on ``device`` (default ``settings.device``), the memory policy in force, and
    the seconds the load took. Imports torch: the worker's processes only."""
    from embedq.backends import load_backend

    t0 = time.perf_counter()
    backend = load_backend(
        settings.model, device=device or settings.device, dtype=settings.dtype, torch_threads=settings.torch_threads,
        linear_kernel=settings.linear_kernel, batch_tokens=settings.batch_tokens,
        online_tokens=settings.online_tokens, pooling=settings.pooling,
        trust_remote_code=settings.trust_remote_code,
        on_runtime_chosen=partial(memory.settle, settings.memory_policy),
        plugin_kinds=load_plugins(settings.kind_plugins), allow_fake=settings.allow_fake_backend,
    )
    seconds = time.perf_counter() - t0
    log.info("loaded %s on %s (%s, runtime %s) in %.1fs", backend.info.model_id, backend.info.device,
             backend.info.dtype, backend.info.linear_kernel, seconds)
    if backend.info.linear_kernel == "onnxruntime" and (
            not settings.preempt or backend.preemption_blocker() is not None):  # no layered runtime in use
        # ONNX Runtime runs the model on its own thread pool (torch_threads threads); PyTorch is left with the heads'
        # small ops, and its idle OpenMP workers would compete with ONNX Runtime's for every core (bench/peers.py on
        # 2 cores: 0.85x the raw ONNX Runtime loop with PyTorch's 2 threads, 1.03x with 1).
        import torch

        torch.set_num_threads(1)
    policy = memory.settle(settings.memory_policy, backend.info.linear_kernel)
    log.info("memory policy %s (asked %s)", policy, settings.memory_policy)
    return backend, policy, seconds
