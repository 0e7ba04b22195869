"""Loading a worker's model: the one code path of an ``embedq worker`` process and of the device process of the split
layout (embedq/workers/split.py), so both serve the same model the same way.

``load_model`` loads the backend with the worker's settings, logs what it loaded and how long it took, tells the backend
whether the worker preempts (it settles its threads: ``Backend.start_serving``), and settles the memory policy on what
the backend reports of its runtime (``Backend.runtime_facts``).
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
    options = settings.backend()
    if device is not None:
        options = options.model_copy(update={"device": device})
    backend = load_backend(settings.model, options, on_runtime_chosen=partial(memory.settle, settings.memory_policy),
                           plugin_kinds=load_plugins(settings.kind_plugins))
    seconds = time.perf_counter() - t0
    log.info("loaded %s on %s (%s, runtime %s) in %.1fs", backend.info.model_id, backend.info.device,
             backend.info.dtype, backend.info.linear_kernel, seconds)
    backend.start_serving(preempt=settings.preempt)
    policy = memory.settle(settings.memory_policy, backend.runtime_facts())
    log.info("memory policy %s (asked %s)", policy, settings.memory_policy)
    return backend, policy, seconds
