"""``embedq worker --device-process``: the split layout of issue 53, one device process and N host processes under one
supervisor.

* The **device process** (``python -m embedq.workers.device_main``) loads the model on the device and runs the one
  :class:`~embedq.workers.service.EmbeddingService` of the machine, whose outbox sends rows back
  (:mod:`embedq.workers.device`): it schedules the items of every host's jobs together (online before bulk, the bulk
  share, deadlines, cancellation, preemption between layers) and launches and lands micro-batches. It never touches
  Redis. It listens on a Unix socket (a private directory the supervisor makes) and takes each host that connects.
* Each **host process** is an ordinary ``embedq worker`` (its Celery node ``<name>-r<i>``, prefetch window share,
  leases, hostile-input bounds, canvas, delivery ledger) whose service is a :class:`~embedq.workers.host.HostService`:
  it checks and tokenizes, hands the device token ids through shared memory, and encodes, stores and acknowledges
  what comes back. Its copy of the model is loaded on the CPU for the tokenizer and the heads; it never runs it.

Faults (``tests/test_split.py``): a host that dies is seen by the device at once (EOF): its jobs there are dropped,
the supervisor restarts it, and its messages come back after ``visibility_timeout`` as for any worker. A device
process that dies is seen by every host at once (EOF): each host's watchdog stops it (``the device process is
gone``), which hands every message it holds back to its queue and exits with status 70; the supervisor restarts the
device and the hosts, which connect to the new device. No job is lost and none is stored twice (the delivery ledger
as for any worker).

The supervisor is :class:`~embedq.workers.replicas.Supervisor`'s: the device process is one more child, the last,
restarted with the same back-off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client

from embedq.settings import Settings
from embedq.workers.channel import Channel
from embedq.workers.replicas import METRICS_PORT_STEP, REPLICA_ENV, Supervisor, die_with_parent

log = logging.getLogger(__name__)

#: The environment variable that makes an ``embedq worker`` a host of the device process listening at its path
#: (and tells the device process where to listen). Not for users: the supervisor sets it.
DEVICE_SOCKET_ENV = "EMBEDQ_DEVICE_SOCKET"
#: Seconds a host waits at most for its device process to listen (it loads the model meanwhile).
CONNECT_TIMEOUT = 600.0


def connect(path: str, timeout: float = CONNECT_TIMEOUT) -> Channel:
    """A host's channel to the device process listening at ``path``, once it listens (polled; the device may still be
    loading the model). Raises :class:`ConnectionError` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        try:
            return Channel(Client(path, family="AF_UNIX"))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if time.monotonic() > end:
                raise ConnectionError(f"no device process listens at {path} after {timeout:g}s") from exc
            time.sleep(0.1)


class SplitSupervisor(Supervisor):
    """:class:`~embedq.workers.replicas.Supervisor` with one more child, the last: the device process."""

    def __init__(self, settings: Settings, hosts: int, *, hostname: str, argv: list[str]) -> None:
        super().__init__(settings, hosts + 1, hostname=hostname, argv=argv)
        self.hosts = self.replicas = hosts
        self.folder = tempfile.mkdtemp(prefix="embedq-device-")
        self.socket = os.path.join(self.folder, "device.sock")

    def child_env(self, index: int) -> dict[str, str]:
        """A host's environment: replica *i* of ``hosts`` (its share of the prefetch window), told where its device
        listens; one torch thread and PyTorch's kernels unless set (it never runs the model). The device process's:
        the supervisor's, with where to listen, and the metrics port after the hosts' where one is set (a host's is
        ``EMBEDQ_METRICS_PORT`` + 100 × its index, the device's + 100 × the number of hosts)."""
        if index < self.hosts:
            env = super().child_env(index)
            if self.settings.torch_threads is None:
                env["EMBEDQ_TORCH_THREADS"] = "1"
            if self.settings.linear_kernel == "auto":  # no runtime to choose (or measure at start) for a host
                env["EMBEDQ_LINEAR_KERNEL"] = "torch"
        else:
            env = dict(os.environ)
            env[REPLICA_ENV] = "device"  # never a supervisor of its own
            if self.settings.metrics_port:
                env["EMBEDQ_METRICS_PORT"] = str(self.settings.metrics_port + METRICS_PORT_STEP * self.hosts)
        env[DEVICE_SOCKET_ENV] = self.socket
        return env

    def start(self, index: int) -> None:
        if index < self.hosts:
            super().start(index)
            return
        with contextlib.suppress(FileNotFoundError):  # a dead device's socket: the new one listens afresh
            os.unlink(self.socket)
        self.procs[index] = subprocess.Popen([sys.executable, "-m", "embedq.workers.device_main"],
                                             env=self.child_env(index), preexec_fn=die_with_parent)
        self.started_at[index] = time.monotonic()
        log.info("device process started (pid %d, %s, listening at %s)", self.procs[index].pid,
                 self.settings.device, self.socket)

    def replica_name(self, index: int) -> str:
        """Host *i*'s node name: ``<name>-r<i>``, or the worker's own name when it has one host; the device's is
        only for the log (it is no Celery node)."""
        if index >= self.hosts:
            return "device"
        return self.hostname if self.hosts == 1 else super().replica_name(index)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """The hosts first (each finishes what the device runs for it, stores it, hands the rest back), the device
        once they are gone: a device that stopped first would look dead to a host still stopping."""
        self.stopping = True
        hosts = [proc for proc in self.procs[:self.hosts] if proc is not None]
        for proc in hosts:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)

        def then_the_device() -> None:
            deadline = time.monotonic() + self.settings.shutdown_timeout + 30
            while any(proc.poll() is None for proc in hosts) and time.monotonic() < deadline:
                time.sleep(0.1)
            device = self.procs[self.hosts]
            if device is not None and device.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    device.send_signal(signum)

        threading.Thread(target=then_the_device, name="embedq-stop-device", daemon=True).start()

    def run(self) -> int:
        try:
            return super().run()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def run_split(settings: Settings, hosts: int, *, hostname: str, loglevel: str) -> int:
    """``embedq worker --device-process``: supervise one device process and ``hosts`` host processes."""
    logging.basicConfig(level=getattr(logging, loglevel.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("supervising a device process and %d host processes for %s", hosts, settings.device)
    return SplitSupervisor(settings, hosts, hostname=hostname, argv=list(sys.orig_argv)).run()
