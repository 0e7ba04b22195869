"""A deterministic fake model for the tests of what happens to jobs, not to vectors (the queue, canvas,
operations, flow control, replicas, faults): ``EMBEDQ_MODEL=embedq-fake`` (32-dimensional vectors; ``embedq-fake-384``:
384, as all-MiniLM-L6-v2's, for tests of sizes) with ``EMBEDQ_ALLOW_FAKE_BACKEND=true``.
It is refused without that setting (:func:`embedq.backends.load_backend`), so it cannot stand in for a real model
by a typo, and its fingerprint names it (``model`` ``embedq-fake``, ``pooling`` ``fake-hash``): a store written
with it is refused by every real model's run.

It serves ``embed`` and ``embed_all`` through the worker's real path: ``prepare`` tokenizes (words and punctuation,
each a token id from a hash of its text, between ``[CLS]`` and ``[SEP]``; a prompt is prepended; ``truncate`` and
``truncation_side`` as for a real model, :class:`~embedq.errors.TooLong` without truncation), the scheduler packs
the items by token count, ``forward`` computes one row per item (``embed``: the mean of a fixed random table's rows for
its token ids, the same ids giving the same vector whatever shares the micro-batch; ``embed_all``: those rows, one a
token), and ``finish`` post-processes (``normalize``, ``dimensions``) and encodes like the dense head (``embed_all``:
like the per-token head, offsets and one tokens × dimension array). It imports neither torch nor transformers and
loads in milliseconds.

``EMBEDQ_FAKE_ITEM_MS`` (default 0) makes each micro-batch take that many milliseconds per item, as a device would:
for the tests of what a process holds while the model runs (a kill mid-run), where an instant model holds nothing.
``EMBEDQ_FAKE_PREPARE_MS`` (default 0) makes tokenizing a ``long_inputs="windows"`` job take that many milliseconds per
10,000 characters, as a long document's tokenizer call does: for the tests of where such a job is tokenized.
``EMBEDQ_FAKE_POISON`` (a word; unset: none) makes the process that runs a micro-batch holding that word SIGKILL
itself, as a segfault in a kernel would: for the tests of poison jobs in whatever process runs the model.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from embedq import errors
from embedq.backends.base import Backend, Encoded, ModelInfo, Prepared, per_token_result, postprocess
from embedq.backends.windowing import Tokens, WindowPlan, concat_rows, finish_windows, weighted_mean, window_items
from embedq.protocol import Fingerprint, encode_result
from embedq.version import __version__

#: The model name that selects this backend.
FAKE_MODEL = "embedq-fake"
DIMENSION = 32  # the vectors' size unless the model name says another (``embedq-fake-384``)
MAX_DIMENSION = 4096
MAX_SEQ_LENGTH = 128
VOCABULARY = 30_000
CLS, SEP, FIRST_ID = 101, 102, 1000
_WORDS = re.compile(r"\w+|[^\w\s]")
_NAME = re.compile(rf"{FAKE_MODEL}(?:-(\d+))?")


def fake_dimension(model: str) -> int | None:
    """The vectors' size that ``model`` names if it names the fake model (``embedq-fake``: 32, ``embedq-fake-384``:
    384), else None."""
    match = _NAME.fullmatch(model.strip().lower())
    if match is None:
        return None
    dimension = int(match.group(1) or DIMENSION)
    if not 1 <= dimension <= MAX_DIMENSION:
        raise errors.UnknownModel(f"{model!r}: the fake model's dimension is 1 to {MAX_DIMENSION}")
    return dimension


def _token_id(word: str) -> int:
    return FIRST_ID + zlib.crc32(word.encode()) % (VOCABULARY - FIRST_ID)


def token_ids(text: str) -> list[int]:
    """A text's token ids without special tokens: each word or punctuation mark, lower-cased, hashed."""
    return [_token_id(w) for w in _WORDS.findall(text.lower())]


