"""``embedq worker``: one Celery worker process per device."""

from __future__ import annotations

import logging
import os
import socket

from embedq.broker import make_app
from embedq.settings import Settings
from embedq.workers import consumer, memory, observe, refused, tasks
from embedq.workers.announce import announce, node_name
from embedq.workers.replicas import REPLICA_NAME_ENV


def default_hostname(settings: Settings) -> str:
    """The Celery node name of a worker started without ``--hostname``."""
    return f"embedq-{settings.device.replace(':', '')}-{os.getpid()}@{socket.gethostname()}"


def _node(settings: Settings, hostname: str | None) -> str:
    """The ``--hostname`` this process's worker runs with: a replica's supervisor names it (it runs the supervisor's
    command line, --hostname included), else the one given, else :func:`default_hostname`."""
    return os.environ.get(REPLICA_NAME_ENV) or hostname or default_hostname(settings)


def worker_argv(settings: Settings, *, hostname: str | None = None, loglevel: str = "INFO") -> list[str]:
    name = _node(settings, hostname)
    return [
        "worker",
        # No forking: CUDA must never be initialised before a fork, and the model lives in this
        # process. Messages never reach the pool anyway (see consumer.coalescing_strategy).
        "--pool=solo",
        "--concurrency=1",
        f"--queues={','.join(settings.queues)}",  # online first
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
    memory.configure(settings.memory_policy)  # before torch is imported
    refused.check_login(settings)  # a wrong user or password ends here, before the model loads
    announcer = announce(settings, node_name(_node(settings, hostname)))  # "starting" while the model loads
    worker = consumer.Worker(settings)
    try:
        worker.load_service()  # fail fast (non-zero exit) on a model that cannot load
    except BaseException:
        if announcer is not None:
            announcer.withdraw()
        raise
    if announcer is not None:
        announcer.stop()
    observe.serve_metrics(worker)  # and on a metrics port that is taken
    app = make_app(settings)
    tasks.register(app, worker)
    app.worker_main(worker_argv(settings, hostname=hostname, loglevel=loglevel))
    if refused.was_refused():
        raise SystemExit(refused.EXIT_STATUS)
