"""Long inputs in windows through the gateway (issue 58): ``long_inputs``, ``window_overlap`` and ``pool_windows`` on
``/v1/embeddings``, ``/embed`` and ``/embed_all``, against a live ``embedq serve`` and a real worker of the fake model
with ``max_windows=4``. The gateway cuts requests into jobs of 2 texts, so an input's index in the request is not its
index in its job."""

from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import pytest
import test_windows_worker
from conftest import GatewayHandle, sparse_delta
from test_windows_worker import SENTENCE, text_of

pytestmark = pytest.mark.integration

worker = test_windows_worker.worker  # the fake model's worker with max_windows=4 (the fixture, not a copy of it)

SMALL = SENTENCE
LONG, LONGER, HUGE = text_of(20), text_of(26), text_of(200)  # 3, 4 and far more than 4 windows of 128 tokens


def serve(settings, log) -> GatewayHandle:
    """A gateway on ``settings``' queue cutting requests into jobs of 2 texts, once it has seen the worker."""
    g = GatewayHandle(settings.broker_url, settings.queue_name, log, EMBEDQ_MODEL=settings.model,
                      EMBEDQ_MAX_TEXTS_PER_JOB="2")
    deadline = time.monotonic() + 60  # the worker's registry record (written every second)
    while httpx.get(g.url + "/health").status_code != 200:
        if time.monotonic() > deadline:
            g.stop()
            raise AssertionError(g.log.read_text(errors="replace")[-4000:])
        time.sleep(0.2)
    return g


@pytest.fixture(scope="module")
def gateway(worker, tmp_path_factory):
    g = serve(worker.settings, tmp_path_factory.mktemp("gw-windows") / "gw.log")
    yield g
    g.stop()


def post(gateway, path: str, body: dict) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=120)


def ok(response: httpx.Response):
    assert response.status_code == 200, response.text
    return response.json()


def openai_vectors(answer: dict) -> np.ndarray:
    return np.asarray([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in answer["data"]])


def test_without_the_fields_every_route_answers_as_before(gateway, worker):
    texts = [SMALL, LONG]
    cut = worker.client.embed(texts)  # a long text is cut to the model's 128 tokens
    assert np.allclose(ok(post(gateway, "/embed", {"inputs": texts})), cut, atol=1e-6)
    refused = post(gateway, "/embed", {"inputs": texts, "truncate": False})  # TEI's truncate=false: an error
    assert refused.status_code == 422 and "too_many_tokens" in refused.json()["error"]
    openai = ok(post(gateway, "/v1/embeddings", {"input": texts, "encoding_format": "base64"}))
    assert np.allclose(openai_vectors(openai), cut, atol=1e-6)
    # long_inputs="truncate" and "error" are the same, named
    assert np.allclose(ok(post(gateway, "/embed", {"inputs": texts, "long_inputs": "truncate"})), cut, atol=1e-6)
    error = post(gateway, "/embed", {"inputs": texts, "long_inputs": "error", "truncate": False})
    assert error.status_code == 422 and "too_many_tokens" in error.json()["error"]
    error = post(gateway, "/v1/embeddings", {"input": texts, "long_inputs": "error"})
    assert error.status_code == 422 and "too_many_tokens" in error.json()["error"]["message"]
    every = ok(post(gateway, "/embed_all", {"inputs": [LONG]}))
    assert np.asarray(every).shape == (1, 128, 32)


def test_pooled_windows_keep_each_route_s_shape(gateway, worker):
    texts = [SMALL, LONG, LONGER]  # two jobs
    want = worker.client.embed(texts, long_inputs="windows")
    cut = worker.client.embed(texts)
    got = ok(post(gateway, "/embed", {"inputs": texts, "long_inputs": "windows", "window_overlap": 8}))
    assert np.asarray(got).shape == (3, 32)
    overlapped = worker.client.embed(texts, long_inputs="windows", window_overlap=8)
    assert np.allclose(got, overlapped, atol=1e-6) and not np.allclose(got[1], want[1], atol=1e-3)
    response = post(gateway, "/v1/embeddings", {"input": texts, "long_inputs": "windows",
                                                "encoding_format": "base64"})
    answer = ok(response)
    assert [d["index"] for d in answer["data"]] == [0, 1, 2] and "windows" not in answer["data"][0]
    assert np.allclose(openai_vectors(answer), want, atol=1e-6)
    assert not np.allclose(want[1], cut[1], atol=1e-3)  # the windows are not the cut text
    # usage counts every window's tokens, as x-compute-tokens does
    windows = ok(post(gateway, "/embed", {"inputs": texts, "long_inputs": "windows", "pool_windows": False}))
    tokens = sum(w["tokens"] for text in windows for w in text)
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] == tokens > 3 * 128
    assert int(response.headers["x-compute-tokens"]) == tokens
    every = ok(post(gateway, "/embed_all", {"inputs": [SMALL, LONG], "long_inputs": "windows"}))
    assert len(every) == 2 and np.asarray(every[1]).shape == (sum(w["tokens"] for w in windows[1]), 32)


