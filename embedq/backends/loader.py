"""A model folder → a backend: the encoder plus the heads the folder calls for.

* a sentence-transformers SentenceTransformer folder (Transformer, Pooling, Dense/Normalize), or a bare
  transformers folder (ST's fallback: mean pooling, last token for ``*ForCausalLM``) → ``embed``;
* a sentence-transformers CrossEncoder folder (a Transformer with ``transformer_task`` =
  ``sequence-classification``), or a bare ``*ForSequenceClassification`` folder → ``predict``, and
  ``rerank`` when the classifier has one label;
* every model also serves ``tokenize`` and ``decode`` (its tokenizer alone).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from embedq import errors
from embedq.backends.base import RuntimeFacts
from embedq.backends.folder import CLASSIFY, FEATURES, FILL_MASK
from embedq.backends.model import ModelBackend, model_task, read_modules
from embedq.settings import BackendSettings


def load_model(path: Path, settings: BackendSettings, *, model_id: str,
               on_runtime_chosen: Callable[[RuntimeFacts], None] | None = None) -> ModelBackend:
    """Load the folder at ``path`` with the heads it calls for. ``settings.pooling``: ``"splade"`` serves a bare
    masked-LM folder as a SPLADE model; a dense mode (``cls``, ``mean``, ``lasttoken``, ...) overrides an embedding
    model's own pooling (TEI's ``--pooling``), which its fingerprint then names. ``settings.trust_remote_code``: run the
    model's own code when it ships some (only from inside the folder; refused otherwise). ``on_runtime_chosen``: see
    :func:`embedq.backends.runtime.choose`."""
    folder = Path(path).resolve()
    modules = read_modules(folder)
    pooling = settings.pooling
    transformer_dir, st_config, task = model_task(folder, modules, pooling)
    if pooling not in (None, "splade") and task != FEATURES:
        raise errors.UnsupportedModel(f"pooling={pooling} applies to embedding models; {folder} is a {task} model")
    if task == FILL_MASK:
        from embedq.backends.sparse import load_sparse

        return load_sparse(folder, transformer_dir, st_config, modules, settings, model_id=model_id,
                           on_runtime_chosen=on_runtime_chosen)
    if task == CLASSIFY:
        from embedq.backends.classify import load_classifier

        return load_classifier(folder, transformer_dir, st_config, modules, settings, model_id=model_id,
                               on_runtime_chosen=on_runtime_chosen)
    from embedq.backends.dense import DenseBackend

    return DenseBackend(folder, settings, model_id=model_id, on_runtime_chosen=on_runtime_chosen)
