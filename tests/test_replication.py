"""``EMBEDQ_REPLICA_ACKS``: a job's message, its result and the gateway's async-job record wait (Redis ``WAIT``) for
replicas before the producer returns, the worker acknowledges, the gateway answers. Real primary and replica."""

from __future__ import annotations

import logging
import signal
import time
import uuid

import pytest
import redis
from conftest import FAKE, WorkerHandle

from embedq.producers.client import Client
from embedq.producers.embedded import RedisServer
from embedq.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
def primary_and_replica(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "r").mkdir()
    primary = RedisServer(dir=str(tmp_path / "p")).start()
    replica = RedisServer(dir=str(tmp_path / "r"), extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start()
    r = redis.Redis(port=replica.port, decode_responses=True)
    end = time.monotonic() + 30
    while r.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < end, "the replica never synced"
        time.sleep(0.05)
    yield primary, replica
    replica.stop()
    primary.stop()


def test_with_replica_acks_a_job_and_its_result_are_on_the_replica_when_submit_and_the_ack_return(
        primary_and_replica, tmp_path, caplog):
    primary, replica = primary_and_replica
    settings = Settings(broker_url=primary.url, queue=f"embedq.test.{uuid.uuid4().hex[:8]}", replica_acks=1,
                        replica_ack_timeout=1.0, **FAKE)
    on_replica = redis.Redis(port=replica.port)
    with Client(settings) as client:
        handle = client.submit(["on the replica before submit returns"])
        # WAIT returned: the message is on the replica now (no worker has taken it: none runs yet)
        assert on_replica.llen(settings.queue_name) == 1
        worker = WorkerHandle(settings, tmp_path / "worker.log")
        try:
            assert handle.result(timeout=60, forget=False).shape == (1, 32)
            worker.wait_until(lambda st: st.get("held_messages", 1) == 0, "the job acknowledged")
            assert on_replica.exists(f"celery-task-meta-{handle.id}")
            # a replica that does not answer: the write is not refused, its wait is bounded and it is logged
            assert replica.proc is not None
            replica.proc.send_signal(signal.SIGSTOP)
            try:
                with caplog.at_level(logging.WARNING, logger="embedq.connection"):
                    started = time.monotonic()
                    late = client.submit(["the replica sleeps"])
                    waited = time.monotonic() - started
                assert "1 job message(s) reached 0 of 1 replicas" in caplog.text
                assert waited >= 0.9  # it did wait for the replica (replica_ack_timeout)
                assert late.result(timeout=60).shape == (1, 32)
                # the result is published inside the pipeline, before its WAIT returns and the worker logs: the line
                # is written once the job is acknowledged (after its store returned)
                worker.wait_until(lambda st: st.get("held_messages", 1) == 0, "the late job acknowledged")
                assert "1 result(s) reached 0 of 1 replicas" in worker.log()
            finally:
                replica.proc.send_signal(signal.SIGCONT)
        finally:
            worker.stop()
    on_replica.close()
