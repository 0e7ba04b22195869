"""Operations: Flower's API, the worker's Prometheus endpoint, ``embedq status`` and the per-batch log line.

One private redis-server, one real ``embedq worker`` (metrics on a free port) and one real Flower process
(basic auth) serve the module; the tests run in file order and each measures only its own jobs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import FAKE, WorkerHandle
from kombu import Connection
from prometheus_client.parser import text_string_to_metric_families

from embedq import keys, monitor
from embedq.broker import redis_client
from embedq.producers.embedded import RedisServer, free_port
from embedq.settings import Settings
from embedq.workers.metrics import exported_names

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AUTH = ("ops", "s3cret-flower-pass")
MARKER = "zebra-marker-7f3a"  # a word in the texts that no monitoring output may contain
IDLE_QUEUE = "embedq.test.nobody-consumes"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ops")
    server = RedisServer().start()
    settings = Settings(broker_url=server.url, queue=f"embedq.test.ops-{uuid.uuid4().hex[:6]}",
                        metrics_port=free_port(), metrics_addr="127.0.0.1")
    worker = WorkerHandle(settings, logs / "worker.log")
    flower_port = free_port()
    env = dict(os.environ, EMBEDQ_BROKER_URL=server.url, EMBEDQ_FLOWER_BASIC_AUTH=":".join(AUTH))
    flower_log = open(logs / "flower.log", "wb")  # noqa: SIM115 - closed at teardown
    # --inspect_timeout (Flower's, ms; default 1 s): how long ?refresh=1 waits for a worker's inspect replies. A
    # worker busy embedding may answer later than 1 s on a loaded machine; asked by name (?workername=) Flower
    # returns at the first reply, so a long bound costs nothing when the worker is quick.
    flower = subprocess.Popen([sys.executable, "-m", "embedq", "flower", f"--port={flower_port}",
                               "--address=127.0.0.1", "--inspect_timeout=30000"], env=env, stdout=flower_log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    stack = {"server": server, "settings": settings, "worker": worker, "flower": flower,
             "flower_url": f"http://127.0.0.1:{flower_port}", "flower_log": logs / "flower.log"}
    try:
        yield stack
    finally:
        flower.terminate()
        try:
            flower.wait(15)
        except subprocess.TimeoutExpired:
            flower.kill()
        flower_log.close()
        worker.stop()
        server.stop()


def _flower(stack, path: str, *, auth: bool = True, timeout: float = 30.0):
    headers = {"Authorization": "Basic " + base64.b64encode(":".join(AUTH).encode()).decode()} if auth else {}
    req = urllib.request.Request(stack["flower_url"] + path, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (OSError, urllib.error.URLError, ValueError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def _texts(n: int, tag: str) -> list[str]:
    return [f"{MARKER} {tag} text number {i} about embeddings and queues" for i in range(n)]


# -- a. Flower ------------------------------------------------------------------------------------
def test_a_flower_api_shows_our_tasks_and_worker(stack):
    worker: WorkerHandle = stack["worker"]
    node = _wait(lambda: [n for n, alive in _flower(stack, "/api/workers?status=true").items()
                          if alive and f"-{worker.proc.pid}@" in n], 60, "Flower to see the worker online")[0]
    with pytest.raises(urllib.error.HTTPError) as denied:
        _flower(stack, "/api/tasks", auth=False)
    assert denied.value.code == 401

    client = worker.client
    good = [client.submit(_texts(3, f"flower-{i}"), dimensions=64) for i in range(4)]
    bad = client.submit(_texts(2, "flower-bad"), dimensions=100_000)
    for handle in good:
        assert handle.result(60).shape == (3, 64)
    with pytest.raises(Exception, match="dimensions"):
        bad.result(60)

    ids = {h.id for h in good} | {bad.id}

    def tasks_done():
        tasks = _flower(stack, "/api/tasks?limit=1000")
        mine = {tid: t for tid, t in tasks.items() if tid in ids}
        if len(mine) == len(ids) and all(t["state"] in ("SUCCESS", "FAILURE") for t in mine.values()):
            return tasks
        return None

    tasks = _wait(tasks_done, 60, "Flower to report our 5 tasks finished")
    for handle in good:
        t = tasks[handle.id]
        assert t["name"] == "embedq.embed"
        assert t["state"] == "SUCCESS"
        assert t["args"] == "[3 texts]"
        assert "all-MiniLM-L6-v2" in t["kwargs"] and stack["settings"].queue_name in t["kwargs"]
        assert "'dimensions': 64" in t["kwargs"]
        assert "class='online'" in t["kwargs"]
        assert t["worker"] == node
        assert isinstance(t["runtime"], float) and 0 <= t["runtime"] < 60
        assert t["received"] and t["started"] and t["succeeded"]
        assert t["received"] <= t["started"] <= t["succeeded"]
    failed = tasks[bad.id]
    assert failed["state"] == "FAILURE" and failed["args"] == "[2 texts]"
    assert "invalid_dimensions" in failed["exception"]
    assert MARKER not in json.dumps(tasks)

    # While the worker holds jobs, Flower's worker view (inspect reserved, stats) shows no texts either. Only a
    # view of one worker (?workername=) asks for its task lists (reserved, active, scheduled, revoked).
    held = [client.submit([*_texts(4, f"held-{i}"), "long " * 200]) for i in range(40)]
    workers = _flower(stack, f"/api/workers?refresh=1&workername={urllib.parse.quote(node)}", timeout=120)
    for handle in held:
        handle.result(120)
    info = workers[node]
    missing = {"stats", "registered", "active_queues", "reserved"} - set(info)
    assert not missing, f"Flower's inspect got no reply for {missing} (see its log): {sorted(info)}"
    assert info["stats"]["embedq"]["model"].endswith("all-MiniLM-L6-v2")
    assert info["stats"]["embedq"]["device"] == "cpu"
    assert info["stats"]["embedq"]["dtype"] == "float32"
    assert "embedq.embed" in info["registered"]
    assert [q["name"] for q in info["active_queues"]] == stack["settings"].queues  # online and bulk
    for request in info.get("reserved") or []:
        assert re.fullmatch(r"\[\d+ texts\]", request["args"]), request
    assert MARKER not in json.dumps(workers)
    assert ":".join(AUTH) not in stack["flower_log"].read_text(errors="replace")


# -- b. Prometheus --------------------------------------------------------------------------------
def _scrape(stack) -> dict[tuple[str, tuple], float]:
    url = f"http://127.0.0.1:{stack['settings'].metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _v(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _idle(samples):
    """The worker holds no job, and every job it received has been observed (``job_seconds``: on the consumer thread,
    after the result is stored; the window's gauge alone can say 0 before the last ones are)."""
    observed = sum(v for (name, _), v in samples.items() if name == "embedq_job_seconds_count")
    done = _v(samples, "embedq_jobs_in_flight") == 0 and observed >= _v(samples, "embedq_jobs_received_total")
    return samples if done else None


def _delta(after, before, name: str, **labels) -> float:
    return _v(after, name, **labels) - _v(before, name, **labels)


def test_b_metrics_move_by_exactly_what_the_jobs_did(stack):
    worker: WorkerHandle = stack["worker"]
    queue = stack["settings"].queue_name
    # Quiescent first: the last jobs of earlier tests are acknowledged (and observed) on the consumer thread
    # just after their results are stored.
    before = _wait(lambda: _idle(_scrape(stack)), 30, "the worker to be idle")
    log_offset = worker.log_path.stat().st_size
    names = {name for name, _ in before}
    families = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in names if n.startswith("embedq_")}
    assert families == exported_names(worker=True), families ^ exported_names(worker=True)

    client = worker.client
    good = [client.submit(_texts(3, f"metrics-{i}")) for i in range(10)]
    too_wide = client.submit(_texts(2, "wide"), dimensions=100_000)  # invalid_dimensions, at the worker
    other_model = client.submit(_texts(2, "other"), model="some/other-model")  # unknown_model, at the worker
    tokens = 0
    for handle in good:
        handle.result(60)
        tokens += handle.usage["tokens"]
    for handle in (too_wide, other_model):
        with pytest.raises(Exception):  # noqa: B017 - the codes are checked through the metrics below
            handle.result(60)

    def settled():
        after = _scrape(stack)
        done = (_delta(after, before, "embedq_job_seconds_count", traffic_class="online") >= 12
                and _v(after, "embedq_jobs_in_flight") == 0)
        return after if done else None

    after = _wait(settled, 30, "the worker to account for all 12 jobs")
    d = lambda name, **labels: _delta(after, before, name, **labels)  # noqa: E731
    assert d("embedq_jobs_received_total") == 12
    assert d("embedq_jobs_succeeded_total") == 10
    assert d("embedq_jobs_failed_total", code="invalid_dimensions") == 1
    assert d("embedq_jobs_failed_total", code="unknown_model") == 1
    assert d("embedq_items_received_total") == 34
    assert d("embedq_items_succeeded_total") == 30
    assert d("embedq_items_failed_total", code="invalid_dimensions") == 2
    assert d("embedq_items_failed_total", code="unknown_model") == 2
    # Only the 30 good texts reach the model; the bad jobs fail before it.
    batches = d("embedq_batches_total")
    assert batches >= 1
    assert d("embedq_batch_items_count") == batches == d("embedq_inference_seconds_count")
    assert d("embedq_batch_items_sum") == 30
    assert d("embedq_real_tokens_total") == tokens == d("embedq_batch_real_tokens_sum")
    assert d("embedq_padded_tokens_total") == d("embedq_batch_tokens_sum") >= tokens
    assert d("embedq_inference_seconds_sum") > 0
    assert d("embedq_tokenize_seconds_count") == 10
    online = {"traffic_class": "online"}  # waits are labelled by traffic class; these jobs are all online
    assert d("embedq_queue_seconds_count", **online) == 12  # every job carried the producer's send time
    assert d("embedq_buffer_seconds_count", **online) == 10
    assert d("embedq_job_seconds_count", **online) == 12
    assert d("embedq_class_jobs_received_total", **online) == 12
    assert d("embedq_class_items_embedded_total", **online) == 30
    assert d("embedq_jobs_cancelled_total") == 0
    assert d("embedq_items_deduplicated_total") == 0  # 30 distinct texts (issue 57: repeats would count here)
    assert d("embedq_online_started_total") == 10  # the failing two never reached a micro-batch
    assert d("embedq_online_wait_seconds_total") > 0 and d("embedq_preemptions_total") == 0  # nothing bulk ran
    bucket = ("embedq_batch_items_bucket", (("le", "+Inf"),))
    assert after[bucket] - before.get(bucket, 0) == batches
    assert _v(after, "embedq_items_in_flight") == 0 and _v(after, "embedq_jobs_in_flight") == 0
    assert _v(after, "embedq_model_load_seconds") > 0
    assert _v(after, "embedq_broker_up") == 1
    # Depths are read from Redis at most every 2 s (and shared between workers for 5 s): a fresh read finds
    # the queue empty.
    _wait(lambda: _v(_scrape(stack), "embedq_queue_depth", queue=queue) == 0, 20, "the queue depth to read 0")
    info = [labels for (name, labels) in after if name == "embedq_worker_info"]
    assert info and dict(info[0])["device"] == "cpu" and dict(info[0])["queue"] == ",".join(stack["settings"].queues)

    # Logs: one INFO line per micro-batch, and nothing else at INFO while jobs run (no texts, ever).
    with worker.log_path.open("rb") as fh:
        fh.seek(log_offset)
        lines = fh.read().decode(errors="replace").splitlines()
    info_lines = [line for line in lines if " INFO " in line]
    batch_lines = [line for line in info_lines if re.search(r"micro-batch: \d+ items, \d+ real / \d+ padded "
                                                            r"tokens, [\d.]+ ms", line)]
    assert len(batch_lines) == batches, info_lines
    assert info_lines == batch_lines
    assert sum(int(re.search(r"(\d+) items", line).group(1)) for line in batch_lines) == 30
    assert MARKER not in "\n".join(lines)


