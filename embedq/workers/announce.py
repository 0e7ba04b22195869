"""A worker's record in the live-worker registry from the moment its process starts (issue 51, item 3).

Loading a model can take minutes on a first start (an ONNX export, the runtime measurements, a large model, a busy
machine). Until it is loaded the worker's own reporter (:class:`~embedq.workers.metrics.Reporter`, started with Celery)
has nothing to say, and a producer started together with it (``docker compose up``, a job beside a new pod) found no
worker and gave up. :class:`Announcer` publishes ``{"state": "starting", "ready": false, queues, model}`` under the
worker's node name every :data:`~embedq.monitor.REPORT_INTERVAL` seconds while the model loads; the reporter then
overwrites the same key. A worker whose model cannot load withdraws it, so that nobody waits for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from embedq import monitor
from embedq.broker import redis_client
from embedq.settings import Settings
from embedq.version import __version__

log = logging.getLogger(__name__)


def node_name(name: str) -> str:
    """The node name Celery gives a worker started with ``--hostname=name`` (``%h`` and friends expanded)."""
    from celery.utils.nodenames import default_nodename, host_format

    return host_format(default_nodename(name))


class Announcer(threading.Thread):
    """Publishes this process's "starting" record until :meth:`loaded` or :meth:`failed` (a daemon thread: a Redis
    that does not answer never holds the start up)."""

    def __init__(self, settings: Settings, hostname: str) -> None:
        super().__init__(name="embedq-announcer", daemon=True)
        self.settings = settings
        self.hostname = hostname
        self.started_at = time.time()
        self._stop_event = threading.Event()
        self._redis: Any = None

    def record(self) -> dict[str, Any]:
        settings = self.settings
        return {"hostname": self.hostname, "pid": os.getpid(), "started_at": self.started_at,
                "reported_at": time.time(), "ready": False, "state": monitor.STARTING, "version": __version__,
                "queues": settings.queues, "model": settings.model, "device": settings.device}

    def run(self) -> None:
        while True:
            try:
                if self._redis is None:
                    self._redis = redis_client(self.settings, timeout=2.0)
                if not self._stop_event.is_set():
                    monitor.publish_worker(self._redis, self.record())
            except Exception as exc:  # Redis away: producers see no worker until it is back
                log.debug("could not announce the starting worker: %s", type(exc).__name__)
            if self._stop_event.wait(monitor.REPORT_INTERVAL):
                return

    def start(self) -> Announcer:
        if self.settings.broker_url:
            super().start()
        return self

    def loaded(self) -> None:
        """The model is loaded: stop announcing (the record stands until the worker's reporter overwrites it)."""
        self._end()

    def failed(self) -> None:
        """The model cannot load: the worker exits, and its record goes with it."""
        self._end()
        if self.settings.broker_url:
            try:
                monitor.withdraw_worker(self._redis or redis_client(self.settings, timeout=2.0), self.hostname)
            except Exception:
                log.debug("could not withdraw the starting worker's record")

    def _end(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5)  # a publish in progress must not put the record back after a withdrawal
