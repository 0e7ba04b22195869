"""The producer API: ``Client.embed`` (blocking) and ``Client.submit`` (a :class:`JobHandle`).

A job is an ordinary Celery task message, so ``app.send_task("embedq.embed", args=[texts],
kwargs=options)`` from any Celery client works too; this class adds validation at the edge and
decoding of the compact result.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout

from embedq import errors
from embedq.protocol import TASK_NAME, EmbedOptions, Fingerprint, decode_result, validate_texts
from embedq.settings import Settings
from embedq.workers.app import DEFAULT_RESULT_TIMEOUT, make_app

#: What a call to the broker raises while Redis is down or restarting (kombu, redis-py or the socket).
BROKER_ERRORS = (OperationalError, RedisConnectionError, RedisTimeout, OSError)


class JobHandle:
    """A submitted job: its id, its state, and its result once the worker stored it.

    Once collected, the outcome (vectors or typed error) stays on the handle, so reading it again, or
    asking its status after the stored copy was deleted from Redis, answers at once.
    """

    def __init__(self, result: AsyncResult) -> None:
        self._result = result
        self._payload: dict[str, Any] | None = None
        self._error: errors.EmbedqError | None = None
        self.fingerprint: Fingerprint | None = None
        self.usage: dict[str, int] | None = None

    @property
    def id(self) -> str:
        return self._result.id

    @property
    def _collected(self) -> bool:
        return self._payload is not None or self._error is not None

    def status(self) -> str:
        """Celery's state: PENDING (queued or buffered), SUCCESS or FAILURE."""
        if self._collected:
            return "FAILURE" if self._error is not None else "SUCCESS"
        return self._result.state

    def ready(self) -> bool:
        return self._collected or self._result.ready()

    def payload(self, timeout: float | None = DEFAULT_RESULT_TIMEOUT) -> dict[str, Any]:
        """The raw result dict, or the job's typed :class:`~embedq.errors.EmbedqError`."""
        if self._error is not None:
            raise self._error
        if self._payload is None:
            try:
                self._payload = self._result.get(timeout=timeout, propagate=True, disable_sync_subtasks=False)
            except CeleryTimeout:
                raise errors.JobTimeout(f"job {self.id} has no result after {timeout}s") from None
            except errors.EmbedqError as exc:
                self._error = exc
                raise
        return self._payload

    def result(self, timeout: float | None = DEFAULT_RESULT_TIMEOUT, *, forget: bool = True) -> np.ndarray:
        """Block for the vectors (float32, one row per input, input order).

        With ``forget`` (the default) the stored result is deleted from Redis once read.
        """
        try:
            payload = self.payload(timeout)
        finally:
            if forget and self._collected:
                self._result.forget()
        vectors, self.fingerprint = decode_result(payload)
        self.usage = payload.get("usage")
        return vectors

    def forget(self) -> None:
        self._result.forget()


def worker_stats(app: Celery, timeout: float = 1.0) -> dict[str, dict[str, Any]]:
    """Counters of every live embedq worker (Celery remote control ``embedq_stats``), by node name."""
    replies = app.control.broadcast("embedq_stats", reply=True, timeout=timeout) or []
    return {node: stats for reply in replies for node, stats in reply.items()}


class Client:
    """Send embedding jobs to embedq workers and collect their results."""

    def __init__(self, settings: Settings | None = None, *, broker_url: str | None = None,
                 app: Celery | None = None) -> None:
        settings = settings or Settings()
        if broker_url is not None:
            settings = settings.model_copy(update={"broker_url": broker_url})
        self.settings = settings
        self.app = app or make_app(settings)

    def submit(self, texts: str | Sequence[str], *, queue: str | None = None, **options: Any) -> JobHandle:
        """Validate and enqueue one job; returns at once."""
        texts = validate_texts(
            texts, max_texts=self.settings.max_texts_per_job, max_chars=self.settings.max_chars
        )
        opts = EmbedOptions.parse(options)
        result = self.app.send_task(
            TASK_NAME, args=[texts], kwargs=opts.wire(), queue=queue or self.settings.queue_name,
            task_id=str(uuid.uuid4()),
        )
        return JobHandle(result)

    def embed(self, texts: str | Sequence[str], *, timeout: float | None = DEFAULT_RESULT_TIMEOUT,
              **options: Any) -> np.ndarray:
        """Embed texts and wait: a ``(len(texts), dim)`` float32 array in input order."""
        return self.submit(texts, **options).result(timeout)

    def workers(self, timeout: float = 1.0) -> dict[str, dict[str, Any]]:
        """Live workers and their counters, by Celery node name."""
        return worker_stats(self.app, timeout)

    def close(self) -> None:
        self.app.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
