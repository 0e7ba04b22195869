"""``embedq worker --processes N``: N worker processes (replicas) serving one device, under one supervisor.

Why replicas (issue 36, docs/ARCHITECTURE.md *Processes*): a worker process is bound by its own interpreter — the
consumer thread (reading, checking and tokenizing messages), the inference thread (launching the model's kernels)
and the results thread (encoding and storing) take turns on one GIL — long before a GPU is busy. N replicas turn
N cores into device throughput with no new moving part: each is an ordinary embedq worker (its own Celery node
in Flower, its own prefetch window, coalescing, preemption, deadlines, cancellation and delivery ledger), so every
guarantee of one worker holds for each, a SIGKILL of one loses no job (its messages come back after
``visibility_timeout``, as for any worker), and more machines are still just more workers.

The supervisor owns no model and no broker connection. It starts the replicas (fresh interpreters, never a fork:
CUDA must not be initialised before one, each runs the supervisor's own command line with an environment that makes
it replica *i*), gives replica *i* the node name ``<name>-r<i>``, a 1/N share of the prefetch window (the machine
holds what one worker would), its metrics port (unset ``metrics_port``, the default: each replica takes the next free
port from 9808, as every worker of the machine does; a set one: ``metrics_port + 100 × i``) and its share of the CPU
threads, forwards SIGTERM/SIGINT (each replica stops
gracefully: finishes its micro-batch, stores what is done, hands the rest back), restarts a replica that dies (with a
back-off; one that could not start at all stops the supervisor), and exits once all have stopped. A replica whose
supervisor dies gets SIGTERM (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from embedq.settings import Settings

log = logging.getLogger(__name__)

#: Seconds between two starts of a replica that keeps dying, at most (doubling from 1 s).
RESTART_BACKOFF_MAX = 30.0
#: A replica that ran this long before it died is restarted at once (its back-off starts over).
HEALTHY_RUN = 60.0
#: With metrics_port set, replica i serves metrics on metrics_port + i × this (unset: the next free default port).
METRICS_PORT_STEP = 100
#: A replica's exit status when its watchdog stopped it (workers.stopping.EXIT_FAILED): always restarted.
EXIT_FAILED = 70
#: A replica's exit status when the broker refused its Redis user (workers.stopping.EXIT_REFUSED): never restarted.
EXIT_REFUSED = 78
#: The environment variables that tell a process it is replica i of a supervisor, and its node name (not for users).
REPLICA_ENV = "EMBEDQ_REPLICA_INDEX"
REPLICA_NAME_ENV = "EMBEDQ_REPLICA_NAME"


def processes_for(settings: Settings, cpus: int | None = None, gpus: int | None = None) -> int:
    """How many replicas serve the device: ``worker_processes`` when set; else, on a GPU, one per four of the cores
    that fall to each GPU of the machine (at most four: two replicas measured 2.03× one on an H100, shared/GPU.md);
    on the CPU one (the model's own threads use every core there)."""
    if is_replica():
        return 1
    if settings.worker_processes:
        return settings.worker_processes
    if not settings.device.startswith("cuda"):
        return 1
    cpus = cpus or len(os.sched_getaffinity(0))
    gpus = gpus or visible_gpus()
    return max(1, min(4, cpus // max(gpus, 1) // 4))


def visible_gpus() -> int:
    """GPUs this process may use (``CUDA_VISIBLE_DEVICES``, else the NVIDIA driver's list), without loading CUDA;
    1 when neither says."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")]) or 1
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/driver/nvidia/gpus")) or 1
    return 1


def replica_env(settings: Settings, index: int, count: int, cpus: int | None = None) -> dict[str, str]:
    """What replica ``index`` of ``count`` changes in the supervisor's environment (the rest it inherits, with the
    supervisor's command-line flags)."""
    env = {"EMBEDQ_WORKER_PROCESSES": "1", REPLICA_ENV: str(index),
           # The machine holds what one worker would: each replica a share of the prefetch window, so a burst is
           # spread over all of them (not taken whole by the first) and none finishes long after the others.
           "EMBEDQ_PREFETCH_TEXTS": str(max(1, settings.prefetch_texts // count)),
           "EMBEDQ_PREFETCH_WINDOW": str(max(1, settings.prefetch_window // count)),
           "EMBEDQ_ONLINE_OVERFLOW_TEXTS": str(settings.online_overflow_texts // count)}
    if settings.metrics_port and index:  # unset (None): nothing to pass, each replica picks a free default port
        env["EMBEDQ_METRICS_PORT"] = str(settings.metrics_port + METRICS_PORT_STEP * index)
    if settings.torch_threads is None and not settings.device.startswith("cuda"):
        cpus = cpus or len(os.sched_getaffinity(0))
        env["EMBEDQ_TORCH_THREADS"] = str(max(1, cpus // count))
    return env


def die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Supervisor:
    """Starts, watches and stops the replicas of one ``embedq worker``."""

    def __init__(self, settings: Settings, count: int, *, hostname: str, argv: list[str]) -> None:
        self.settings = settings
        self.count = count
        self.hostname = hostname  # name@host: replica i is name-r<i>@host
        self.argv = argv  # the command a replica runs: the supervisor's own (the environment makes it a replica)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self.started_at = [0.0] * count
        self.backoff = [1.0] * count
        self.next_start = [0.0] * count
        self.served = [False] * count  # ran HEALTHY_RUN seconds, or died other than at its start
        self.stopping = False
        self.replicas = count  # the workers that share the prefetch window (a split worker's hosts)

    def replica_name(self, index: int) -> str:
        name, _, host = self.hostname.partition("@")
        return f"{name}-r{index}@{host}" if host else f"{name}-r{index}"

    def child_env(self, index: int) -> dict[str, str]:
        """The environment of replica ``index``: the supervisor's, made replica *i* of ``replicas``."""
        env = dict(os.environ)
        env.update(replica_env(self.settings, index, self.replicas))
        env[REPLICA_NAME_ENV] = self.replica_name(index)
        return env

    def start(self, index: int) -> None:
        self.procs[index] = subprocess.Popen(self.argv, env=self.child_env(index), preexec_fn=die_with_parent)
        self.started_at[index] = time.monotonic()
        log.info("replica %d started (pid %d, %s)", index, self.procs[index].pid, self.replica_name(index))

    def stop(self, signum: int = signal.SIGTERM) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)

    def run(self) -> int:
        """Start every replica and watch them until stopped; returns the exit status (0 after a graceful stop, the
        first failing replica's status when one could not start at all)."""
        def on_signal(signum: int, _frame: Any) -> None:
            log.info("stopping %d replicas (signal %d)", self.count, signum)
            self.stop(signum)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        for i in range(self.count):
            self.start(i)
        status = 0
        while True:
            alive = 0
            for i, proc in enumerate(self.procs):
                if proc is None:
                    if not self.stopping and time.monotonic() >= self.next_start[i]:
                        self.start(i)
                        alive += 1
                    continue
                code = proc.poll()
                if code is None:
                    alive += 1
                    if time.monotonic() - self.started_at[i] >= HEALTHY_RUN:
                        self.served[i] = True
                    continue
                self.procs[i] = None
                if self.stopping:
                    status = status or (code if code > 0 else 0)
                    continue
                ran = time.monotonic() - self.started_at[i]
                if code == EXIT_REFUSED or (code > 0 and code != EXIT_FAILED and not self.served[i]):
                    # It never got going (a model that cannot load, a taken port): no restart helps.
                    log.error("replica %d could not start (exit status %d): stopping", i, code)
                    self.stop()
                    status = code
                    continue
                self.served[i] = True
                self.backoff[i] = 1.0 if ran >= HEALTHY_RUN else min(self.backoff[i] * 2, RESTART_BACKOFF_MAX)
                self.next_start[i] = time.monotonic() + (0.0 if ran >= HEALTHY_RUN else self.backoff[i])
                log.warning("replica %d exited with status %d after %.0fs; restarting it", i, code, ran)
            if self.stopping and not alive:
                return status
            time.sleep(0.2)


def run_replicas(settings: Settings, count: int, *, hostname: str, loglevel: str) -> int:
    """``embedq worker`` with ``count`` > 1: supervise ``count`` replicas, each started with this process's own
    command line (``sys.orig_argv``: the same flags) and an environment that makes it replica *i*."""
    logging.basicConfig(level=getattr(logging, loglevel.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("supervising %d worker processes for %s", count, settings.device)
    return Supervisor(settings, count, hostname=hostname, argv=list(sys.orig_argv)).run()


def is_replica() -> bool:
    """Is this process a replica started by a supervisor (it never supervises replicas of its own)?"""
    return REPLICA_ENV in os.environ
