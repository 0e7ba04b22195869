"""The one writer of a job's terminal record: every reader of a job id sees the same outcome.

A job ends once: with its result, or with a typed error (its own failure, a refusal, ``cancelled``,
``expired``, ``dead_letter``). Workers store outcomes on their results thread, refuse unreadable
messages on their consumer thread, and producers store ``cancelled`` when a user cancels; through
Celery's ``mark_as_done``/``mark_as_failure`` those writers could overwrite each other (a FAILURE is
overwritten by a later SUCCESS), so a job cancelled while it ran read as cancelled to one reader and as
a success to the next. :class:`ResultStore` writes the record Celery's Redis backend would write (same
key, same encoding, the same pub/sub notification, the backend's TTL) but only if the job has no record
yet, atomically in Redis: the first outcome wins, whoever wrote it.

A job with Celery canvas work (callbacks, errbacks, a chain, a chord) gets, in the same atomic step, a small
*pending* marker beside its record (:data:`~embedq.keys.CANVAS_KEY`, the record's TTL): its worker deletes it once
that work is sent (:meth:`ResultStore.canvas_sent`), so a worker killed in between leaves the marker, and the
redelivered message's worker sends the work instead (``workers/canvas.py``). A job without canvas work costs what it
did before: the same one script per job, with no marker.

Every reader of records reads them one way (:func:`record_key`, :func:`read_outcome`): ``Client.collect`` and
``JobHandle.result`` (``producers/collect.py``) and the gateway's asyncio waiter (``gateway/results.py``).
"""

from __future__ import annotations

from typing import Any

from celery import Celery, states
from redis.exceptions import ResponseError

from embedq import errors
from embedq.connection import RedisSettings, named
from embedq.keys import CANVAS_KEY

#: SET the record only if absent (with a TTL when one is given) and, if set, notify waiting readers. With a second
#: key, setting the record also sets that key (the job's canvas-pending marker), with the same TTL.
_STORE_ONCE = """
local done
if tonumber(ARGV[2]) > 0 then
  done = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
else
  done = redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
if done then
  if KEYS[2] then
    if tonumber(ARGV[2]) > 0 then
      redis.call('SET', KEYS[2], 1, 'EX', ARGV[2])
    else
      redis.call('SET', KEYS[2], 1)
    end
  end
  redis.call('PUBLISH', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


class ResultStore:
    """Terminal records of jobs, written once. Uses the app's (thread-local) result backend."""

    def __init__(self, app: Celery, settings: RedisSettings | None = None) -> None:
        """``settings``: with ``replica_acks``, each write of :meth:`store_many` waits for that many replicas."""
        self.app = app
        self.settings = settings

    def store(self, job_id: str, outcome: dict[str, Any] | errors.EmbedqError) -> bool:
        """Store ``outcome`` (a result payload or a typed error) unless the job already has one.

        Returns True if this call wrote the record, False if another outcome was there first. Raises the
        broker's errors when Redis cannot be reached (the caller decides whether to retry)."""
        return self.store_many([(job_id, outcome)])[0]

    def store_many(self, outcomes: list[tuple[str, dict[str, Any] | errors.EmbedqError]],
                   canvas: frozenset[str] | set[str] = frozenset()) -> list[bool]:
        """:meth:`store` for many jobs in one round trip (a pipeline of the same atomic script, one per job);
        each job's record is written once, as with :meth:`store`. Returns, per job, whether this call wrote it.
        The jobs in ``canvas`` (ids) also get their canvas-pending marker, set with the record, atomically."""
        backend = self.app.backend
        pipe = backend.client.pipeline(transaction=False)
        # Celery's record (what _get_result_meta builds with no request: a batch is stored at one instant, so its
        # records share date_done); the record's fields other than result and task_id are the same for every job.
        success = backend._get_result_meta(result=None, state=states.SUCCESS, traceback=None, request=None)
        failure_ttl = int(getattr(backend, "failure_expires", None) or backend.expires or 0)
        success_ttl = int(backend.expires or 0)
        for job_id, outcome in outcomes:
            if isinstance(outcome, errors.EmbedqError):
                meta = backend._get_result_meta(result=backend.encode_result(outcome, states.FAILURE),
                                                state=states.FAILURE, traceback=None, request=None)
                ttl = failure_ttl
            else:
                meta, ttl = {**success, "result": outcome}, success_ttl
            meta["task_id"] = job_id
            # EVAL, not a registered script: redis-py's pipeline asks SCRIPT EXISTS before every execute, a second
            # round trip per batch
            key = backend.get_key_for_task(job_id)
            if job_id in canvas:
                pipe.eval(_STORE_ONCE, 2, key, CANVAS_KEY.format(job_id), backend.encode(meta), ttl)
            else:
                pipe.eval(_STORE_ONCE, 1, key, backend.encode(meta), ttl)
        settings = self.settings
        wait = settings.replica_wait() if settings is not None else None
        if wait is not None:
            pipe.execute_command(*wait)
        try:
            replies = pipe.execute()
        except ResponseError as exc:
            raise named(exc) from exc  # a script's write refused for now (replicas, maxmemory, disk): an outage
        if settings is not None and wait is not None:
            settings.replicated(replies.pop(), f"{len(outcomes)} result(s)")
        return [bool(written) for written in replies]

    def canvas_sent(self, job_ids: list[str]) -> None:
        """The canvas work of these jobs has been sent: delete their pending markers (one round trip)."""
        if job_ids:
            self.app.backend.client.delete(*(CANVAS_KEY.format(job_id) for job_id in job_ids))

    def outcome(self, job_id: str) -> dict[str, Any]:
        """The stored record's meta (``status`` PENDING when there is none)."""
        return self.app.backend.get_task_meta(job_id, cache=False)


def as_key(value: Any) -> bytes:
    """A Redis key or channel name as bytes (redis-py answers bytes unless it decodes responses)."""
    return value if isinstance(value, bytes) else str(value).encode()


def record_key(backend: Any, job_id: str) -> bytes:
    """The key of a job's record in the result backend's Redis, also the channel its storing is published on."""
    return as_key(backend.get_key_for_task(job_id))


def read_outcome(backend: Any, raw: bytes | str) -> dict[str, Any] | BaseException | None:
    """A stored record (as Redis holds it, or as its notification carries it) read by the result backend: the job's
    result payload, or its error (an exception, not raised: a typed :class:`~embedq.errors.EmbedqError` for every
    error embedq stores), or None while the record holds no outcome (a state that is not final)."""
    meta = backend.decode_result(raw)
    status = meta.get("status")
    if status == states.SUCCESS:
        result: dict[str, Any] = meta["result"]
        return result
    if status in states.PROPAGATE_STATES:
        error: BaseException = backend.exception_to_python(meta["result"])
        return error
    return None
