"""The per-token head (``embed_all``, TEI's ``/embed_all``): the last hidden state of every token, no pooling.

For clients that run their own late interaction. A text's row is its real tokens' hidden states (special
tokens and a prompt included, padding left out whichever side it is on), as sentence-transformers'
``encode(output_value="token_embeddings")`` returns them. The result is ragged: token offsets and one
tokens × hidden array (float16 on request halves it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from embedq.backends.base import Encoded, Head, ModelInfo, Prepared, per_token_result
from embedq.backends.tokenizing import Tokenization
from embedq.backends.tokens import prepare_texts
from embedq.backends.windowing import concat_rows


class TokenEmbeddingsHead(Head):
    name = "tokens"
    kinds = ("embed_all",)
    pools_windows = True

    def __init__(self, tokenization: Tokenization, hidden: int) -> None:
        self.tokenization = tokenization
        self.hidden = hidden
        self.info: ModelInfo | None = None

    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared:
        return prepare_texts(self.tokenization, self.info, items, options)

    def pool(self, rows: list[Any], weights: list[int], options: Any) -> np.ndarray:
        """Every window's tokens one after the other (each window's special tokens included; the tokens two windows
        share appear in both)."""
        return concat_rows(rows, self.hidden)

    def rows(self, output: Any, mask: torch.Tensor, index: Any, batch: Sequence[Encoded]) -> list[np.ndarray]:
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        if index is not None:
            hidden, mask = hidden.index_select(0, index), mask.index_select(0, index)
        states = hidden.float().cpu().numpy()
        real = mask.bool().cpu().numpy()
        return [states[i][real[i]] for i in range(len(states))]

    def finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]:
        assert self.info is not None
        return per_token_result(kind, rows, self.info, self.hidden, prepared, options.encoding)
