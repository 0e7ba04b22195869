"""The split layout (issue 53: ``embedq worker --device-process``, embedq/workers/split.py): one device process and two
host processes under one supervisor, on the fake model (what is under test is where jobs go when a process dies, not
the vectors) and a Redis of the test's own.

* Jobs sent to the worker are answered by its hosts with the vectors the model gives them alone.
* A host process SIGKILLed during a burst: the device drops its jobs at once, the supervisor restarts the host, and
  every job is answered, once (its messages come back after ``visibility_timeout``).
* The device process SIGKILLed during a burst: every host sees it at once, hands every message it holds back and
  exits with status 70; the supervisor restarts the device and the hosts, and every job is answered, once.

"Once": every record stored for a job is a success with the same vectors (tests/faults/test_crashes.py's Recorder).
"""

from __future__ import annotations

import re
import time
import uuid

import numpy as np
import psutil
import pytest
import redis
from conftest import FAKE
from test_crashes import Recorder

from embedq import errors
from embedq.backends.fake import FakeBackend
from embedq.producers.client import Client
from embedq.producers.embedded import RedisServer, free_port, start_worker, stop_worker, wait_for_worker
from embedq.protocol import EmbedOptions, decode_result
from embedq.settings import Settings
from embedq.workers.delivery import dead_letters
from embedq.workers.replicas import METRICS_PORT_STEP

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

HOSTS = 2
STATE_TIMEOUT = 180.0  # bounds each wait for a state; never a pause
#: One-text jobs of a burst, and the fake model's milliseconds per item (embedq/backends/fake.py): the burst runs for
#: seconds, so a kill after the first answer lands while every process holds jobs (an instant model holds none).
BURST = 2000
ITEM_MS = 2
#: The word that makes the fake model's process SIGKILL itself (EMBEDQ_FAKE_POISON): a job that kills the device.
POISON = "nightshade"


@pytest.fixture
def split(tmp_path, request):
    """A Redis of the test's own and a split worker on it (supervisor, device, two hosts), with a Client; a test's
    ``split_settings`` mark adds settings."""
    marker = request.node.get_closest_marker("split_settings")
    extra = dict(marker.kwargs) if marker else {}
    with RedisServer() as server:
        settings = Settings(broker_url=server.url, queue=f"embedq.test.split.{uuid.uuid4().hex[:8]}",
                            worker_processes=HOSTS, device_process=True, visibility_timeout=5,
                            online_queue_limit=0, **FAKE, **extra)
        log = tmp_path / "worker.log"
        proc = start_worker(settings, log_path=log, extra_env={"EMBEDQ_FAKE_ITEM_MS": str(ITEM_MS),
                                                               "EMBEDQ_FAKE_POISON": POISON})
        client = Client(settings)
        try:
            wait_for_worker(client.app, proc, timeout=STATE_TIMEOUT, log_path=log, processes=HOSTS)
            yield settings, proc, client, log
        finally:
            stop_worker(proc)
            client.close()


def _children(proc) -> dict[str, int]:
    """The supervisor's children by role: ``device`` and ``host-<pid>``."""
    out = {}
    for child in psutil.Process(proc.pid).children():
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        out["device" if "embedq.workers.device_main" in cmd else f"host-{child.pid}"] = child.pid
    return out


def _run_or_shared(stats: dict) -> int:
    """Items the model ran, and items that took an identical item's row (workers/dedupe.py)."""
    return stats.get("items", 0) + stats.get("items_deduplicated", 0)


def _texts(n: int, tag: str) -> list[str]:
    return [f"{tag} text {i} about coalescing workers and one device" for i in range(n)]


def _reference(texts: list[str]) -> np.ndarray:
    backend = FakeBackend()
    options = EmbedOptions.parse({})
    out = [decode_result(backend.finish("embed", backend.forward(p.items), p, options))[0]
           for p in (backend.prepare("embed", [t], options) for t in texts)]
    return np.concatenate(out)


def _wait(ready, what: str) -> None:
    end = time.monotonic() + STATE_TIMEOUT
    while not ready():
        assert time.monotonic() < end, f"never reached: {what}"
        time.sleep(0.05)


def _burst_with_a_kill(settings, proc, client, kill) -> None:
    """Send BURST one-text jobs in one round trip, call ``kill(children)`` as soon as the first is answered, and wait
    for every answer: each equal to the model's alone, and none stored twice with different vectors."""
    recorder = Recorder(settings.broker_url)
    try:
        texts = _texts(BURST, "burst")
        handles = client.submit_many([[t] for t in texts])  # in one round trip: a backlog from the start
        handles[0].result(timeout=STATE_TIMEOUT)
        kill(_children(proc))
        vectors = np.concatenate([h.result(timeout=STATE_TIMEOUT) for h in handles])
        assert np.abs(vectors - _reference(texts)).max() <= 1e-6
    finally:
        recorder.close()
    ids = {h.id for h in handles}
    assert ids <= set(recorder.records)
    for job_id in ids:  # none with two different results
        stored = recorder.records[job_id]
        assert all(r["status"] == "SUCCESS" for r in stored), stored
        first = decode_result(stored[0]["result"])[0]
        assert all(np.abs(decode_result(r["result"])[0] - first).max() <= 1e-6 for r in stored[1:])


