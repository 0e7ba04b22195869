"""Wire contract, error tree and settings: pure tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from celery.backends.base import Backend as CeleryBackend

from embedq import errors
from embedq.protocol import EmbedOptions, decode_vectors, encode_vectors, validate_texts
from embedq.settings import Settings, model_slug


@pytest.mark.parametrize(
    ("texts", "exc"),
    [
        ([], errors.EmptyInput),
        ([""], errors.EmptyText),
        (["ok", ""], errors.EmptyText),
        (["ok", 3], errors.InvalidType),
        ([None], errors.InvalidType),
        ({"a": 1}, errors.InvalidType),
        (42, errors.InvalidType),
        (["x" * 11], errors.TextTooLong),
        (["a"] * 6, errors.TooManyTexts),
    ],
)
def test_validate_texts_errors(texts, exc):
    with pytest.raises(exc) as info:
        validate_texts(texts, max_texts=5, max_chars=10)
    assert info.value.message.startswith(f"[{exc.code}] ")


def test_validate_texts_accepts_single_string():
    assert validate_texts("hello", max_texts=5, max_chars=10) == ["hello"]


@pytest.mark.parametrize(
    "kwargs",
    [{"normalize": "maybe"}, {"dimensions": 0}, {"dimensions": -3}, {"truncation_side": "middle"},
     {"encoding": "int8"}, {"nonsense": 1}, {"prompt": "a", "prompt_name": "b"}, {"v": 99}, ["not", "a", "dict"]],
)
def test_bad_options_are_invalid_option(kwargs):
    with pytest.raises(errors.InvalidOption):
        EmbedOptions.parse(kwargs)


def test_options_wire_is_minimal():
    assert EmbedOptions.parse({}).wire() == {}
    assert EmbedOptions.parse({"dimensions": 64, "encoding": "float"}).wire() == {"dimensions": 64, "encoding": "float"}


@pytest.mark.parametrize("encoding", ["float32", "float16", "float"])
def test_vector_codec_roundtrip(encoding):
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((7, 33)).astype(np.float32)
    payload = encode_vectors(vecs, encoding)
    back = decode_vectors(payload)
    assert back.shape == (7, 33) and back.dtype == np.float32
    tol = 1e-3 if encoding == "float16" else 0.0
    np.testing.assert_allclose(back, vecs, rtol=tol, atol=tol)
    if encoding == "float32":  # compact: 4 bytes per value, base64
        assert len(payload["data"]) == pytest.approx(7 * 33 * 4 * 4 / 3, rel=0.01)


def test_errors_survive_the_celery_result_backend_roundtrip():
    from celery import Celery

    app = Celery(set_as_current=False)
    backend = CeleryBackend(app=app)
    for cls in (errors.EmptyText, errors.UnknownModel, errors.BackendError, errors.TooLong):
        original = cls("something is wrong")
        meta = backend.prepare_exception(original, serializer="json")
        rebuilt = backend.exception_to_python(meta)
        assert type(rebuilt) is cls
        assert rebuilt.code == cls.code and rebuilt.message == original.message
        assert meta["exc_message"][0].startswith(f"[{cls.code}]")


def test_error_tree_codes_unique_and_mapped():
    assert errors.HTTP_STATUS["empty_text"] == 400  # TEI: empty input is 400 "Empty"
    assert errors.HTTP_STATUS["too_many_texts"] == 413
    assert errors.HTTP_STATUS["overloaded"] == 429
    assert errors.HTTP_STATUS["backend_error"] == 424
    assert errors.HTTP_STATUS["unavailable"] == 503
    assert errors.BackendError.retryable and not errors.EmptyText.retryable


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("EMBEDQ_BROKER_URL", "redis://h:1/2")
    monkeypatch.setenv("EMBEDQ_MAX_BATCH_TOKENS", "1234")
    s = Settings()
    assert s.broker_url == "redis://h:1/2" and s.result_url == "redis://h:1/2"
    assert s.max_batch_tokens == 1234
    assert s.queue_name == "embedq.all-minilm-l6-v2"
    assert model_slug("/tmp/My Model/") == "my-model"


def test_producer_imports_without_torch_transformers_tokenizers():
    """A web app that imports the producer must not need the worker's heavy dependencies."""
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in {'torch', 'transformers', 'tokenizers', 'sentence_transformers'}:
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import embedq
        from embedq import Client, JobHandle
        from embedq import cli
        from embedq.producers import client, embedded, index
        from embedq import broker, cancellation, monitor
        from embedq import batching, protocol, errors, settings
        c = Client(broker_url='redis://127.0.0.1:1/0')
        assert not any(m.split('.')[0] in {'torch', 'transformers', 'tokenizers'} for m in sys.modules)
        assert not any(m.startswith('embedq.workers') for m in sys.modules), 'a producer imported embedq.workers'
        print('ok')
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_docstrings_that_list_the_kinds_name_every_kind():
    """The kinds table's docstring names every built-in kind, and the docstrings that once listed some of them (four
    of eight: issue 38) point to the table instead of listing."""
    import embedq.kinds
    import embedq.protocol
    import embedq.workers.tasks

    listed = set(re.findall(r"``([a-z_]+)``", embedq.kinds.__doc__ or ""))
    built_in = {embedq.kinds.TASKS[name].kind for name in embedq.kinds.BUILT_IN}  # a plugin test may have added more
    assert len(built_in) == 8 and built_in <= listed, built_in - listed
    for module in (embedq.protocol, embedq.workers.tasks):
        assert "kinds" in (module.__doc__ or ""), module.__name__
        assert not set(re.findall(r"``(embedq\.[a-z_]+)``", module.__doc__ or "")) - {"embedq.embed"}, module.__name__
