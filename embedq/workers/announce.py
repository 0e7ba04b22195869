"""A worker's record in the live-worker registry from the moment its process starts (issue 51, item 3).

Loading a model can take minutes on a first start (an ONNX export, the runtime measurements, a large model, a busy
machine). Until it is loaded the worker's reporter (:class:`~embedq.workers.metrics.Reporter`, started with Celery)
has nothing to say, and a producer started together with it (``docker compose up``, a job beside a new pod) found no
worker and gave up. :func:`announce` starts a reporter of its own that publishes ``{"state": "starting", "ready":
false, queues, model}`` under the worker's node name while the model loads; the worker's reporter then overwrites the
same key. A worker whose model cannot load withdraws it, so that nobody waits for it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from embedq import monitor
from embedq.broker import redis_client
from embedq.settings import Settings
from embedq.version import __version__
from embedq.workers.metrics import Reporter


def node_name(name: str) -> str:
    """The node name Celery gives a worker started with ``--hostname=name`` (``%h`` and friends expanded)."""
    from celery.utils.nodenames import default_nodename, host_format

    return host_format(default_nodename(name))


def starting_record(settings: Settings, hostname: str, started_at: float) -> dict[str, Any]:
    """The registry record of a worker whose model is loading."""
    return {"hostname": hostname, "pid": os.getpid(), "started_at": started_at, "reported_at": time.time(),
            "ready": False, "state": monitor.STARTING, "version": __version__, "queues": settings.queues,
            "model": settings.model, "device": settings.device}


def announce(settings: Settings, hostname: str) -> Reporter | None:
    """A started reporter of the "starting" record (None without a broker URL): ``stop()`` it once the model is
    loaded (the record stands until the worker's reporter replaces it), ``withdraw()`` it when the model cannot load.
    A daemon thread: a Redis that does not answer never holds the start up."""
    if not settings.broker_url:
        return None
    started_at = time.time()
    reporter = Reporter(lambda: starting_record(settings, hostname, started_at), None,
                        redis_client(settings, timeout=2.0))
    reporter.start()
    return reporter
