"""The narrow backend contract the worker knows about.

A backend tokenizes (once per text, no padding) and embeds micro-batches of token ids. The
scheduler only asks it for ``is_padded`` and the token counts; the worker applies the per-job
post-processing (``dimensions``, ``normalize``) with :func:`postprocess`. Only this subpackage
imports torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is; feeds the embedding-space fingerprint."""

    model_id: str
    path: str
    dimension: int
    max_seq_length: int
    pooling: str
    normalizes: bool
    weights_sha256: str
    dtype: str
    device: str
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    linear_kernel: str = "torch"  # what runs the Linear layers: "torch" or "onednn" (CPU)


@dataclass(frozen=True)
class Tokenized:
    """Token ids of a job's texts (special tokens included, no padding)."""

    ids: list[list[int]]
    prompt_length: int = 0


class Backend(ABC):
    info: ModelInfo
    #: padded backends cost ``longest × count`` per batch, unpadded ones ``sum`` of lengths.
    is_padded: bool = True

    @abstractmethod
    def tokenize(
        self,
        texts: Sequence[str],
        *,
        prompt: str | None = None,
        truncate: bool = True,
        truncation_side: str = "right",
    ) -> Tokenized:
        """Tokenize texts exactly as sentence-transformers would (prompt prepended).

        Raises :class:`embedq.errors.TooLong` when ``truncate`` is False and a text is over the
        model's ``max_seq_length``.
        """

    @abstractmethod
    def embed(self, batch: Sequence[Sequence[int]], prompt_lengths: Sequence[int] | None = None) -> np.ndarray:
        """Embed one micro-batch: ``(len(batch), info.dimension)`` float32.

        The output is the model's pipeline *without* a trailing Normalize module;
        :func:`postprocess` applies normalization per job.
        """

    def health(self) -> dict[str, Any]:
        return {"model": self.info.model_id, "device": self.info.device, "dtype": self.info.dtype,
                "linear_kernel": self.info.linear_kernel}


def postprocess(vectors: np.ndarray, *, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Matryoshka truncation, then L2 normalization (so truncated vectors stay unit length)."""
    out = np.asarray(vectors, dtype=np.float32)
    if dimensions is not None:
        out = out[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.maximum(norms, 1e-12)
    return np.ascontiguousarray(out, dtype=np.float32)
