"""How embedq reaches Redis beyond its URL: TLS, Redis Sentinel, and how many replicas a write must reach.

:class:`RedisSettings` is the part of :class:`embedq.settings.Settings` (its base) that says it; every field is set as
``EMBEDQ_<FIELD>`` like the others. :class:`NoReplicas` and :class:`CannotPersist` name a primary's refusals to
write for want of replicas in sync and for a failing disk. It imports nothing of embedq.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis._parsers.base import BaseParser
from redis.exceptions import OutOfMemoryError, ResponseError

log = logging.getLogger(__name__)


class NoReplicas(ResponseError):
    """``NOREPLICAS``: the primary refuses writes while fewer replicas than its ``min-replicas-to-write`` are in sync
    (a replica down, or a failover in progress): a passing state, tried again like an outage."""


class CannotPersist(ResponseError):
    """``MISCONF``: Redis refuses writes because its last snapshot failed (``stop-writes-on-bgsave-error``: a full
    or failing disk): a passing state once the disk is mended, tried again like an outage."""


# redis-py raises a plain ResponseError for a reply it has no class for; these are named, so that they can be caught
# with the outages (a write refused by a demoted primary, READONLY, and one refused at maxmemory, OOM, already are).
BaseParser.EXCEPTION_CLASSES.setdefault("NOREPLICAS", NoReplicas)
BaseParser.EXCEPTION_CLASSES.setdefault("MISCONF", CannotPersist)

#: A script's refused write as Redis 6 words it inside the script's error (``Error running script ... -OOM ...``),
#: which no reply class names: the class it is raised as (:func:`named`).
_WRAPPED: tuple[tuple[str, type[ResponseError]], ...] = (
    ("NOREPLICAS", NoReplicas), ("-OOM command not allowed", OutOfMemoryError), ("-MISCONF", CannotPersist))


def named(exc: ResponseError) -> ResponseError:
    """``exc``, or the class of the passing refusal it wraps (:data:`_WRAPPED`): Redis 6 wraps a script's write
    refused for want of replicas, at maxmemory or for a failing disk in the script's error."""
    for marker, cls in _WRAPPED:
        if not isinstance(exc, cls) and marker in str(exc):
            return cls(str(exc))
    return exc


class RedisSettings(BaseSettings):
    """TLS, Sentinel and replica acknowledgements (the URLs themselves are :class:`~embedq.settings.Settings`')."""

    model_config = SettingsConfigDict(env_prefix="EMBEDQ_", extra="ignore", protected_namespaces=())

    tls_ca_file: str | None = Field(default=None, description="CA bundle for rediss:// URLs.")
    tls_cert_file: str | None = Field(default=None, description="Client certificate for rediss:// (mutual TLS).")
    tls_key_file: str | None = Field(default=None, description="Client key for rediss:// (mutual TLS).")
    tls_cert_reqs: Literal["required", "optional", "none"] = Field(
        default="required", description="Verify the Redis server's certificate (rediss://, or sentinel_tls).",
    )
    # -- Redis Sentinel (embedq/sentinel.py)
    sentinel_master: str | None = Field(
        default=None, min_length=1, description="With sentinel:// URLs: the name Sentinel watches the primary "
        "under (`sentinel monitor <name> ...`); every Redis client resolves the primary through the sentinels.",
    )
    sentinel_username: str | None = Field(default=None, description="The sentinels' own ACL user (the URL's "
                                          "user and password are the Redis servers', as in Celery).")
    sentinel_password: SecretStr | None = Field(default=None, description="The sentinels' own password "
                                                "(`requirepass` in sentinel.conf).")
    sentinel_tls: bool = Field(default=False, description="The sentinels and the Redis servers they name speak TLS "
                               "(the tls_* settings apply to both).")
    # -- replication (docs/OPERATIONS.md, Redis Sentinel: what a failover can lose)
    replica_acks: int = Field(
        default=0, ge=0, le=16, description="Replicas a job's message must reach (Redis WAIT) before a producer's "
        "submit returns its id, and a job's result before the worker acknowledges its message; fewer within "
        "replica_ack_timeout is logged (a warning), not refused. 0: off (a failover can then lose the last writes "
        "the old primary acknowledged: waiting producers send those jobs again).",
    )
    replica_ack_timeout: float = Field(
        default=1.0, gt=0, le=60, description="Seconds a write waits for replica_acks replicas at most.",
    )

    def replica_wait(self) -> tuple[str, int, int] | None:
        """The ``WAIT`` command a pipeline of writes ends with when :attr:`replica_acks` asks for replicas (None: it
        does not). ``WAIT`` covers the writes of the connection it is sent on, so it goes in the same pipeline."""
        if not self.replica_acks:
            return None
        return ("WAIT", self.replica_acks, max(1, int(self.replica_ack_timeout * 1000)))

    def replicated(self, reached: Any, what: str) -> None:
        """Log writes that reached fewer replicas than :attr:`replica_acks` (``reached``: ``WAIT``'s reply)."""
        if int(reached) < self.replica_acks:
            log.warning("%s reached %s of %d replicas within %.1f s: a failover now could lose them (replica_acks)",
                        what, reached, self.replica_acks, self.replica_ack_timeout)