def test_queue_depth_counts_waiting_and_unacknowledged_messages(stack, monkeypatch):
    """Against kombu's own records: messages received and not acknowledged count, per queue."""
    settings: Settings = stack["settings"]
    # The stored copy is reused within DEPTHS_TTL (read when it is stored): long here, so that no pause of a loaded
    # machine between two reads lets it lapse; expiry is what deleting the key stands for below.
    monkeypatch.setattr(monitor, "DEPTHS_TTL", 3600.0)
    client = redis_client(settings)
    qa, qb = f"embedq.test.depth-a-{uuid.uuid4().hex[:6]}", f"embedq.test.depth-b-{uuid.uuid4().hex[:6]}"
    with Connection(settings.broker_url) as conn:
        a, b = conn.SimpleQueue(qa), conn.SimpleQueue(qb)
        for i in range(5):
            a.put({"n": i, "pad": "x" * 3000})  # entries longer than the 512 bytes the script reads
        for i in range(3):
            b.put({"n": i})
        taken = [a.get(timeout=5) for _ in range(2)]  # received, not acknowledged: in kombu's unacked hash
        depths = monitor.queue_depths(client)
        assert (depths[qa].waiting, depths[qa].unacked, depths[qa].depth) == (3, 2, 5)
        assert (depths[qb].waiting, depths[qb].unacked) == (3, 0)
        # Shared between workers: the first read counts and stores, the next reads within the TTL reuse it ...
        client.delete(keys.DEPTHS_KEY)
        assert monitor.shared_queue_depths(client, [qa])[qa].unacked == 2
        for message in taken:
            message.ack()
        assert monitor.queue_depths(client, [qa])[qa].unacked == 0
        assert monitor.shared_queue_depths(client, [qa])[qa].unacked == 2
        # ... unless a queue is missing from it (just declared), or the shared copy has expired (deleted here).
        qc = f"embedq.test.depth-c-{uuid.uuid4().hex[:6]}"
        assert monitor.shared_queue_depths(client, [qa, qc])[qa].unacked == 0
        client.delete(keys.DEPTHS_KEY)
        assert monitor.shared_queue_depths(client, [qa])[qa].unacked == 0
        assert client.pttl(keys.DEPTHS_KEY) > 60_000  # stored for DEPTHS_TTL as read at call time (patched)
        a.close()
        b.close()
    client.delete(keys.DEPTHS_KEY)  # the worker's scrapes must not reuse this test's hour-long copy
    client.close()


