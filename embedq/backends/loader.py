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
from embedq.backends.kernels import LinearKernel
from embedq.backends.model import ModelBackend, model_task, read_modules


def load_model(path: Path, *, model_id: str, device: str = "cpu", dtype: str = "float32",
               torch_threads: int | None = None, linear_kernel: LinearKernel = "auto", batch_tokens: int = 2048,
               online_tokens: int = 256, pooling: str | None = None,
               trust_remote_code: bool = False,
               on_runtime_chosen: Callable[[RuntimeFacts], None] | None = None) -> ModelBackend:
    """Load the folder at ``path`` with the heads it calls for. ``pooling``: ``"splade"`` serves a bare masked-LM
    folder as a SPLADE model; a dense mode (``cls``, ``mean``, ``lasttoken``, ...) overrides an embedding model's
    own pooling (TEI's ``--pooling``), which its fingerprint then names. ``trust_remote_code``: run the model's own
    code when it ships some (only from inside the folder; refused otherwise). ``on_runtime_chosen``: see
    :func:`embedq.backends.runtime.choose`."""
    folder = Path(path).resolve()
    modules = read_modules(folder)
    transformer_dir, st_config, task = model_task(folder, modules, pooling)
    common = dict(model_id=model_id, device=device, dtype=dtype, torch_threads=torch_threads,
                  linear_kernel=linear_kernel, batch_tokens=batch_tokens, online_tokens=online_tokens,
                  trust_remote_code=trust_remote_code, on_runtime_chosen=on_runtime_chosen)
    if pooling not in (None, "splade") and task != FEATURES:
        raise errors.UnsupportedModel(f"pooling={pooling} applies to embedding models; {folder} is a {task} model")
    if task == FILL_MASK:
        from embedq.backends.sparse import load_sparse

        return load_sparse(folder, transformer_dir, st_config, modules, **common)
    if task == CLASSIFY:
        from embedq.backends.classify import load_classifier

        return load_classifier(folder, transformer_dir, st_config, modules, **common)
    from embedq.backends.dense import DenseBackend

    return DenseBackend(folder, pooling=None if pooling == "splade" else pooling, **common)
