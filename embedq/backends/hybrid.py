"""The BGE-M3 head (``embed_hybrid``): dense, lexical and ColBERT outputs from one forward pass.

A folder in FlagEmbedding's layout: the transformer (XLM-RoBERTa for BGE-M3) plus ``sparse_linear.pt``
(hidden → 1) and ``colbert_linear.pt`` (hidden → ColBERT width). The outputs are FlagEmbedding's
(``BGEM3FlagModel.encode``, inference):

* ``dense``: the CLS token's hidden state, L2-normalised;
* ``lexical``: ReLU(sparse_linear(hidden)) per token, the largest weight per token id, positive weights only,
  CLS/EOS/PAD/UNK left out; a row is (ids ascending, weights); the result's ``lexical_dimensions`` is the
  vocabulary size (config.json's ``vocab_size``), which bounds every id (a database's ``sparsevec(V)``);
* ``colbert``: colbert_linear over every real token but CLS, each vector L2-normalised.

A job names the outputs it wants; each combination is a head of its own (``m3:dense+colbert``), so jobs asking
for different outputs share micro-batches and one forward pass, and no item computes what its job did not ask
for. The folder's own sentence-transformers modules, when it has them, still serve plain ``embed`` jobs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from embedq import errors
from embedq.backends.base import Encoded, Head, ModelInfo, Prepared
from embedq.backends.encoder import Encoder
from embedq.backends.tokenizing import Tokenization
from embedq.backends.tokens import prepare_texts
from embedq.backends.windowing import concat_rows, merge_sparse, weighted_mean
from embedq.protocol import HYBRID_OUTPUTS, Fingerprint, encode_result
from embedq.version import __version__

SPARSE_FILE = "sparse_linear.pt"
COLBERT_FILE = "colbert_linear.pt"


def is_m3_folder(folder: Path) -> bool:
    return (folder / SPARSE_FILE).is_file() and (folder / COLBERT_FILE).is_file()


def _linear(path: Path, hidden: int, encoder: Encoder, out: int | None = None) -> torch.nn.Linear:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        weight = state["weight"]
        layer = torch.nn.Linear(hidden, out or int(weight.shape[0]))
        layer.load_state_dict(state)
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise errors.UnsupportedModel(f"cannot load {path.name}: {exc}") from exc
    if layer.in_features != hidden:
        raise errors.UnsupportedModel(f"{path.name} takes {layer.in_features} features; the model has {hidden}")
    return layer.to(device=encoder.device, dtype=encoder.dtype).eval()


class M3Weights:
    """The two linear heads and the token ids the lexical output leaves out."""

    def __init__(self, folder: Path, encoder: Encoder) -> None:
        hidden = int(getattr(encoder.config, "hidden_size", 0) or 0)
        self.sparse = _linear(folder / SPARSE_FILE, hidden, encoder, 1)
        self.colbert = _linear(folder / COLBERT_FILE, hidden, encoder)
        tok = encoder.tokenizer
        self.unused = sorted({i for i in (tok.cls_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
                              if i is not None})
        self.colbert_dim = self.colbert.out_features
        self.hidden = hidden
        # every lexical id is below it (the embedding matrix's rows): a database's sparse column's dimension
        self.vocab = int(getattr(encoder.config, "vocab_size", 0) or len(tok))


class M3Head(Head):
    """One combination of outputs; :func:`m3_heads` makes them all."""

    kinds = ("embed_hybrid",)
    pools_windows = True

    def __init__(self, tokenization: Tokenization, weights: M3Weights, outputs: tuple[str, ...]) -> None:
        self.tokenization = tokenization
        self.weights = weights
        self.outputs = outputs
        self.name = "m3:" + "+".join(outputs)
        self.info: ModelInfo | None = None
        self.by_outputs: dict[tuple[str, ...], M3Head] = {}

    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared:
        head = self.by_outputs[tuple(o for o in HYBRID_OUTPUTS if o in options.outputs)]
        prepared = prepare_texts(self.tokenization, self.info, items, options)
        for item in prepared.items:  # the variant that computes exactly the job's outputs
            item.head = head.name
        return prepared

    def pool(self, rows: list[Any], weights: list[int], options: Any) -> tuple[Any, ...]:
        """Each output over a text's windows: ``dense`` the token-weighted mean of the windows' CLS vectors,
        L2-normalised again (the model's normalisation); ``lexical`` the largest weight per id (FlagEmbedding's
        rule within a text); ``colbert`` every window's vectors one after the other."""
        out: list[Any] = []
        at = 0
        for name in (o for o in HYBRID_OUTPUTS if o in options.outputs):
            if name == "dense":
                mean = weighted_mean([r[at] for r in rows], weights, self.weights.hidden)
                out.append(mean / max(float(np.linalg.norm(mean)), 1e-12) if rows else mean)
                at += 1
            elif name == "lexical":
                out += merge_sparse([(r[at], r[at + 1]) for r in rows], "max")
                at += 2
            else:
                out.append(concat_rows([r[at] for r in rows], self.weights.colbert_dim))
                at += 1
        return tuple(out)

    def rows(self, output: Any, mask: torch.Tensor, index: Any, batch: Sequence[Encoded]) -> list[Any]:
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        items = list(batch)
        if index is not None:
            hidden, mask = hidden.index_select(0, index), mask.index_select(0, index)
            items = [batch[i] for i in index.tolist()]
        lengths = [len(item.ids) for item in items]
        parts: dict[str, list[Any]] = {}
        if "dense" in self.outputs:
            parts["dense"] = list(F.normalize(hidden[:, 0], dim=-1).float().cpu().numpy())
        if "lexical" in self.outputs:
            weights = torch.relu(self.weights.sparse(hidden)).squeeze(-1).float().cpu().numpy()
            unused = np.asarray(self.weights.unused)
            parts["lexical"] = [_lexical(np.asarray(item.ids), weights[i, :n], unused)
                                for i, (item, n) in enumerate(zip(items, lengths))]
        if "colbert" in self.outputs:
            vectors = self.weights.colbert(hidden[:, 1:])
            vectors = vectors * mask[:, 1:, None].to(vectors.dtype)
            vectors = F.normalize(vectors, dim=-1).float().cpu().numpy()
            parts["colbert"] = [vectors[i, :max(n - 1, 0)] for i, n in enumerate(lengths)]
        return [tuple(x for name in self.outputs for x in _flat(name, parts[name][i])) for i in range(len(items))]

    def finish(self, kind: str, rows: list[Any], prepared: Prepared, options: Any) -> dict[str, Any]:
        info = self.info
        assert info is not None
        wanted = [o for o in HYBRID_OUTPUTS if o in options.outputs]
        arrays: dict[str, Any] = {}
        at = 0
        for name in wanted:  # the job's items ran on the head of exactly these outputs, in this order
            width = 2 if name == "lexical" else 1
            column = [row[at:at + width] for row in rows]
            at += width
            if name == "dense":
                arrays["dense"] = np.stack([c[0] for c in column]).astype(np.float32, copy=False)
            elif name == "lexical":
                arrays.update(_ragged("lexical", [c[0] for c in column], [c[1] for c in column], options.top_k))
            else:
                mats = [c[0] for c in column]
                arrays["colbert_offsets"] = _offsets([len(m) for m in mats])
                arrays["colbert"] = (np.concatenate(mats) if mats else np.zeros((0, self.weights.colbert_dim))
                                     ).astype(np.float32, copy=False)
        fingerprint = Fingerprint(kind=kind, model=info.model_id, weights_sha256=info.weights_sha256,
                                  pooling="m3:" + "+".join(wanted), normalize=True, dimensions=self.weights.hidden,
                                  dtype=info.dtype, prompt=prepared.state.get("prompt"), embedq_version=__version__)
        extra: dict[str, Any] = {"outputs": wanted}
        if "lexical" in wanted:
            extra["lexical_dimensions"] = self.weights.vocab
        if options.return_tokens and "lexical" in wanted:
            extra["lexical_tokens"] = self.tokenization.tokenizer.convert_ids_to_tokens(
                arrays["lexical_indices"].tolist())
        # float16 is for the dense and ColBERT vectors; lexical weights stay float32
        return encode_result(kind, arrays, fingerprint, items=len(rows), tokens=prepared.tokens,
                             encoding=options.encoding, extra=extra, exact=("lexical_values",))