def same_windows(a: list[list[dict]], b: list[list[dict]]) -> bool:
    """Two per-window answers: the same windows, their vectors equal within float32's noise."""
    def spans(x: list[list[dict]]) -> list:
        return [[(w["window"], w["start"], w["end"], w["tokens"]) for w in text] for text in x]

    return spans(a) == spans(b) and all(np.allclose([w["embedding"] for w in p], [w["embedding"] for w in q],
                                                    atol=1e-6) for p, q in zip(a, b))


def test_per_window_answers_slice_the_input(gateway, worker):
    texts = [LONG, SMALL, LONGER]
    body = {"inputs": texts, "long_inputs": "windows", "pool_windows": False}
    got = ok(post(gateway, "/embed", body))
    want = worker.client.submit(texts, long_inputs="windows", pool_windows=False).result()
    assert [len(text) for text in got] == [3, 1, 4]
    for text, windows, expected in zip(texts, got, want):
        assert [w["window"] for w in windows] == list(range(len(windows)))
        assert windows[0]["start"] == 0 and windows[-1]["end"] == len(text)
        assert "".join(text[w["start"]:w["end"]] for w in windows) == text  # no overlap: the spans tile the text
        assert [(w["start"], w["end"], w["tokens"]) for w in windows] == [(e.start, e.end, e.tokens) for e in expected]
        vectors = np.asarray([w["embedding"] for w in windows], np.float32)
        assert np.allclose(vectors, [e.output for e in expected], atol=1e-6)
        # a window is the model run on its slice of the text alone
        alone = ok(post(gateway, "/embed", {"inputs": [text[w["start"]:w["end"]] for w in windows]}))
        assert np.allclose(vectors, alone, atol=1e-6)
    single = ok(post(gateway, "/embed", {**body, "inputs": LONG}))  # TEI: one input is still a list of one
    assert len(single) == 1 and len(single[0]) == 3
    # OpenAI: one entry per input, its `embedding` null, its windows' vectors in the request's encoding
    for encoding in ("float", "base64"):
        answer = ok(post(gateway, "/v1/embeddings", {"input": texts, "long_inputs": "windows", "pool_windows": False,
                                                     "encoding_format": encoding}))
        assert [d["index"] for d in answer["data"]] == [0, 1, 2]
        for entry, windows in zip(answer["data"], got):
            assert entry["embedding"] is None and entry["object"] == "embedding"
            spans = [(w["window"], w["start"], w["end"], w["tokens"]) for w in entry["windows"]]
            assert spans == [(w["window"], w["start"], w["end"], w["tokens"]) for w in windows]
            vectors = [w["embedding"] if encoding == "float" else np.frombuffer(base64.b64decode(w["embedding"]),
                                                                                "<f4") for w in entry["windows"]]
            assert np.allclose(vectors, [w["embedding"] for w in windows], atol=1e-6)
    # the served model's own route and Vertex AI's instances read the same fields
    assert same_windows(ok(post(gateway, "/", body)), got)
    vertex = ok(post(gateway, "/vertex", {"instances": [body, {"inputs": [SMALL], "long_inputs": "windows"}]}))
    assert same_windows(vertex["predictions"][0], got) and np.asarray(vertex["predictions"][1]).shape == (1, 32)
    every = ok(post(gateway, "/embed_all", body))
    assert [len(text) for text in every] == [3, 1, 4]
    assert [np.asarray(w["embedding"]).shape for w in every[1]] == [(every[1][0]["tokens"], 32)]


def test_a_text_over_max_windows_fails_the_request_naming_it(gateway):
    # jobs of 2: HUGE is input 2 of the request, input 0 of its job; the job's other text is answered by the worker
    for texts in ([SMALL, LONG, HUGE, SMALL], [SMALL, LONG, HUGE]):  # ... or the whole job fails
        refused = post(gateway, "/embed", {"inputs": texts, "long_inputs": "windows"})
        assert refused.status_code == 413, refused.text
        assert refused.json()["error_type"] == "Validation"
        assert refused.json()["error"].startswith("[too_many_windows] inputs[2] needs more than 4 windows")
    both = post(gateway, "/embed", {"inputs": [HUGE, SMALL, SMALL, HUGE], "long_inputs": "windows",
                                    "pool_windows": False})
    assert both.status_code == 413 and "inputs[0]" in both.json()["error"] and "inputs 3 failed" in both.text
    openai = post(gateway, "/v1/embeddings", {"input": [SMALL, SMALL, SMALL, HUGE], "long_inputs": "windows"})
    assert openai.status_code == 413 and "inputs[3]" in openai.json()["error"]["message"]
    # an async job: failed, with the same error
    created = post(gateway, "/jobs", {"kind": "embed", "body": {"inputs": [SMALL, SMALL, HUGE],
                                                                "long_inputs": "windows"}})
    assert created.status_code == 202, created.text
    deadline = time.monotonic() + 120
    while (state := httpx.get(f"{gateway.url}/jobs/{created.json()['id']}").json())["status"] == "queued":
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    assert state["status"] == "failed" and state["code"] == 413 and "inputs[2]" in state["error"]["error"], state
    # without windows the same text is cut, as before
    assert np.asarray(ok(post(gateway, "/embed", {"inputs": [HUGE]}))).shape == (1, 32)


