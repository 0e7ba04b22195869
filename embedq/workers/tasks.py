"""The Celery glue: a task per job kind whose messages bypass the pool, and the consumer's parts embedq adds.

There is one Celery task per job kind (every entry of the kinds table, ``kinds.TASKS``, plugins' kinds included),
all with the same *strategy* (:func:`coalescing_strategy`): Celery hands each message to the app's
:class:`~embedq.workers.consumer.Worker` (:func:`register` gives the app its worker and the worker its app), which
holds it until its job's record is stored, so the scheduler sees the texts of *all* waiting jobs. On SIGTERM
:class:`GracefulStop` lets the worker finish the micro-batch in progress, store and acknowledge what is done, and hand
the rest back. :class:`EmbedqConsumer` refuses what Celery itself cannot dispatch with a typed error for the job, never
logging a message's body, and runs no task but embedq's kinds on its queues.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task, bootsteps
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer

from embedq import errors
from embedq.kinds import TASKS, TaskSpec
from embedq.workers import refused, transport
from embedq.workers.consumer import Worker
from embedq.workers.observe import WorkerInfo

log = logging.getLogger(__name__)

#: Seconds between a worker's attempts to reach a broker it lost, at most (EmbedqConsumer.ensure_connected).
RECONNECT_MAX = 2.0


def worker_of(app: Celery) -> Worker:
    """The :class:`Worker` that :func:`register` gave this Celery app."""
    worker = getattr(app, "embedq_worker", None)
    if worker is None:
        raise RuntimeError("this Celery app has no embedq worker: start it with `embedq worker`")
    return worker


def coalescing_strategy(task: Task, app: Celery, consumer: Any, **_: Any):
    """The strategy of every job kind's task (Celery's hook, named in :class:`JobTask`)."""
    return worker_of(app).strategy(task, app, consumer)


class JobTask(Task):
    """A job kind's task: its messages never reach the pool (see :func:`coalescing_strategy`)."""

    acks_late = True
    typing = False
    Strategy = "embedq.workers.tasks:coalescing_strategy"
    Request = "embedq.workers.observe:EmbedRequest"

    def run(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - only reached by .apply()
        raise errors.Unavailable(f"{self.name} runs only inside an embedq worker")


def task_class(spec: TaskSpec) -> type[JobTask]:
    return type(f"{spec.kind.capitalize()}Task", (JobTask,), {"name": spec.name, "__module__": __name__})


def register(app: Celery, worker: Worker) -> list[Task]:
    """Give the app its worker, make ``redis://`` URLs use the worker's transport with the worker's fetch policy,
    and register every job kind's task (the worker refuses, per job, the kinds its model does not serve)."""
    app.embedq_worker = worker
    worker.attach(app)
    limit, held = worker.settings.max_message_bytes, worker.messages
    transport.install(transport.FetchPolicy(order=held.fetch_order, plan=held.fetch_plan,
                                            admits=held.fetch_admits, after_fetch=held.flush_intake,
                                            max_body_bytes=limit, fetch_bytes=limit))
    app.steps["consumer"].add(GracefulStop)
    app.steps["consumer"].add(WorkerInfo)
    return [app.register_task(task_class(spec)()) for spec in TASKS.values()]


class GracefulStop(bootsteps.StartStopStep):
    """Consumer bootstep: the worker's warm shutdown (SIGTERM, Ctrl-C).

    It runs after Celery has stopped consuming and before the channel closes: the micro-batch in
    progress finishes (bounded by ``shutdown_timeout``), finished jobs are stored and acknowledged,
    and every job still held goes back to the head of its queue, marked as handed back so its next
    delivery is not taken for a crash. kombu's own restore-at-close is switched off: on a lost
    connection it would requeue jobs this worker is still running (and, with Redis away, dump them
    to a file); held messages keep their lease instead and are acknowledged after the reconnect.
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        channel = getattr(c.task_consumer, "channel", None)
        if channel is not None:
            channel.qos.restore_at_shutdown = False

    def stop(self, c: Any) -> None:
        if worker_state.should_stop is not None or worker_state.should_terminate is not None:
            self.shutdown(c)

    def shutdown(self, c: Any) -> None:
        worker_of(c.app).shutdown()


class EmbedqConsumer(Consumer):
    """Celery's consumer, refusing what it cannot run without logging message bodies.

    Celery's own handlers log up to 1 KiB of the body (users' texts) at ERROR/CRITICAL and leave the
    producer waiting; these record a typed ``invalid_message`` error for the job id and log the reason.
    """

    def _refuse(self, message: Any, reason: str) -> None:
        refusal = getattr(message, "refusal", None)  # the transport could not read the body (too large inflated)
        worker_of(self.app).reader.refuse(message, refusal or errors.InvalidMessage(reason))

    def update_strategies(self) -> None:
        """Only embedq's job kinds run here. Every Celery app registers Celery's built-in tasks
        (``celery.accumulate``, ``celery.chord_unlock``, ``celery.backend_cleanup``, the canvas primitives), and
        Celery would run them from any queue it consumes; on embedq's queues they are unknown tasks, refused with
        a typed error like any other name."""
        super().update_strategies()
        for name in [name for name in self.strategies if name not in TASKS]:
            del self.strategies[name]

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's per-message dispatch, made total: whatever an entry's headers hold (a task "name" that is a
        list, say), the message is refused with a typed error and the consumer goes on."""
        on_task_received = super().create_task_handler(*args, **kwargs)

        def guarded(message: Any) -> Any:
            try:
                return on_task_received(message)
            except Exception as exc:
                log.warning("refusing a message Celery could not dispatch (%s)", type(exc).__name__)
                if not getattr(message, "acknowledged", False):
                    self._refuse(message, f"cannot dispatch the message ({type(exc).__name__})")
                return None

        return guarded

    def on_connection_error_before_connected(self, exc: Exception) -> None:
        """Celery takes a refusal of the worker's Redis user (NOPERM) for a broker outage and reconnects for ever: a
        refusal stops the worker instead (:mod:`embedq.workers.refused`)."""
        refused.stop_if_refused(exc, "connecting its consumer", self.app.conf.broker_url)
        super().on_connection_error_before_connected(exc)

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        refused.stop_if_refused(exc, "consuming", self.app.conf.broker_url)
        super().on_connection_error_after_connected(exc)

    def ensure_connected(self, conn: Any) -> Any:
        """Celery's connection, retried while the broker is away, but not while it refuses the user's password; and
        tried more often: after 0.5 s, 1 s, then every :data:`RECONNECT_MAX` s (Celery's own pauses grow by 2 s up to
        30 s), so a worker is back within about that much of a restarted Redis or a replica promoted by Sentinel."""
        ensure, url = conn.ensure_connection, self.app.conf.broker_url

        def refusing(errback: Any = None, *args: Any, **kwargs: Any) -> Any:
            def on_error(exc: Exception, *rest: Any) -> Any:
                refused.stop_if_refused(exc, "connecting", url)
                return errback(exc, *rest)

            kwargs = {"interval_start": 0.5, "interval_step": 0.5, "interval_max": RECONNECT_MAX, **kwargs}
            return ensure(on_error if errback is not None else None, *args, **kwargs)

        conn.ensure_connection = refusing
        return super().ensure_connected(conn)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        compression = (message.headers or {}).get("compression") if isinstance(message.headers, dict) else None
        how = f"content type {message.content_type!r}" + (f", compression {compression!r}" if compression else "")
        self._refuse(message, f"cannot decode the message ({type(exc).__name__}; {how})")

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self._refuse(message, "not a Celery task message")

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        headers = message.headers if isinstance(message.headers, dict) else {}
        name = str(headers.get("task"))[:100]
        self._refuse(message, f"unknown task {name!r}; this queue runs {', '.join(TASKS)}")

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._refuse(message, f"invalid task message ({type(exc).__name__})")
