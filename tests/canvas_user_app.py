"""A user's own Celery app, as a Celery user writes it, for tests/test_canvas.py: a plain Celery worker
(``celery -A canvas_user_app worker -P solo``) runs its tasks beside an embedq worker, on the same Redis.

``user.store`` records what it was called with (a callback gets a job's result as its first argument) and
``user.failed`` what an old-style errback gets (the failed task's id), each under a Redis list the test reads.
"""

from __future__ import annotations

import json
import os

import redis
from celery import Celery

RECORDS = "user.records.{}"  # one list per tag: the JSON of each call's first argument


def make_app(url: str, embedq_queue: str | None = None) -> Celery:
    app = Celery("user", broker=url, backend=url, set_as_current=False)
    # embedq's jobs are sent to embedq's queue by name; the user's own tasks go wherever the user routes them
    app.conf.update(task_routes={"embedq.*": {"queue": embedq_queue}} if embedq_queue else {},
                    task_acks_late=True,  # in flight shows in kombu's unacked hash until the task is done
                    worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)

    @app.task(name="user.store", shared=False)
    def store(payload, tag):
        redis.Redis.from_url(url).rpush(RECORDS.format(tag), json.dumps(payload))
        return len(payload) if isinstance(payload, list) else payload["usage"]["texts"]

    @app.task(name="user.failed", shared=False)
    def failed(task_id, tag):
        redis.Redis.from_url(url).rpush(RECORDS.format(tag), json.dumps(task_id))

    return app


app = make_app(os.environ.get("USER_BROKER_URL", "redis://127.0.0.1:1/0"))
