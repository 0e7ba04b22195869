"""Bad and hostile messages against a real worker: each gets its documented typed error, nothing else
is lost, nothing is executed, and no text reaches the worker's log.

Every bad message is sent *raw* (``send_task`` or a hand-built kombu message), bypassing the producer's
own checks: the worker never trusts producers. All of them are in flight together with a good job
each, so bad and good items share the worker's buffer and micro-batches.
"""

from __future__ import annotations

import json
import pickle
import re
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from celery.result import AsyncResult
from conftest import WorkerHandle

from embedq import errors
from embedq.protocol import TASK_NAME
from embedq.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SECRET = f"SECRET-{uuid.uuid4().hex[:12]}"  # in every text sent here; must never appear in the log
MAX_TEXTS, MAX_CHARS, MAX_BYTES = 64, 5000, 64 * 1024
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md"
PICKLE_MARKER = Path("/tmp") / f"embedq-pickle-ran-{uuid.uuid4().hex}"


class _Evil:
    """Unpickling this creates PICKLE_MARKER: proof that a pickle was executed."""

    def __reduce__(self):
        return (open, (str(PICKLE_MARKER), "w"))


def _t(s: str = "text") -> str:
    return f"{s} {SECRET}"


# (name, kind, payload, expected code). kind "task": send_task(args, kwargs); kind "raw": a kombu message
# with the given body bytes / content type / task name.
CASES: list[tuple[str, str, dict, str]] = [
    ("texts is an int", "task", {"args": [5]}, "invalid_type"),
    ("texts is a dict", "task", {"args": [{"text": _t()}]}, "invalid_type"),
    ("texts is null", "task", {"args": [None]}, "invalid_type"),
    ("texts is empty", "task", {"args": [[]]}, "empty_input"),
    ("a text is an int", "task", {"args": [[_t(), 3]]}, "invalid_type"),
    ("a text is null", "task", {"args": [[_t(), None]]}, "invalid_type"),
    ("a text is a list", "task", {"args": [[[_t()]]]}, "invalid_type"),
    ("a text is a float", "task", {"args": [[1.5]]}, "invalid_type"),
    ("a text is empty", "task", {"args": [[_t(), ""]]}, "empty_text"),
    ("an input of token ids is empty", "task", {"args": [[_t(), []]]}, "empty_text"),
    ("a token id is negative", "task", {"args": [[[101, -1, 102]]]}, "invalid_type"),
    ("a token id is a bool", "task", {"args": [[[101, True]]]}, "invalid_type"),
    ("a token id is past the vocabulary", "task", {"args": [[[101, 10**9, 102]]]}, "invalid_text"),
    ("too many texts", "task", {"args": [[_t()] * (MAX_TEXTS + 1)]}, "too_many_texts"),
    ("a text too long", "task", {"args": [["a" * (MAX_CHARS + 1) + SECRET]]}, "text_too_long"),
    ("a lone surrogate", "task", {"args": [[_t("bad \ud800 text")]]}, "invalid_text"),
    ("too many tokens, no truncation", "task", {"args": [[_t("word " * 600)]], "kwargs": {"truncate": False}},
     "too_many_tokens"),
    ("unknown option", "task", {"args": [[_t()]], "kwargs": {"colour": "red"}}, "invalid_option"),
    ("normalize is a string", "task", {"args": [[_t()]], "kwargs": {"normalize": "yes"}}, "invalid_option"),
    ("dimensions 0", "task", {"args": [[_t()]], "kwargs": {"dimensions": 0}}, "invalid_option"),
    ("dimensions negative", "task", {"args": [[_t()]], "kwargs": {"dimensions": -5}}, "invalid_option"),
    ("dimensions a float", "task", {"args": [[_t()]], "kwargs": {"dimensions": 12.5}}, "invalid_option"),
    ("dimensions a string", "task", {"args": [[_t()]], "kwargs": {"dimensions": "64"}}, "invalid_option"),
    ("dimensions a bool", "task", {"args": [[_t()]], "kwargs": {"dimensions": True}}, "invalid_option"),
    ("dimensions above the model's", "task", {"args": [[_t()]], "kwargs": {"dimensions": 100_000}},
     "invalid_dimensions"),
    ("unknown encoding", "task", {"args": [[_t()]], "kwargs": {"encoding": "float64"}}, "invalid_option"),
    ("unknown truncation side", "task", {"args": [[_t()]], "kwargs": {"truncation_side": "middle"}},
     "invalid_option"),
    ("prompt and prompt_name", "task", {"args": [[_t()]], "kwargs": {"prompt": "q: ", "prompt_name": "query"}},
     "invalid_option"),
    ("unknown prompt name", "task", {"args": [[_t()]], "kwargs": {"prompt_name": "nope"}}, "unknown_prompt_name"),
    ("another model", "task", {"args": [[_t()]], "kwargs": {"model": "bert-base-uncased"}}, "unknown_model"),
    ("future protocol version", "task", {"args": [[_t()]], "kwargs": {"v": 99}}, "invalid_option"),
    ("two positional arguments", "task", {"args": [[_t()], [_t()]]}, "invalid_type"),
    ("no positional argument", "task", {"args": []}, "invalid_type"),
    ("args is a string", "raw", {"body": json.dumps([_t(), {}, {}])}, "invalid_type"),
    ("kwargs is a list", "raw", {"body": json.dumps([[[_t()]], ["x"], {}])}, "invalid_option"),
    ("body is an object", "raw", {"body": json.dumps({"texts": [_t()]})}, "invalid_message"),
    ("body is truncated JSON", "raw", {"body": json.dumps([[_t()], {}, {}])[:-7]}, "invalid_message"),
    ("body is not UTF-8", "raw", {"body": b"\xff\xfe\x00" + SECRET.encode()}, "invalid_message"),
    ("body nested 20,000 deep", "raw", {"body": "[" * 20_000 + "]" * 20_000}, "invalid_message"),
    ("pickle", "raw", {"body": pickle.dumps(([[_t()]], {"evil": _Evil()}, {})),
                       "content_type": "application/x-python-serialize", "content_encoding": "binary"},
     "invalid_message"),
    ("yaml", "raw", {"body": f"- ['{_t()}']\n- {{}}\n- {{}}\n", "content_type": "application/x-yaml"},
     "invalid_message"),
    ("unknown compression", "raw", {"body": json.dumps([[_t()], {}, {}]), "compression": "application/x-nope"},
     "invalid_message"),
    ("unknown task name", "raw", {"body": json.dumps([[_t()], {}, {}]), "task": "embedq.embedd"},
     "invalid_message"),
    ("message too large", "raw", {"body": json.dumps([["a" * 1000 + SECRET] * 70, {}, {}])}, "message_too_large"),
    ("bytes for a text (msgpack)", "raw", {"body": __import__("msgpack").packb([[_t().encode()], {}, {}]),
                                           "content_type": "application/x-msgpack", "content_encoding": "binary"},
     "invalid_type"),
]


