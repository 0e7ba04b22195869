"""``embedq verify`` against real servers: a worker on the default model (passes), a worker configured unlike its
folder (fails, and says why), and embedq's own HTTP gateway through ``--endpoint`` (TEI's and OpenAI's routes)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

from conftest import CORPUS, WorkerHandle
from families import FAMILIES, save

from embedq.cli import main
from embedq.cli.verify import HALF_COSINE, STRICT, thresholds
from embedq.settings import Settings

pytestmark = pytest.mark.integration


def _verify(monkeypatch, capsys, settings: Settings, *argv: str) -> tuple[int, str]:
    monkeypatch.setenv("EMBEDQ_BROKER_URL", settings.broker_url)
    monkeypatch.setenv("EMBEDQ_QUEUE", settings.queue)
    code = main(["verify", *argv])
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def gateway(worker, shared_gateway):
    """The session's gateway (conftest.py's ``shared_gateway``) on the shared worker, settled for this module."""
    return shared_gateway


@pytest.fixture(scope="module")
def misconfigured(redis_server, tmp_path_factory, corpus):
    """A worker whose server disagrees with the model card: the multilingual-e5-like family (mean pooling, a
    ``query: `` default prompt) served from a copy without its prompts and with ``embedq worker --pooling CLS``."""
    root = tmp_path_factory.mktemp("misconfigured")
    folder = save(FAMILIES["xlm-roberta"], root / "e5", corpus[:2000])
    copy = shutil.copytree(folder, root / "e5-served")
    config = json.loads((copy / "config_sentence_transformers.json").read_text())
    config["prompts"], config["default_prompt_name"] = {}, None
    (copy / "config_sentence_transformers.json").write_text(json.dumps(config))
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.{root.name}", model=str(copy),
                        linear_kernel="torch")
    handle = WorkerHandle(settings, root / "worker.log",  # the override as TEI spells it, on the command line
                          command=[sys.executable, "-m", "embedq", "worker", "--pooling", "CLS"])
    yield handle, folder, copy
    handle.stop()


def test_verify_passes_on_the_default_model(worker, monkeypatch, capsys):
    code, out = _verify(monkeypatch, capsys, worker.settings, str(CORPUS), "--limit", "40", "--json")
    report = json.loads(out)
    assert code == 0, out
    assert report["passed"] and report["texts"] == 40 and report["failed_texts"] == 0
    assert report["served_dtype"] == "float32" and report["thresholds"]["min_cosine"] == STRICT[0]
    assert report["min_cosine"] >= 0.99999 and report["max_abs_delta"] <= 1e-5
    assert len(report["per_text"]) == 40 and all(t["ok"] for t in report["per_text"])
    assert not report["notes"]  # same weights hash, same pooling

    code, out = _verify(monkeypatch, capsys, worker.settings, "--show", "0")  # the built-in sample, as a table
    assert code == 0 and out.rstrip().endswith("PASS")
    assert "min cosine 1.0000000" in out or "min cosine 0.99999" in out


def test_verify_fails_on_a_misconfigured_worker_and_says_why(misconfigured, monkeypatch, capsys):
    handle, folder, copy = misconfigured
    code, out = _verify(monkeypatch, capsys, handle.settings, "--model", str(copy), "--reference", str(folder))
    assert code == 1, out
    assert out.rstrip().endswith("FAIL")
    assert "note: the server reports cls pooling; the folder says mean" in out
    assert "note: the server's weights hash differs" in out
    assert "diagnosis: the served vectors match the reference with cls pooling instead of mean and no prompt" in out
    assert "prompt:    'query: '" in out

    code, out = _verify(monkeypatch, capsys, handle.settings, "--model", str(copy), "--reference", str(folder),
                        "--json")
    report = json.loads(out)
    assert code == 1 and not report["passed"] and report["failed_texts"] == report["texts"] == 12
    assert report["min_cosine"] < 0.99
    assert report["diagnosis"][0]["differs_by"] == "cls pooling instead of mean and no prompt"

    # the served copy against itself: its own prompts (none) and... still cls, which the folder does not say
    code, out = _verify(monkeypatch, capsys, handle.settings, "--model", str(copy))
    assert code == 1 and "diagnosis: the served vectors match the reference with cls pooling instead of mean" in out


def test_verify_an_endpoint_the_gateway(gateway, monkeypatch, capsys, worker):
    for url in (gateway.url, gateway.url + "/embed"):  # TEI's POST /embed
        code, out = _verify(monkeypatch, capsys, worker.settings, "--endpoint", url)
        assert code == 0, out
        assert f"served:    tei endpoint {gateway.url}/embed, float32" in out and "PASS" in out
    code, out = _verify(monkeypatch, capsys, worker.settings, "--endpoint", gateway.url + "/v1", "--json")
    report = json.loads(out)  # OpenAI's /v1/embeddings (base64, unit vectors)
    assert code == 0, out
    assert report["served"] == f"openai endpoint {gateway.url}/v1/embeddings"
    assert report["min_cosine"] >= 0.99999 and report["max_abs_delta"] <= 1e-5


def test_verify_refuses_what_it_cannot_run(monkeypatch, capsys, tmp_path, worker):
    code = main(["verify", "--reference", str(tmp_path / "missing")])
    assert code == 2
    assert "is not a model folder" in capsys.readouterr().err
    assert main(["worker", "--pooling", "median"]) == 2
    assert "unknown --pooling 'median'" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _ = _verify(monkeypatch, capsys, worker.settings, str(empty))
    assert code == 2


def test_thresholds_follow_the_served_dtype():
    assert thresholds("float32", None, None)[:2] == STRICT
    assert thresholds("float16", None, None)[:2] == (HALF_COSINE, None)
    assert thresholds(None, None, None)[:2] == (HALF_COSINE, None)
    assert thresholds("float16", 0.9999, 1e-3) == (0.9999, 1e-3, "given")
