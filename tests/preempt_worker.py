"""A real ``embedq worker`` whose model fails (a RuntimeError in the forward pass, as a kernel error would) on
any micro-batch holding a text that contains ``FAIL_IN_MODEL``.

Fault injection for tests/test_preempt.py: the failure happens inside a preemption, so the test can show that a
failing online micro-batch fails only its own job and the paused bulk micro-batch resumes. Nothing else differs
from ``python -m embedq worker``.
"""

from __future__ import annotations

import sys

from embedq.backends import model
from embedq.producers.cli import main

MARKER = "FAIL_IN_MODEL"
_prepare, _forward = model.ModelBackend.prepare, model.ModelBackend.forward


def _prepare_marked(self, kind, items, options):
    prepared = _prepare(self, kind, items, options)
    for item, text in zip(prepared.items, items):
        item.fails = isinstance(text, str) and MARKER in text
    return prepared


def _forward_or_fail(self, batch):
    if any(getattr(item, "fails", False) for item in batch):
        raise RuntimeError("injected failure (FAIL_IN_MODEL)")
    return _forward(self, batch)


model.ModelBackend.prepare, model.ModelBackend.forward = _prepare_marked, _forward_or_fail

if __name__ == "__main__":
    sys.exit(main(["worker"]))
