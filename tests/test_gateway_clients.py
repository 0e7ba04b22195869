"""The clients people point at `embedq serve`, unmodified, against a live gateway and a real worker: the Node ``openai``
SDK (tests/js, installed by scripts/setup.sh with ``npm ci``; its default asks for base64 and decodes it blindly) and
LangChain's ``OpenAIEmbeddings`` with ``check_embedding_ctx_length=False`` (texts, not tiktoken's ids). Their vectors
equal ``Client.embed``'s for the same texts, as the openai Python SDK's do (tests/test_gateway.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration

JS = Path(__file__).with_name("js")
#: The bar of tests/test_gateway.py: the gateway hands on the worker's float32 vectors unchanged.
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def gateway(worker, shared_gateway):
    """The session's gateway (conftest.py's ``shared_gateway``) on the shared worker, settled for this module."""
    return shared_gateway


@pytest.fixture(scope="module")
def texts(corpus) -> list[str]:
    return [*corpus[600:605], "naïve café — 東京 ✓"]


def _delta(got, want) -> float:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max())


# -- the Node openai SDK ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def node() -> str:
    found = shutil.which("node")
    if found is None:
        pytest.skip("node not found: the Node openai SDK's test needs Node.js 20+ (scripts/setup.sh runs npm ci in "
                    "tests/js when node and npm are there)")
    assert (JS / "node_modules" / "openai" / "package.json").exists(), (
        f"the Node openai SDK is not installed: run `npm ci` in {JS} (scripts/setup.sh does)")
    return found


def node_openai(node: str, base_url: str, calls: list[dict]) -> list[dict]:
    """Each call's fields to ``client.embeddings.create`` of the Node SDK, in one process (tests/js/embed.mjs)."""
    done = subprocess.run([node, str(JS / "embed.mjs")], input=json.dumps({"baseURL": base_url, "calls": calls}),
                          capture_output=True, text=True, timeout=120, cwd=JS)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["results"]


def test_node_openai_sdk_default_base64_dimensions_and_errors(node, gateway, worker, texts):
    default, dims, floats, empty = node_openai(node, gateway.url + "/v1", [
        {"model": "text-embedding-3-small", "input": texts},
        {"model": "text-embedding-3-small", "input": texts[0], "dimensions": 64},
        {"model": "m", "input": texts[:2], "encoding_format": "float"},
        {"model": "m", "input": []},
    ])
    # the SDK's default: it asks for base64, the gateway answers strings, the SDK decodes them as float32
    assert default["sent"]["encoding_format"] == "base64" and default["wire"] == "string", default["sent"]
    assert default["index"] == list(range(len(texts))) and default["model"] == worker.settings.model
    assert default["usage"]["prompt_tokens"] == default["usage"]["total_tokens"] > len(texts)
    assert _delta(default["embeddings"], worker.client.embed(texts)) <= TOLERANCE
    # dimensions: the first 64, renormalised, as the Client's dimensions=64
    assert dims["sent"]["dimensions"] == 64 and dims["sent"]["encoding_format"] == "base64"
    want = worker.client.embed(texts[:1], dimensions=64, normalize=True)
    assert _delta(dims["embeddings"], want) <= TOLERANCE
    assert abs(float(np.linalg.norm(dims["embeddings"][0])) - 1.0) < 1e-5
    assert floats["wire"] == "array" and _delta(floats["embeddings"], worker.client.embed(texts[:2])) <= TOLERANCE
    # an empty input is the SDK's BadRequestError (HTTP 400), never an empty list
    assert empty["error"]["status"] == 400, empty


# -- LangChain ------------------------------------------------------------------------------------------------------
def test_langchain_openai_embeddings_without_tiktoken(gateway, worker, texts):
    from langchain_openai import OpenAIEmbeddings

    common = {"model": "text-embedding-3-small", "base_url": gateway.url + "/v1", "api_key": "unused",
              "check_embedding_ctx_length": False, "max_retries": 0}
    # chunk_size=4: two requests for six texts, their vectors put back in order
    documents = OpenAIEmbeddings(**common, chunk_size=4).embed_documents(texts)
    assert _delta(documents, worker.client.embed(texts)) <= TOLERANCE
    query = OpenAIEmbeddings(**common).embed_query(texts[-1])
    assert _delta([query], worker.client.embed(texts[-1:])) <= TOLERANCE
    short = OpenAIEmbeddings(**common, dimensions=64).embed_documents(texts[:2])
    assert _delta(short, worker.client.embed(texts[:2], dimensions=64, normalize=True)) <= TOLERANCE
