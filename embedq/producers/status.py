"""``embedq status``: queues, live workers and recent throughput, as tables (or JSON).

Everything comes from Redis (embedq/monitor.py): no remote-control broadcast, so a dead worker cannot
make the command hang; it gives up after the broker timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from embedq import acl, errors, monitor
from embedq.settings import Settings


def _rate(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:,.1f}"


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


#: The live-workers table's columns: (header, right-aligned, the cell of a worker's record). NARROW is what tells
#: whether the fleet serves, and fits 100 columns; ``--wide`` shows every column and the online/bulk table, ``--worker``
#: one worker's whole record, ``--json`` everything.
_COLUMNS: dict[str, tuple[bool, Callable[[dict[str, Any], float], str]]] = {
    "worker": (False, lambda w, now: w.get("hostname", "?")),
    "model": (False, lambda w, now: w.get("model", "?")),
    "device": (False, lambda w, now: w.get("device", "?") + (" (starting)" if w.get("state") == monitor.STARTING
                                                              else "")),
    "dtype": (False, lambda w, now: w.get("dtype", "?")),
    "queues": (False, lambda w, now: ",".join(w.get("queues", []))),
    "held": (True, lambda w, now: f"{w.get('held_messages', 0):,}"),
    "held texts": (True, lambda w, now: f"{w.get('held_texts', 0):,}"),
    "jobs/s": (True, lambda w, now: _rate(w.get("rates", {}).get("jobs_per_s", 0.0))),
    "texts/s": (True, lambda w, now: _rate(w.get("rates", {}).get("items_per_s", 0.0))),
    "tokens/s": (True, lambda w, now: _rate(w.get("rates", {}).get("tokens_per_s", 0.0))),
    "padding": (True, lambda w, now: f"{w.get('rates', {}).get('padding_ratio', 0.0):.1%}"),
    # items that did not run through the model: an identical one waiting at the same time did (issue 57)
    "deduplicated": (True, lambda w, now: f"{w.get('counters', {}).get('items_deduplicated', 0):,}"),
    "done": (True, lambda w, now: f"{w.get('counters', {}).get('jobs_succeeded', 0):,}"),
    "failed": (True, lambda w, now: f"{w.get('counters', {}).get('jobs_failed', 0):,}"),
    "up": (True, lambda w, now: _ago(now - w.get("started_at", now))),
    "metrics": (True, lambda w, now: f":{w['metrics_port']}" if w.get("metrics_port") else "none"),
}
NARROW = ("worker", "model", "device", "held", "texts/s", "failed", "up", "metrics")
WIDE = tuple(_COLUMNS)


def _workers_table(snap: monitor.Snapshot, columns: tuple[str, ...]) -> Table:
    # No outer border and no padding at the edges: two columns more fit at 80 (a long node name or model id folds).
    table = Table(title=f"Live workers: {len(snap.workers)}", title_justify="left", show_edge=False, pad_edge=False)
    for name in columns:
        right, _cell = _COLUMNS[name]
        wraps = name in ("worker", "model", "queues")  # the long ones fold; every header stays whole
        table.add_column(name, justify="right" if right else "left", no_wrap=not wraps, overflow="fold",
                         min_width=len(name))
    for w in snap.workers:
        table.add_row(*(_COLUMNS[name][1](w, snap.taken_at) for name in columns))
    return table


def render(snap: monitor.Snapshot, broker: str, *, wide: bool = False) -> Group:
    queues = Table(title="Queues", title_justify="left", expand=False)
    for name, justify in (("queue", "left"), ("waiting", "right"), ("unacked", "right"), ("depth", "right")):
        queues.add_column(name, justify=justify, no_wrap=True)
    for q in snap.queues.values():
        queues.add_row(q.queue, f"{q.waiting:,}", f"{q.unacked:,}", f"{q.depth:,}")
    if not snap.queues:
        queues.add_row("(no queues declared yet)", "", "", "")

    workers = _workers_table(snap, WIDE if wide else NARROW)
    totals = {"jobs_per_s": 0.0, "items_per_s": 0.0, "tokens_per_s": 0.0}
    window = 0.0
    for w in snap.workers:
        rates = w.get("rates", {})
        for key in totals:
            totals[key] += rates.get(key, 0.0)
        window = max(window, rates.get("window_s", 0.0))
    lines = [Text(f"broker {broker}", style="dim"), queues, workers]
    if snap.workers and wide:
        lines.append(_traffic_table(snap))
    if snap.workers:
        lines.append(Text(f"recent throughput (last {window:.0f}s): {_rate(totals['jobs_per_s'])} jobs/s, "
                          f"{_rate(totals['items_per_s'])} texts/s, {_rate(totals['tokens_per_s'])} tokens/s"))
        if not wide:
            lines.append(Text("held: jobs a worker holds; failed: its failed jobs; metrics: its /metrics port. "
                              "--wide: every column; --worker NAME: one worker's record", style="dim"))
    else:
        lines.append(Text(f"no live workers (each reports every {monitor.REPORT_INTERVAL:.0f}s; a stopped one "
                          f"disappears within {monitor.WORKER_TTL}s)", style="bold red"))
    lines.append(Text(f"dead letters: {snap.dead_letters:,}", style="bold red" if snap.dead_letters else ""))
    return Group(*lines)


#: Record fields the summary lines of ``--worker`` already show.
_SHOWN = frozenset({"hostname", "model", "device", "dtype", "queues", "held_messages", "held_texts", "metrics_port",
                    "started_at", "reported_at", "rates"})


def render_worker(record: dict[str, Any], taken_at: float) -> Table:
    """One worker's whole registry record, one field a line (``embedq status --worker NAME``)."""
    table = Table(title=f"Worker {record.get('hostname', '?')}", title_justify="left", box=box.SIMPLE_HEAD,
                  show_header=False, pad_edge=False)
    table.add_column("field", no_wrap=True, style="bold")
    table.add_column("value", overflow="fold")
    for name in WIDE[1:]:
        table.add_row(name, _COLUMNS[name][1](record, taken_at))
    table.add_row("reported", f"{_ago(taken_at - record.get('reported_at', taken_at))} ago")
    for key, value in record.items():
        if key in _SHOWN:
            continue
        if isinstance(value, dict) and value and all(not isinstance(v, dict) for v in value.values()):
            for sub, item in value.items():
                table.add_row(f"{key}.{sub}", _plain(item))
        else:
            table.add_row(key, _plain(value))
    return table


