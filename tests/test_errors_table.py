"""One error table (issue 38, acceptance c): every class of ``embedq.errors``' tree, walked, carries its code, HTTP
status, TEI ``error_type`` and retryability; the gateway answers each with exactly that status and type on TEI's
routes, OpenAI's routes and ``GET /jobs/{id}``; README's table, OPERATIONS.md's and the module's docstring say the
same.

The gateway is a real ``embedq serve`` process on a real Redis. No worker serves its queue: the test takes each
job the gateway sent off the queue and stores, with the worker's own :class:`~embedq.results.ResultStore`, the
failure its text names, so each class travels the way a worker's error does (Celery's result record, rebuilt by
the gateway's result backend) and reaches the gateway's error handler."""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import GatewayHandle
from kombu.serialization import loads

from embedq import errors, monitor
from embedq.producers.client import Client
from embedq.results import ResultStore
from embedq.settings import Settings

os.environ.setdefault("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
ROOT = Path(__file__).resolve().parents[1]
CLASSES = errors.table()
BY_NAME = {cls.__name__: cls for cls in CLASSES}
PREFIX = "fail with "


def _row(cls: type[errors.EmbedqError]) -> tuple[str, int, str, bool]:
    return cls.code, cls.http_status, cls.error_type, cls.retryable


# -- the table itself -------------------------------------------------------------------------------------------
def test_the_table_is_the_whole_tree_and_each_code_means_one_status():
    def walk(cls):
        return [cls] + [c for sub in cls.__subclasses__() for c in walk(sub)]

    assert walk(errors.EmbedqError) == CLASSES
    assert {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.EmbedqError)} \
        == set(CLASSES)  # the tree is the module: no error class is defined anywhere else
    assert {"JobNotFound", "ModelNotFound", "TooManyInputs"} <= set(BY_NAME)
    for cls in CLASSES:
        assert isinstance(cls.http_status, int) and 400 <= cls.http_status < 600, cls
        assert errors.HTTP_STATUS[cls.code] == cls.http_status, cls  # classes sharing a code share its status
        error = cls("boom")
        assert error.message == f"[{cls.code}] boom"
        assert error.to_dict() == {"code": cls.code, "message": f"[{cls.code}] boom", "retryable": cls.retryable}
    # TEI's own statuses where TEI defines one
    assert _row(errors.EmptyInput)[1:3] == (400, "Empty") and _row(errors.EmptyText)[1:3] == (400, "Empty")
    assert _row(errors.UnsupportedTask)[1:3] == (424, "Backend")
    assert _row(errors.TooManyInputs)[1:3] == (422, "Validation")
    assert _row(errors.Overloaded)[1:3] == (429, "Overloaded")
    assert _row(errors.Unavailable)[1:3] == (503, "Unhealthy")
    assert errors.Cancelled.http_status == 409


def test_the_module_docstring_documents_every_class():
    doc = errors.__doc__ or ""
    for cls in CLASSES:
        line = re.search(rf"^[\s│├└─]*{cls.__name__}\s+(\*\s+)?(\S+)\s+(\d+) (\w+)", doc, re.M)
        assert line, cls.__name__
        star, code, status, error_type = line.groups()
        assert (code, int(status), error_type, bool(star)) == _row(cls), cls.__name__


def _markdown_rows(text: str, header: str) -> list[list[str]]:
    """The rows of the first markdown table after ``header`` whose head starts with ``| code |``."""
    rest = text[text.index(header):]
    lines = rest.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| code |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip().strip("|").split("|")])
    return rows


def test_readme_s_table_is_the_table():
    rows = _markdown_rows((ROOT / "README.md").read_text(), "### Errors")
    got = {name: (code, int(status), error_type, retryable == "yes")
           for code, name, status, error_type, retryable in rows}
    assert got == {cls.__name__: _row(cls) for cls in CLASSES}


def test_operations_table_agrees():
    rows = _markdown_rows((ROOT / "docs" / "OPERATIONS.md").read_text(), "| code | HTTP | retryable | when |")
    assert len(rows) > 15
    for code, status, retryable, *_ in rows:
        cls = next(c for c in CLASSES if c.code == code)
        assert (int(status), retryable == "yes") == (cls.http_status, cls.retryable), code


