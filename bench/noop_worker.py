"""Floor for bench/pipeline.py: a plain Celery worker running a task that does nothing.

What one message costs a worker on its own (fetch, decode, run, store the result, ack) with Celery's
defaults, json and a prefetch window that keeps the solo worker fed. Started by the benchmark as
``celery -A bench.noop_worker worker --pool=solo`` against a private Redis (``NOOP_BROKER_URL``).
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("noop", broker=os.environ["NOOP_BROKER_URL"], backend=os.environ["NOOP_BROKER_URL"])
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                # Celery's default is 4 messages per process; a solo worker fed 4 at a time waits on the
                # broker between batches, which would make the floor slower than plain Celery need be.
                worker_prefetch_multiplier=int(os.environ.get("NOOP_PREFETCH", "64")),
                worker_hijack_root_logger=False)


@app.task(name="noop.noop")
def noop() -> None:
    return None
