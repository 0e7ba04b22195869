"""Seams of a worker's inference thread, for a program that runs ``embedq worker`` in its own process and must steer
when micro-batches start (tests/controlled_worker.py: a gate before every pick, a hold at a preemption point;
tests/faults/crashy_worker.py: a death as a micro-batch enters the model).

Such a program calls :func:`install` with its :class:`ServiceHooks` before the worker starts; every
:class:`~embedq.workers.service.EmbeddingService` made afterwards calls them. The defaults do nothing: a worker without
installed hooks pays one method call per micro-batch and per preemption point.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ServiceHooks:
    """Override what you need; each method runs on the inference thread and gets the
    :class:`~embedq.workers.service.EmbeddingService` (typed ``Any`` here: the service imports this module)."""

    def before_pick(self, service: Any) -> None:
        """Under the service's lock, before the inference thread picks what runs next: a micro-batch, a crash
        suspect to run alone, or an online micro-batch at a preemption point. It may block there with
        ``service.wait_locked(seconds)``, which lets jobs arrive meanwhile (and returns early on new work or a
        stop: read ``service.stopping``)."""

    def at_point(self, service: Any, point: int) -> None:
        """At preemption point ``point`` (1, 2, ... from the start of each preemptible micro-batch), after the
        online micro-batches waiting there ran. It may hold the paused micro-batch there, calling
        ``service.preempt()`` to run the online ones that arrive meanwhile."""

    def before_launch(self, service: Any, keys: Sequence[tuple[Any, int]]) -> None:
        """As a micro-batch enters the model: its items, as (job, index of the item in the job)."""


_installed = ServiceHooks()


def install(hooks: ServiceHooks) -> None:
    """The hooks of every service this process makes from now on."""
    global _installed
    _installed = hooks


def installed() -> ServiceHooks:
    return _installed