def _plain(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".")
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    return str(value)


def _traffic_table(snap: monitor.Snapshot) -> Table:
    """Online against bulk on each worker: how online jobs get ahead (preemption between layers, or the cap), how
    often bulk micro-batches were paused and for how long, and how long online jobs waited to start."""
    table = Table(title="Online and bulk", title_justify="left")
    for name in ("worker", "online ahead of bulk", "preemptions", "bulk paused", "online jobs",
                 "online wait (mean)"):
        table.add_column(name, justify="left" if name in ("worker", "online ahead of bulk") else "right",
                         no_wrap=name != "online ahead of bulk", overflow="fold")
    for w in snap.workers:
        counters, timers = w.get("counters", {}), w.get("timers", {})
        started = counters.get("online_started", 0)
        wait = timers.get("online_wait_seconds", 0.0) / started if started else 0.0
        table.add_row(w.get("hostname", "?"), str(w.get("preemption", "?")), f"{counters.get('preemptions', 0):,}",
                      f"{timers.get('bulk_paused_seconds', 0.0):,.1f}s", f"{started:,}", f"{wait * 1e3:,.1f} ms")
    return table


def take(settings: Settings, queues: list[str]) -> monitor.Snapshot:
    from embedq.broker import BROKER_ERRORS, redis_client, safe_url

    client = redis_client(settings, timeout=min(settings.broker_timeout, 10.0))
    try:
        return monitor.snapshot(client, queues)
    except acl.CAUGHT as exc:  # before BROKER_ERRORS: a wrong password is a ConnectionError to redis-py
        if acl.refusal(exc) is None:
            raise
        raise acl.forbidden(exc, settings.broker_url) from None
    except BROKER_ERRORS as exc:
        raise errors.BrokerUnavailable(
            f"cannot reach the broker at {safe_url(settings.broker_url)}: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        client.close()


def matching(workers: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The records ``--worker NAME`` shows: the worker of that node name, else those whose node name contains it
    or whose pid it is."""
    exact = [w for w in workers if w.get("hostname") == name]
    return exact or [w for w in workers if name in str(w.get("hostname", "")) or str(w.get("pid")) == name]


def show_status(settings: Settings, *, queues: list[str], as_json: bool, watch: float | None, wide: bool = False,
                worker: str | None = None, console: Console | None = None) -> int:
    from embedq.broker import safe_url

    console = console or Console()
    broker = safe_url(settings.broker_url)
    if worker is not None:
        snap = take(settings, queues)
        records = matching(snap.workers, worker)
        if not records:
            names = ", ".join(sorted(str(w.get("hostname")) for w in snap.workers)) or "none"
            print(f"embedq status: no live worker matches {worker!r} (live: {names})", file=sys.stderr)
            return 1
        if as_json:
            print(json.dumps(records, indent=1, default=str))
        else:
            console.print(Group(*(render_worker(r, snap.taken_at) for r in records)))
        return 0
    if as_json:
        print(json.dumps(take(settings, queues).as_dict(), indent=1, default=str))
        return 0
    snap = take(settings, queues)
    # As wide as the tables need (like `kubectl -o wide`): with --wide, and when the output is a file or a pipe with
    # no COLUMNS given (a pager, a log, grep): rich would fold every cell at 80 columns there. A terminal, or COLUMNS,
    # keeps its width (the default table fits 80 columns, folding long names).
    if wide or (not console.is_terminal and not os.environ.get("COLUMNS")):
        measured = Measurement.get(console, console.options.update(width=1000), render(snap, broker, wide=wide))
        console = Console(width=max(console.width, measured.maximum), force_terminal=console.is_terminal)
    if not watch:
        console.print(render(snap, broker, wide=wide))
        return 0
    from rich.live import Live

    with Live(render(snap, broker, wide=wide), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(watch)
            live.update(render(take(settings, queues), broker, wide=wide), refresh=True)
