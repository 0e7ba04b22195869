"""What producers and workers share about the broker: the Celery app, the one Redis client builder,
the errors a broker call raises, and the Redis keys both sides read.

Producers import this module, never ``embedq.workers``. Importing it imports Celery and redis-py but
never torch: the job tasks are registered by name and only a worker process loads a model.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeout

from embedq import errors
from embedq.connection import CannotPersist, NoReplicas
from embedq.kinds import TASKS, load_plugins
from embedq.sentinel import SCHEME as SENTINEL_SCHEME
from embedq.sentinel import is_sentinel
from embedq.sentinel import parse as parse_sentinel
from embedq.settings import Settings

_FAILOVER = " ({exc}): a failover in progress, or fewer replicas in sync than its min-replicas-to-write; try again"
#: Writes a Redis refuses for a passing reason, and what :func:`unavailable` says of each after "refused the write":
#: it is a replica now (READONLY: a failover), fewer replicas than its min-replicas-to-write are in sync
#: (NOREPLICAS), it is at its maxmemory with nothing to evict (OOM: the noeviction a broker needs), its last snapshot
#: failed (MISCONF: a full disk). Tried again like an outage.
REFUSED_FOR_NOW: dict[type[Exception], str] = {
    ReadOnlyError: _FAILOVER,
    NoReplicas: _FAILOVER,
    OutOfMemoryError: ": it is at its maxmemory ({exc}); try again once results expire or are collected, or after its "
                      "operator raises maxmemory",
    CannotPersist: ": it cannot save to disk ({exc}); try again once its operator mends the disk",
}
#: What a call to the broker raises while Redis is down, restarting or failing over (kombu, redis-py or the socket),
#: or refuses writes for now (:data:`REFUSED_FOR_NOW`).
BROKER_ERRORS = (OperationalError, RedisConnectionError, RedisTimeout, OSError, errors.BrokerUnavailable,
                 *REFUSED_FOR_NOW)
#: Seconds a connection of the gateway's asyncio pool waits to connect to a sentinel or the primary.
POOL_SOCKET_TIMEOUT = 5.0


def lease_interval(settings: Settings) -> float:
    """Seconds between a worker's renewals of the messages it holds (see workers/delivery.py)."""
    return max(settings.visibility_timeout / 4, 1.0)


def safe_url(url: str | None) -> str:
    """``url`` with its passwords masked (every address of a ``sentinel://`` URL), for messages and logs."""
    from kombu.utils.url import maybe_sanitize_url

    return ";".join(maybe_sanitize_url(part) for part in (url or "").split(";"))


def unavailable(exc: BaseException, url: str | None) -> errors.BrokerUnavailable:
    """The typed error of a broker call that failed with ``exc``, one of :data:`BROKER_ERRORS` (retryable)."""
    for refused, why in REFUSED_FOR_NOW.items():
        if isinstance(exc, refused):
            return errors.BrokerUnavailable(f"the broker at {safe_url(url)} refused the write"
                                            + why.format(exc=str(exc)[:120]))
    return errors.BrokerUnavailable(f"cannot reach the broker at {safe_url(url)}: {type(exc).__name__}: "
                                    f"{str(exc)[:200]}")


def tls_options(settings: Settings, url: str | None = None) -> dict[str, object] | None:
    """redis-py's TLS arguments for ``url`` (default: the broker's): a ``rediss://`` URL, or a ``sentinel://`` one
    with ``sentinel_tls``; None for plain Redis."""
    import ssl

    url = settings.broker_url if url is None else url
    if not ((url or "").startswith("rediss://") or (is_sentinel(url) and settings.sentinel_tls)):
        return None
    reqs = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
    out: dict[str, object] = {"ssl_cert_reqs": reqs[settings.tls_cert_reqs]}
    for key, value in (("ssl_ca_certs", settings.tls_ca_file), ("ssl_certfile", settings.tls_cert_file),
                       ("ssl_keyfile", settings.tls_key_file)):
        if value:
            out[key] = value
    return out


