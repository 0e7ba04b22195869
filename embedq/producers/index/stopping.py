"""How ``embedq index`` stops, and what it checks before it creates its output.

**Stopping.** Ctrl-C or SIGTERM raises :class:`Stop` from the signal handler itself, so whatever the run is
blocked in ends at once: connecting to a broker that does not answer, reading a stdin that sends nothing, waiting
for room in a full bulk queue, for a worker, or for results. Only a write to the output (:meth:`Stopper.writing`)
and the final commit finish first; the run then commits what has arrived, which the next run continues from.
A second signal quits at once (KeyboardInterrupt); the next run cuts the output back to its last commit.

**Before the output.** The broker must answer within ``connect_timeout`` seconds (a wrong URL is named, not
retried for minutes) and a live worker must serve the queue within ``wait_for_worker`` seconds
(:func:`wait_for_worker`); otherwise the run is refused before it creates a file or sends a job.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from embedq import errors, monitor
from embedq.producers.client import BROKER_ERRORS, Client


class Stop(BaseException):
    """A stop was asked (Ctrl-C, SIGTERM). A BaseException, as KeyboardInterrupt, so that no library's
    ``except Exception`` swallows it when the handler raises it inside a blocking call."""


def say(text: str) -> None:
    """A line on stderr that does not break the progress bar."""
    from tqdm import tqdm

    tqdm.write(f"embedq index: {text}", file=sys.stderr)


class Stopper:
    """The run's stop state and its signal handler."""

    def __init__(self) -> None:
        self.asked = False
        self.finishing = False  # the final commit runs: a first stop waits for it
        self._in_write = 0

    def check(self) -> None:
        if self.asked:
            raise Stop

    @contextlib.contextmanager
    def writing(self, *, then_stop: bool = True) -> Iterator[None]:
        """A write to the output: a stop asked meanwhile is raised once it ends (``then_stop``; else by the next
        :meth:`check`), not inside it."""
        self._in_write += 1
        try:
            yield
        finally:
            self._in_write -= 1
        if then_stop and self.asked and not self._in_write and not self.finishing:
            raise Stop

    def catch(self) -> Callable[[], None]:
        """Install the handler for SIGINT and SIGTERM (main thread only); returns what puts the previous back."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def ask(signum: int, frame: Any) -> None:
            if self.asked:
                raise KeyboardInterrupt
            self.asked = True
            say("stopping: committing what has arrived (again to quit at once)")
            if not self._in_write and not self.finishing:
                raise Stop

        previous = {sig: signal.signal(sig, ask) for sig in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore


def ride_out(client: Client, call: Callable[[], Any], timeout: float, hint: str = "") -> Any:
    """``call()``, retried with backoff while the broker cannot be reached, for up to ``timeout`` seconds; then
    :class:`~embedq.errors.BrokerUnavailable` naming the broker (``hint`` appended)."""
    deadline, pause = None, 0.5
    while True:
        try:
            return call()
        except BROKER_ERRORS as exc:
            now = time.monotonic()
            reason = client._unreachable(exc).message.removeprefix("[unavailable] ")
            if deadline is None:
                deadline = now + timeout
                say(f"{reason}; retrying for up to {timeout:g}s (Ctrl-C to stop)")
            if now >= deadline:
                raise errors.BrokerUnavailable(f"{reason}; gave up after {timeout:g}s{hint}") from None
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, 5.0)


#: Seconds between the notes of a wait for a starting worker.
START_NOTE = 10.0


def wait_for_worker(client: Client, queue: str, limit: float, broker_timeout: float) -> None:
    """Return once a live, ready worker serves ``queue`` (the registry, :func:`embedq.monitor.serving`), looking
    every half second. With none at all, for up to ``limit`` seconds (``inf``: for ever), then
    :class:`~embedq.errors.NoWorker` naming the queue and what the live workers serve. While one is starting (its
    process registered, its model loading: issue 51 item 3, a worker started together with the indexer) it waits
    for it, saying so every :data:`START_NOTE` seconds, up to ``worker_start_timeout``."""
    deadline = time.monotonic() + limit
    start_deadline = time.monotonic() + client.settings.worker_start_timeout
    noted = False
    next_note = 0.0
    while True:
        found = ride_out(client, lambda: monitor.serving(monitor.live_workers(client.redis()), queue),
                         broker_timeout)
        if found:
            return
        now = time.monotonic()
        if found.starting:
            if now >= start_deadline:
                raise errors.NoWorker(f"{found.describe()}: still starting after "
                                      f"{client.settings.worker_start_timeout:g}s (EMBEDQ_WORKER_START_TIMEOUT)")
            if now >= next_note:
                ages = [time.time() - float(r.get("started_at") or time.time()) for r in found.starting]
                say(f"waiting for {len(ages)} starting worker{'s' if len(ages) > 1 else ''} of queue {queue} to load "
                    f"its model (starting for {max(ages):.0f}s; up to {client.settings.worker_start_timeout:g}s, "
                    "EMBEDQ_WORKER_START_TIMEOUT)")
                next_note = now + START_NOTE
            deadline = max(deadline, now + limit)  # one that dies while starting: --wait-for-worker from then
        elif now >= deadline:
            raise errors.NoWorker(f"{found.describe()} (waited {limit:g}s; --wait-for-worker SECONDS waits "
                                  "longer, inf for ever)")
        elif not noted:
            noted = True
            say(f"{found.describe()}; waiting {'for one' if math.isinf(limit) else f'up to {limit:g}s for one'} "
                "(--wait-for-worker)")
        time.sleep(0.5 if math.isinf(deadline) else min(0.5, max(deadline - time.monotonic(), 0.01)))
