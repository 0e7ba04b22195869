"""Each way to change an embedding space silently (docs/FIDELITY.md), and what embedq does about it: the fingerprint
changes and the indexer refuses to append, or embedq matches sentence-transformers regardless.

The models are tiny family models from ``families.py`` (an e5-like XLM-RoBERTa with ``query: ``/``passage: ``
prompts and a default prompt, a Qwen3-Embedding-like decoder pooling the last token); the refusals are the
indexer's own output checks (``open_sink`` / ``Sink.accept``), fed with fingerprints of real results.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

from families import FAMILIES, MAX_SEQ_LENGTH, save
from tiny_models import run_as_the_worker

from embedq import errors
from embedq.backends import load_backend
from embedq.backends.folder import weights_sha256
from embedq.producers.index.runner import storage_options
from embedq.producers.index.sinks import open_sink
from embedq.protocol import EmbedOptions, Fingerprint, decode_result

pytestmark = pytest.mark.integration  # builds and loads models

LONG = " ".join(["a text long enough to be truncated at the model's limit"] * 20)


@pytest.fixture(scope="module")
def texts(corpus) -> list[str]:
    return [*corpus[:12], LONG, "short"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, corpus) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("silent")
    return {"e5": save(FAMILIES["xlm-roberta"], root / "e5", corpus[:2000]),
            "qwen3": save(FAMILIES["qwen3"], root / "qwen3", corpus[:2000]),
            "qwen3-right": save(FAMILIES["qwen3"], root / "qwen3-right", corpus[:2000], padding_side="right")}


def _load(folder: Path, **kwargs):
    return load_backend(str(folder), linear_kernel="torch", **kwargs)


def _embed(backend, texts, **options) -> tuple[np.ndarray, Fingerprint]:
    """As the worker runs a job: interleaved with another job in mixed-length micro-batches."""
    return decode_result(run_as_the_worker(backend, "embed", texts, EmbedOptions.parse(options), step=4,
                                           other=list(reversed(texts))))


def _st(folder: Path, texts, **kwargs) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=1, **kwargs)


def _index_refuses(tmp_path: Path, made_with: Fingerprint, then: Fingerprint) -> bool:
    """Whether an output the indexer wrote with ``made_with`` vectors refuses to take ``then`` vectors."""
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.npy"
    sink = open_sink(out, "npy", vector_dtype="float32", options={})
    sink.accept(made_with)
    sink.write(["a"], np.ones((1, 4), np.float32))
    sink.commit()
    sink.close()
    again = open_sink(out, "npy", vector_dtype="float32", options={})
    try:
        again.accept(then)
    except errors.OutputMismatch:
        return True
    finally:
        again.close()
    return False


def test_pooling_override_changes_the_fingerprint_and_the_index_refuses(models, texts, tmp_path):
    own, fp = _embed(_load(models["e5"]), texts)
    cls, fp_cls = _embed(_load(models["e5"], pooling="cls"), texts)
    assert fp.pooling == "mean" and fp_cls.pooling == "cls"
    assert float(np.abs(own - cls).max()) > 1e-2
    assert _index_refuses(tmp_path, fp, fp_cls)
    assert not _index_refuses(tmp_path, fp, _embed(_load(models["e5"]), texts[:3])[1])  # the check can pass


def test_default_prompt_is_applied_and_a_missing_one_is_another_space(models, texts, tmp_path):
    backend = _load(models["e5"])
    vectors, fp = _embed(backend, texts)  # no prompt named: the folder's default_prompt_name ("query")
    assert fp.prompt == "query: "
    assert float(np.abs(vectors - _st(models["e5"], texts)).max()) <= 1e-5
    _, fp_passage = _embed(backend, texts, prompt_name="passage")
    assert fp_passage.prompt == "passage: " and _index_refuses(tmp_path, fp, fp_passage)

    # the same weights served from a copy that lost its prompts: another folder hash, another prompt, refused
    copy = shutil.copytree(models["e5"], tmp_path / "e5-no-prompts")
    config = json.loads((copy / "config_sentence_transformers.json").read_text())
    config["prompts"], config["default_prompt_name"] = {}, None
    (copy / "config_sentence_transformers.json").write_text(json.dumps(config))
    bare, fp_bare = _embed(_load(copy), texts)
    assert fp_bare.prompt is None and fp_bare.weights_sha256 != fp.weights_sha256
    assert float(np.abs(bare - vectors).max()) > 1e-3
    assert _index_refuses(tmp_path, fp, fp_bare)


def test_last_token_is_right_whatever_the_padding_side(models, texts):
    left, fp_left = _embed(_load(models["qwen3"]), texts, prompt_name="query")
    right, fp_right = _embed(_load(models["qwen3-right"]), texts, prompt_name="query")
    assert fp_left.pooling == fp_right.pooling == "lasttoken"
    reference = _st(models["qwen3"], texts, prompt_name="query")
    assert float(np.abs(left - reference).max()) <= 1e-5
    assert float(np.abs(right - reference).max()) <= 1e-5  # the same weights padded on the other side


def test_a_missing_eos_is_another_folder_and_matches_sentence_transformers(models, texts, tmp_path, caplog):
    copy = shutil.copytree(models["qwen3"], tmp_path / "qwen3-no-eos")
    tokenizer = json.loads((copy / "tokenizer.json").read_text())
    tokenizer["post_processor"] = None  # what a tokenizer saved without Qwen3-Embedding's EOS template does
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    with caplog.at_level(logging.WARNING):
        backend = _load(copy)
    assert "does not end a text with the EOS token" in caplog.text
    with_eos, fp = _embed(_load(models["qwen3"]), texts)
    without, fp_no_eos = _embed(backend, texts)
    assert fp_no_eos.weights_sha256 != fp.weights_sha256 and _index_refuses(tmp_path, fp, fp_no_eos)
    assert float(np.abs(without - with_eos).max()) > 1e-3  # it is another space indeed
    assert float(np.abs(without - _st(copy, texts)).max()) <= 1e-5  # and still sentence-transformers' own


def test_truncation_length_and_side(models, texts, tmp_path):
    copy = shutil.copytree(models["e5"], tmp_path / "e5-shorter")
    config = json.loads((copy / "sentence_bert_config.json").read_text())
    config["max_seq_length"] = MAX_SEQ_LENGTH // 2
    (copy / "sentence_bert_config.json").write_text(json.dumps(config))
    full, fp = _embed(_load(models["e5"]), texts)
    short, fp_short = _embed(_load(copy), texts)
    assert weights_sha256(copy) != weights_sha256(models["e5"]) and _index_refuses(tmp_path, fp, fp_short)
    assert float(np.abs(short - _st(copy, texts)).max()) <= 1e-5
    assert float(np.abs(short[-2] - full[-2]).max()) > 1e-3  # the long text: cut elsewhere
    assert float(np.abs(short[-1] - full[-1]).max()) <= 1e-6  # a short one: the same

    # the side is a job option: an index made cutting on the right refuses a run cutting on the left
    out = tmp_path / "side.npy"
    open_sink(out, "npy", vector_dtype="float32", options=storage_options({})).close()
    with pytest.raises(errors.OutputMismatch, match="options"):
        open_sink(out, "npy", vector_dtype="float32", options=storage_options({"truncation_side": "left"}))


def test_normalisation_changes_the_fingerprint(models, texts, tmp_path):
    backend = _load(models["e5"])
    unit, fp = _embed(backend, texts)
    raw, fp_raw = _embed(backend, texts, normalize=False)
    assert fp.normalize and not fp_raw.normalize and _index_refuses(tmp_path, fp, fp_raw)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-6)
    assert float(np.abs(np.linalg.norm(raw, axis=1) - 1.0).max()) > 1e-2


def test_dtype_changes_the_fingerprint(models, texts, tmp_path):
    full, fp = _embed(_load(models["e5"]), texts)
    half, fp_half = _embed(_load(models["e5"], dtype="bfloat16"), texts)
    assert fp_half.dtype == "bfloat16" and _index_refuses(tmp_path, fp, fp_half)
    cos = (full * half).sum(1) / (np.linalg.norm(full, axis=1) * np.linalg.norm(half, axis=1))
    assert float(cos.min()) >= 0.99  # close, not the same: a bf16 index must not take fp32 vectors silently
