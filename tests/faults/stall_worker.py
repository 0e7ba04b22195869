"""A real ``embedq worker`` whose results thread or canvas thread hangs on chosen jobs, for the watchdog's tests
(tests/faults/test_hostile_canvas.py).

A job whose id starts with ``hang-results-`` hangs the results thread while it stores the job's record; one whose id
starts with ``hang-canvas-`` hangs the canvas thread while it sends the job's canvas work. Nothing else differs
from ``python -m embedq worker``.
"""

from __future__ import annotations

import sys
import threading

from embedq.cli import main
from embedq.results import ResultStore
from embedq.workers import canvas

_store_many, _dispatch = ResultStore.store_many, canvas.dispatch
_never = threading.Event()


def _store_many_or_hang(self, outcomes, *args, **kwargs):
    if any(isinstance(job_id, str) and job_id.startswith("hang-results-") for job_id, _ in outcomes):
        _never.wait()
    return _store_many(self, outcomes, *args, **kwargs)


def _dispatch_or_hang(app, work, outcome, sending):
    if str(work.request.id).startswith("hang-canvas-"):
        _never.wait()
    return _dispatch(app, work, outcome, sending)


ResultStore.store_many, canvas.dispatch = _store_many_or_hang, _dispatch_or_hang

if __name__ == "__main__":
    sys.exit(main(["worker"]))
