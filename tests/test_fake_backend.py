"""The fake backend (``embedq/backends/fake.py``): deterministic, batch-invariant, no torch, and never served by a
worker unless ``EMBEDQ_ALLOW_FAKE_BACKEND`` says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import WorkerHandle

from embedq import errors
from embedq.backends import load_backend
from embedq.backends.fake import MAX_SEQ_LENGTH, FakeBackend
from embedq.protocol import EmbedAllOptions, EmbedOptions, decode_arrays, decode_result
from embedq.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def _run(backend: FakeBackend, batches: list[list], options: EmbedOptions) -> np.ndarray:
    """Each batch prepared as one job and run as micro-batches of 3 items."""
    out = []
    for texts in batches:
        prepared = backend.prepare("embed", texts, options)
        rows = [row for i in range(0, len(prepared.items), 3) for row in backend.forward(prepared.items[i:i + 3])]
        out.append(backend.finish("embed", rows, prepared, options))
    return np.concatenate([decode_result(p)[0] for p in out])


def test_vectors_depend_on_the_text_alone_and_options_work():
    backend = load_backend("embedq-fake", allow_fake_backend=True)
    texts = ["Hello, world", "another text", "x " * 400, "Hello, world"]
    together = _run(backend, [texts], EmbedOptions.parse({}))
    apart = _run(backend, [[t] for t in reversed(texts)], EmbedOptions.parse({}))[::-1]
    assert np.array_equal(together, apart) and np.array_equal(together[0], together[3])
    assert np.allclose(np.linalg.norm(together, axis=1), 1, atol=1e-6)
    short = _run(backend, [texts], EmbedOptions.parse({"dimensions": 8, "normalize": False}))
    assert short.shape == (4, 8) and not np.allclose(np.linalg.norm(short, axis=1), 1)
    with pytest.raises(errors.TooLong):
        backend.prepare("embed", ["x " * 400], EmbedOptions.parse({"truncate": False}))
    assert len(backend.prepare("embed", ["x " * 400], EmbedOptions.parse({})).items[0].ids) == MAX_SEQ_LENGTH
    with pytest.raises(errors.InvalidDimensions):
        backend.prepare("embed", ["x"], EmbedOptions.parse({"dimensions": 33}))
    with pytest.raises(errors.UnsupportedTask):
        backend.prepare("rerank", ["x"], EmbedOptions.parse({}))


def test_its_name_chooses_the_dimension_and_embed_all_returns_each_tokens_row():
    backend = load_backend("embedq-fake-384", allow_fake_backend=True)
    assert backend.info.dimension == 384 and backend.kinds == ("embed", "embed_all")
    texts = ["Hello, world", "another text"]
    assert _run(backend, [texts], EmbedOptions.parse({})).shape == (2, 384)
    options = EmbedAllOptions.parse({"encoding": "float16"})
    prepared = backend.prepare("embed_all", texts, options)
    rows = backend.forward(prepared.items)
    result = decode_arrays(backend.finish("embed_all", rows, prepared, options))
    offsets, tokens = result["offsets"], result["tokens"]
    # [CLS] hello , world [SEP]; [CLS] another text [SEP]
    assert list(offsets) == [0, 5, 9] and tokens.shape == (9, 384)
    together = np.concatenate([backend.table[e.ids] for e in prepared.items])
    assert np.allclose(tokens, together, atol=2e-3)  # float16
    mean = _run(backend, [texts[:1]], EmbedOptions.parse({"normalize": False}))[0]
    assert np.allclose(mean, together[:5].mean(axis=0), atol=1e-6)
    for name in ("embedq-fake-0", "embedq-fake-99999"):
        with pytest.raises(errors.UnknownModel, match="dimension"):
            load_backend(name, allow_fake_backend=True)
    with pytest.raises(errors.UnknownModel, match="EMBEDQ_ALLOW_FAKE_BACKEND"):
        load_backend("embedq-fake-384")


def test_it_is_refused_unless_allowed_and_imports_no_torch():
    with pytest.raises(errors.UnknownModel, match="EMBEDQ_ALLOW_FAKE_BACKEND"):
        load_backend("embedq-fake")
    code = ("import sys; from embedq.backends import load_backend; "
            "load_backend('embedq-fake', allow_fake_backend=True); "
            "sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode == 0


def test_the_backend_settings_are_one_object_from_the_same_variables(monkeypatch):
    """``Settings.backend()`` reads the EMBEDQ_* variables a backend loads with (names and meanings kept, the token
    budgets resolved for the device) into one object ``load_backend`` takes whole; a keyword replaces one field, a
    value it refuses is ``InvalidOption``, a name it lacks a TypeError."""
    for name, value in {"DEVICE": "cuda:1", "DTYPE": "bfloat16", "TORCH_THREADS": "3", "LINEAR_KERNEL": "onednn",
                        "ONLINE_BATCH_TOKENS": "512", "POOLING": "last-token", "TRUST_REMOTE_CODE": "true",
                        "ALLOW_FAKE_BACKEND": "true", "MAX_WINDOWS": "7"}.items():
        monkeypatch.setenv(f"EMBEDQ_{name}", value)
    options = Settings().backend()
    assert options.model_dump() == {"device": "cuda:1", "dtype": "bfloat16", "torch_threads": 3,
                                    "linear_kernel": "onednn", "batch_tokens": 16384, "online_tokens": 512,
                                    "pooling": "lasttoken", "trust_remote_code": True, "allow_fake_backend": True,
                                    "max_windows": 7}
    assert isinstance(load_backend("embedq-fake", options), FakeBackend)
    with pytest.raises(errors.UnknownModel, match="EMBEDQ_ALLOW_FAKE_BACKEND"):
        load_backend("embedq-fake", options, allow_fake_backend=False)
    with pytest.raises(errors.InvalidOption, match="pooling"):
        load_backend("embedq-fake", options, pooling="median")
    with pytest.raises(TypeError, match="allow_fake"):
        load_backend("embedq-fake", options, allow_fake=True)


@pytest.mark.integration
def test_a_worker_refuses_it_unless_the_setting_says_so(redis_server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith("_CACHE")}
    env.update(EMBEDQ_BROKER_URL=redis_server.url, EMBEDQ_MODEL="embedq-fake", EMBEDQ_QUEUE="embedq.test.fake-no",
               PYTHONPATH=str(ROOT))
    refused = subprocess.run([sys.executable, "-m", "embedq", "worker"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "EMBEDQ_ALLOW_FAKE_BACKEND" in refused.stderr, refused.stderr[-2000:]
    settings = Settings(broker_url=redis_server.url, queue="embedq.test.fake", model="embedq-fake",
                        allow_fake_backend=True)
    worker = WorkerHandle(settings, tmp_path / "worker.log")
    try:
        texts = ["Hello, world", "another text", "third"]
        got = worker.client.embed(texts, timeout=60)
        assert np.array_equal(got, _run(FakeBackend(), [texts], EmbedOptions.parse({})))
        assert worker.client.submit(texts).result(timeout=60).shape == (3, 32)
    finally:
        worker.stop()