def _lexical(ids: np.ndarray, weights: np.ndarray, unused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FlagEmbedding's ``_process_token_weights``: the largest positive weight per id, special ids left out."""
    keep = (weights > 0) & ~np.isin(ids, unused)
    ids, weights = ids[keep], weights[keep]
    if not len(ids):
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    order = np.lexsort((-weights, ids))  # by id, the largest weight first
    ids, weights = ids[order], weights[order]
    first = np.r_[True, ids[1:] != ids[:-1]]
    return ids[first].astype(np.int32), weights[first].astype(np.float32)


def _flat(name: str, value: Any) -> tuple[Any, ...]:
    return value if name == "lexical" else (value,)


def _offsets(lengths: list[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def _ragged(prefix: str, ids: list[np.ndarray], values: list[np.ndarray], top_k: int | None) -> dict[str, np.ndarray]:
    from embedq.backends.sparse import prune

    kept = [prune(i, v, top_k) for i, v in zip(ids, values)]
    return {f"{prefix}_offsets": _offsets([len(i) for i, _ in kept]),
            f"{prefix}_indices": (np.concatenate([i for i, _ in kept]) if kept else np.zeros(0)).astype(np.int32),
            f"{prefix}_values": (np.concatenate([v for _, v in kept]) if kept else np.zeros(0)).astype(np.float32)}


def m3_heads(folder: Path, encoder: Encoder) -> list[M3Head]:
    """One head per non-empty combination of outputs, all sharing the weights; the first serves prepare."""
    weights = M3Weights(folder, encoder)
    combos = [c for n in range(len(HYBRID_OUTPUTS), 0, -1) for c in itertools.combinations(HYBRID_OUTPUTS, n)]
    heads = [M3Head(encoder.tokenization, weights, combo) for combo in combos]
    table = {head.outputs: head for head in heads}
    for head in heads:
        head.by_outputs = table
    return heads
