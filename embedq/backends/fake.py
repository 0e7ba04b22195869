"""A deterministic fake model for the tests of what happens to jobs, not to vectors (the queue, canvas,
operations, flow control, replicas, faults): ``EMBEDQ_MODEL=embedq-fake`` with ``EMBEDQ_ALLOW_FAKE_BACKEND=true``.
It is refused without that setting (:func:`embedq.backends.load_backend`), so it cannot stand in for a real model
by a typo, and its fingerprint names it (``model`` ``embedq-fake``, ``pooling`` ``fake-hash``): a store written
with it is refused by every real model's run.

It serves ``embed`` through the worker's real path: ``prepare`` tokenizes (words and punctuation, each a token id
from a hash of its text, between ``[CLS]`` and ``[SEP]``; a prompt is prepended; ``truncate`` and
``truncation_side`` as for a real model, :class:`~embedq.errors.TooLong` without truncation), the scheduler packs
the items by token count, ``forward`` computes one row per item (the mean of a fixed random table's rows for its
token ids: the same ids, the same vector, whatever shares the micro-batch), and ``finish`` post-processes
(``normalize``, ``dimensions``) and encodes like the dense head. It imports neither torch nor transformers and
loads in milliseconds.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from embedq import errors
from embedq.backends.base import Backend, Encoded, ModelInfo, Prepared, postprocess
from embedq.protocol import Fingerprint, encode_result
from embedq.version import __version__

#: The model name that selects this backend.
FAKE_MODEL = "embedq-fake"
DIMENSION = 32
MAX_SEQ_LENGTH = 128
VOCABULARY = 30_000
CLS, SEP, FIRST_ID = 101, 102, 1000
_WORDS = re.compile(r"\w+|[^\w\s]")


def token_ids(text: str) -> list[int]:
    """A text's token ids without special tokens: each word or punctuation mark, lower-cased, hashed."""
    return [FIRST_ID + zlib.crc32(w.encode()) % (VOCABULARY - FIRST_ID) for w in _WORDS.findall(text.lower())]


class FakeBackend(Backend):
    """:mod:`embedq.backends.fake`'s model: unpadded (a micro-batch costs its real tokens)."""

    is_padded = False

    def __init__(self, model_id: str = FAKE_MODEL) -> None:
        self.table = np.random.default_rng(0).standard_normal((VOCABULARY, DIMENSION)).astype(np.float32)
        self.info = ModelInfo(
            model_id=model_id, path="", dimension=DIMENSION, max_seq_length=MAX_SEQ_LENGTH, pooling="fake-hash",
            normalizes=True, weights_sha256=hashlib.sha256(self.table.tobytes()).hexdigest(), dtype="float32",
            device="cpu", linear_kernel="none", kinds=("embed",))

    def _encode(self, item: Any, prompt: str | None, truncate: bool, side: str) -> Encoded:
        if side not in ("right", "left"):
            raise errors.InvalidOption(f"truncation_side must be 'right' or 'left', not {side!r}")
        body = list(item) if not isinstance(item, str) else token_ids(item)
        head = token_ids(prompt) if prompt else []
        ids = [CLS, *head, *body, SEP]
        if len(ids) > MAX_SEQ_LENGTH:
            if not truncate:
                raise errors.TooLong(f"an input has {len(ids)} tokens, over the model's max_seq_length of "
                                     f"{MAX_SEQ_LENGTH}")
            room = MAX_SEQ_LENGTH - 2 - len(head)
            body = body[:room] if side == "right" else body[len(body) - room:]
            ids = [CLS, *head, *body, SEP]
        if any(not 0 <= i < VOCABULARY for i in ids):
            raise errors.InvalidText(f"a token id is outside the model's vocabulary of {VOCABULARY} tokens")
        return Encoded(ids, None, len(head))

    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared:
        self.check_kind(kind)
        if options.prompt_name is not None:
            raise errors.UnknownPromptName(f"prompt_name {options.prompt_name!r} is not defined by the model "
                                           "(known: none)")
        if options.dimensions is not None and options.dimensions > DIMENSION:
            raise errors.InvalidDimensions(f"dimensions={options.dimensions} but the model's vectors have "
                                           f"{DIMENSION}")
        encoded = [self._encode(item, options.prompt, options.truncate, options.truncation_side) for item in items]
        return Prepared(encoded, sum(len(e.ids) for e in encoded), {"prompt": options.prompt})

    def forward(self, batch: Sequence[Encoded]) -> list[np.ndarray]:
        return [self.table[item.ids].mean(axis=0) for item in batch]

    def finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]:
        norm = self.info.normalizes if options.normalize is None else options.normalize
        vectors = postprocess(np.stack(rows), normalize=norm, dimensions=options.dimensions)
        info = self.info
        fingerprint = Fingerprint(kind="embed", model=info.model_id, weights_sha256=info.weights_sha256,
                                  pooling=info.pooling, normalize=norm, dimensions=options.dimensions or DIMENSION,
                                  dtype=info.dtype, prompt=prepared.state["prompt"], embedq_version=__version__)
        return encode_result("embed", {"vectors": vectors}, fingerprint, items=len(rows), tokens=prepared.tokens,
                             encoding=options.encoding)