class FakeBackend(Backend):
    """:mod:`embedq.backends.fake`'s model: unpadded (a micro-batch costs its real tokens)."""

    is_padded = False

    def __init__(self, model_id: str = FAKE_MODEL, *, max_windows: int = 128) -> None:
        self.max_windows = max_windows
        self.dimension = fake_dimension(model_id) or DIMENSION
        self.item_seconds = float(os.environ.get("EMBEDQ_FAKE_ITEM_MS") or 0) / 1000
        self.prepare_seconds = float(os.environ.get("EMBEDQ_FAKE_PREPARE_MS") or 0) / 1000 / 10_000  # a character
        poison = token_ids(os.environ.get("EMBEDQ_FAKE_POISON") or "")
        self.poison = poison[0] if poison else None
        self.table = np.random.default_rng(0).standard_normal((VOCABULARY, self.dimension)).astype(np.float32)
        super().__init__(ModelInfo(
            model_id=model_id, path="", dimension=self.dimension, max_seq_length=MAX_SEQ_LENGTH,
            pooling="fake-hash", normalizes=True, weights_sha256=hashlib.sha256(self.table.tobytes()).hexdigest(),
            dtype="float32", device="cpu", linear_kernel="none", kinds=("embed", "embed_all")))

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

    def head_names(self) -> tuple[str, ...]:
        return ("mean", "tokens")

    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared:
        self.check_kind(kind)
        if options.prompt_name is not None:
            raise errors.UnknownPromptName(f"prompt_name {options.prompt_name!r} is not defined by the model "
                                           "(known: none)")
        dimensions = getattr(options, "dimensions", None)
        if dimensions is not None and dimensions > self.dimension:
            raise errors.InvalidDimensions(f"dimensions={dimensions} but the model's vectors have {self.dimension}")
        state: dict[str, Any] = {"prompt": options.prompt}
        if getattr(options, "windows", False):
            encoded, state["windows"] = self._windows(items, options)
        else:
            encoded = [self._encode(item, options.prompt, options.truncate, options.truncation_side) for item in items]
        for e in encoded:
            e.head = "tokens" if kind == "embed_all" else "mean"
        return Prepared(encoded, sum(len(e.ids) for e in encoded), state)

    def _windows(self, items: list[Any], options: Any) -> tuple[list[Encoded], WindowPlan]:
        """``long_inputs="windows"``: each text's windows of :data:`MAX_SEQ_LENGTH` tokens (windowing.py)."""
        if any(not isinstance(item, str) for item in items):
            raise errors.InvalidOption("long_inputs='windows' takes texts, not token ids")
        head = [CLS, *(token_ids(options.prompt) if options.prompt else [])]
        plan = WindowPlan(options.window_overlap, options.pool_windows)
        encoded: list[Encoded] = []
        for i, text in enumerate(items):
            if self.prepare_seconds:
                time.sleep(self.prepare_seconds * len(text))
            words = list(_WORDS.finditer(text.lower()))
            tokens = Tokens(text, [w.start() for w in words], [w.end() for w in words])
            encoded += window_items(tokens, [_token_id(w.group()) for w in words], head, [SEP], MAX_SEQ_LENGTH,
                                    options.window_overlap, self.max_windows, plan, i, len(head) - 1)
        return encoded, plan

    def forward(self, batch: Sequence[Encoded]) -> list[np.ndarray]:
        if self.poison is not None and any(self.poison in item.ids for item in batch):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.item_seconds:
            time.sleep(self.item_seconds * len(batch))
        return [self.table[item.ids] if item.head == "tokens" else self.table[item.ids].mean(axis=0)
                for item in batch]

    def finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]:
        if "windows" in prepared.state:
            def pool(r: list[np.ndarray], w: list[int]) -> np.ndarray:
                if kind == "embed_all":
                    return concat_rows(r, self.dimension)
                return weighted_mean(r, w, self.dimension)
            return finish_windows(rows, prepared, lambda r: self._finish(kind, r, prepared, options), pool)
        return self._finish(kind, rows, prepared, options)

    def _finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]:
        if kind == "embed_all":
            return per_token_result(kind, rows, self.info, self.dimension, prepared, options.encoding)
        info = self.info
        norm = self.info.normalizes if options.normalize is None else options.normalize
        vectors = postprocess(np.stack(rows), normalize=norm, dimensions=options.dimensions)
        fingerprint = Fingerprint(kind="embed", model=info.model_id, weights_sha256=info.weights_sha256,
                                  pooling=info.pooling, normalize=norm, dimensions=options.dimensions or self.dimension,
                                  dtype=info.dtype, prompt=prepared.state["prompt"], embedq_version=__version__)
        return encode_result("embed", {"vectors": vectors}, fingerprint, items=len(rows), tokens=prepared.tokens,
                             encoding=options.encoding)