@pytest.mark.parametrize("path, body, wrong", [
    ("/embed", {"truncate": False, "long_inputs": "truncate"}, "contradicts"),
    ("/embed", {"truncate": True, "long_inputs": "windows"}, "contradicts"),
    ("/embed", {"truncate": True, "long_inputs": "error"}, "contradicts"),
    ("/embed", {"window_overlap": 8}, "applies only with long_inputs='windows'"),
    ("/embed_all", {"pool_windows": False, "long_inputs": "truncate"}, "applies only with long_inputs='windows'"),
    ("/v1/embeddings", {"pool_windows": False}, "applies only with long_inputs='windows'"),
])
def test_contradictions_are_a_typed_422(gateway, path, body, wrong):
    texts = {"input" if path.startswith("/v1") else "inputs": [SMALL]}
    refused = post(gateway, path, {**texts, **body})
    assert refused.status_code == 422, refused.text
    message = refused.json()["error"]["message"] if path.startswith("/v1") else refused.json()["error"]
    assert message.startswith("[invalid_option]") and wrong in message


def test_the_openapi_document_describes_the_fields(gateway):
    schemas = httpx.get(gateway.url + "/openapi.json").json()["components"]["schemas"]
    for name in ("EmbedRequest", "TextsRequest", "OpenAIEmbeddingRequest"):
        fields = schemas[name]["properties"]
        assert {"long_inputs", "window_overlap", "pool_windows"} <= set(fields), name
        assert "too_many_windows" in fields["long_inputs"]["description"]
        assert "data[i].windows" in fields["pool_windows"]["description"]
    assert "long_inputs" not in schemas["RerankRequest"]["properties"]


def test_bad_values_are_a_422(gateway):
    for body in ({"long_inputs": "chunks"}, {"long_inputs": "windows", "window_overlap": -1},
                 {"long_inputs": "windows", "pool_windows": "no"}):
        refused = post(gateway, "/embed", {"inputs": [SMALL], **body})
        assert refused.status_code == 422 and refused.json()["error_type"] == "Validation", refused.text
    # false and windows agree: windows never cut
    assert np.asarray(ok(post(gateway, "/embed", {"inputs": [LONG], "truncate": False,
                                                  "long_inputs": "windows"}))).shape == (1, 32)


def test_the_openai_sdk_with_extra_body(gateway, worker):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    texts = [SMALL, LONG]
    pooled = client.embeddings.create(model="any", input=texts, extra_body={"long_inputs": "windows"})
    got = np.asarray([d.embedding for d in pooled.data], np.float32)  # the SDK's base64, decoded by it
    assert np.allclose(got, worker.client.embed(texts, long_inputs="windows"), atol=1e-6)
    windows = client.embeddings.create(model="any", input=texts, encoding_format="float",
                                       extra_body={"long_inputs": "windows", "pool_windows": False})
    assert windows.data[0].embedding is None and len(windows.data[1].windows) == 3
    assert np.allclose(windows.data[0].windows[0]["embedding"], got[0], atol=1e-6)  # one window: the text's vector
    with pytest.raises(openai.APIStatusError, match="too_many_windows") as caught:
        client.embeddings.create(model="any", input=[HUGE], extra_body={"long_inputs": "windows"})
    assert caught.value.status_code == 413


def same_sparse(got: list[dict], want: list[dict]) -> bool:
    """Two sparse vectors in TEI's shape, equal read densely (conftest.sparse_delta: the jobs' micro-batches differ)."""
    return sparse_delta([e["index"] for e in got], [e["value"] for e in got],
                        [e["index"] for e in want], [e["value"] for e in want]) <= 1e-5


def test_sparse_windows(splade_worker, tmp_path):
    """/embed_sparse of a real SPLADE model: pooled windows in TEI's shape, and per window."""
    gateway = serve(splade_worker.settings, tmp_path / "gw.log")
    try:
        texts = [SMALL, text_of(60), LONG]
        client = splade_worker.client
        pooled = ok(post(gateway, "/embed_sparse", {"inputs": texts, "long_inputs": "windows"}))
        want = client.embed_sparse(texts, long_inputs="windows")
        assert len(pooled) == 3 and all(same_sparse(p, w.to_tei()) for p, w in zip(pooled, want))
        assert pooled[1] != ok(post(gateway, "/embed_sparse", {"inputs": [texts[1]]}))[0]  # not the cut text
        got = ok(post(gateway, "/embed_sparse", {"inputs": texts, "long_inputs": "windows", "pool_windows": False}))
        expected = client.submit_job("embed_sparse", texts, long_inputs="windows", pool_windows=False).result()
        assert [len(text) for text in got] == [len(e) for e in expected] and len(got[1]) > 1
        for text, windows, per in zip(texts, got, expected):
            assert "".join(text[w["start"]:w["end"]] for w in windows) == text
            assert all(same_sparse(w["embedding"], e.output.to_tei()) for w, e in zip(windows, per))
    finally:
        gateway.stop()
