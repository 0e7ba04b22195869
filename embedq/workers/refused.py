"""A worker whose Redis user the broker refuses stops, with one clear line and :data:`EXIT_STATUS`, instead of
retrying for ever.

Celery takes every broker error for an outage (``broker_channel_error_retry``, and no limit on reconnections, so a
worker outlives any Redis restart), and embedq's own threads ride out outages too. A refusal is no outage: a user
without a right the worker role needs (``NOPERM``), or a wrong password, fails the same way on every try, and a worker
that retries it is a hang that looks alive. So every place that retries the broker asks :func:`is_refused` first;
a refusal stops the worker (Celery's warm shutdown: what it holds goes back to the queue) with status 78, sysexits'
``EX_CONFIG`` (a unit file can name it in ``RestartPreventExitStatus=``).
"""

from __future__ import annotations

import logging
from typing import Any

from celery.exceptions import WorkerShutdown
from celery.worker import state as worker_state

from embedq import acl
from embedq.broker import redis_client
from embedq.settings import Settings
from embedq.workers.stopping import EXIT_REFUSED

log = logging.getLogger(__name__)

#: The exit status of a worker the broker refused (sysexits.h ``EX_CONFIG``: a configuration error).
EXIT_STATUS = EXIT_REFUSED


def url_of(client: Any) -> str:
    """The broker URL of a redis-py client, its password left out (what a refusal names)."""
    kw = client.connection_pool.connection_kwargs
    user = f"{kw['username']}@" if kw.get("username") else ""
    return f"redis://{user}{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


def _say(exc: BaseException, doing: str, url: str | None) -> None:
    log.critical("%s; the worker stops (%s; exit status %d)", acl.forbidden(exc, url).message, doing, EXIT_STATUS)


def is_refused(exc: BaseException, doing: str, url: str | None = None) -> bool:
    """Any thread: if ``exc`` is the broker refusing this worker's user, log it (once) and ask Celery to stop the
    worker (its event loop checks between two fetches; before it starts, it does not start). True if so."""
    if acl.refusal(exc) is None:
        return False
    if worker_state.should_stop is None:
        _say(exc, doing, url)
        worker_state.should_stop = EXIT_STATUS
    return True


def stop_if_refused(exc: BaseException, doing: str, url: str | None = None) -> None:
    """Celery's consumer thread: raise :class:`~celery.exceptions.WorkerShutdown` if ``exc`` is a refusal."""
    if is_refused(exc, doing, url):
        raise WorkerShutdown(EXIT_STATUS)


def was_refused() -> bool:
    """After Celery's worker returned: whether it stopped because the broker refused its user (Celery's
    ``worker_main`` returns no exit status; ``embedq worker`` exits with :data:`EXIT_STATUS` then)."""
    return worker_state.should_stop == EXIT_STATUS


def check_login(settings: Settings) -> None:
    """Before the model loads: a wrong user name or password (or a disabled user) ends the process at once with
    :data:`EXIT_STATUS`. A broker that does not answer is not checked here (Celery waits for it)."""
    client: Any = redis_client(settings, timeout=5.0)
    try:
        client.ping()
    except acl.REFUSED as exc:
        _say(exc, "logging in", settings.broker_url)
        raise SystemExit(EXIT_STATUS) from None
    except Exception:  # away: Celery's own connection waits for it, as before
        pass
    finally:
        client.close()