def sentinel_kwargs(settings: Settings, timeout: float | None = None) -> dict[str, object]:
    """redis-py's arguments of a connection to a sentinel itself: its own user and password, TLS, socket waits."""
    out: dict[str, object] = {}
    if timeout is not None:
        out.update(socket_timeout=timeout, socket_connect_timeout=timeout)
    if settings.sentinel_username:
        out["username"] = settings.sentinel_username
    if settings.sentinel_password is not None:
        out["password"] = settings.sentinel_password.get_secret_value()
    if settings.sentinel_tls:
        out.update(ssl=True, **(tls_options(settings, SENTINEL_SCHEME) or {}))
    return out


def sentinel_retry(*, asynchronous: bool = False) -> Any:
    """redis-py's retries of a connection to a primary found through Sentinel: after up to 0.1 s, 0.2 s, 0.4 s, each
    try asking the sentinels again. redis-py's default waits up to 1, 2 and 4 s between its tries: a process sleeping
    there while the replica was promoted reached the new primary seconds late (5 s, bench/failover.py)."""
    from redis.backoff import ExponentialWithJitterBackoff

    if asynchronous:
        from redis.asyncio.retry import Retry
    else:
        from redis.retry import Retry  # type: ignore[assignment]
    return Retry(ExponentialWithJitterBackoff(cap=0.4, base=0.1), 3)


def _primary_kwargs(settings: Settings, url: str, timeout: float, *,
                    asynchronous: bool = False) -> tuple[Any, dict[str, object]]:
    """The sentinels of ``url`` and redis-py's arguments of a connection to the primary they name."""
    if not settings.sentinel_master:
        raise ValueError("a sentinel:// URL needs the name of the primary: set EMBEDQ_SENTINEL_MASTER")
    spec = parse_sentinel(url)
    kwargs: dict[str, object] = {**spec.connection_kwargs(), "socket_timeout": timeout,
                                 "socket_connect_timeout": timeout,
                                 "retry": sentinel_retry(asynchronous=asynchronous)}
    tls = tls_options(settings, url)
    if tls is not None:
        kwargs.update(ssl=True, **tls)
    return spec.hosts, kwargs


def redis_client(settings: Settings, *, timeout: float = 5.0) -> Any:
    """A redis-py client for the broker, TLS options from the settings, with bounded socket waits: the one builder for
    every direct Redis use (producers' epoch, queue depths and cancellations; workers' metrics, registry and
    cancellation feed; ``embedq status``). With a ``sentinel://`` URL it is a client of the primary the sentinels name,
    asked again after a failover (a command on a dead or demoted primary raises a connection error; the next one
    reaches the new primary)."""
    import redis

    url = settings.broker_url
    if not url:
        raise ValueError("no broker configured: set EMBEDQ_BROKER_URL")
    if is_sentinel(url):
        from redis.sentinel import Sentinel

        hosts, kwargs = _primary_kwargs(settings, url, timeout)
        return Sentinel(hosts, sentinel_kwargs=sentinel_kwargs(settings, timeout), **kwargs).master_for(
            settings.sentinel_master)
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                **(tls_options(settings, url) or {}))


def async_redis_client(settings: Settings, url: str, *, max_connections: int, pool_wait: float) -> Any:
    """An asyncio redis-py client of ``url`` whose commands wait up to ``pool_wait`` s for one of its
    ``max_connections`` connections (the gateway's), resolving the primary through Sentinel for a ``sentinel://``
    URL."""
    import redis.asyncio as aioredis

    if is_sentinel(url):
        from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

        class BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
            """Sentinel's pool of the primary's connections, waiting for a free one as the plain pool does."""

        hosts, kwargs = _primary_kwargs(settings, url, POOL_SOCKET_TIMEOUT, asynchronous=True)
        kwargs.pop("socket_timeout")  # a pub/sub connection waits for messages as long as it takes
        return Sentinel(hosts, sentinel_kwargs=sentinel_kwargs(settings, POOL_SOCKET_TIMEOUT), **kwargs).master_for(
            settings.sentinel_master, connection_pool_class=BlockingSentinelPool, max_connections=max_connections,
            timeout=pool_wait)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=pool_wait,
                                                    **(tls_options(settings, url) or {}))
    return aioredis.Redis(connection_pool=pool)


