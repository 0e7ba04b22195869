"""Every Redis key, list, set and stream embedq itself reads or writes, declared once.

A name with ``{}`` takes a job id (or, for :data:`WORKER_KEY`, a Celery node name). The two spellings
(``embedq.<name>`` and the older ``embedq-<name>-{}``) stay as they are: a running fleet keeps data under
these names, and renaming one would orphan it across an upgrade. Celery's and kombu's own names are theirs
(``celery-task-meta-<id>`` for a job's record and its pub/sub channel; kombu's ``unacked`` hash and
``unacked_index`` sorted set, read through kombu's channel); the ones embedq reads directly are at the end.
"""

from __future__ import annotations

# -- producers ---------------------------------------------------------------------------------------------------
#: A key with no TTL that changes when Redis loses its data (restarted without persistence, flushed).
EPOCH_KEY = "embedq.epoch"

# -- workers -----------------------------------------------------------------------------------------------------
#: Counted isolated runs of a suspect job (it exists: the job is a suspect; workers/delivery.py).
ATTEMPTS_KEY = "embedq-attempts-{}"
#: Set when a stopping worker handed the job back gracefully (its next delivery is not a crash).
RETURNED_KEY = "embedq-returned-{}"
#: Set with a job's record when the job has Celery canvas work (callbacks, errbacks, chain, chord) not yet sent;
#: deleted once it is sent (workers/canvas.py).
CANVAS_KEY = "embedq-canvas-{}"
#: List of JSON records of dead-lettered jobs, newest first (written by workers, read by ``embedq status``).
DEAD_LETTERS = "embedq.dead-letters"
#: Stream of cancelled job ids (producers add, every worker follows it; cancellation.py).
CANCELLED_STREAM = "embedq.cancelled"
#: One JSON record per live worker, by its Celery node name (``embedq status``; monitor.py).
WORKER_KEY = "embedq.worker.{}"
#: The last queue depths read by any worker, shared for a few seconds (monitor.py).
DEPTHS_KEY = "embedq.queue-depths"

# -- gateway -----------------------------------------------------------------------------------------------------
#: The record of an async job (``POST /jobs``): its kind, its request body and its embedq job ids.
GATEWAY_JOB_KEY = "embedq.gateway.job.{}"
#: Set of the async jobs whose webhook is owed.
WEBHOOKS_KEY = "embedq.gateway.webhooks"
#: A gateway replica's claim on delivering one job's webhook (``EMBEDQ_WEBHOOK_LEASE`` seconds unless renewed).
WEBHOOK_LEASE_KEY = "embedq.gateway.webhook.lease.{}"

# -- kombu's names that embedq reads itself (``embedq status``, the benchmarks) -------------------------------------
KOMBU_BINDINGS = "_kombu.binding.{}"  # one set per exchange; members: routing key, pattern, queue
KOMBU_SEP = "\x06\x16"
KOMBU_UNACKED = "unacked"