def _scrape(port: int) -> dict[str, float]:
    """A metrics endpoint's samples without labels, and ``embedq_*_info`` families by name (their value)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels or sample.name.endswith("_info"):
                out[sample.name] = sample.value
    return out


@pytest.mark.split_settings(metrics_port=free_port())
def test_jobs_through_the_device_process_equal_the_model_alone(split):
    settings, proc, client, log = split
    children = _children(proc)
    assert "device" in children and len(children) == HOSTS + 1, children
    texts = _texts(200, "plain")
    handles = [client.submit(texts[k:k + 4]) for k in range(0, len(texts), 4)]
    vectors = np.concatenate([h.result(timeout=STATE_TIMEOUT) for h in handles])
    assert np.abs(vectors - _reference(texts)).max() <= 1e-6
    text = log.read_text()
    assert "device process ready" in text and text.count("connected (pid") == HOSTS

    def parts():  # each host's counters, with its device process's (STATS, once a second)
        stats = [s for node, s in client.workers(2).items() if f"-{proc.pid}-r" in node]
        # (the fake model tokenizes some of these texts alike: those run once, issue 57)
        return len(stats) == HOSTS and all(_run_or_shared(s.get("device_process", {})) >= len(texts) for s in stats)

    _wait(parts, "every host shows the device process's counters")
    stats = list(client.workers(2).values())
    assert {s["device_process"]["pid"] for s in stats} == {children["device"]}
    assert sum(s["jobs_succeeded"] for s in stats) == len(handles)  # the jobs are the hosts' ...
    assert stats[0]["device_process"]["batches"] >= 1  # ... the micro-batches the device's
    # Prometheus: each host and the device process serve their own endpoint (the device's after the hosts'); the
    # device exports the micro-batches, the hosts the jobs, each the other's at 0: sums over the targets add up.
    hosts = [_scrape(settings.metrics_port + METRICS_PORT_STEP * i) for i in range(HOSTS)]
    device = _scrape(settings.metrics_port + METRICS_PORT_STEP * HOSTS)
    assert device["embedq_device_process_info"] == 1 and "embedq_worker_info" not in device
    assert "embedq_broker_up" not in device and all(h["embedq_broker_up"] == 1 for h in hosts)
    assert device["embedq_items_total"] + device["embedq_items_deduplicated_total"] == len(texts)
    assert device["embedq_batches_total"] >= 1
    assert device["embedq_batch_items_count"] == device["embedq_batches_total"]
    assert all(h["embedq_items_total"] == 0 and h["embedq_worker_info"] == 1 for h in hosts)
    assert sum(h["embedq_jobs_succeeded_total"] for h in hosts) == len(handles)
    assert "embedq_jobs_succeeded_total" not in device  # the hosts' (counted there): not twice


def test_a_host_sigkilled_during_a_burst_loses_no_job(split):
    settings, proc, client, log = split
    killed = {}

    def kill(children):
        host = next(pid for role, pid in children.items() if role != "device")
        killed["pid"] = host
        psutil.Process(host).kill()

    _burst_with_a_kill(settings, proc, client, kill)
    text = log.read_text()
    dropped = re.search(rf"\(pid {killed['pid']}\) is gone: (\d+) of its jobs dropped", text)
    assert dropped and int(dropped[1]) > 0, "the kill landed while the host had jobs at the device"
    assert "exited with status -9" in text and "restarting it" in text
    _wait(lambda: len(_children(proc)) == HOSTS + 1, "the host restarted")


def test_the_device_process_sigkilled_during_a_burst_loses_no_job(split):
    settings, proc, client, log = split
    killed = {}

    def kill(children):
        killed["pid"] = children["device"]
        psutil.Process(children["device"]).kill()

    _burst_with_a_kill(settings, proc, client, kill)
    text = log.read_text()
    assert "the device process is gone" in text  # each host's watchdog stopped it and handed its messages back
    handed = [int(n) for n in re.findall(r"handed (\d+) messages back", text)]
    assert handed and max(handed) > 0, "the kill landed while the hosts held jobs"
    assert text.count("device process ready") >= 2  # and a new device process served the rest
    _wait(lambda: "device" in _children(proc) and _children(proc)["device"] != killed["pid"], "a new device")


@pytest.mark.split_settings(max_attempts=2, resend_after=30)
def test_a_job_that_kills_the_device_process_is_dead_lettered_and_the_others_succeed(split):
    """The device tells each host which jobs start (STARTED): when it dies, the hosts blame those, so the poison
    job runs alone next time, kills the device once more, and is dead-lettered after max_attempts (2); the jobs
    blamed with it the first time run alone and succeed."""
    settings, _, client, log = split
    before = [client.submit([f"an ordinary text {i}"]) for i in range(20)]
    poison = client.submit([f"this text is {POISON} to the model"])
    after = [client.submit([f"another ordinary text {i}"]) for i in range(20)]
    with pytest.raises(errors.DeadLetter, match="2 times"):
        poison.result(timeout=STATE_TIMEOUT)
    texts = [f"an ordinary text {i}" for i in range(20)] + [f"another ordinary text {i}" for i in range(20)]
    vectors = np.concatenate([h.result(timeout=STATE_TIMEOUT) for h in [*before, *after]])
    assert np.abs(vectors - _reference(texts)).max() <= 1e-6
    [record] = [r for r in dead_letters(redis.Redis.from_url(settings.broker_url)) if r["id"] == poison.id]
    assert record["crashes"] == 2
    text = log.read_text()
    assert text.count("the device process is gone") >= 2 and "job(s) of the micro-batch in the model" in text