# -- c. embedq status -----------------------------------------------------------------------------
def _status(stack, *args: str, broker: str | None = None, timeout: float = 60, columns: int = 100):
    env = dict(os.environ, EMBEDQ_BROKER_URL=broker or stack["server"].url, COLUMNS=str(columns))
    return subprocess.run([sys.executable, "-m", "embedq", "status", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"[│┃|]", row) if cell.strip()]


def _workers_table(text: str) -> tuple[list[str], list[dict[str, str]]]:
    """The headers and rows of the status's live-workers table. A long node name or model id folds over several
    lines; a row's continuation lines have an empty ``device`` cell, and their pieces are joined back."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Live workers:"))
    headers = [cell.strip() for cell in lines[start + 1].split("┃")]
    rows: list[dict[str, str]] = []
    for line in lines[start + 3:]:
        if "│" not in line:
            break
        cells = [cell.strip() for cell in line.split("│")]
        assert len(cells) == len(headers), line
        if cells[headers.index("device")]:
            rows.append(dict(zip(headers, cells)))
        else:
            rows[-1] = {h: rows[-1][h] + c for h, c in zip(headers, cells)}
    return headers, rows


def _fresh_record(client, worker: WorkerHandle, after: float) -> dict | None:
    """The worker's registry record if it was reported later than ``after`` (``time.time()``), else None."""
    mine = [r for r in monitor.live_workers(client) if r.get("pid") == worker.proc.pid]
    return mine[0] if mine and mine[0].get("reported_at", 0.0) > after else None


