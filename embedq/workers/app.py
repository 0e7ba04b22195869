"""The Celery application, shared by producers (to send) and workers (to consume).

Importing this module imports Celery but never torch: the embedding task is registered by name
and only a worker process loads a model.
"""

from __future__ import annotations

from celery import Celery

from embedq.protocol import TASK_NAME
from embedq.settings import Settings

#: Seconds a result may take before a producer's blocking call gives up (``Client.embed``).
DEFAULT_RESULT_TIMEOUT = 600.0


def celery_config(settings: Settings) -> dict[str, object]:
    broker = settings.broker_url
    if broker is None:
        raise ValueError("no broker configured: set EMBEDQ_BROKER_URL (or use the CLI's embedded default)")
    transport_options = {
        # A buffered message must never be redelivered while this worker still holds it: the
        # prefetch window is bounded (prefetch_window) and a full window drains in far less
        # than this. See docs/ARCHITECTURE.md.
        "visibility_timeout": settings.visibility_timeout,
    }
    return {
        "broker_url": broker,
        "result_backend": settings.result_url,
        "broker_transport_options": transport_options,
        "result_backend_transport_options": {"retry_policy": {"timeout": 5.0}},
        "broker_connection_retry_on_startup": True,
        "task_serializer": settings.serializer,
        "result_serializer": settings.serializer,
        "accept_content": ["json", "msgpack"],
        "result_accept_content": ["json", "msgpack"],
        "result_expires": settings.result_ttl,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_default_queue": settings.queue_name,
        "task_routes": {TASK_NAME: {"queue": settings.queue_name}},
        "worker_prefetch_multiplier": settings.prefetch_window,
        "worker_send_task_events": True,
        "task_send_sent_event": False,
        "worker_hijack_root_logger": False,
        "broker_channel_error_retry": True,
    }


def make_app(settings: Settings, *, name: str = "embedq") -> Celery:
    app = Celery(name, set_as_current=False)
    app.conf.update(celery_config(settings))
    return app
