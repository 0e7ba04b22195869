"""The tokenizer's heads: ``embedq.tokenize`` (TEI's ``/tokenize``: the tokens a model would be fed) and
``embedq.decode`` (TEI's ``/decode``: token ids back to text), as jobs.

Producers never import a tokenizer, so tokenizing is a job like the others; it runs no model (its
``prepare`` does the work and it puts no items in a micro-batch). Prompts resolve as for ``embed``. Every
model serves both (:func:`tokenizer_heads`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from embedq import errors
from embedq.backends.base import Encoded, Head, ModelInfo, Prepared
from embedq.backends.modules import read_json
from embedq.backends.tokenizing import Tokenization
from embedq.protocol import Fingerprint, encode_result
from embedq.version import __version__


def read_prompts(folder: Path) -> tuple[dict[str, str], str | None]:
    """``prompts`` and ``default_prompt_name`` of ``config_sentence_transformers.json``."""
    config = read_json(folder / "config_sentence_transformers.json")
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise errors.UnsupportedModel(f"invalid prompts in config_sentence_transformers.json: {prompts!r}")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise errors.UnsupportedModel(f"default_prompt_name {default!r} is not among the prompts")
    return dict(prompts), default


def resolve_prompt(info: ModelInfo, prompt: str | None, prompt_name: str | None) -> str | None:
    """The job's prompt: its own text, else the named one, else the model's default (None: no prompt)."""
    if prompt is not None:
        return prompt
    name = prompt_name or info.default_prompt_name
    if name is None:
        return None
    if name not in info.prompts:
        known = ", ".join(sorted(info.prompts)) or "none"
        raise errors.UnknownPromptName(f"prompt_name {name!r} is not defined by the model (known: {known})")
    return info.prompts[name] or None


def encode_items(tokenization: Tokenization, items: list[Any], *, prompt: str | None, truncate: bool,
                 truncation_side: str) -> list[Encoded]:
    """A job's inputs as the model takes them: texts tokenized as sentence-transformers does, an input of token
    ids (TEI's routes take them) as those ids (:meth:`~embedq.backends.tokenizing.Tokenization.encode_ids`). With
    a prompt, ids are decoded (special tokens skipped) and tokenized behind it as a text, as TEI does."""
    if all(isinstance(item, str) for item in items):
        return tokenization.encode_texts(items, prompt=prompt, truncate=truncate, truncation_side=truncation_side)[0]
    if prompt is not None:  # an id outside the vocabulary is refused here too, never dropped from the text
        for item in items:
            if not isinstance(item, str):
                tokenization.check_ids(item)
        decode = tokenization.tokenizer.decode
        items = [item if isinstance(item, str) else decode(list(item), skip_special_tokens=True) for item in items]
        return tokenization.encode_texts(items, prompt=prompt, truncate=truncate, truncation_side=truncation_side)[0]
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(tokenization.encode_texts(texts, truncate=truncate, truncation_side=truncation_side)[0] if texts
                   else ())
    return [next(encoded) if isinstance(item, str) else
            tokenization.encode_ids(item, truncate=truncate, truncation_side=truncation_side) for item in items]


def prepare_texts(tokenization: Tokenization, info: ModelInfo | None, texts: list[Any], options: Any) -> Prepared:
    """A job of texts (or token-id inputs) for a head that runs the model: its prompt resolved
    (``state["prompt"]``), its texts tokenized as sentence-transformers does, its token count."""
    assert info is not None
    prompt = resolve_prompt(info, options.prompt, options.prompt_name)
    if getattr(options, "windows", False):  # long_inputs="windows": each text's windows are its items
        encoded, windows = tokenization.windower.encode(texts, prompt, options)
        return Prepared(encoded, sum(len(e.ids) for e in encoded), {"prompt": prompt, "windows": windows})
    encoded = encode_items(tokenization, texts, prompt=prompt, truncate=options.truncate,
                           truncation_side=options.truncation_side)
    return Prepared(encoded, sum(len(e.ids) for e in encoded), {"prompt": prompt})


def prepare_texts_many(tokenization: Tokenization, info: ModelInfo | None, jobs: list[tuple[list[Any], Any]], *,
                       check: Callable[[Any], None] | None = None) -> list[Prepared | errors.EmbedqError]:
    """:func:`prepare_texts` for many jobs: those whose prompt and truncation agree are tokenized in one call
    (a call costs about as much for one short text as for dozens: the tokenizer's Python wrapper is most of a short
    text's cost). Each text gets the ids it gets alone (no padding; the tokenizer treats the texts of a call
    independently). A job whose options fail ``check`` or name an unknown prompt gets its own error; a group whose
    call fails (a text over the limit with ``truncate=False``) is tokenized job by job, so only the job at fault
    fails."""
    assert info is not None
    out: list[Prepared | errors.EmbedqError | None] = [None] * len(jobs)
    groups: dict[tuple[Any, ...], list[int]] = {}
    prompts: list[str | None] = [None] * len(jobs)
    for j, (_, options) in enumerate(jobs):
        try:
            if check is not None:
                check(options)
            prompts[j] = resolve_prompt(info, options.prompt, options.prompt_name)
        except errors.EmbedqError as exc:
            out[j] = exc
            continue
        if getattr(options, "windows", False):
            try:
                out[j] = prepare_texts(tokenization, info, *jobs[j])
            except errors.EmbedqError as exc:
                out[j] = exc
            continue
        groups.setdefault((prompts[j], options.truncate, options.truncation_side), []).append(j)
    for (prompt, truncate, side), members in groups.items():
        texts = [text for j in members for text in jobs[j][0]]
        try:
            encoded = encode_items(tokenization, texts, prompt=prompt, truncate=truncate, truncation_side=side)
        except errors.EmbedqError:
            for j in members:
                try:
                    out[j] = prepare_texts(tokenization, info, *jobs[j])
                except errors.EmbedqError as exc:
                    out[j] = exc
            continue
        start = 0
        for j in members:
            mine = encoded[start:start + len(jobs[j][0])]
            start += len(mine)
            out[j] = Prepared(mine, sum(len(e.ids) for e in mine), {"prompt": prompt})
    return out  # type: ignore[return-value]


#: The kinds every model serves with its tokenizer alone.
TOKENIZER_KINDS = ("tokenize", "decode")


def tokenizer_heads(tokenization: Tokenization, info: ModelInfo) -> dict[str, Head]:
    """The heads of :data:`TOKENIZER_KINDS`, by kind."""
    return {"tokenize": TokenizeHead(tokenization, info), "decode": DecodeHead(tokenization, info)}


class _TokenizerHead(Head):
    """A head that runs the tokenizer alone: the model's tokenization, its info, and its results' fingerprint."""

    def __init__(self, tokenization: Tokenization, info: ModelInfo) -> None:
        self.tokenization = tokenization
        self.info = info

    def fingerprint(self, dtype: str, prompt: str | None) -> Fingerprint:
        info = self.info
        return Fingerprint(kind=self.name, model=info.model_id, weights_sha256=info.weights_sha256, pooling="none",
                           normalize=False, dimensions=0, dtype=dtype, prompt=prompt, embedq_version=__version__)


class TokenizeHead(_TokenizerHead):
    name = "tokenize"
    kinds = ("tokenize",)

    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared:
        prompt = resolve_prompt(self.info, options.prompt, options.prompt_name)
        details = self.tokenization.details(items, prompt=prompt, truncate=options.truncate,
                                            truncation_side=options.truncation_side,
                                            add_special_tokens=options.add_special_tokens, refuse_long=False)
        return Prepared([], sum(len(d.ids) for d in details), {"details": details, "prompt": prompt})

    def finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]:
        details = prepared.state["details"]
        offsets = np.cumsum([0] + [len(d.ids) for d in details], dtype=np.int64)
        ids = np.fromiter((i for d in details for i in d.ids), dtype=np.int64, count=int(offsets[-1]))
        special = np.fromiter((bool(s) for d in details for s in d.special), dtype=bool, count=int(offsets[-1]))
        spans = np.asarray([span for d in details for span in d.offsets], dtype=np.int64).reshape(-1, 2)
        fingerprint = self.fingerprint("int32", prepared.state["prompt"])
        return encode_result("tokenize", {"ids": ids, "offsets": offsets, "spans": spans, "special": special},
                             fingerprint, items=len(details), tokens=prepared.tokens,
                             extra={"tokens": [t for d in details for t in d.tokens],
                                    "prompt": prepared.state["prompt"]})


class DecodeHead(_TokenizerHead):
    """Token ids to text, as ``tokenizer.decode`` does (the model's own tokenizer; special tokens skipped unless
    ``skip_special_tokens=False``). An id outside the vocabulary is dropped, as the tokenizers library (and so TEI)
    drops it."""

    name = "decode"
    kinds = ("decode",)

    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared:
        tokenizer = self.tokenization.tokenizer
        vocabulary = len(tokenizer)
        texts = tokenizer.batch_decode([[i for i in ids if i < vocabulary] for ids in items],
                                       skip_special_tokens=options.skip_special_tokens)
        return Prepared([], sum(len(ids) for ids in items), {"texts": texts})

    def finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]:
        texts = prepared.state["texts"]
        return encode_result("decode", {}, self.fingerprint("str", None), items=len(texts), tokens=prepared.tokens,
                             extra={"texts": texts})
