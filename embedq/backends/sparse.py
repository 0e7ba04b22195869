"""The SPLADE head (``embed_sparse``, TEI's ``/embed_sparse``): a weight per vocabulary id from a masked-LM.

A sentence-transformers ``SparseEncoder`` folder (a Transformer with ``transformer_task="fill-mask"``, or the
older ``MLMTransformer``, then ``SpladePooling``), or a bare ``*ForMaskedLM`` folder served with
``pooling="splade"`` (what ``SparseEncoder`` and TEI's ``--pooling splade`` make of it: max pooling, ReLU).
Weights are ``SpladePooling``'s, in its order of operations, so they match ``SparseEncoder.encode``:

    w[v] = pool over the text's tokens t of log(1 + act(logit[t, v] * mask[t]))

with ``act`` ReLU (``log1p_relu``: one more log1p) and ``pool`` max or sum. The batch × length × vocabulary
logits are the largest tensor a micro-batch makes: they are never copied, only each text's real tokens are read,
and the head lowers the worker's token budget so that they stay under :data:`LOGITS_BYTES`. Max pooling reads
them once: ReLU and log1p are non-decreasing, so the largest weight is the activation of the largest logit, and
the activation runs on vocabulary-sized rows (one pass over the logits instead of four; the same values, since
a padding position's masked logit, 0, is never above the ReLU's floor). A row is the text's non-zero
weights as (vocabulary ids, values), ids ascending; ``top_k`` and token strings are the job's options.
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
from embedq.backends.folder import FILL_MASK
from embedq.backends.model import ModelBackend, base_info, check_modality
from embedq.backends.modules import read_json
from embedq.backends.tokenizing import Tokenization
from embedq.backends.tokens import TOKENIZER_KINDS, prepare_texts, read_prompts, tokenizer_heads
from embedq.backends.transformer import DTYPES
from embedq.backends.windowing import merge_sparse
from embedq.protocol import Fingerprint, encode_result
from embedq.settings import BackendSettings
from embedq.version import __version__

#: Most bytes a micro-batch's vocabulary logits may take; the token budget is lowered to stay under it
#: (a 30,522-token vocabulary in fp32 stays under it up to 8,796 tokens; XLM-R's 250,002 to 1,073).
LOGITS_BYTES = 1 << 30
STRATEGIES = ("max", "sum")
ACTIVATIONS = ("relu", "log1p_relu")


def _activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    x = x.relu_().log1p_()
    return x.log1p_() if activation == "log1p_relu" else x


def splade_pool(logits: torch.Tensor, mask: torch.Tensor, strategy: str, activation: str,
                rows: Sequence[int] | None = None) -> torch.Tensor:
    """``SpladePooling.forward`` (inference) on ``logits`` (batch × length × vocabulary) for ``rows`` (default:
    all): returns len(rows) × vocabulary. Only each row's real tokens (one contiguous run, right or left padded)
    are read; with ``sum`` they are overwritten in place."""
    picked = range(logits.shape[0]) if rows is None else rows
    lengths = mask.sum(dim=1).tolist()
    starts = mask.argmax(dim=1).tolist()  # the first real token: 0 unless left padded
    out = torch.zeros((len(picked), logits.shape[-1]), dtype=logits.dtype, device=logits.device)
    for j, i in enumerate(picked):
        n, s = int(lengths[i]), int(starts[i])
        if not n:
            continue
        tokens = logits[i, s:s + n]
        if strategy == "max":
            torch.amax(tokens, dim=0, out=out[j])
        else:
            torch.sum(_activate(tokens, activation), dim=0, out=out[j])
    return _activate(out, activation) if strategy == "max" else out


def sparse_rows(pooled: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each row of ``pooled`` (batch × vocabulary) as (non-zero ids int32 ascending, their values float32).
    A NaN is not zero: it stays in the row, and the worker fails that item."""
    dense = pooled.float().cpu().numpy()
    out = []
    for row in dense:
        ids = np.flatnonzero(row).astype(np.int32)
        out.append((ids, row[ids].astype(np.float32, copy=False)))
    return out


