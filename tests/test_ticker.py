"""The consumer's paced timers (embedq/workers/acks.py's ``Ticker``) on kombu's own timer, without a worker: at their
pace while the worker holds jobs, once a second while it holds none, back to their pace at a delivery."""

from __future__ import annotations

import time

from kombu.asynchronous.timer import Timer

from embedq.workers.held import IDLE_TICK, Ticker

ACK_INTERVAL = 0.02


def _next(timer: Timer, before: float, after: float):
    """The one live entry of ``timer`` and the range its delay was set in (scheduled between ``before`` and
    ``after``): ``(entry, lowest, highest)``."""
    [(eta, entry)] = [(s.eta, s.entry) for s in timer.queue if not s.entry.canceled]
    return entry, eta - after, eta - before


def _run(entry) -> None:
    """The event loop's turn for ``entry``: taken off the schedule (cancelled here, popped there), then called."""
    entry.cancel()
    entry()


def test_a_ticker_runs_at_its_pace_while_jobs_are_held_and_once_a_second_otherwise():
    timer, held, calls = Timer(), {}, []
    before = time.monotonic()
    ticker = Ticker(timer, ACK_INTERVAL, lambda: calls.append(len(held)), held)
    entry, low, high = _next(timer, before, time.monotonic())
    assert low <= IDLE_TICK <= high  # idle from the start

    held["job"] = object()  # a delivery
    before = time.monotonic()
    ticker.wake()
    entry, low, high = _next(timer, before, time.monotonic())
    assert low <= ACK_INTERVAL <= high

    before = time.monotonic()
    _run(entry)  # the event loop's turn: the call, and the next one at the pace of a worker holding jobs
    entry, low, high = _next(timer, before, time.monotonic())
    assert calls == [1] and low <= ACK_INTERVAL <= high
    before = time.monotonic()
    ticker.wake()  # a second delivery changes nothing: the next call is near already
    assert _next(timer, before, time.monotonic())[0] is entry

    held.clear()  # everything acknowledged
    before = time.monotonic()
    _run(entry)
    entry, low, high = _next(timer, before, time.monotonic())
    assert calls == [1, 0] and low <= IDLE_TICK <= high

    ticker.cancel()
    assert not [s for s in timer.queue if not s.entry.canceled]
    _run(entry)  # a call that was due as it was cancelled schedules nothing
    assert not [s for s in timer.queue if not s.entry.canceled]
