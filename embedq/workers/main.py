"""``embedq worker``: one Celery worker process per device."""

from __future__ import annotations

import logging
import os
import socket

from embedq.settings import Settings
from embedq.workers import consumer, transport
from embedq.workers.app import make_app


def worker_argv(settings: Settings, *, hostname: str | None = None, loglevel: str = "INFO") -> list[str]:
    name = hostname or f"embedq-{settings.device.replace(':', '')}-{os.getpid()}@{socket.gethostname()}"
    return [
        "worker",
        # No forking: CUDA must never be initialised before a fork, and the model lives in this
        # process. Messages never reach the pool anyway (see consumer.coalescing_strategy).
        "--pool=solo",
        "--concurrency=1",
        f"--queues={settings.queue_name}",
        f"--prefetch-multiplier={settings.prefetch_window}",
        f"--hostname={name}",
        f"--loglevel={loglevel}",
        "--task-events",
        "--without-gossip",
        "--without-mingle",
    ]


def run_worker(settings: Settings, *, hostname: str | None = None, loglevel: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, loglevel.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    transport.install()
    consumer.configure(settings)
    consumer.load_service()  # fail fast (non-zero exit) on a model that cannot load
    app = make_app(settings)
    consumer.register(app)
    app.worker_main(worker_argv(settings, hostname=hostname, loglevel=loglevel))
