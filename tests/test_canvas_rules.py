"""The bounds of a job's canvas at the edge (embedq/workers/canvas_rules.py), and the JSON size estimate of a
callback's payload (embedq/workers/canvas.py): pure, no Redis."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedq.protocol import encode_array, json_result
from embedq.settings import Settings
from embedq.workers.canvas import json_bytes
from embedq.workers.canvas_rules import CanvasRules


def rules(**overrides) -> CanvasRules:
    return CanvasRules.from_settings(Settings(queue="embedq.q", callback_queue="user.cb", **overrides))


def sig(task="user.store", **options):
    return {"task": task, "args": [], "kwargs": {}, "options": options, "subtask_type": None, "immutable": False}


def container(task, **kwargs):
    return {**sig(task), "kwargs": kwargs}


def refused(embed, headers=None, **overrides) -> str | None:
    error = rules(**overrides).check(embed, headers or {})
    return None if error is None else error.message


def test_usual_canvases_pass():
    assert refused({"callbacks": None, "errbacks": None, "chain": None, "chord": None}) is None
    assert refused({"callbacks": [sig()], "errbacks": [sig("user.failed")]}) is None
    assert refused({"chain": [sig(), sig(queue="user.cb")]}) is None
    body = {**sig(), "chord_size": 3}
    assert refused({"chord": body}, {"group": "g" * 36, "group_index": 2}) is None
    assert refused({"callbacks": [container("celery.group", tasks=[sig(), sig()])]}) is None
    assert refused({"callbacks": [sig(queue="extra")]}, callback_queues="extra, more") is None


@pytest.mark.parametrize("embed, reason", [
    ({"callbacks": [sig()] * 33}, "EMBEDQ_CANVAS_MAX_SIGNATURES"),
    ({"callbacks": [sig()] * 100_000}, "EMBEDQ_CANVAS_MAX_SIGNATURES"),
    ({"chain": [sig()] * 17}, "EMBEDQ_CANVAS_MAX_CHAIN"),
    ({"chain": [sig("embedq.embed")] * 3000}, "EMBEDQ_CANVAS_MAX_CHAIN"),
    ({"callbacks": [container("celery.chain", tasks=[sig()] * 17)]}, "EMBEDQ_CANVAS_MAX_CHAIN"),
    ({"callbacks": [sig(link=[sig(link=[sig(link=[sig(link=[sig()])])])])]}, "EMBEDQ_CANVAS_MAX_DEPTH"),
    ({"chord": {**sig(), "chord_size": 10**9}}, "EMBEDQ_CANVAS_MAX_CHORD_SIZE"),
    ({"chord": {**sig(), "chord_size": 1e9}}, "EMBEDQ_CANVAS_MAX_CHORD_SIZE"),
    ({"callbacks": [sig(queue="hostile.name")]}, "EMBEDQ_CALLBACK_QUEUES"),
    ({"callbacks": [sig(exchange="hostile")]}, "EMBEDQ_CALLBACK_QUEUES"),
    ({"callbacks": [sig(routing_key="hostile")]}, "EMBEDQ_CALLBACK_QUEUES"),
    ({"callbacks": [sig(queue={"name": "hostile"})]}, "EMBEDQ_CALLBACK_QUEUES"),
    ({"errbacks": [sig(queue=["x"])]}, "EMBEDQ_CALLBACK_QUEUES"),
    ({"callbacks": [sig("embedq.embed")]}, "EMBEDQ_CALLBACK_KINDS"),
    ({"callbacks": [container("celery.group", tasks=[sig("embedq.rerank")])]}, "EMBEDQ_CALLBACK_KINDS"),
    ({"callbacks": [sig("celery.accumulate")]}, "built-in"),
    ({"chord": sig("celery.chord_unlock")}, "built-in"),
    ({"callbacks": "x"}, "not a list"),
    ({"callbacks": [None]}, "not an object"),
    ({"callbacks": [{"task": 5}]}, "no task name"),
    ({"callbacks": [{"task": "user.x", "options": "x"}]}, "not an object"),
    ("x", "not an object"),
])
def test_canvases_past_a_bound_or_naming_what_is_not_allowed_are_refused(embed, reason):
    message = refused(embed)
    assert message is not None and reason in message, message
    assert message.startswith("[invalid_message]")


def test_a_self_link_nested_a_thousand_deep_is_refused_without_recursion():
    deep = sig("embedq.embed")
    for _ in range(100_000):  # far past Python's recursion limit
        deep = sig("user.x", link=[deep])
    assert "EMBEDQ_CANVAS_MAX_DEPTH" in refused({"callbacks": [deep]})


@pytest.mark.parametrize("headers", [{"group": 5}, {"group": "g" * 257}, {"group": ""},
                                     {"group": "g", "group_index": "1"}, {"group": "g", "group_index": 2**40}])
def test_a_chord_part_with_a_bad_group_is_refused(headers):
    assert "group" in refused({"chord": sig()}, headers)


def test_embedq_kinds_are_allowed_by_name_and_only_to_the_online_queue():
    assert refused({"callbacks": [sig("embedq.embed")]}, callback_kinds="embed") is None
    assert refused({"chain": [sig("embedq.embed", queue="embedq.q")]}, callback_kinds="embedq.embed") is None
    assert "not an allowed queue" in refused({"callbacks": [sig("embedq.embed", queue="user.cb")]},
                                             callback_kinds="embed")
    assert "EMBEDQ_CALLBACK_KINDS" in refused({"callbacks": [sig("embedq.rerank")]}, callback_kinds="embed")


@pytest.mark.parametrize("encoding", ["float16", "float32", "float"])
@pytest.mark.parametrize("shape", [(64, 384), (4, 32, 384), (5,)])
def test_the_json_size_estimate_is_an_upper_bound_within_a_factor_of_two(encoding, shape):
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(shape) * rng.choice([1e-5, 1.0, 300.0], size=shape)).astype(np.float32)
    payload = {"v": 1, "kind": "embed", "vectors": encode_array(values, encoding),
               "ids": encode_array(np.arange(-50, 50, dtype=np.int32)), "usage": {"texts": 3, "tokens": 9}}
    real = len(json.dumps(json_result(payload)))
    assert real <= json_bytes(payload) <= 2 * real + 512


def test_sending_rides_out_an_outage_and_fails_what_the_broker_refuses_while_it_answers_ping():
    """The canvas thread's policy (workers/canvas.py, Sending), with the broker's answers scripted: a send that
    fails while PING fails is tried again (an outage: as long as it lasts); one that fails while PING answers is a
    strike, and two strikes fail it for good; stopping leaves it unsent."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from embedq import errors
    from embedq.workers.canvas import Failed, Sending, Unsent

    def sending(up, stopping=False):
        answers = iter(up)
        return Sending(max_bytes=1 << 20, online_queue="q", online_limit=0, stopping=lambda: stopping,
                       broker_up=lambda: next(answers), waiting=lambda q: 0, sleep=lambda s: None)

    calls = []

    def flaky(fail_times):
        def call():
            calls.append(1)
            if len(calls) <= fail_times:
                raise RedisConnectionError("connection reset")
            return "sent"
        return call

    assert sending([False] * 50).send("j", "its callback", flaky(50)) == "sent"  # a long outage, ridden out
    assert len(calls) == 51
    calls.clear()
    with pytest.raises(Failed) as failed:
        sending([True, True]).send("j", "its callback", flaky(10))
    assert len(calls) == 2 and isinstance(failed.value.error, errors.MessageTooLarge)
    calls.clear()
    assert sending([True]).send("j", "its callback", flaky(1)) == "sent"  # one strike, then it went through
    calls.clear()
    with pytest.raises(Unsent):
        sending([], stopping=True).send("j", "its callback", flaky(1))
    with pytest.raises(Failed):  # the broker answered with an error: failed at once, never retried
        sending([]).send("j", "its callback", lambda: (_ for _ in ()).throw(ValueError("OOM")))


def test_an_allowed_embedq_kind_in_a_canvas_passes_the_online_admission():
    """EMBEDQ_CALLBACK_KINDS lets embed run as a callback; it is sent only while the online queue holds fewer than
    online_queue_limit jobs (the producer's rule), else that work fails with overloaded."""
    from embedq import errors
    from embedq.workers.canvas import Failed, Sending

    def admitting(held, limit=2):
        return Sending(max_bytes=1 << 20, online_queue="q", online_limit=limit, stopping=lambda: False,
                       broker_up=lambda: True, waiting=lambda queue: held)

    kind, user = sig("embedq.embed"), sig()
    admitting(1).admit([kind, user])
    admitting(5).admit([user])  # a user's task is no embedq job: no admission
    admitting(5, limit=0).admit([kind])  # no limit
    with pytest.raises(Failed) as failed:
        admitting(2).admit([user, container("celery.group", tasks=[kind])])
    assert isinstance(failed.value.error, errors.Overloaded)