@pytest.fixture(scope="module")
def guarded(redis_server, tmp_path_factory):
    queue = f"embedq.test.{tmp_path_factory.mktemp('bad').name}"
    settings = Settings(broker_url=redis_server.url, queue=queue, max_texts_per_job=MAX_TEXTS, max_chars=MAX_CHARS,
                        max_message_bytes=MAX_BYTES)
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("logs") / "worker.log")
    yield handle
    handle.stop()


def publish_raw(app, queue: str, body: bytes | str, *, content_type: str = "application/json",
                content_encoding: str = "utf-8", task: str = TASK_NAME, compression: str | None = None) -> str:
    """A hand-built Celery protocol-2 message, body and headers as given."""
    job_id = str(uuid.uuid4())
    headers = {"lang": "py", "task": task, "id": job_id, "root_id": job_id, "parent_id": None, "group": None,
               "retries": 0, "eta": None, "expires": None, "timelimit": [None, None], "argsrepr": "",
               "kwargsrepr": "", "origin": "tests"}
    if compression:
        headers["compression"] = compression
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    with app.connection_for_write() as conn:
        conn.Producer().publish(body, routing_key=queue, exchange="", content_type=content_type,
                                content_encoding=content_encoding, headers=headers, correlation_id=job_id,
                                retry=True)
    return job_id


