"""The per-process state of a worker, shared by the consumer (delivery) and observe (monitoring)."""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embedq.batching import PrefetchWindow
    from embedq.cancellation import CancelFeed
    from embedq.settings import Settings
    from embedq.workers.delivery import Ledger
    from embedq.workers.metrics import Reporter, WorkerMetrics
    from embedq.workers.service import EmbeddingService, Job


class _Runtime:
    """Per-process state of a worker: its settings, the service, the jobs it holds, finished jobs to ack."""

    settings: Settings | None = None
    service: EmbeddingService | None = None
    ledger: Ledger | None = None
    finished: queue.SimpleQueue = queue.SimpleQueue()  # (job, outcome, monotonic time stored)
    started: queue.SimpleQueue = queue.SimpleQueue()  # jobs whose first micro-batch started (for events)
    metrics: WorkerMetrics | None = None
    reporter: Reporter | None = None
    hostname: str = ""
    started_at: float = 0.0  # Unix time the worker started consuming
    timers: list[Any] = []
    window: PrefetchWindow | None = None
    consumer: Any = None  # Celery's Consumer: its qos is the channel's prefetch count
    held: dict[str, Job] = {}  # job id -> job, from delivery until acknowledged (consumer thread only)
    stopped: bool = False
    bulk_queues: frozenset[str] = frozenset()  # queues whose jobs are bulk (the rest are online)
    cancels: CancelFeed | None = None
    cancels_retry_at: float = 0.0  # monotonic time before which the stream is not read (after a failure)
    revoked_seen: int = 0  # size of Celery's revoked set at the last look (Flower's "revoke", celery control)


RUNTIME = _Runtime()
