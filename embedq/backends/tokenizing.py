"""How the encoder tokenizes: texts exactly as sentence-transformers does (prompt prepended, truncation on either side
keeping the prompt) and text pairs as ``CrossEncoder.predict`` does, long inputs tokenized only as far as the model
reads them (:mod:`embedq.backends.cutting`), and the details ``embedq.tokenize`` answers with.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from embedq import errors
from embedq.backends.base import Encoded
from embedq.backends.cutting import Cutter, Window
from embedq.backends.windowing import Windower


@dataclass
class Details:
    """Everything about one tokenized input (``embedq.tokenize``): ids, token strings, special flags and
    character offsets into the string the model saw (the prompt, if any, then the text)."""

    ids: list[int]
    tokens: list[str] = field(default_factory=list)
    special: list[int] = field(default_factory=list)
    offsets: list[tuple[int, int]] = field(default_factory=list)


def _cut(row: list[Any], limit: int, keep_head: int) -> list[Any]:
    """Left truncation that keeps a prompt: the first ``keep_head`` entries and the end of the row."""
    return row if len(row) <= limit else row[:keep_head] + row[len(row) - (limit - keep_head):]


def _cut_details(d: Details, limit: int, keep_head: int, with_strings: bool) -> Details:
    d.ids = _cut(d.ids, limit, keep_head)
    if with_strings:
        d.tokens, d.special, d.offsets = (_cut(x, limit, keep_head) for x in (d.tokens, d.special, d.offsets))
    return d


class Tokenization:
    """A model's tokenizer called as sentence-transformers calls it, to the model's limit: handed the tokenizer, the
    limit (``max_seq_length``) and whether the model takes segment ids; owns a copy of the tokenizer that truncates on
    the left, the :class:`~embedq.backends.cutting.Cutter`, the prompts' lengths and the lock its calls take."""

    def __init__(self, tokenizer: Any, max_seq_length: int, takes_token_type_ids: bool, *,
                 max_windows: int = 128) -> None:
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.takes_token_type_ids = takes_token_type_ids
        self._tokenizer_left = copy.deepcopy(tokenizer)
        self._tokenizer_left.truncation_side = "left"
        # Long texts are tokenized only as far as the model reads them (cutting.py): the same ids, bounded work.
        self.cutter = Cutter(tokenizer, need=max_seq_length + 1)
        self._lock = threading.Lock()
        self._prompt_lengths: dict[str, int] = {}
        self.windower = Windower(self, max_windows)  # long_inputs="windows" (windowing.py)

    def _call(self, tokenizer: Any, first: list[str], second: list[str] | None, *, truncate: bool,
              details: bool = False, add_special_tokens: bool = True) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "padding": False,
            "return_attention_mask": False,
            "return_token_type_ids": second is not None and self.takes_token_type_ids,
            "add_special_tokens": add_special_tokens,
        }
        if details:
            kwargs.update(return_offsets_mapping=True, return_special_tokens_mask=True)
        if truncate:
            kwargs.update(truncation="longest_first" if second is not None else True, max_length=self.max_seq_length)
        else:
            kwargs.update(truncation=False)
        out = tokenizer(first, second, **kwargs) if second is not None else tokenizer(first, **kwargs)
        if details:
            return {"ids": out["input_ids"], "tokens": [enc.tokens for enc in out.encodings],
                    "special": out["special_tokens_mask"], "offsets": out["offset_mapping"],
                    "sequence": [enc.sequence_ids for enc in out.encodings]}
        return {"ids": out["input_ids"], "type_ids": out.get("token_type_ids")}

    def prompt_length(self, prompt: str) -> int:
        """ST's ``_get_prompt_length``: tokens of the prompt alone, less a trailing special token."""
        cached = self._prompt_lengths.get(prompt)
        if cached is not None:
            return cached
        _, end = self.cutter.plan([prompt], keep_end=False)[0]
        ids = list(self._call(self.tokenizer, [prompt[:end]], None, truncate=True)["ids"][0])
        length = len(ids)
        if ids and ids[-1] in self.tokenizer.all_special_ids:
            length -= 1
        self._prompt_lengths[prompt] = length
        return length

    def _check_side(self, truncation_side: str) -> None:
        if truncation_side not in ("right", "left"):
            raise errors.InvalidOption(f"truncation_side must be 'right' or 'left', not {truncation_side!r}")

    def _too_long(self, rows: list[list[int]], what: str, cut: list[int | None]) -> None:
        """Raises for the first row over the limit; ``cut[i]``: characters of item ``i`` tokenized when only a piece
        was (the cutter found more tokens than the model reads in it), else None."""
        for index, row in enumerate(rows):
            if cut[index] is not None:
                raise errors.TooLong(
                    f"{what} {index} has more tokens than the model's max_seq_length of {self.max_seq_length} "
                    f"(more than {self.max_seq_length} in its first {cut[index]} characters)")
            if len(row) > self.max_seq_length:
                raise errors.TooLong(
                    f"{what} {index} has {len(row)} tokens, over the model's max_seq_length of {self.max_seq_length}"
                )

    def encode_texts(self, texts: Sequence[str], *, prompt: str | None = None, truncate: bool = True,
                     truncation_side: str = "right") -> tuple[list[Encoded], int]:
        """Texts exactly as sentence-transformers tokenizes them (prompt prepended): (items, prompt length).

        Raises :class:`embedq.errors.TooLong` when ``truncate`` is False and a text is over the limit."""
        details = self.details(texts, prompt=prompt, truncate=truncate, truncation_side=truncation_side,
                               with_strings=False)
        plen = self.prompt_length(prompt) if prompt else 0
        return [Encoded(d.ids, None, plen) for d in details], plen

    def check_ids(self, ids: Sequence[int]) -> None:
        """:class:`~embedq.errors.InvalidText` for an id outside the vocabulary (the model has no row for it)."""
        vocabulary = len(self.tokenizer)
        bad = next((i for i in ids if i >= vocabulary), None)
        if bad is not None:
            raise errors.InvalidText(f"token id {bad} is outside the model's vocabulary of {vocabulary} tokens")

    def encode_ids(self, ids: Sequence[int], *, truncate: bool = True, truncation_side: str = "right") -> Encoded:
        """One input given as token ids (TEI's ``Input::Ids``): the model's own ids as they are, cut to the model's
        limit on ``truncation_side`` (or :class:`~embedq.errors.TooLong` without ``truncate``); an id outside the
        vocabulary is :class:`~embedq.errors.InvalidText` (the model has no row for it)."""
        self._check_side(truncation_side)
        self.check_ids(ids)
        row, limit = list(ids), self.max_seq_length
        if len(row) > limit:
            if not truncate:
                raise errors.TooLong(f"an input of {len(row)} token ids is over the model's max_seq_length of {limit}")
            row = row[:limit] if truncation_side == "right" else row[len(row) - limit:]
        return Encoded(row, None, 0)

    def details(self, texts: Sequence[str], *, prompt: str | None = None, truncate: bool = True,
                truncation_side: str = "right", add_special_tokens: bool = True,
                with_strings: bool = True, refuse_long: bool = True) -> list[Details]:
        """Texts tokenized as the model sees them; with ``with_strings`` also token strings, special
        flags and character offsets into ``prompt + text``. A long text is tokenized as far as the model reads it
        (:class:`~embedq.backends.cutting.Cutter`), with the ids the whole text would give. ``truncate=False``
        refuses a text over the model's limit (:class:`~embedq.errors.TooLong`), or with ``refuse_long=False``
        gives all its tokens (``tokenize``, which runs no model: TEI's ``/tokenize`` never truncates)."""
        self._check_side(truncation_side)
        full = [prompt + text for text in texts] if prompt else list(texts)
        if truncate and truncation_side == "left" and prompt:
            return self._details_head_tail(full, prompt, add_special_tokens, with_strings)
        keep_end = truncate and truncation_side == "left"
        with self._lock:
            if prompt:
                self.prompt_length(prompt)
            windows = (self.cutter.plan(full, keep_end) if truncate or refuse_long
                       else [(0, len(text)) for text in full])
            pieces = [s[a:b] for s, (a, b) in zip(full, windows)]
            tokenizer = self._tokenizer_left if keep_end else self.tokenizer
            out = self._call(tokenizer, pieces, None, truncate=truncate, details=with_strings,
                             add_special_tokens=add_special_tokens)
        rows = [list(r) for r in out["ids"]]
        if not truncate and refuse_long:
            self._too_long(rows, "text", [None if (a, b) == (0, len(s)) else b - a
                                          for s, (a, b) in zip(full, windows)])
        result = [Details(r) for r in rows]
        if with_strings:
            for i, d in enumerate(result):
                self._strings(d, out, i, windows[i][0])
        return result

    @staticmethod
    def _strings(d: Details, out: dict[str, Any], i: int, start: int) -> None:
        """Row ``i`` of ``out``'s token strings, special flags and offsets into ``d``; the offsets of the text's
        tokens moved by ``start``, where the piece tokenized began in the text (special tokens keep (0, 0))."""
        d.tokens, d.special = list(out["tokens"][i]), list(out["special"][i])
        d.offsets = [(a + start, b + start) if start and seq is not None else (a, b)
                     for (a, b), seq in zip(out["offsets"][i], out["sequence"][i])]

    def _details_head_tail(self, full: list[str], prompt: str, add_special_tokens: bool,
                           with_strings: bool) -> list[Details]:
        """Left truncation that keeps the prompt: the first ``prompt_length`` tokens (the prompt, with a leading
        special token) and the end of the text, as :func:`_cut` takes them from the untruncated row. A long text:
        the head from a prefix, the end from a suffix, each with more than ``max_seq_length`` stable tokens (so the
        whole row is over the limit, and both ends are its own)."""
        limit = self.max_seq_length
        with self._lock:
            keep = min(self.prompt_length(prompt), limit)
            heads = self.cutter.plan(full, keep_end=False)
            tails = self.cutter.plan(full, keep_end=True)
            # per text: its whole window, or a head and a tail
            parts: list[list[Window]] = []
            for s, head, tail in zip(full, heads, tails):
                whole = (0, len(s))
                parts.append([whole] if whole in (head, tail) or head[1] > tail[0] else [head, tail])
            pieces = [s[a:b] for s, windows in zip(full, parts) for a, b in windows]
            out = self._call(self.tokenizer, pieces, None, truncate=False, details=with_strings,
                             add_special_tokens=add_special_tokens)
        result: list[Details] = []
        k = 0
        for windows in parts:
            if len(windows) == 1:
                d = Details(list(out["ids"][k]))
                if with_strings:
                    self._strings(d, out, k, 0)
                d = _cut_details(d, limit, keep, with_strings)
            else:
                head, tail = Details(list(out["ids"][k])), Details(list(out["ids"][k + 1]))
                if with_strings:
                    self._strings(head, out, k, 0)
                    self._strings(tail, out, k + 1, windows[1][0])
                d = Details(head.ids[:keep] + tail.ids[len(tail.ids) - (limit - keep):])
                if with_strings:
                    d.tokens, d.special, d.offsets = (
                        x[:keep] + y[len(y) - (limit - keep):]
                        for x, y in ((head.tokens, tail.tokens), (head.special, tail.special),
                                     (head.offsets, tail.offsets)))
            result.append(d)
            k += len(windows)
        return result

    def encode_pairs(self, pairs: Sequence[tuple[str, str]], *, truncate: bool = True,
                     truncation_side: str = "right") -> list[Encoded]:
        """Text pairs as one sequence each (``[CLS] a [SEP] b [SEP]``), ``longest_first`` truncation, with
        segment ids when the model takes them (as ``CrossEncoder.predict`` tokenizes them). Long sides are
        tokenized as far as the model reads them (:meth:`Cutter.plan_pairs`), with the whole pair's ids."""
        self._check_side(truncation_side)
        keep_end = truncate and truncation_side == "left"
        tokenizer = self._tokenizer_left if keep_end else self.tokenizer
        odd = None
        if truncate:
            budget = self.max_seq_length - tokenizer.num_special_tokens_to_add(pair=True)
            odd = budget if budget % 2 else None
        with self._lock:
            windows, splits = self.cutter.plan_pairs(pairs, keep_end, odd)
            first = [a[w[0]:w[1]] for (a, _), (w, _) in zip(pairs, windows)]
            second = [b[w[0]:w[1]] for (_, b), (_, w) in zip(pairs, windows)]
            plain = [i for i in range(len(pairs)) if i not in splits]
            out = self._call(tokenizer, [first[i] for i in plain], [second[i] for i in plain],
                             truncate=truncate) if plain else {"ids": [], "type_ids": None}
            split = self._split_pairs(tokenizer, [(first[i], second[i], splits[i]) for i in splits], keep_end)
        rows: list[list[int]] = [[] for _ in pairs]
        types: list[list[int] | None] = [None for _ in pairs]
        for k, i in enumerate(plain):
            rows[i] = list(out["ids"][k])
            types[i] = list(out["type_ids"][k]) if out["type_ids"] is not None else None
        for i, (ids, type_ids) in zip(splits, split):
            rows[i], types[i] = ids, type_ids
        if not truncate:
            cut = [None if (wa, wb) == ((0, len(a)), (0, len(b))) else (wa[1] - wa[0]) + (wb[1] - wb[0])
                   for (a, b), (wa, wb) in zip(pairs, windows)]
            self._too_long(rows, "pair", cut)
        return [Encoded(r, types[i], 0) for i, r in enumerate(rows)]

    def _split_pairs(self, tokenizer: Any, pieces: list[tuple[str, str, tuple[int, int]]],
                     keep_end: bool) -> list[tuple[list[int], list[int] | None]]:
        """Pairs whose kept counts the cutter computed from their whole sides' counts (two long sides, an odd
        budget: :meth:`Cutter.plan_pairs`): each piece encoded alone, truncated to its count, then put together by
        the tokenizer's own post-processor (special tokens, segment ids), as its pair truncation does."""
        if not pieces:
            return []
        out = tokenizer([p for a, b, _ in pieces for p in (a, b)], add_special_tokens=False, truncation=False,
                        padding=False, return_attention_mask=False, return_token_type_ids=False)
        backend = tokenizer.backend_tokenizer  # that call left it without truncation or padding
        direction = "left" if keep_end else "right"
        rows = []
        for k, (_, _, (n1, n2)) in enumerate(pieces):
            first, second = out.encodings[2 * k], out.encodings[2 * k + 1]
            first.truncate(n1, direction=direction)
            second.truncate(n2, direction=direction)
            pair = backend.post_process(first, second, add_special_tokens=True)
            rows.append((list(pair.ids), list(pair.type_ids) if self.takes_token_type_ids else None))
        return rows