def prune(ids: np.ndarray, values: np.ndarray, top_k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The ``top_k`` largest weights (ties: the lower id first), ids ascending."""
    if top_k is None or len(ids) <= top_k:
        return ids, values
    keep = np.sort(np.argsort(-values, kind="stable")[:top_k])
    return ids[keep], values[keep]


class SpladeHead(Head):
    """``embed_sparse``; and ``embed`` with ``normalize=False``, the same weights as a dense vocabulary-sized vector
    (TEI's ``/embed`` on a SPLADE model; its default ``normalize=true`` is refused there, 424, and here)."""

    name = "splade"
    kinds = ("embed_sparse", "embed")
    pools_windows = True

    def __init__(self, tokenization: Tokenization, strategy: str, activation: str) -> None:
        self.tokenization = tokenization
        self.strategy = strategy
        self.activation = activation
        self.info: ModelInfo | None = None

    @property
    def pooling(self) -> str:
        return f"splade-{self.strategy}" + ("" if self.activation == "relu" else f"-{self.activation}")

    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared:
        if kind == "embed":
            assert self.info is not None
            if options.normalize is not False:
                raise errors.UnsupportedTask("`normalize` is not available for SPLADE models: ask normalize=False "
                                             "for the weights as a dense vector, or embed_sparse for the sparse ones")
            if options.dimensions is not None and options.dimensions > self.info.dimension:
                raise errors.InvalidDimensions(f"dimensions={options.dimensions} is more than the model's "
                                               f"{self.info.dimension}")
        return prepare_texts(self.tokenization, self.info, items, options)

    def pool(self, rows: list[Any], weights: list[int], options: Any) -> tuple[np.ndarray, np.ndarray]:
        """The windows' weights merged as SpladePooling merges tokens: the largest weight per id (``max``), or
        their sum (``sum``: a token two windows share counts twice)."""
        return merge_sparse(rows, self.strategy)

    def rows(self, output: Any, mask: torch.Tensor, index: Any, batch: Sequence[Encoded]) -> list[Any]:
        # items of another head in the batch: only this head's rows are read
        rows = None if index is None else index.tolist()
        return sparse_rows(splade_pool(output.logits, mask, self.strategy, self.activation, rows))

    def finish(self, kind: str, rows: list[Any], prepared: Prepared, options: Any) -> dict[str, Any]:
        info = self.info
        assert info is not None
        if kind == "embed":  # the weights densely, cut to ``dimensions`` (TEI's Matryoshka cut, on SPLADE too)
            width = options.dimensions or info.dimension
            dense = np.zeros((len(rows), width), dtype=np.float32)
            for i, (ids, values) in enumerate(rows):
                keep = ids < width
                dense[i, ids[keep]] = values[keep]
            fingerprint = Fingerprint(kind="embed", model=info.model_id, weights_sha256=info.weights_sha256,
                                      pooling=self.pooling, normalize=False, dimensions=width, dtype=info.dtype,
                                      prompt=prepared.state.get("prompt"), embedq_version=__version__)
            return encode_result("embed", {"vectors": dense}, fingerprint, items=len(rows), tokens=prepared.tokens,
                                 encoding=options.encoding)
        kept = [prune(ids, values, options.top_k) for ids, values in rows]
        lengths = np.fromiter((len(ids) for ids, _ in kept), dtype=np.int64, count=len(kept))
        offsets = np.zeros(len(kept) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        indices = np.concatenate([ids for ids, _ in kept]) if kept else np.zeros(0, np.int32)
        values = np.concatenate([v for _, v in kept]) if kept else np.zeros(0, np.float32)
        extra = None
        if options.return_tokens:
            extra = {"tokens": self.tokenization.tokenizer.convert_ids_to_tokens(indices.tolist())}
        fingerprint = Fingerprint(kind=kind, model=info.model_id, weights_sha256=info.weights_sha256,
                                  pooling=self.pooling, normalize=False, dimensions=info.dimension, dtype=info.dtype,
                                  prompt=prepared.state.get("prompt"), embedq_version=__version__)
        return encode_result(kind, {"offsets": offsets, "indices": indices.astype(np.int32, copy=False),
                                    "values": values.astype(np.float32, copy=False)}, fingerprint,
                             items=len(rows), tokens=prepared.tokens, encoding=options.encoding, extra=extra)


def splade_config(modules: list[tuple[str, Path]]) -> tuple[str, str]:
    """(pooling strategy, activation) of a SparseEncoder's SpladePooling module; a bare folder: (max, relu)."""
    if not modules:
        return "max", "relu"
    kinds = [k for k, _ in modules]
    if kinds[1:] != ["SpladePooling"]:
        raise errors.UnsupportedModel(f"a masked-LM Transformer must be followed by SpladePooling alone; got {kinds}")
    config = read_json(modules[1][1] / "config.json")
    strategy = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    if strategy not in STRATEGIES or activation not in ACTIVATIONS:
        raise errors.UnsupportedModel(
            f"SpladePooling pooling_strategy={strategy!r}, activation_function={activation!r} is not supported "
            f"(supported: {STRATEGIES}, {ACTIVATIONS})")
    return strategy, activation


def load_sparse(folder: Path, transformer_dir: Path, st_config: dict[str, Any], modules: list[tuple[str, Path]],
                settings: BackendSettings, *, model_id: str,
                on_runtime_chosen: Callable[[RuntimeFacts], None] | None = None) -> ModelBackend:
    strategy, activation = splade_config(modules)
    check_modality(st_config, "logits")
    if st_config.get("module_output_name", "token_embeddings") != "token_embeddings":
        raise errors.UnsupportedModel(
            f"Transformer module_output_name={st_config['module_output_name']!r} is not supported")
    vocab = int(read_json(transformer_dir / "config.json").get("vocab_size") or 0)
    if vocab < 1:
        raise errors.UnsupportedModel(f"{transformer_dir}: a SPLADE model needs config.json's vocab_size")
    element = torch.finfo(DTYPES.get(settings.dtype, torch.float32)).bits // 8
    cap = max(1, LOGITS_BYTES // (vocab * element))
    budget, online = min(settings.batch_tokens, cap), min(settings.online_tokens, cap)
    encoder = Encoder(transformer_dir, st_config, settings.model_copy(update={"batch_tokens": budget,
                                                                              "online_tokens": online}),
                      task=FILL_MASK, allow_chat_template=bool(modules), on_runtime_chosen=on_runtime_chosen)
    head = SpladeHead(encoder.tokenization, strategy, activation)
    prompts, default_prompt_name = read_prompts(folder)
    info = base_info(folder, encoder, model_id=model_id, dimension=vocab, pooling=head.pooling, normalizes=False,
                     prompts=prompts, default_prompt_name=default_prompt_name,
                     kinds=("embed_sparse", "embed", *TOKENIZER_KINDS))
    head.info = info
    heads: dict[str, Head] = {"embed_sparse": head, "embed": head, **tokenizer_heads(encoder.tokenization, info)}
    backend = ModelBackend(encoder, heads, info)
    backend.max_batch_tokens = budget if budget < settings.batch_tokens else None
    return backend
