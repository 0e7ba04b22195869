"""``embedq status``: queues, live workers and recent throughput, as tables (or JSON).

Everything comes from Redis (embedq/monitor.py): no remote-control broadcast, so a dead worker cannot
make the command hang; it gives up after the broker timeout.
"""

from __future__ import annotations

import json
import time

from kombu.utils.url import maybe_sanitize_url
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from embedq import errors, monitor
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


def render(snap: monitor.Snapshot, broker: str) -> Group:
    queues = Table(title="Queues", title_justify="left", expand=False)
    for name, justify in (("queue", "left"), ("waiting", "right"), ("unacked", "right"), ("depth", "right")):
        queues.add_column(name, justify=justify, no_wrap=True)
    for q in snap.queues.values():
        queues.add_row(q.queue, f"{q.waiting:,}", f"{q.unacked:,}", f"{q.depth:,}")
    if not snap.queues:
        queues.add_row("(no queues declared yet)", "", "", "")

    workers = Table(title=f"Live workers: {len(snap.workers)}", title_justify="left")
    for name in ("worker", "model", "device", "dtype", "queues", "held jobs", "held texts", "jobs/s", "texts/s",
                 "tokens/s", "padding", "succeeded", "failed", "up"):
        workers.add_column(name, justify="left" if name in ("worker", "model", "device", "dtype", "queues")
                           else "right", no_wrap=name != "model", overflow="fold")
    totals = {"jobs_per_s": 0.0, "items_per_s": 0.0, "tokens_per_s": 0.0}
    window = 0.0
    for w in snap.workers:
        rates = w.get("rates", {})
        counters = w.get("counters", {})
        for key in totals:
            totals[key] += rates.get(key, 0.0)
        window = max(window, rates.get("window_s", 0.0))
        workers.add_row(
            w.get("hostname", "?"), w.get("model", "?"), w.get("device", "?"), w.get("dtype", "?"),
            ",".join(w.get("queues", [])), f"{w.get('held_messages', 0):,}", f"{w.get('held_texts', 0):,}",
            _rate(rates.get("jobs_per_s", 0.0)), _rate(rates.get("items_per_s", 0.0)),
            _rate(rates.get("tokens_per_s", 0.0)), f"{rates.get('padding_ratio', 0.0):.1%}",
            f"{counters.get('jobs_succeeded', 0):,}", f"{counters.get('jobs_failed', 0):,}",
            _ago(snap.taken_at - w.get("started_at", snap.taken_at)),
        )
    lines = [Text(f"broker {broker}", style="dim"), queues, workers]
    if snap.workers:
        lines.append(_traffic_table(snap))
    if snap.workers:
        lines.append(Text(f"recent throughput (last {window:.0f}s): {_rate(totals['jobs_per_s'])} jobs/s, "
                          f"{_rate(totals['items_per_s'])} texts/s, {_rate(totals['tokens_per_s'])} tokens/s"))
    else:
        lines.append(Text(f"no live workers (each reports every {monitor.REPORT_INTERVAL:.0f}s; a stopped one "
                          f"disappears within {monitor.WORKER_TTL}s)", style="bold red"))
    lines.append(Text(f"dead letters: {snap.dead_letters:,}", style="bold red" if snap.dead_letters else ""))
    return Group(*lines)


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
    from embedq.broker import BROKER_ERRORS, redis_client

    client = redis_client(settings, timeout=min(settings.broker_timeout, 10.0))
    try:
        return monitor.snapshot(client, queues)
    except BROKER_ERRORS as exc:
        raise errors.BrokerUnavailable(
            f"cannot reach the broker at {maybe_sanitize_url(settings.broker_url)}: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        client.close()


def show_status(settings: Settings, *, queues: list[str], as_json: bool, watch: float | None,
                console: Console | None = None) -> int:
    console = console or Console()
    broker = maybe_sanitize_url(settings.broker_url or "")
    if as_json:
        print(json.dumps(take(settings, queues).as_dict(), indent=1, default=str))
        return 0
    if not watch:
        console.print(render(take(settings, queues), broker))
        return 0
    from rich.live import Live

    with Live(render(take(settings, queues), broker), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(watch)
            live.update(render(take(settings, queues), broker), refresh=True)


