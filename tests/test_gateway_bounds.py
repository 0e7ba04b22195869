"""The gateway's bounds (issue 35, a security probe's findings): deadlines no clock can overflow on, bodies nested
too deeply or too large (chunked or sized), HEAD on the health routes, JSON's types read strictly, and an OpenAPI
document that declares the headers the gateway reads and every status it answers (checked by schemathesis)."""

from __future__ import annotations

import datetime as dt
import os
import socket
import sys
from pathlib import Path

import httpx
import pytest

from embedq import errors
from embedq.protocol import MAX_DEADLINE_SECONDS

pytestmark = pytest.mark.integration
os.environ.setdefault("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")

#: The POST routes that send jobs (they read X-Embedq-Deadline, -Class and -Model).
JOB_ROUTES = ("/embed", "/embed_sparse", "/embed_all", "/rerank", "/predict", "/tokenize", "/decode", "/similarity",
              "/v1/embeddings", "/embeddings", "/jobs", "/", "/invocations")
#: Examples per operation of the schemathesis run (raise it for a longer hunt: EMBEDQ_SCHEMATHESIS_EXAMPLES=200).
EXAMPLES = int(os.environ.get("EMBEDQ_SCHEMATHESIS_EXAMPLES", "10"))
#: schemathesis' settings (read from its working folder): a 5xx is a failure unless it is one the document lists for
#: every route that gives it (503: no worker or no broker; 504: a deadline passed), which status_code_conformance
#: checks, so a 500 (or an undocumented 5xx) still fails.
SCHEMATHESIS_TOML = """
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "503", "504"]
"""


@pytest.fixture(scope="module")
def gateway(worker, shared_gateway):
    """The session's gateway (conftest.py's ``shared_gateway``) on the shared worker, settled for this module."""
    return shared_gateway


def _log_size(gateway) -> int:
    return gateway.log.stat().st_size


def _no_traceback(gateway, since: int) -> None:
    """The gateway logged no exception since ``since`` (its log's size when the test began)."""
    with gateway.log.open("rb") as fh:
        fh.seek(since)
        log = fh.read().decode(errors="replace")
    assert "Traceback" not in log, log[-4000:]


# -- deadlines ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1e308", "1e10", str(MAX_DEADLINE_SECONDS + 1), "1e999", "inf", "-inf", "nan",
                                   "0", "-1", "1_0", "abc", "9" * 400], ids=lambda v: v[:12])
def test_a_deadline_over_a_week_or_not_seconds_is_422(gateway, value):
    since = _log_size(gateway)
    for route, body in (("/embed", {"inputs": "x"}), ("/v1/embeddings", {"input": "x"}),
                        ("/jobs", {"kind": "embed", "body": {"inputs": "x"}})):
        r = httpx.post(gateway.url + route, json=body, headers={"X-Embedq-Deadline": value}, timeout=30)
        assert r.status_code == 422, (route, value, r.status_code, r.text[:300])
        assert "X-Embedq-Deadline" in r.text
    _no_traceback(gateway, since)


def test_a_deadline_of_a_week_and_huge_client_timeouts_are_served(gateway, worker):
    since = _log_size(gateway)
    want = worker.client.embed(["a week"])[0].tolist()
    assert httpx.post(gateway.url + "/embed", json={"inputs": "a week"},
                      headers={"X-Embedq-Deadline": str(MAX_DEADLINE_SECONDS)}).json()[0] == pytest.approx(want)
    # the OpenAI SDKs' timeouts are clamped (to the gateway's own wait), whatever their size: never an overflow
    for value in ("1e308", "1e999", "inf", "nan", "9" * 400, "-5"):
        for name in ("x-stainless-read-timeout", "x-stainless-timeout"):
            r = httpx.post(gateway.url + "/embed", json={"inputs": "a week"}, headers={name: value}, timeout=30)
            assert r.status_code == 200, (name, value, r.status_code, r.text[:300])
    _no_traceback(gateway, since)


@pytest.mark.parametrize("deadline", [1e308, 1e10, MAX_DEADLINE_SECONDS + 1, float("inf"), float("nan"), -1.0, 0,
                                      10**400, -(10**5000),
                                      dt.datetime.max.replace(tzinfo=dt.timezone.utc),
                                      dt.datetime.max.replace(tzinfo=dt.timezone(dt.timedelta(hours=-5))),
                                      dt.datetime.min.replace(tzinfo=dt.timezone(dt.timedelta(hours=5)))],
                         ids=lambda v: type(v).__name__ + ":" + (repr(v)[:30] if not isinstance(v, int) else
                                                                 f"{v.bit_length()}bits"))
