"""The watchdog's reading of the results and canvas threads (``Outbox.stalled``, ``CanvasThread.health``): a stall is
time without progress *while work waits*. A thread that sat idle past ``EMBEDQ_STALL_TIMEOUT`` and is then handed
work has stalled for no time at all: its idle time before the hand-over is not counted (a worker idle for five minutes
between two jobs was stopped with status 70 by its next job before its thread had woken to take it). A thread that
took work and makes no progress on it, or that has not taken what it was given earlier, is still a stall.

The threads are not started where the test needs the hand-over to meet a thread that has not woken yet: the state the
watchdog read in that window, made to last.
"""

from __future__ import annotations

import threading
import time

from embedq import errors
from embedq.settings import Settings
from embedq.workers.canvas_thread import CanvasThread
from embedq.workers.outbox import Outbox
from embedq.workers.stats import Stats

TIMEOUT = 300.0
IDLE = 1000.0  # how long the thread "sat idle" before the hand-over: its beat set this far back


def test_results_thread_idle_past_the_timeout_has_not_stalled_when_handed_a_job():
    outbox = Outbox(None, Settings(), Stats(), on_done=lambda job, outcome: None)  # the thread never wakes
    outbox.beat -= IDLE
    outbox.put(object(), errors.BackendError("x"))
    assert outbox.stalled(TIMEOUT) is None  # the job was handed over just now
    outbox.beat -= IDLE  # ... and the thread has not taken it for IDLE seconds: that is a stall
    outbox.put(object(), errors.BackendError("y"))  # more work does not hide it
    assert outbox.stalled(TIMEOUT) >= IDLE


def test_results_thread_stuck_on_a_batch_is_a_stall_whatever_it_is_handed():
    release = threading.Event()
    outbox = Outbox(None, Settings(), Stats(), on_done=lambda job, outcome: release.wait())
    outbox.start()
    try:
        outbox.put(object(), errors.BackendError("stuck"))
        end = time.monotonic() + 60
        while not outbox.busy:  # the thread took the job and hangs in on_done
            assert time.monotonic() < end, "the results thread never took the job"
            time.sleep(0.01)
        outbox.beat -= IDLE
        outbox.put(object(), errors.BackendError("next"))
        assert outbox.stalled(TIMEOUT) >= IDLE
    finally:
        release.set()
        outbox.close()
        outbox.thread.join(10)


def test_canvas_thread_idle_past_the_timeout_has_not_stalled_when_handed_work():
    thread = CanvasThread(Settings(), Stats(), finished=None, stopping=lambda: False, already_stored="stored")
    thread.beat -= IDLE
    thread.put([])
    assert thread.health(TIMEOUT) is None
    thread.beat -= IDLE  # the work handed over has not been taken for IDLE seconds
    thread.put([])
    assert "no progress" in thread.health(TIMEOUT)
    thread.busy, thread._entries = True, type(thread._entries)()  # it took the work and hangs on it
    thread.beat -= IDLE
    thread.resend(object(), None)
    assert "no progress" in thread.health(TIMEOUT)