def test_c_status_lists_queue_depths_and_the_live_worker(stack):
    worker: WorkerHandle = stack["worker"]
    for i in range(3):  # jobs nobody consumes: they wait in the list
        worker.client.submit(_texts(1, f"idle-{i}"), queue=IDLE_QUEUE)
    done = worker.client.submit(_texts(2, "status"))
    done.result(60)
    finished = time.time()
    # The worker's counters count a job before its result is stored, and its record reads them after stamping
    # reported_at: a record stamped after `finished` carries them. Its rates come from a sample taken just before
    # the stamp, so wait for the record after that one too, whose sample is surely later than `finished`.
    client = redis_client(stack["settings"])
    try:
        first = _wait(lambda: _fresh_record(client, worker, finished), 60,
                      "a worker record reported after the job finished")
        _wait(lambda: _fresh_record(client, worker, first["reported_at"]), 60, "the worker's next record")
    finally:
        client.close()

    (mine,) = [r for r in json.loads(_status(stack, "--json").stdout)["workers"] if r["pid"] == worker.proc.pid]
    for columns in (80, 100):  # the default table fits a terminal of 80 or 100 columns: every header whole
        out = _status(stack, columns=columns)
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert max(len(line) for line in text.splitlines()) <= columns, text
        assert "Queues" in text and "Live workers: 1" in text
        idle_row = next(line for line in text.splitlines() if IDLE_QUEUE in line)
        assert _cells(idle_row)[-3:] == ["3", "0", "3"]  # waiting, unacked, depth
        headers, (row,) = _workers_table(text)
        assert headers == ["worker", "model", "device", "held", "texts/s", "failed", "up", "metrics"], text
        assert f"-{worker.proc.pid}@" in row["worker"] and row["model"].endswith("all-MiniLM-L6-v2"), row
        assert row["device"] == "cpu" and row["held"].isdigit(), row
        assert row["failed"] == str(mine["counters"]["jobs_failed"]), row  # the earlier tests' failed jobs
        assert row["metrics"] == f":{stack['settings'].metrics_port}", row
        assert "recent throughput" in text and "dead letters: 0" in text
        assert "--wide" in text and "Online and bulk" not in text  # the details are on request

    # Piped with no COLUMNS (a pager, a log): as wide as the table needs, each worker on one line (issue 51, item 7:
    # it folded at 80 columns)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    piped = subprocess.run([sys.executable, "-m", "embedq", "status"], env=dict(env, EMBEDQ_BROKER_URL=stack[
        "server"].url), capture_output=True, text=True, timeout=60).stdout
    (line,) = [line for line in piped.splitlines() if f"-{worker.proc.pid}@" in line]
    assert _cells(line)[1].endswith("all-MiniLM-L6-v2") and _cells(line)[2] == "cpu", piped

    wide = _status(stack, "--wide", columns=80).stdout  # every column, as wide as they need
    headers, (row,) = _workers_table(wide)
    assert headers[:5] == ["worker", "model", "device", "dtype", "queues"] and "tokens/s" in headers, wide
    assert row["dtype"] == "float32" and row["queues"] == ",".join(stack["settings"].queues), row
    assert row["deduplicated"] == f"{mine['counters']['items_deduplicated']:,}", row  # (issue 57)
    assert "Online and bulk" in wide
    traffic_row = [line for line in wide.splitlines() if f"-{worker.proc.pid}@" in line][1]
    assert _cells(traffic_row)[2] == "0", traffic_row  # preemptions: no bulk job ran on this worker
    one = _status(stack, "--worker", str(worker.proc.pid), columns=80)
    assert one.returncode == 0 and f"-{worker.proc.pid}@" in one.stdout, one.stderr
    field = re.compile(r"\s*(\S.*?)\s{2,}(\S.*?)\s*")  # one line of --worker: name, two spaces or more, value
    fields = {m[1]: m[2] for line in one.stdout.splitlines() if (m := field.fullmatch(line))}
    assert fields["dtype"] == "float32" and fields["metrics"] == f":{stack['settings'].metrics_port}", fields
    missing = _status(stack, "--worker", "no-such-worker", columns=80)
    assert missing.returncode == 1 and "no live worker matches 'no-such-worker'" in missing.stderr

    snap = json.loads(_status(stack, "--json").stdout)
    assert snap["queues"][IDLE_QUEUE] == {"waiting": 3, "unacked": 0, "depth": 3}
    (record,) = snap["workers"]
    assert record["pid"] == worker.proc.pid and record["device"] == "cpu" and record["ready"] is True
    assert record["counters"]["items_succeeded"] >= 2
    assert record["rates"]["items_per_s"] > 0  # texts were embedded within the last minute
    assert record["metrics_port"] == stack["settings"].metrics_port
    assert record["preemption"].startswith(("between layers", "off: ONNX Runtime"))
    assert record["counters"]["online_started"] >= 1 and record["timers"]["online_wait_seconds"] > 0


