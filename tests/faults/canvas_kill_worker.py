"""A real ``embedq worker`` that SIGKILLs itself between storing a job's result and acknowledging its message.

Fault injection for tests/test_canvas.py, chosen by the job's id: ``kill-stored-*`` dies right after the result is
stored (the job's canvas work not yet sent: its pending marker is set), ``kill-sent-*`` right after the canvas work
was sent and its marker deleted (the message still unacknowledged). Either way the message is redelivered, found
stored, and the test checks that the job's callback ran exactly once. Each job kills a worker once (a Redis key says
it did), so the restarted worker runs whatever it does with the redelivered job. Nothing else differs from
``python -m embedq worker``.
"""

from __future__ import annotations

import os
import signal
import sys

import redis

from embedq.cli import main
from embedq.results import ResultStore

_store_many, _canvas_sent = ResultStore.store_many, ResultStore.canvas_sent


def _die_if(job_ids: object, prefix: str) -> None:
    for job_id in job_ids:  # type: ignore[union-attr]
        if isinstance(job_id, str) and job_id.startswith(prefix) and redis.Redis.from_url(
                os.environ["EMBEDQ_BROKER_URL"]).set(f"killed.{job_id}", 1, nx=True):
            os.kill(os.getpid(), signal.SIGKILL)


def _store_many_then_die(self, outcomes, *args, **kwargs):
    written = _store_many(self, outcomes, *args, **kwargs)
    _die_if([job_id for job_id, _ in outcomes], "kill-stored-")
    return written


def _canvas_sent_then_die(self, job_ids):
    _canvas_sent(self, job_ids)
    _die_if(job_ids, "kill-sent-")


ResultStore.store_many, ResultStore.canvas_sent = _store_many_then_die, _canvas_sent_then_die

if __name__ == "__main__":
    sys.exit(main(["worker"]))