class Routes:
    """Celery's router for embedq's app (``task_routes``): a job kind's task goes to the online queue, any other task
    (a user's callback or errback that a job's canvas sends, Celery's own ``celery.*`` tasks) to
    ``EMBEDQ_CALLBACK_QUEUE``, never to embedq's queues, whose workers refuse tasks that are not embedq kinds. A
    queue given with the task (``apply_async(queue=...)``, a signature's ``options``) wins over both; a worker sends
    a job's canvas only where ``EMBEDQ_CALLBACK_QUEUES`` allows it (``workers/canvas_rules.py``)."""

    def __init__(self, queue: str, callback_queue: str) -> None:
        self.queue = queue
        self.callback_queue = callback_queue

    def __call__(self, name: str, args: Any = None, kwargs: Any = None, options: Any = None, task: Any = None,
                 **_: Any) -> dict[str, str]:
        return {"queue": self.queue if name in TASKS else self.callback_queue}


def celery_config(settings: Settings) -> dict[str, object]:
    broker = settings.broker_url
    if broker is None:
        raise ValueError("no broker configured: set EMBEDQ_BROKER_URL (or use the CLI's embedded default)")
    transport_options = {
        # A message a worker holds is never redelivered while that worker lives: it renews the lease
        # (the unacked index's timestamp) every lease_interval. A dead worker's messages come back after
        # visibility_timeout; the restore sweep looks every lease_interval (kombu's default: 100 s).
        # See docs/OPERATIONS.md for the arithmetic.
        "visibility_timeout": settings.visibility_timeout,
        "unacked_restore_interval": lease_interval(settings),
        "unacked_restore_throttle": 1,
        # The sweep's lock outlives a worker killed while sweeping; kombu's 300 s would stall every restore
        # that long. Restores are transactions (WATCH unacked), so a shorter lock never restores twice.
        "unacked_mutex_expire": int(min(300, max(5, 2 * lease_interval(settings)))),
        # Fail a publish fast when Redis is gone instead of blocking a web request.
        "socket_connect_timeout": 5,
    }
    result_options: dict[str, object] = {"retry_policy": {"timeout": settings.broker_timeout}}
    sentinel = {"master_name": settings.sentinel_master, "sentinel_kwargs": sentinel_kwargs(settings, 5.0)}
    if is_sentinel(broker):
        transport_options.update(sentinel)
    if is_sentinel(settings.result_url):
        result_options.update(sentinel)
    config: dict[str, object] = {
        "broker_url": broker,
        "result_backend": settings.result_url,
        "broker_transport_options": transport_options,
        # How long a result write (worker) or a result subscription (producer) rides out a Redis restart
        # before it raises; the worker then retries the write itself, the producer polls.
        "result_backend_transport_options": result_options,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,  # a worker outlives any Redis restart
        "task_serializer": settings.serializer,
        "result_serializer": settings.serializer,
        # Never pickle: a pickle message is refused before it is decoded (workers/delivery.py records why).
        "accept_content": ["json", "msgpack"],
        "result_accept_content": ["json", "msgpack"],
        "result_expires": settings.result_ttl,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_default_queue": settings.queue_name,
        "task_routes": (Routes(settings.queue_name, settings.callback_queue),),
        "worker_prefetch_multiplier": settings.prefetch_window,
        "worker_send_task_events": True,
        "task_send_sent_event": False,
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,  # our jobs never reach the pool
        "broker_channel_error_retry": True,
        "worker_consumer": "embedq.workers.tasks:EmbedqConsumer",
    }
    tls = tls_options(settings)
    if tls is not None:
        config["broker_use_ssl"] = tls
    result_tls = tls_options(settings, settings.result_url)
    if result_tls is not None:
        config["redis_backend_use_ssl"] = result_tls
    return config


def make_app(settings: Settings, *, name: str = "embedq") -> Celery:
    load_plugins(settings.kind_plugins)  # before the routes: a plugin's kind is routed like the others
    app = Celery(name, set_as_current=False)
    app.conf.update(celery_config(settings))
    return app
