"""Celery's canvas on embedq's jobs: what Celery's tracer does after a task, done after a job's record is stored.

embedq's worker consumes task messages itself (``workers/consumer.py``), so Celery's tracer never runs and nothing it
does per task happens on its own. This module does it, as Celery 5 does for a plain task (``celery/app/trace.py``,
``celery/backends/base.py``), once the job's terminal record is stored and before its message is acknowledged:

* **success**: each ``link`` callback, then the next step of a ``chain``, is sent with the job's result as its first
  argument, in the plain JSON form (:func:`~embedq.protocol.json_result`: arrays as lists of numbers), with
  ``parent_id`` the job and ``root_id`` the job's root; several callbacks go as one group, as Celery sends them. A
  chord header part returns its result through the configured backend's own ``on_chord_part_return`` (Celery's
  Redis backend counts the parts and sends the body once all are in);
* **failure** (a typed error): the chord part returns as FAILURE, the failure is stored on the chain's later steps,
  and the ``link_error`` errbacks run as Celery runs them (``backend._call_task_errbacks``): an errback registered
  in this process would be called in-process with (request, exc, traceback); no user task is registered in an
  embedq worker, so every errback is sent as a task with the job id as its argument (Celery's old-style errback);
* **cancelled or expired** (Celery's REVOKED): only the chord part returns, as REVOKED; no callback or errback.

A task the canvas sends goes to the queue its signature names, else to ``EMBEDQ_CALLBACK_QUEUE`` (``broker.Routes``),
never to embedq's own queues. The once-per-job bookkeeping (the canvas-pending marker) is in ``results.py`` and
``workers/acks.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from celery import Celery, group, signature, states

from embedq import errors
from embedq.protocol import json_result

log = logging.getLogger(__name__)

#: The fields of a protocol-2 message's ``embed`` that hold canvas work.
CANVAS_FIELDS = ("callbacks", "errbacks", "chain", "chord")


@dataclass(frozen=True, eq=False)
class Canvas:
    """A job's canvas work: Celery's request context of its message (headers and ``embed``), as Celery's own
    backends read it (``id``, ``group``, ``group_index``, ``chord``, ``chain``, ``errbacks``, ``root_id``...)."""

    request: Any


def canvas_of(req: Any) -> Canvas | None:
    """The canvas work a job's Celery request carries, or None (the common case: one dict lookup per field)."""
    try:
        embed = req._payload[2]
    except Exception:
        return None
    if not isinstance(embed, dict) or not any(embed.get(name) for name in CANVAS_FIELDS):
        return None
    return Canvas(req._context)


def revoked(outcome: Any) -> bool:
    return isinstance(outcome, (errors.Cancelled, errors.Expired))


def dispatch(app: Celery, canvas: Canvas, outcome: dict[str, Any] | BaseException) -> None:
    """Send a job's canvas work for its stored ``outcome`` (its result payload, or its error). Raises the broker's
    errors when the work cannot be sent (the caller keeps the pending marker)."""
    request = canvas.request
    backend = app.backend
    if revoked(outcome):
        if request.chord:
            backend.on_chord_part_return(request, states.REVOKED, outcome)
        return
    if isinstance(outcome, BaseException):
        if request.chord:
            backend.on_chord_part_return(request, states.FAILURE, outcome)
        backend._fail_chain(request.chain, outcome, None, store_result=True, state=states.FAILURE)
        if request.errbacks:
            backend._call_task_errbacks(request, outcome, None)
        return
    result = json_result(outcome)
    _callbacks_and_chain(app, request, result)
    if request.chord:
        backend.on_chord_part_return(request, states.SUCCESS, result)


def chord_part(app: Celery, canvas: Canvas, record: dict[str, Any]) -> None:
    """A chord part whose job's record another writer stored first (a producer's cancellation): return the part
    with the stored outcome. Celery's Redis backend counts a part once per task id, so this is safe to repeat."""
    request = canvas.request
    if request.chord and record.get("status") in states.READY_STATES:
        result = record.get("result")
        if record["status"] == states.SUCCESS and isinstance(result, dict):
            result = json_result(result)
        app.backend.on_chord_part_return(request, record["status"], result)


def _callbacks_and_chain(app: Celery, request: Any, result: Any) -> None:
    """Celery's ``_dispatch_callbacks_and_chain`` (``celery/app/trace.py``) for a finished job."""
    job_id = request.id
    options = {"parent_id": job_id, "root_id": request.root_id or job_id,
               "priority": (request.delivery_info or {}).get("priority")
               if app.conf.task_inherit_parent_priority else None}
    callbacks = request.callbacks
    if callbacks:
        if len(callbacks) > 1:
            sigs, groups = [], []
            for sig in callbacks:
                sig = signature(sig, app=app)
                (groups if isinstance(sig, group) else sigs).append(sig)
            for group_ in groups:
                _publish(app, group_.apply_async, (result,), **options)
            if sigs:
                _publish(app, group(sigs, app=app).apply_async, (result,), **options)
        else:
            _publish(app, signature(callbacks[0], app=app).apply_async, (result,), **options)
    chain = request.chain
    if chain:
        step = signature(chain[-1], app=app)
        _publish(app, step.apply_async, (result,), chain=chain[:-1], **options)


def _publish(app: Celery, publish: Any, *args: Any, **kwargs: Any) -> Any:
    """Publish as Celery's tracer publishes a callback (``amqp._retry_publish`` where this Celery has it: the
    publish retries wait between tries)."""
    retry_publish = getattr(app.amqp, "_retry_publish", None)
    return retry_publish(publish, *args, **kwargs) if retry_publish is not None else publish(*args, **kwargs)