# -- what the gateway answers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def failing(redis_server, tmp_path_factory):
    """A gateway on a queue no worker serves, and a thread that fails each job it sends with the error class its
    text names (``fail with <Class>``), stored as a worker stores it; the thread registers as a live worker of the
    queue (else the gateway would answer 503 ``no_worker`` before sending)."""
    queue = f"embedq.test.errors.{uuid.uuid4().hex[:8]}"
    settings = Settings(broker_url=redis_server.url, queue=queue)
    client = Client(settings)
    r, store = client.redis(), ResultStore(client.app)
    stop = threading.Event()

    def fail_jobs() -> None:
        published = 0.0
        while not stop.is_set():
            if time.monotonic() - published > monitor.REPORT_INTERVAL:  # it serves the queue: the registry says so
                monitor.publish_worker(r, {"hostname": f"errors-table@{queue}", "ready": True, "queues": [queue],
                                           "model": "a thread of this test"})
                published = time.monotonic()
            popped = r.brpop([settings.queue_name], timeout=0.2)
            if popped is None:
                continue
            message = json.loads(popped[1])
            args = loads(base64.b64decode(message["body"]), message["content-type"], message["content-encoding"])[0]
            text = args[0][0]
            store.store(message["headers"]["id"], BY_NAME[text[len(PREFIX):]]("stored by the test"))

    thread = threading.Thread(target=fail_jobs, daemon=True)
    thread.start()
    g = GatewayHandle(redis_server.url, queue, tmp_path_factory.mktemp("gw-errors") / "gw.log")
    yield g
    g.stop()
    stop.set()
    thread.join(5)
    monitor.withdraw_worker(r, f"errors-table@{queue}")
    client.close()


@pytest.mark.integration
def test_the_gateway_answers_every_class_with_its_table_status(failing):
    gateway = failing

    def tei(cls):
        return httpx.post(gateway.url + "/embed", json={"inputs": [PREFIX + cls.__name__]}, timeout=60)

    def openai(cls):
        return httpx.post(gateway.url + "/v1/embeddings", json={"input": [PREFIX + cls.__name__], "model": "m"},
                          timeout=60)

    def job(cls):
        started = httpx.post(gateway.url + "/jobs", json={"kind": "embed", "body": {"inputs": PREFIX + cls.__name__}},
                             timeout=60)
        assert started.status_code == 202, started.text
        deadline = time.monotonic() + 60
        while (state := httpx.get(f"{gateway.url}/jobs/{started.json()['id']}", timeout=60).json())["status"] \
                == "queued" and time.monotonic() < deadline:
            time.sleep(0.1)
        return state

    with ThreadPoolExecutor(16) as pool:
        answers = {cls: (pool.submit(tei, cls), pool.submit(openai, cls), pool.submit(job, cls)) for cls in CLASSES}
        answers = {cls: tuple(f.result() for f in futures) for cls, futures in answers.items()}
    for cls, (tei_answer, openai_answer, job_state) in answers.items():
        status, error_type, prefix = cls.http_status, cls.error_type, f"[{cls.code}] "
        assert (tei_answer.status_code, tei_answer.json()) == (
            status, {"error": prefix + "stored by the test", "error_type": error_type}), cls.__name__
        body = openai_answer.json()
        assert openai_answer.status_code == status and body["code"] == status and body["type"] == error_type, \
            (cls.__name__, openai_answer.status_code, body)
        assert body["error"] == {"message": prefix + "stored by the test", "type": error_type, "param": None,
                                 "code": str(status)}, cls.__name__
        assert job_state["status"] == "failed" and job_state["code"] == status, (cls.__name__, job_state)
        assert job_state["error"] == {"error": prefix + "stored by the test", "error_type": error_type}, cls.__name__
    # and the OpenAPI document lists every status the table holds, on every job route
    doc = httpx.get(gateway.url + "/openapi.json").json()
    statuses = {str(cls.http_status) for cls in CLASSES}
    for path in ("/embed", "/v1/embeddings", "/jobs", "/rerank"):
        assert statuses <= set(doc["paths"][path]["post"]["responses"]), path
