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

A task the canvas sends goes to the queue its signature names, else to ``EMBEDQ_CALLBACK_QUEUE`` (``broker.Routes``).
What a canvas may name is checked when the message is read (``workers/canvas_rules.py``): only queues an operator
allowed (``EMBEDQ_CALLBACK_QUEUE``, ``EMBEDQ_CALLBACK_QUEUES``), and embedq's own kinds only where
``EMBEDQ_CALLBACK_KINDS`` allows them: those go to the online queue, and are sent only while it holds fewer than
``online_queue_limit`` jobs (the producer's admission; else ``overloaded``).

**Bounded.** What a job's canvas publishes is bounded before anything is built: the messages that carry its result
(each callback, the chain's next step, its chord part) times the size of the result's JSON form, estimated from its
arrays' element counts (:func:`json_bytes`), is at most ``EMBEDQ_CANVAS_MAX_BYTES``. Work past that bound, or that
the broker refuses (:class:`Sending`: a message whose publish, with kombu's own few retries, fails twice while Redis
still answers PING),
or that admission refuses, *fails*: the job's errbacks run, its chain's later steps and its chord part are stored
as failed, a warning names the job and the reason, and ``canvas_failures`` counts it. Nothing is retried forever
but a broker outage, which is ridden out (so a Redis restart loses no callback). The sending itself runs on the
worker's canvas thread (``workers/canvas_thread.py``), never on the results thread.

The once-per-job bookkeeping (the canvas-pending marker) is in ``results.py`` and ``workers/canvas_thread.py``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import Celery, group, signature, states

from embedq import errors
from embedq.broker import BROKER_ERRORS
from embedq.kinds import TASKS
from embedq.protocol import json_result, result_size
from embedq.workers.canvas_rules import CONTAINERS, FIELDS

log = logging.getLogger(__name__)

#: The fields of a protocol-2 message's ``embed`` that hold canvas work.
CANVAS_FIELDS = FIELDS
#: Sends the broker refuses while it answers PING before a callback counts as failed (the message is the problem).
MAX_STRIKES = 2
#: Bytes one array element takes at most in the JSON form: a float32 as Python writes it ("-1.2345678918552399e-05"),
#: an int32 ("-2147483648"), with ", " between elements.
FLOAT_JSON_BYTES, INT_JSON_BYTES = 25, 13


@dataclass(frozen=True, eq=False)
class Canvas:
    """A job's canvas work: Celery's request context of its message (headers and ``embed``), as Celery's own
    backends read it (``id``, ``group``, ``group_index``, ``chord``, ``chain``, ``errbacks``, ``root_id``...)."""

    request: Any


class Failed(Exception):
    """A job's canvas work cannot be sent (``error`` says why): it fails, and its errbacks run."""

    def __init__(self, error: errors.EmbedqError) -> None:
        super().__init__(error.message)
        self.error = error


class Unsent(Exception):
    """The worker is stopping while the broker is away: the work waits for the job's redelivery (its marker)."""


@dataclass
class Sending:
    """How the canvas thread sends: riding out a broker outage (``broker_up`` false: wait and try again), while a
    send the broker refuses with the broker up is a strike, and :data:`MAX_STRIKES` strikes fail the work."""

    max_bytes: int
    online_queue: str
    online_limit: int  # 0: no admission limit
    stopping: Callable[[], bool]
    broker_up: Callable[[], bool]
    waiting: Callable[[str], int]  # jobs waiting in a queue (monitor.waiting)
    beat: Callable[[], None] = lambda: None  # the thread is alive (the watchdog reads it)
    sleep: Callable[[float], None] = time.sleep

    def send(self, job_id: str, what: str, call: Callable[[], Any]) -> Any:
        strikes, delay = 0, 0.2
        while True:
            try:
                return call()
            except BROKER_ERRORS as exc:
                if self.stopping():
                    raise Unsent(f"{what}: {type(exc).__name__}") from exc
                if self.broker_up():
                    strikes += 1
                    if strikes >= MAX_STRIKES:
                        raise Failed(errors.MessageTooLarge(
                            f"the broker refused {what} {strikes} times ({type(exc).__name__}) while it answered "
                            "PING: the message itself is the problem")) from exc
                    continue
                log.warning("sending %s of job %s failed (%s): the broker is away; retrying in %.1fs", what, job_id,
                            type(exc).__name__, delay)
                self.beat()
                self.sleep(delay)
                delay = min(delay * 2, 5.0)
            except Failed:
                raise
            except Exception as exc:  # the broker answered with an error (a full Redis), a signature Celery chokes on
                raise Failed(errors.InvalidMessage(f"{what} could not be sent ({type(exc).__name__}: "
                                                   f"{str(exc)[:200]})")) from exc

    def admit(self, sigs: list[Any]) -> None:
        """embedq's own kinds among the tasks about to be sent pass the producer's online admission."""
        if self.online_limit and any(_has_kind(sig) for sig in sigs):
            held = self.waiting(self.online_queue)
            if held >= self.online_limit:
                raise Failed(errors.Overloaded(f"queue {self.online_queue} holds {held} jobs (online_queue_limit="
                                               f"{self.online_limit}): an embedq kind in the canvas was not sent"))


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


def json_bytes(payload: dict[str, Any]) -> int:
    """About (at most) how many bytes ``json_result(payload)`` takes as JSON, from its arrays' element counts: the
    JSON form is never built to learn its size (a 63 MB float16 record is a ~470 MB JSON string)."""
    total = 2
    for name, value in payload.items():
        if isinstance(value, dict) and "encoding" in value and "shape" in value:
            shape = [int(n) for n in value.get("shape") or []]
            elements, rows = math.prod(shape), math.prod(shape[:-1])
            per = FLOAT_JSON_BYTES if str(value.get("dtype", "float32")).startswith("float") else INT_JSON_BYTES
            total += len(str(name)) + 96 + elements * per + rows * 4  # a row's brackets and the ", " after it
        else:
            total += len(str(name)) + 4 + result_size(value)
    return int(total)


def carriers(request: Any) -> int:
    """Messages of a successful job's canvas work that carry its result: each callback task (a group's each), the
    chain's next step, the chord part (stored with the chord's results)."""
    sigs = list(request.callbacks or [])
    if request.chain:
        sigs.append(request.chain[-1])
    return sum(_leaves(sig) for sig in sigs) + (1 if request.chord else 0)


def dispatch(app: Celery, canvas: Canvas, outcome: dict[str, Any] | BaseException, sending: Sending) -> None:
    """Send a job's canvas work for its stored ``outcome`` (its result payload, or its error). Raises
    :class:`Failed` when the work fails (after its errbacks ran and its failure was stored where Celery stores
    it), :class:`Unsent` when the worker stops with the broker away (the caller keeps the pending marker)."""
    request = canvas.request
    backend = app.backend
    job_id = request.id
    if revoked(outcome):
        if request.chord:
            sending.send(job_id, "its chord part", lambda: backend.on_chord_part_return(request, states.REVOKED,
                                                                                       outcome))
        return
    if isinstance(outcome, BaseException):
        _fail(app, request, outcome, sending)
        return
    size, messages = json_bytes(outcome), carriers(request)
    try:
        if size * messages > sending.max_bytes:
            raise Failed(errors.ResultTooLarge(
                f"its canvas would publish {messages} message(s) of about {size} bytes of JSON each; the limit is "
                f"{sending.max_bytes} bytes per job (EMBEDQ_CANVAS_MAX_BYTES)"))
        sending.send(job_id, "its admission", lambda: sending.admit(
            [*(request.callbacks or []), *(request.chain[-1:] if request.chain else [])]))
        result = json_result(outcome)
        _callbacks_and_chain(app, request, result, sending)
        if request.chord:
            sending.send(job_id, "its chord part", lambda: backend.on_chord_part_return(request, states.SUCCESS,
                                                                                       result))
    except Failed as exc:
        _fail(app, request, exc.error, sending, callbacks_only=True)
        raise


def _fail(app: Celery, request: Any, exc: BaseException, sending: Sending, *, callbacks_only: bool = False) -> None:
    """A failed job (or a job whose callbacks failed): its chord part returns as FAILURE, the failure is stored on
    its chain's later steps, its errbacks run (Celery's ``handle_failure`` after a failed callback dispatch)."""
    backend, job_id = app.backend, request.id
    try:
        if request.chord:
            sending.send(job_id, "its chord part", lambda: backend.on_chord_part_return(request, states.FAILURE, exc))
        sending.send(job_id, "its chain's failure", lambda: backend._fail_chain(
            request.chain, exc, None, store_result=True, state=states.FAILURE))
        if request.errbacks:
            sending.send(job_id, "its errbacks", lambda: backend._call_task_errbacks(request, exc, None))
    except Failed as failed:
        if not callbacks_only:
            raise
        log.warning("the errbacks of job %s could not be sent either: %s", job_id, failed.error.message)


def chord_part(app: Celery, canvas: Canvas, record: dict[str, Any], sending: Sending) -> None:
    """A chord part whose job's record another writer stored first (a producer's cancellation): return the part
    with the stored outcome. Celery's Redis backend counts a part once per task id, so this is safe to repeat."""
    request = canvas.request
    if request.chord and record.get("status") in states.READY_STATES:
        result = record.get("result")
        if record["status"] == states.SUCCESS and isinstance(result, dict):
            if json_bytes(result) > sending.max_bytes:
                result = errors.ResultTooLarge("the chord part's result is over EMBEDQ_CANVAS_MAX_BYTES")
                status = states.FAILURE
            else:
                result, status = json_result(result), states.SUCCESS
        else:
            status = record["status"]
        sending.send(request.id, "its chord part", lambda: app.backend.on_chord_part_return(request, status, result))


def _callbacks_and_chain(app: Celery, request: Any, result: Any, sending: Sending) -> None:
    """Celery's ``_dispatch_callbacks_and_chain`` (``celery/app/trace.py``) for a finished job. Each publish as
    Celery's tracer publishes a callback (``amqp._retry_publish`` where this Celery has it: kombu's few retries,
    reconnecting, as for any task: a stale connection after a Redis restart is no strike); :class:`Sending` decides
    what happens when those are spent."""
    job_id = request.id
    options = {"parent_id": job_id, "root_id": request.root_id or job_id,
               "priority": (request.delivery_info or {}).get("priority")
               if app.conf.task_inherit_parent_priority else None}
    retry_publish = getattr(app.amqp, "_retry_publish", None)

    def publish(call: Any, *args: Any, **kwargs: Any) -> Any:
        return retry_publish(call, *args, **kwargs) if retry_publish is not None else call(*args, **kwargs)

    callbacks = request.callbacks
    if callbacks:
        if len(callbacks) > 1:
            sigs, groups = [], []
            for sig in callbacks:
                sig = signature(sig, app=app)
                (groups if isinstance(sig, group) else sigs).append(sig)
            for group_ in groups:
                sending.send(job_id, "a callback group", lambda g=group_: publish(g.apply_async, (result,), **options))
            if sigs:
                sending.send(job_id, "its callbacks",
                             lambda: publish(group(sigs, app=app).apply_async, (result,), **options))
        else:
            sig = signature(callbacks[0], app=app)
            sending.send(job_id, "its callback", lambda: publish(sig.apply_async, (result,), **options))
    chain = request.chain
    if chain:
        step = signature(chain[-1], app=app)
        sending.send(job_id, "its chain's next step",
                     lambda: publish(step.apply_async, (result,), chain=chain[:-1], **options))


def _leaves(sig: Any) -> int:
    """Tasks of a signature that get the result it is called with (a group's every task, a chain's first...)."""
    if not isinstance(sig, dict):
        return 1
    kwargs = sig.get("kwargs") if isinstance(sig.get("kwargs"), dict) else {}
    task = sig.get("task")
    if task == "celery.group":
        tasks = kwargs.get("tasks") or []
        return sum(_leaves(t) for t in ([tasks] if isinstance(tasks, dict) else tasks)) or 1
    if task == "celery.chain":
        tasks = kwargs.get("tasks") or []
        return _leaves(tasks if isinstance(tasks, dict) else tasks[0]) if tasks else 1
    if task == "celery.chord":
        header = kwargs.get("header") or []
        return sum(_leaves(t) for t in ([header] if isinstance(header, dict) else header)) or 1
    return 1


def _has_kind(sig: Any) -> bool:
    """An embedq kind among the tasks of a signature (containers looked into; the depth is bounded at the edge)."""
    if not isinstance(sig, dict):
        return False
    task = sig.get("task")
    if task in TASKS:
        return True
    if task in CONTAINERS and isinstance(sig.get("kwargs"), dict):
        kwargs = sig["kwargs"]
        for name in ("tasks", "header", "body"):
            value = kwargs.get(name)
            if any(_has_kind(t) for t in ([value] if isinstance(value, dict) else value or [])):
                return True
    return False
