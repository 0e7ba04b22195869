"""Relevance scores between embedded texts: dense, sparse (lexical), ColBERT and their weighted hybrid.

Pure numpy, no torch: producers and search services use it on what ``Client.embed_hybrid`` or
``Client.embed_sparse`` returned. The definitions are FlagEmbedding's (``BGEM3FlagModel.compute_score``):

* ``dense(q, d)``: the inner product (cosine for normalised vectors);
* ``sparse(q, d)``: Σ over the ids both texts have of weight_q × weight_d;
* ``colbert(q, d)``: late interaction (MaxSim): the mean over the query's vectors of the best inner product
  with any of the document's;
* ``hybrid``: Σ weight × score over the parts present, divided by Σ of their weights, with BGE-M3's
  recommended weights (dense 0.4, sparse 0.2, ColBERT 0.4) unless others are given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from embedq.protocol import HybridEmbedding, SparseVector

#: BGE-M3's recommended weights for (dense, sparse, ColBERT) in its model card's hybrid example.
M3_WEIGHTS: dict[str, float] = {"dense": 0.4, "sparse": 0.2, "colbert": 0.4}


def dense(query: np.ndarray, document: np.ndarray) -> float:
    return float(np.dot(np.asarray(query, np.float32), np.asarray(document, np.float32)))


def sparse(query: SparseVector, document: SparseVector) -> float:
    """Σ over shared ids of weight_q × weight_d (ids are ascending and unique in a :class:`SparseVector`)."""
    _, qi, di = np.intersect1d(query.indices, document.indices, assume_unique=True, return_indices=True)
    return float(np.dot(query.values[qi].astype(np.float64), document.values[di].astype(np.float64)))


def colbert(query: np.ndarray, document: np.ndarray) -> float:
    """MaxSim: mean over the query's token vectors of the largest inner product with a document token vector."""
    q, d = np.asarray(query, np.float32), np.asarray(document, np.float32)
    if not len(q) or not len(d):
        return 0.0
    return float((q @ d.T).max(axis=1).mean())


def hybrid(parts: Mapping[str, float], weights: Mapping[str, float] | None = None) -> float:
    """Σ weight × score over the parts given, divided by the sum of their weights."""
    weights = M3_WEIGHTS if weights is None else weights
    used = {name: float(weights.get(name, 0.0)) for name in parts}
    total = sum(used.values())
    if total <= 0:
        raise ValueError(f"the weights of {sorted(parts)} add up to {total}; give at least one positive weight")
    return sum(used[name] * parts[name] for name in parts) / total


def score_all(query: HybridEmbedding, documents: HybridEmbedding, *, query_index: int = 0,
              weights: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """Each document's parts and hybrid score against the query at ``query_index`` of ``query``, in document
    order: ``[{"index", "score", "dense", "sparse", "colbert"}]`` (parts the embeddings lack are left out)."""
    n = _count(documents)
    out = []
    for i in range(n):
        parts: dict[str, float] = {}
        if query.dense is not None and documents.dense is not None:
            parts["dense"] = dense(query.dense[query_index], documents.dense[i])
        if query.lexical is not None and documents.lexical is not None:
            parts["sparse"] = sparse(query.lexical[query_index], documents.lexical[i])
        if query.colbert is not None and documents.colbert is not None:
            parts["colbert"] = colbert(query.colbert[query_index], documents.colbert[i])
        out.append({"index": i, "score": hybrid(parts, weights), **parts})
    return out


def _count(embedding: HybridEmbedding) -> int:
    for part in (embedding.dense, embedding.lexical, embedding.colbert):
        if part is not None:
            return len(part)
    return 0
