"""A real ``embedq worker`` the tests can steer, with fault injections that stay inert until a test triggers them;
nothing else differs from ``python -m embedq worker``.

- Its model fails (a RuntimeError in the forward pass, as a kernel error would) on any micro-batch holding a text
  that contains ``FAIL_IN_MODEL`` (tests/test_preempt.py: a failing online micro-batch inside a preemption fails
  only its own job and the paused bulk micro-batch resumes).
- With ``EMBEDQ_TEST_FAULT=die``, a micro-batch holding a text that contains ``FAULT_IN_MODEL`` raises an exception
  no ``except Exception`` catches, so the inference thread dies there (as a bug in the service's own bookkeeping
  would kill it); with ``EMBEDQ_TEST_FAULT=stall`` it blocks in the model for good (a hung kernel).
  tests/faults/test_liveness.py: the worker notices, hands the other messages back and exits.
- Gate: while the Redis key named by ``EMBEDQ_TEST_GATE`` exists, no micro-batch starts (none at all: a batch, a
  crash suspect's run alone, an online batch at a preemption point: ``ServiceHooks.before_pick``); the worker goes on
  receiving and buffering jobs up to its prefetch window, as it would behind a long micro-batch. Tests of
  coalescing and of the window so control what is buffered when the model runs, whatever the speed of the
  machine, the model or the producer: they wait until the worker's counters show the jobs held, then delete the key.
  ``INCR <key>:pass`` lets one micro-batch through the closed gate (``WorkerHandle.step``): a job is then running, its
  first micro-batch done and the rest held, whatever the speed of the model.
- Load gate: while the Redis key named by ``EMBEDQ_TEST_LOAD_GATE`` exists, the model does not load (the worker's
  process has started and registered itself as "starting": :mod:`embedq.workers.announce`), as a first start that
  exports and measures on a busy machine stays in that state. tests/test_first_hour.py so holds a worker in its start
  for as long as a test needs, on any machine.
- Hold: while the Redis key named by ``EMBEDQ_TEST_HOLD`` exists, a bulk micro-batch that reaches its
  ``HOLD_AT``-th preemption point stays there (it sets ``<key>:held`` to that point's number), running online
  micro-batches as they arrive, as at any preemption point. tests/test_preempt.py so knows, from a state it can
  read, that the bulk micro-batch is running when it sends online jobs, and that it has not ended when they are
  answered, on a fast machine or a slow one; it deletes the key to let the bulk micro-batch go on.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

import embedq.backends
from embedq.backends import model
from embedq.backends.base import Backend
from embedq.backends.fake import FakeBackend
from embedq.cli import main
from embedq.workers import hooks

MARKER = "FAIL_IN_MODEL"
FAULT_MARKER = "FAULT_IN_MODEL"


class InjectedDeath(BaseException):
    """Escapes every ``except Exception`` of the service: the thread that raises it dies."""


HOLD_AT = 20  # of MiniLM's 54 points: inside the fourth of its six layers


def _mark(prepared, items) -> None:
    for item, text in zip(getattr(prepared, "items", ()), items):
        item.fails = isinstance(text, str) and MARKER in text
        item.fault = isinstance(text, str) and FAULT_MARKER in text


def _marking(cls: type[Backend]) -> None:
    """``cls``'s prepare and forward with the markers (the real model's backend and the fake one alike)."""
    prepare, prepare_many, forward = cls.prepare, cls.prepare_many, cls.forward

    def prepare_marked(self, kind, items, options):
        prepared = prepare(self, kind, items, options)
        _mark(prepared, items)
        return prepared

    def prepare_many_marked(self, kind, jobs):
        out = prepare_many(self, kind, jobs)
        for (items, _), prepared in zip(jobs, out):
            _mark(prepared, items)
        return out

    def forward_or_fail(self, batch):
        fault = os.environ.get("EMBEDQ_TEST_FAULT")
        if fault and any(getattr(item, "fault", False) for item in batch):
            if fault == "stall":
                threading.Event().wait()
            raise InjectedDeath("injected death of the inference thread (FAULT_IN_MODEL)")
        if any(getattr(item, "fails", False) for item in batch):
            raise RuntimeError("injected failure (FAIL_IN_MODEL)")
        return forward(self, batch)

    cls.prepare, cls.prepare_many, cls.forward = prepare_marked, prepare_many_marked, forward_or_fail


class Controls(hooks.ServiceHooks):
    """The gate and the hold, through the worker's public seams (embedq/workers/hooks.py)."""

    def before_pick(self, service):
        # Under the lock, before any micro-batch is picked: a batch, a crash suspect's run alone, an online batch at
        # a preemption point. Waiting on the service's condition lets jobs arrive meanwhile.
        key = os.environ.get("EMBEDQ_TEST_GATE")
        if not key:
            return
        while _closed(key) and not service.stopping:
            service.wait_locked(0.01)

    def at_point(self, service, point):
        key = os.environ.get("EMBEDQ_TEST_HOLD")
        if not key or point != HOLD_AT:
            return
        redis = _redis()
        if not redis.exists(key):
            return
        redis.set(f"{key}:held", point)
        while redis.exists(key) and not service.stopping:
            service.preempt()
            time.sleep(0.005)


def _closed(key: str) -> bool:
    """Is the gate ``key`` closed to the next micro-batch? A pass (``INCR <key>:pass``) lets one through. While the
    broker is away (a test restarts it) the gate stays closed; the restarted broker has no key: it is open."""
    import redis as redis_py

    client = _redis()
    try:
        if not client.exists(key):
            return False
        if int(client.get(f"{key}:pass") or 0) > 0:  # a test let one micro-batch through
            client.decr(f"{key}:pass")
            return False
        return True
    except redis_py.ConnectionError:
        return True


@functools.cache
def _redis():  # one client for the process: the hold asks at every bulk micro-batch's HOLD_AT-th point
    import redis

    return redis.Redis.from_url(os.environ["EMBEDQ_BROKER_URL"])


def _gated_load(load):
    @functools.wraps(load)
    def gated(*args, **kwargs):
        key = os.environ.get("EMBEDQ_TEST_LOAD_GATE")
        while key and _redis().exists(key):
            time.sleep(0.05)
        return load(*args, **kwargs)

    return gated


_marking(model.ModelBackend)
_marking(FakeBackend)
hooks.install(Controls())
embedq.backends.load_backend = _gated_load(embedq.backends.load_backend)  # the worker imports it when it loads

if __name__ == "__main__":
    sys.exit(main(["worker"]))
