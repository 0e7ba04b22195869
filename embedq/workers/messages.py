"""Reading a job's task message, and refusing one that cannot be read or run.

:class:`MessageReader`, owned by the :class:`~embedq.workers.consumer.Worker` (its ``reader``), turns a message
Celery hands the strategy into a request (``receive``: Celery's message protocols 1 and 2, JSON or msgpack only),
and refuses what cannot be a job (too large, undecodable, a content type other than json/msgpack, no usable job id,
a Celery canvas that breaks its bounds or names what an operator did not allow: ``workers/canvas_rules.py``) with a
typed error recorded under its job id, logging the id and the reason only, never its body (``refuse``). A readable
message goes on to the worker's ``deliver``. The functions read a message's fields: a job id embedq can key records
by (:func:`_job_id_ok`) and its ``expires`` as a deadline (:func:`deadline_of`, :func:`expires_iso`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import Celery, Task
from kombu.exceptions import ContentDisallowed

from embedq import errors
from embedq.kinds import TASKS, TaskSpec
from embedq.protocol import MAX_DEADLINE_SECONDS
from embedq.results import ResultStore
from embedq.settings import Settings
from embedq.workers.canvas_rules import CanvasRules

log = logging.getLogger(__name__)

MAX_JOB_ID = 256  # characters: a longer "id" header names no job embedq would have sent (its ids are UUIDs)


class MessageReader:
    """Read a task message into a request, or refuse it.

    Handed the worker's settings and canvas rules, where a readable message goes (``deliver``: request, args,
    kwargs, message, the kind's spec) and what counts a refusal (``refused``: its error); the worker gives it the
    result store its refusals are recorded in once it is on its Celery app (``store``)."""

    def __init__(self, settings: Settings, canvas_rules: CanvasRules,
                 deliver: Callable[[Any, Any, Any, Any, TaskSpec], None],
                 refused: Callable[[errors.EmbedqError], None]) -> None:
        self.settings, self.canvas_rules = settings, canvas_rules
        self.deliver, self.refused = deliver, refused
        self.store: ResultStore | None = None

    def receive(self, task: Task, app: Celery, message: Any, body: Any, ack: Any, reject: Any, Req: Any,
                hostname: str, eventer: Any, connection_errors: Any) -> None:
        """Consumer thread: one message of an embedq task: refuse what cannot be read, else deliver it."""
        from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2

        settings = self.settings
        too_large = getattr(message, "refusal", None) or _too_large(message, settings.max_message_bytes)
        if too_large is not None:
            self.refuse(message, too_large)
            return
        try:
            if body is None and "args" not in message.payload:
                body, headers, decoded, utc = message.body, message.headers, False, app.uses_utc_timezone()
            elif "args" in message.payload:
                body, headers, decoded, utc = hybrid_to_proto2(message, message.payload)
            else:
                body, headers, decoded, utc = proto1_to_proto2(message, body)
            req = Req(message, on_ack=ack, on_reject=reject, app=app, hostname=hostname, eventer=eventer,
                      task=task, connection_errors=connection_errors, body=body, headers=headers,
                      decoded=decoded, utc=utc)
            args, kwargs = req.args, req.kwargs
        except ContentDisallowed:
            self.refuse(message, errors.InvalidMessage(
                f"content type {message.content_type!r} refused: only json and msgpack are accepted"))
            return
        except Exception as exc:
            self.refuse(message, errors.InvalidMessage(f"malformed task message ({type(exc).__name__})"))
            return
        if not _job_id_ok(req.id):
            self.refuse(message, errors.InvalidMessage(
                f"the message has no job id (a string of 1 to {MAX_JOB_ID} characters, UTF-8)"))
            return
        refusal = self.canvas_rules.check(_embed_of(req), req._request_dict)
        if refusal is not None:  # nothing of its canvas is sent: its job gets the refusal, and that is all
            self.refuse(message, refusal)
            return
        self.deliver(req, args, kwargs, message, TASKS[task.name])

    def refuse(self, message: Any, error: errors.EmbedqError) -> None:
        """A message that is never run: record its typed error when it names a job, acknowledge it, and log
        its id and the reason only (never its body: it may hold users' texts)."""
        headers = getattr(message, "headers", None)
        task_id = headers.get("id") if isinstance(headers, dict) else None
        log.warning("refused message %s: %s", task_id if _job_id_ok(task_id) else "(no id)", error.message)
        if _job_id_ok(task_id):
            try:
                assert self.store is not None, "the worker gives its reader the result store on its app"
                self.store.store(task_id, error)
            except Exception as exc:  # the broker is away (or the record cannot be written): the log says so
                log.warning("could not store the refusal of %s (%s)", task_id, type(exc).__name__)
        self.refused(error)
        message.ack()


def _embed_of(req: Any) -> Any:
    """The canvas part (``embed``) of a protocol-2 body, or None."""
    payload = getattr(req, "_payload", None)
    return payload[2] if isinstance(payload, (list, tuple)) and len(payload) > 2 else None


def _job_id_ok(job_id: Any) -> bool:
    """A job id embedq can key records by: a string of 1 to MAX_JOB_ID characters that UTF-8 can encode (a lone
    surrogate cannot be written to Redis: its job would never get a record nor its message an ack)."""
    if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_JOB_ID:
        return False
    try:
        job_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

def deadline_of(expires: Any) -> float | None:
    """A Celery ``expires`` (an aware datetime) as a monotonic time, at most ``MAX_DEADLINE_SECONDS`` from now
    (producers refuse longer deadlines; one sent by other means is clamped, so no wait can overflow)."""
    if expires is None:
        return None
    try:
        left = float(expires.timestamp() - time.time())
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None
    if left != left:  # NaN
        return None
    return time.monotonic() + min(left, float(MAX_DEADLINE_SECONDS))

def expires_iso(expires: Any) -> str | None:
    return expires.isoformat() if hasattr(expires, "isoformat") else None

def _too_large(message: Any, limit: int) -> errors.EmbedqError | None:
    body = getattr(message, "body", None)
    if isinstance(body, (bytes, bytearray, str)) and len(body) > limit:
        return errors.MessageTooLarge(f"the message body has {len(body)} bytes; the limit is {limit}")
    return None