def test_status_on_an_unreachable_broker_fails_fast_and_clearly(stack):
    t0 = time.monotonic()
    out = _status(stack, broker=f"redis://127.0.0.1:{free_port()}/0")
    assert out.returncode == 2
    assert "cannot reach the broker" in out.stderr
    assert time.monotonic() - t0 < 30


def test_a_stopped_worker_leaves_the_registry(stack):
    worker: WorkerHandle = stack["worker"]
    worker.stop()
    snap = json.loads(_status(stack, "--json").stdout)
    assert snap["workers"] == []
    assert "no live workers" in _status(stack).stdout


def test_a_taken_metrics_port_stops_the_worker_with_a_clear_message(stack, tmp_path):
    import socket

    from embedq.producers.embedded import start_worker

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = stack["settings"].model_copy(update={"metrics_port": port, **FAKE})  # (the port is under test)
        proc = start_worker(settings, log_path=tmp_path / "w.log")
        assert proc.wait(120) != 0
    assert f"cannot serve metrics on 127.0.0.1:{port}" in Path(tmp_path / "w.log").read_text()


def test_a_worker_stops_clearly_when_every_default_metrics_port_is_taken():
    import socket
    from types import SimpleNamespace

    from embedq.workers import observe
    from embedq.workers.metrics import DEFAULT_PORTS, WorkerMetrics

    held = []
    try:
        for port in DEFAULT_PORTS:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the endpoint does: TIME_WAIT is free
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
                held.append(sock)
            except OSError:
                sock.close()  # taken already, by another program
        worker = SimpleNamespace(settings=Settings(metrics_port=None, metrics_addr="127.0.0.1"),
                                 metrics=WorkerMetrics())
        with pytest.raises(SystemExit, match=r"every default port on 127\.0\.0\.1 \(9808-9839\) is taken; set "
                           r"EMBEDQ_METRICS_PORT to a free port, or 0 for none"):
            observe.serve_metrics(worker)
        assert worker.metrics.port is None
    finally:
        for sock in held:
            sock.close()


