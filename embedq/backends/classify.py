"""The classifier head: ``rerank`` (TEI's ``/rerank``) and ``predict`` (``/predict``) from one model's logits.

A sentence-transformers CrossEncoder folder (a Transformer whose ``transformer_task`` is
``sequence-classification``) or a bare ``*ForSequenceClassification`` folder. Pairs are tokenized as one
sequence with segment ids (see :meth:`Encoder.encode_pairs`), so a rerank of 1 query × 100 texts is 100
items that pack with every other job's items. Scores are ``CrossEncoder.predict``'s:

* ``rerank`` (one-label models only): the model's activation over its logit (``activation_fn`` of
  ``config_sentence_transformers.json``, or the older config.json keys; Sigmoid by default), or the logit
  itself with ``raw_scores``;
* ``predict``: softmax over the labels (``CrossEncoder.predict(apply_softmax=True)``; TEI does the same),
  the activation for a one-label model, the logits with ``raw_scores``; labels from ``id2label``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedq import errors
from embedq.backends.base import Encoded, Head, ModelInfo, Prepared, RuntimeFacts
from embedq.backends.encoder import Encoder
from embedq.backends.folder import CLASSIFY
from embedq.backends.model import ModelBackend, base_info, check_modality
from embedq.backends.modules import activation, read_json
from embedq.backends.tokenizing import Tokenization
from embedq.backends.tokens import TOKENIZER_KINDS, read_prompts, tokenizer_heads
from embedq.protocol import Fingerprint, encode_result
from embedq.settings import BackendSettings
from embedq.version import __version__


def activation_name(folder: Path, config: Any, num_labels: int) -> str:
    """The activation ``CrossEncoder`` applies in ``predict`` (``get_default_activation_fn``): the one the
    folder names (only ``torch.*`` classes, as without ``trust_remote_code``), else Sigmoid for one label
    and Identity for more."""
    named = read_json(folder / "config_sentence_transformers.json").get("activation_fn")
    if named is None:
        st = getattr(config, "sentence_transformers", None)
        named = st.get("activation_fn") if isinstance(st, dict) else None
    if named is None:
        named = getattr(config, "sbert_ce_default_activation_function", None)
    if isinstance(named, str) and named.startswith("torch."):
        return named
    return "torch.nn.modules.activation.Sigmoid" if num_labels == 1 else "torch.nn.modules.linear.Identity"


class ClassifierHead(Head):
    name = "classifier"

    def __init__(self, tokenization: Tokenization, labels: tuple[str, ...], activation_fn: str) -> None:
        self.tokenization = tokenization
        self.labels = labels
        self.activation_name = activation_fn
        self.activation = activation(activation_fn, "CrossEncoder activation_fn")
        self.kinds = ("rerank", "predict") if len(labels) == 1 else ("predict",)
        self.info: ModelInfo | None = None

    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared:
        texts = [(i, t) for i, t in enumerate(items) if isinstance(t, str)]
        pairs = [(i, t) for i, t in enumerate(items) if not isinstance(t, str)]
        encoded: list[Encoded | None] = [None] * len(items)
        kw = {"truncate": options.truncate, "truncation_side": options.truncation_side}
        if pairs:
            for (i, _), enc in zip(pairs, self.tokenization.encode_pairs([p for _, p in pairs], **kw)):
                encoded[i] = enc
        if texts:
            done, _ = self.tokenization.encode_texts([t for _, t in texts], **kw)
            for (i, _), enc in zip(texts, done):
                encoded[i] = enc
        rows = [e for e in encoded if e is not None]
        return Prepared(rows, sum(len(e.ids) for e in rows))

    def rows(self, output: Any, mask: torch.Tensor, index: Any, batch: Sequence[Encoded]) -> list[np.ndarray]:
        logits = output.logits
        if index is not None:
            logits = logits.index_select(0, index)
        return list(logits.float().cpu().numpy().astype(np.float32, copy=False))

    def finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]:
        assert self.info is not None
        logits = np.stack(rows).astype(np.float32, copy=False)
        if not np.isfinite(logits).all():
            raise errors.BackendError("the model produced a non-finite score")
        if options.raw_scores:
            scores, how = logits, "logits"
        elif len(self.labels) == 1:
            with torch.inference_mode():
                scores = self.activation(torch.from_numpy(logits)).numpy()
            how = self.activation_name.rsplit(".", 1)[-1].lower()
        else:
            with torch.inference_mode():
                scores = torch.softmax(torch.from_numpy(logits), dim=1).numpy()
            how = "softmax"
        info = self.info
        fingerprint = Fingerprint(kind=kind, model=info.model_id, weights_sha256=info.weights_sha256, pooling=how,
                                  normalize=False, dimensions=len(self.labels), dtype=info.dtype, prompt=None,
                                  embedq_version=__version__)
        if kind == "rerank":
            return encode_result("rerank", {"scores": np.ascontiguousarray(scores[:, 0])}, fingerprint,
                                 items=len(rows), tokens=prepared.tokens)
        return encode_result("predict", {"scores": np.ascontiguousarray(scores)}, fingerprint, items=len(rows),
                             tokens=prepared.tokens, extra={"labels": list(self.labels)})


def load_classifier(folder: Path, transformer_dir: Path, st_config: dict[str, Any], modules: list[tuple[str, Path]],
                    settings: BackendSettings, *, model_id: str,
                    on_runtime_chosen: Callable[[RuntimeFacts], None] | None = None) -> ModelBackend:
    if len(modules) > 1:
        raise errors.UnsupportedModel(
            f"a sequence-classification Transformer followed by {[k for k, _ in modules[1:]]} is not supported")
    check_modality(st_config, "logits")
    if st_config.get("module_output_name", "scores") not in ("scores", "logits"):
        raise errors.UnsupportedModel(
            f"Transformer module_output_name={st_config['module_output_name']!r} is not supported")
    encoder = Encoder(transformer_dir, st_config, settings, task=CLASSIFY, allow_chat_template=bool(modules),
                      on_runtime_chosen=on_runtime_chosen)
    config = encoder.config
    num_labels = int(getattr(config, "num_labels", 0) or 0)
    if num_labels < 1:
        raise errors.UnsupportedModel(f"{folder}: a classifier needs at least one label")
    id2label = getattr(config, "id2label", None) or {}
    labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
    head = ClassifierHead(encoder.tokenization, labels, activation_name(folder, config, num_labels))
    prompts, default_prompt_name = read_prompts(folder)
    info = base_info(folder, encoder, model_id=model_id, dimension=num_labels, pooling="classifier",
                     normalizes=False, prompts=prompts, default_prompt_name=default_prompt_name,
                     kinds=(*head.kinds, *TOKENIZER_KINDS), labels=labels)
    head.info = info
    heads: dict[str, Head] = dict.fromkeys(head.kinds, head)
    heads.update(tokenizer_heads(encoder.tokenization, info))
    return ModelBackend(encoder, heads, info)
