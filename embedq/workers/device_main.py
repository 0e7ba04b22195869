"""The device process of the split layout (embedq/workers/split.py): ``python -m embedq.workers.device_main``, started
by the supervisor with ``EMBEDQ_DEVICE_SOCKET`` and the worker's settings in its environment.

It loads the model (:func:`~embedq.workers.loading.load_model`, as any worker), serves its own Prometheus metrics
(the micro-batch counters and histograms, which its hosts export at 0: sums over every target add up; the port as a
worker picks one, or ``EMBEDQ_METRICS_PORT`` as the supervisor sets it), runs one
:class:`~embedq.workers.device.DeviceService` (an ``EmbeddingService`` whose outbox sends rows back), listens on the
Unix socket and takes every host that connects (:class:`~embedq.workers.device.HostLink`). Its watchdog looks every
second: a dead or stalled inference thread exits with status 70 (the supervisor restarts it; the hosts see EOF and
hand their messages back). SIGTERM or SIGINT: the micro-batch in progress finishes, its rows go back, and it exits 0.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from multiprocessing.connection import Listener
from typing import Any

import numpy as np

from embedq.settings import Settings
from embedq.workers import memory
from embedq.workers.channel import NONE, STATS, Channel
from embedq.workers.device import DeviceService, HostLink
from embedq.workers.loading import load_model
from embedq.workers.metrics import WorkerMetrics
from embedq.workers.observe import serve_endpoint
from embedq.workers.split import DEVICE_SOCKET_ENV
from embedq.workers.stats import MODEL_COUNTERS
from embedq.workers.stopping import EXIT_FAILED, LIVENESS_INTERVAL

log = logging.getLogger("embedq.workers.device")

#: The device process's counters its hosts show (STATS, once a second): what only the device knows (what it exports to
#: Prometheus, stats.MODEL_COUNTERS, with its timers and padding).
DEVICE_COUNTERS = (*MODEL_COUNTERS, "inference_seconds", "online_wait_seconds", "bulk_paused_seconds",
                   "model_cpu_seconds", "padding_ratio")


def serve(settings: Settings, path: str, stop: threading.Event) -> int:
    """Load the model, listen at ``path`` and serve the hosts that connect until ``stop`` is set; the exit status."""
    memory.configure(settings.memory_policy)  # before torch is imported
    backend, policy, seconds = load_model(settings)
    metrics = WorkerMetrics(device_process=True)
    metrics.model_load_seconds = seconds
    service = DeviceService(backend, settings, memory_policy=policy, metrics=metrics).start()
    metrics.bind(service, window_state=dict, queues=[], redis=None)
    serve_endpoint(metrics, settings, "embedq device process")
    listener = Listener(path, family="AF_UNIX")
    links: list[HostLink] = []

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:  # closed: stopping
                return
            try:
                link = HostLink(len(links), Channel(conn), service).start()
            except Exception:  # a peer that is not a host (or died at once): it is not served, the others are
                log.exception("a host could not be taken")
                conn.close()
                continue
            links.append(link)
            log.info("host %d connected (pid %d)", link.number, link.pid)

    threading.Thread(target=accept, name="embedq-device-accept", daemon=True).start()
    log.info("device process ready: listening at %s", path)
    while not stop.wait(LIVENESS_INTERVAL):
        reason = service.health(settings.stall_timeout)
        if reason is not None:
            log.critical("stopping: %s; exiting with status %d", reason, EXIT_FAILED)
            logging.shutdown()
            os._exit(EXIT_FAILED)  # the inference thread may be stuck in native code: nothing would join it
        metrics.hosts = sum(not link.gone.is_set() for link in links)
        metrics.rates.sample(service.stats)
        counters = json.dumps({"pid": os.getpid(), "device": settings.device, "hosts": len(links),
                               **{k: v for k, v in service.stats.snapshot().items() if k in DEVICE_COUNTERS}})
        for link in list(links):
            link.send(STATS, np.zeros(0, NONE), counters.encode())
    listener.close()
    service.stop(settings.shutdown_timeout)
    for link in links:
        link.close()
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = os.environ.get(DEVICE_SOCKET_ENV)
    if not path:
        print(f"embedq device process: {DEVICE_SOCKET_ENV} is not set (embedq worker --device-process starts it)",
              file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return serve(Settings(), path, stop)


if __name__ == "__main__":
    sys.exit(main())