def send_case(worker: WorkerHandle, kind: str, payload: dict) -> str:
    app, queue = worker.client.app, worker.settings.queue_name
    if kind == "task":
        job_id = str(uuid.uuid4())
        app.send_task(TASK_NAME, args=payload["args"], kwargs=payload.get("kwargs", {}), queue=queue,
                      task_id=job_id)
        return job_id
    return publish_raw(app, queue, **payload)


def documented_codes() -> set[str]:
    """The codes listed in docs/OPERATIONS.md's error table (lines like ``| `code` | ...``)."""
    return set(re.findall(r"^\| `([a-z_]+)` \|", OPERATIONS.read_text(), flags=re.M))


def test_the_table_is_big_and_distinct():
    assert len(CASES) >= 30
    assert len({name for name, *_ in CASES}) == len(CASES)


def test_each_bad_input_gets_its_documented_error_and_the_good_job_beside_it_succeeds(guarded):
    sent = []
    for name, kind, payload, code in CASES:
        bad = send_case(guarded, kind, payload)
        good = guarded.client.submit([_t(f"good job beside {name}")])
        sent.append((name, code, bad, good))
    documented = documented_codes()
    wrong = []
    for name, code, bad_id, good in sent:
        with pytest.raises(errors.EmbedqError) as info:
            AsyncResult(bad_id, app=guarded.client.app).get(timeout=60)
        if info.value.code != code:
            wrong.append(f"{name}: got {info.value.code} ({info.value.message}), expected {code}")
        assert code in documented, f"{code} is not in the error table of docs/OPERATIONS.md"
        vectors = good.result(timeout=60)
        assert vectors.shape == (1, 384) and np.isfinite(vectors).all(), name
    assert not wrong, "\n".join(wrong)
    assert not PICKLE_MARKER.exists(), "a pickle message was deserialised"
    assert SECRET not in guarded.log(), "a text reached the worker's log"
    assert guarded.proc.poll() is None


def test_a_pickle_message_is_refused_and_never_executed(guarded):
    job_id = publish_raw(guarded.client.app, guarded.settings.queue_name,
                         pickle.dumps(([[_t()]], {"evil": _Evil()}, {})),
                         content_type="application/x-python-serialize", content_encoding="binary")
    with pytest.raises(errors.InvalidMessage, match="application/x-python-serialize"):
        AsyncResult(job_id, app=guarded.client.app).get(timeout=60)
    assert not PICKLE_MARKER.exists()
    assert f"refused message {job_id}" in guarded.log()
    assert guarded.client.embed([_t("still serving")]).shape == (1, 384)


def test_garbage_pushed_onto_the_queue_list_does_not_stop_the_worker(guarded):
    """Not even a kombu envelope: nothing to answer, but the worker goes on serving."""
    client = redis.Redis.from_url(guarded.settings.broker_url)
    queue = guarded.settings.queue_name
    for junk in (b"not json " + SECRET.encode(), b'{"body": "eA=="}', b"[1, 2, 3]", b"\xff" * 64):
        client.lpush(queue, junk)
    handles = [guarded.client.submit([_t(f"after junk {i}")]) for i in range(5)]
    assert all(h.result(timeout=60).shape == (1, 384) for h in handles)
    assert guarded.proc.poll() is None
    assert SECRET not in guarded.log()