def _scraped_ports(config: Path) -> dict[str, set[int]]:
    """Ports the ``embedq-workers`` job of an ops/ Prometheus configuration scrapes, by machine."""
    import yaml

    job = next(j for j in yaml.safe_load(config.read_text())["scrape_configs"] if j["job_name"] == "embedq-workers")
    out: dict[str, set[int]] = {}
    for group in job["static_configs"]:
        for target in group["targets"]:
            host, port = target.rsplit(":", 1)
            out.setdefault(host, set()).add(int(port))
    return out


def test_two_workers_on_one_host_both_serve_with_metrics_where_prometheus_looks(stack, tmp_path):
    """The README's command twice on one machine, same settings, no per-worker port: both start, both take jobs,
    each serves its metrics on its own default port, which the registry and `embedq status` announce and
    ops/prometheus.yml scrapes on every machine."""
    from embedq.workers.metrics import DEFAULT_PORTS

    settings = Settings(broker_url=stack["server"].url, queue=f"embedq.test.two-{uuid.uuid4().hex[:6]}",
                        metrics_port=None,  # unset, as in the README: no EMBEDQ_METRICS_PORT in the workers' env
                        **FAKE)  # the fake model: the ports and the registry are under test, not the vectors
    workers = []
    try:
        for i in range(2):  # one after the other: the second one starts while the first holds its port
            workers.append(WorkerHandle(settings, tmp_path / f"worker-{i}.log"))
        pids = {w.proc.pid for w in workers}
        client = redis_client(settings)
        try:
            records = _wait(lambda: (r := [w for w in monitor.live_workers(client) if w.get("pid") in pids])
                            and len(r) == 2 and r, 60, "both workers in the registry")
        finally:
            client.close()
        ports = {r["pid"]: r["metrics_port"] for r in records}
        assert all(r["queues"] == settings.queues for r in records), records
        assert len(set(ports.values())) == 2 and set(ports.values()) <= set(DEFAULT_PORTS), ports

        # Both take jobs: bursts of one-text jobs until each worker has finished some (the first burst does, unless
        # one worker's window swallowed it whole; the bound is only a safety net).
        for burst in range(20):
            handles = workers[0].client.submit_many([_texts(1, f"two-{burst}-{i}") for i in range(8)])
            workers[0].client.collect(handles, timeout=60)
            done = [w.stats()["jobs_succeeded"] for w in workers]
            if all(done):
                break
        assert all(done), f"a worker took no job: {done}"

        # Each endpoint answers on its port, which ops/prometheus.yml scrapes on every machine it lists.
        scraped = _scraped_ports(Path(__file__).resolve().parents[1] / "ops" / "prometheus.yml")
        assert scraped and all(set(ports.values()) <= p for p in scraped.values()), scraped
        for w in workers:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[w.proc.pid]}/metrics", timeout=10) as resp:
                samples = {s.name: s.value for f in text_string_to_metric_families(resp.read().decode())
                           for s in f.samples}
            assert samples["embedq_jobs_succeeded_total"] >= 1
        out = _status(stack, columns=100)
        _headers, rows = _workers_table(out.stdout)
        shown = {row["worker"]: row["metrics"] for row in rows}
        for pid, port in ports.items():
            assert [m for name, m in shown.items() if f"-{pid}@" in name] == [f":{port}"], out.stdout
    finally:
        for w in workers:
            w.stop()


def test_the_operations_guide_documents_every_metric():
    guide = (Path(__file__).resolve().parents[1] / "docs" / "OPERATIONS.md").read_text()
    table = {re.sub(r"_total$", "", name) for name in re.findall(r"^\| `(embedq_\w+)`", guide, flags=re.M)}
    assert table == exported_names(), table ^ exported_names()