def test_the_client_refuses_a_deadline_past_a_week_and_never_overflows(worker, deadline):
    with pytest.raises((errors.InvalidOption, errors.Expired)) as caught:
        worker.client.submit(["x"], deadline=deadline)
    assert caught.value.http_status in (422, 504)


def test_the_client_takes_deadlines_up_to_a_week(worker):
    in_six_days = dt.datetime.now(dt.timezone(dt.timedelta(hours=2))) + dt.timedelta(days=6)
    assert worker.client.embed(["x"], deadline=in_six_days).shape[0] == 1
    assert worker.client.embed(["x"], deadline=float(MAX_DEADLINE_SECONDS)).shape[0] == 1
    with pytest.raises(errors.InvalidOption, match="one week"):
        worker.client.submit(["x"], deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=8))


# -- bodies -------------------------------------------------------------------------------------------------
def test_deeply_nested_json_is_400_or_422_on_every_route(gateway):
    since = _log_size(gateway)
    deep = "[" * 10_000 + "]" * 10_000
    nested = '{"inputs": ' + '{"a": ' * 10_000 + "1" + "}" * 10_000 + "}"
    for route in JOB_ROUTES:
        for body in (deep, nested):
            r = httpx.post(gateway.url + route, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code in (400, 422), (route, body[:12], r.status_code, r.text[:300])
            assert r.json().get("error") or r.json().get("message")
    _no_traceback(gateway, since)


def _post_raw(gateway, head: bytes, body: bytes) -> bytes:
    """Sends a request's head and part of its body, never its end, and reads the answer: it can only come from a
    gateway that stopped reading at its limit."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=60) as s:
        s.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_a_body_over_the_limit_is_413_chunked_or_sized_and_unread_past_the_limit(gateway):
    since = _log_size(gateway)
    limit = 16_000_000  # EMBEDQ_GATEWAY_PAYLOAD_LIMIT's default
    request = (f"POST /embed HTTP/1.1\r\nHost: 127.0.0.1:{gateway.port}\r\nContent-Type: application/json\r\n"
               .encode())
    # 17 MB chunked (no Content-Length): the answer comes once the limit is passed, the rest of the body unsent
    piece = b"a" * (1 << 20)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(limit // len(piece) + 1))
    chunked = _post_raw(gateway, request + b"Transfer-Encoding: chunked\r\n\r\n", chunks)
    assert chunked.startswith(b"HTTP/1.1 413 "), chunked[:300]
    # sized: refused by its Content-Length before any of the body comes
    sized = _post_raw(gateway, request + b"Content-Length: 17000000\r\n\r\n", b"")
    assert sized.startswith(b"HTTP/1.1 413 "), sized[:300]
    # and through an ordinary client (httpx streams a generator chunked)
    r = httpx.post(gateway.url + "/embed", content=(piece for _ in range(17)),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error_type"] == "Validation", r.text[:300]
    # a chunked body within the limit is read as it came
    ok = httpx.post(gateway.url + "/embed", content=iter([b'{"inputs": ', b'["a chunked body"]}']),
                    headers={"Content-Type": "application/json"})
    assert ok.status_code == 200 and len(ok.json()) == 1
    _no_traceback(gateway, since)


@pytest.mark.parametrize(("route", "body"), [("/embed", b'{"inputs": "x"}'), ("/v1/embeddings", b'{"input": "x"}'),
                                             ("/rerank", b'{"query": "q", "texts": ["a"]}')])
def test_a_body_that_is_not_json_is_400_and_one_without_a_json_content_type_is_415(gateway, route, body):
    """Issue 51, TEI's contract (axum's JSON extractor): malformed JSON is 400, a body without `Content-Type:
    application/json` (curl -d sends a form's) is 415; both were 422. A body that is JSON but wrong stays 422."""
    def post(content: bytes, **headers: str) -> httpx.Response:
        return httpx.post(gateway.url + route, content=content, headers=headers, timeout=30)

    assert post(body[:-3], **{"Content-Type": "application/json"}).status_code == 400
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        r = post(body, **headers)
        assert r.status_code == 415 and "application/json" in r.text, (headers, r.status_code, r.text[:200])
    assert post(b'{"nope": 1}', **{"Content-Type": "application/json; charset=utf-8"}).status_code == 422

# -- HEAD ---------------------------------------------------------------------------------------------------
def test_head_answers_as_get_without_a_body(gateway):
    for path in ("/health", "/ping", "/", "/metrics", "/info", "/v1/models", "/openapi.json"):
        get, head = httpx.get(gateway.url + path), httpx.head(gateway.url + path)
        assert head.status_code == get.status_code == 200, (path, head.status_code, get.status_code)
        assert head.content == b"" and head.headers.get("content-type") == get.headers.get("content-type")
    assert httpx.head(gateway.url + "/embed").status_code == 405  # POST-only routes stay so
    wrong = httpx.get(gateway.url + "/embed")  # RFC 9110: a 405 names the allowed methods (issue 51, TEI's answer)
    assert wrong.status_code == 405 and wrong.headers.get("allow") == "POST", wrong.headers


# -- strict JSON types --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("route", "body"), [
    ("/embed", {"inputs": "x", "dimensions": True}),
    ("/v1/embeddings", {"input": "x", "dimensions": True}),
    ("/embed", {"inputs": "x", "normalize": 1}),
    ("/embed", {"inputs": "x", "truncate": "yes"}),
    ("/embed", {"inputs": "x", "dimensions": 1.0}),
    ("/decode", {"ids": [True, False]}),
    ("/rerank", {"query": "q", "texts": ["t"], "raw_scores": 1}),
    ("/tokenize", {"inputs": "x", "add_special_tokens": 0}),
    ("/jobs", {"kind": "embed", "body": {"inputs": "x", "dimensions": True}}),
    ("/", {"inputs": "x", "dimensions": True}),
])
def test_json_types_are_strict_true_is_no_integer(gateway, route, body):
    r = httpx.post(gateway.url + route, json=body)
    assert r.status_code == 422, (route, body, r.status_code, r.text[:300])


def test_json_integers_still_fill_their_fields(gateway, worker):
    r = httpx.post(gateway.url + "/embed", json={"inputs": "x", "dimensions": 8, "normalize": False})
    assert r.status_code == 200 and len(r.json()[0]) == 8


# -- the OpenAPI document -----------------------------------------------------------------------------------
def test_openapi_declares_the_headers_read_and_the_statuses_answered(gateway):
    doc = httpx.get(gateway.url + "/openapi.json").json()
    for route in JOB_ROUTES:
        operation = doc["paths"][route]["post"]
        headers = {p["name"]: p for p in operation.get("parameters", []) if p["in"] == "header"}
        assert {"X-Embedq-Deadline", "X-Embedq-Class", "X-Embedq-Model"} <= set(headers), route
        assert headers["X-Embedq-Deadline"]["schema"]["maximum"] == MAX_DEADLINE_SECONDS
        assert {"400", "404", "413", "422", "429", "503", "504"} <= set(operation["responses"]), route
    info = doc["paths"]["/info"]["get"]
    assert [p["name"] for p in info["parameters"]] == ["X-Embedq-Model"] and "503" in info["responses"]
    for path in ("/health", "/ping"):
        assert "503" in doc["paths"][path]["get"]["responses"]


def test_schemathesis_with_headers_negative_and_boundary_data_finds_no_error(gateway, tmp_path):
    """schemathesis against the gateway's OpenAPI document, the X-Embedq-* headers included, in positive and
    negative modes through its examples, coverage (boundary values) and fuzzing phases: no 500, no status the
    document does not list, bodies as documented. ``EMBEDQ_SCHEMATHESIS_EXAMPLES`` (default 10) raises the
    examples per operation for a longer hunt."""
    import subprocess

    since = _log_size(gateway)
    st = Path(sys.executable).with_name("st")
    (tmp_path / "schemathesis.toml").write_text(SCHEMATHESIS_TOML)
    done = subprocess.run([str(st), "run", gateway.url + "/openapi.json", "--checks",
                           "not_a_server_error,status_code_conformance,content_type_conformance,"
                           "response_schema_conformance", "--mode", "all", "--phases", "examples,coverage,fuzzing",
                           "-n", str(EXAMPLES), "--generation-deterministic", "--request-timeout", "120",
                           "--no-color", "--report", "ndjson", "--report-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    _no_traceback(gateway, since)
