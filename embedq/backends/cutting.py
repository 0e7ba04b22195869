"""Long texts cut before the tokenizer: a text is tokenized only as far as the model reads it.

Tokenizing a 100,000-character text costs tens of milliseconds however few tokens the model keeps of it (one job of
150 such texts held a worker for ~10 s, and every small job behind it). So a text longer than ``first`` characters is
handed to the tokenizer as a *piece*: a prefix when the model keeps its first tokens (right truncation, and the
overflow check of ``truncate=False``), a suffix when it keeps its last (left truncation). The piece is tokenized
once without special tokens to check it; if the check fails the piece doubles, up to the whole text. The ids are the
whole text's, exactly:

A fast tokenizer normalises (a rewrite of a character or a few: case, accents, NFKC, whitespace runs), splits the
result into words (the pre-tokenizer: whitespace, punctuation, regex splits; ``Encoding.word_ids``) and tokenizes
each word alone (WordPiece, BPE and Unigram never look past a word). A prefix is split as the whole text is up to its
last word (the pre-tokenizer reads left to right; at most the word that touches the cut differs, which may continue,
merge differently, or turn into ``[UNK]`` past WordPiece's 100 characters). So a token of the prefix is *stable*
when it is not in the prefix's last word and ends at least ``margin`` characters before the cut (normalisers and
added tokens reach a few characters across it): the whole text has the same token there. A suffix is the mirror
image, with one more condition: the pre-tokenizer must start reading where the whole text's reading also starts a
word, or a regex such as ``\\p{N}{1,3}`` (Llama 3, cl100k) groups a long digit run in another phase all along the
run. A suffix therefore starts at a space that follows a non-space character, where every pre-tokenizer in use
(BERT's, Whitespace, Metaspace, the GPT-2, cl100k, Llama-3 and Qwen2 regexes) ends a word; when no such space is
near, the piece grows instead.

A piece is accepted when its stable tokens at the kept end number at least ``need`` (``max_seq_length + 1``): the
model keeps fewer, all of them stable, so truncating the piece keeps what truncating the whole text keeps; and the
whole text has more tokens than the model reads, as the piece has, so ``truncate=False`` still fails it. A tokenizer
whose pre-tokenizer leaves the whole text one word (Metaspace with ``split=False``, none) never has a stable token:
its pieces grow to the whole text (exact, as slow as before). Text pairs (``longest_first``) also need the kept
counts to be those of the whole pair; see :meth:`Cutter.plan_pairs`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

#: Characters kept between a stable token and the cut (normalisers and added tokens reach a few across it).
MARGIN = 64
#: Characters per token the first piece allows for (text of English words runs about 4-5 in WordPiece and BPE).
CHARS_PER_TOKEN = 6

Window = tuple[int, int]  # [start, end) of a text: the piece handed to the tokenizer

# A space that follows a non-space character: where every pre-tokenizer in use ends a word.
_WORD_END = re.compile(r"(?<=\S) ")


def _last_word_end(text: str, lo: int, hi: int) -> int | None:
    """The largest ``p`` in ``[max(lo, 1), hi]`` where ``text[p]`` is a space after a non-space character."""
    found = None
    for match in _WORD_END.finditer(text, max(lo, 1), hi + 1):
        found = match.start()
    return found


class Cutter:
    """Plans the pieces of texts (and text pairs) that ``tokenizer`` (a transformers fast tokenizer) is handed."""

    def __init__(self, tokenizer: Any, *, need: int, first: int | None = None, margin: int = MARGIN) -> None:
        added = [str(getattr(t, "content", t)) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
        self.tokenizer = tokenizer
        self.need = need  # stable tokens a piece must have at its kept end
        self.margin = max(margin, 2 * max((len(a) for a in added), default=0))
        self.first = first if first is not None else need * CHARS_PER_TOKEN + 2 * self.margin
        #: Characters handed to the tokenizer to check pieces (and count whole sides of pairs), for measurements.
        self.checked_chars = 0

    # -- one text ---------------------------------------------------------------------------------------------
    def window(self, text: str, keep_end: bool, size: int) -> Window | None:
        """The piece of about ``size`` characters at ``text``'s kept end: the whole text when that is not over twice
        as long; None when a suffix finds no word start to begin at (the caller grows ``size``)."""
        n = len(text)
        if 2 * size >= n:  # a piece of more than half the text: the whole text (at most twice its length checked)
            return 0, n
        if not keep_end:  # a prefix: ends before a space where one is near (fewer half-read words), else anywhere
            end = _last_word_end(text, size - size // 4, size)
            return 0, size if end is None else end
        start = _last_word_end(text, n - 2 * size, n - size)  # a suffix must start at a word start (see above)
        return None if start is None else (start, n)

    def stable(self, encoding: Any, length: int, keep_end: bool) -> int:
        """Tokens at the kept end of a piece of ``length`` characters (``encoding``: without special tokens) that
        the whole text has too: none in the word at the cut, none within ``margin`` characters of it."""
        words, offsets = encoding.word_ids, encoding.offsets
        n = len(words)
        if not n:
            return 0
        if keep_end:
            edge, bound = words[0], self.margin
            for count, i in enumerate(range(n - 1, -1, -1)):
                if words[i] == edge or offsets[i][0] < bound:
                    return count
            return n
        edge, bound = words[-1], length - self.margin
        for i in range(n):
            if words[i] == edge or offsets[i][1] > bound:
                return i
        return n

    def counts(self, pieces: list[str], keep_end: bool | None) -> list[tuple[int, int]]:
        """(stable tokens, all tokens) of each piece, tokenized in one call (``keep_end`` None: whole texts)."""
        if not pieces:
            return []
        self.checked_chars += sum(map(len, pieces))
        out = self.tokenizer(pieces, add_special_tokens=False, truncation=False, padding=False,
                             return_attention_mask=False, return_token_type_ids=False, return_offsets_mapping=True)
        return [(len(enc.ids) if keep_end is None else self.stable(enc, len(piece), keep_end), len(enc.ids))
                for piece, enc in zip(pieces, out.encodings)]

    def plan(self, texts: Sequence[str], keep_end: bool) -> list[Window]:
        """Each text's piece: a window with at least ``need`` stable tokens at its kept end, or the whole text."""
        windows: list[Window] = [(0, len(t)) for t in texts]
        sizes = {i: self.first for i, t in enumerate(texts) if len(t) > self.first}
        while sizes:
            grow: dict[int, int] = {}
            trying: list[tuple[int, Window]] = []
            for i, size in sizes.items():
                w = self.window(texts[i], keep_end, size)
                if w is None:
                    grow[i] = 2 * size
                elif w != (0, len(texts[i])):
                    trying.append((i, w))
            found = self.counts([texts[i][a:b] for i, (a, b) in trying], keep_end)
            for (i, w), (stable, _) in zip(trying, found):
                if stable >= self.need:
                    windows[i] = w
                else:
                    grow[i] = 2 * sizes[i]
            sizes = grow
        return windows

    # -- text pairs ---------------------------------------------------------------------------------------------
    def plan_pairs(self, pairs: Sequence[tuple[str, str]], keep_end: bool, odd_budget: int | None = None
                   ) -> tuple[list[tuple[Window, Window]], dict[int, tuple[int, int]]]:
        """Each pair's two pieces, and for some pairs the tokens each side keeps. Each side is whole or has
        ``need`` stable tokens at its kept end (more than the pair's budget: each side keeps no more than that,
        and is over it in the whole pair as in the pieces).

        ``odd_budget``: the content tokens a pair keeps (max_seq_length less the pair's special tokens) when
        ``longest_first`` truncation applies and that budget is odd. Then two sides over the budget split it with
        the extra token going to the one with more tokens, which the pieces may not tell. So a cut side must have
        more stable tokens than a whole partner over the budget has tokens; and when both sides are long, both are
        counted whole (single texts: linear; the tokenizer's own pair truncation of two long texts is quadratic in
        time and memory) and the pair is returned with the kept counts :func:`longest_first` gives for them (the
        caller truncates the pieces' encodings to those counts). With an even budget two sides over it keep half
        each whatever their lengths, and a side within the budget is whole, its count exact: the pieces truncate
        as the whole pair does."""
        windows = [[(0, len(a)), (0, len(b))] for a, b in pairs]
        splits: dict[int, tuple[int, int]] = {}
        # pair -> [size of each side's piece; None: that side is whole]
        sizes: dict[int, list[int | None]] = {}
        for i, pair in enumerate(pairs):
            side_sizes: list[int | None] = [self.first if len(s) > self.first else None for s in pair]
            if odd_budget is not None and None not in side_sizes:
                splits[i] = (0, 0)
            elif side_sizes != [None, None]:
                sizes[i] = side_sizes
        if splits:
            texts = {text: 0 for i in splits for text in pairs[i]}  # a rerank's query: counted once
            texts.update(zip(texts, (count for _, count in self.counts(list(texts), None))))
            for i in splits:
                splits[i] = longest_first(texts[pairs[i][0]], texts[pairs[i][1]], odd_budget or 0)
            order = list(splits)
            for side in (0, 1):
                for i, window in zip(order, self.plan([pairs[i][side] for i in order], keep_end)):
                    windows[i][side] = window
        whole_counts: dict[tuple[int, int], int] = {}  # tokens of a whole side whose partner is cut (odd budget)
        while sizes:
            pieces: dict[tuple[int, int], Window | None] = {}  # None: no word start to begin the suffix at
            for i, side_sizes in sizes.items():
                for j, size in enumerate(side_sizes):
                    if size is not None:
                        w = self.window(pairs[i][j], keep_end, size)
                        if w == (0, len(pairs[i][j])):
                            side_sizes[j] = None
                        else:
                            pieces[(i, j)] = w
            if odd_budget is not None:
                todo = [(i, side_sizes.index(None)) for i, side_sizes in sizes.items()
                        if side_sizes.count(None) == 1 and (i, side_sizes.index(None)) not in whole_counts]
                whole_counts.update((key, count) for key, (_, count) in
                                    zip(todo, self.counts([pairs[i][j] for i, j in todo], None)))
            cut = [(key, w) for key, w in pieces.items() if w is not None]
            found = dict(zip((key for key, _ in cut),
                             self.counts([pairs[i][j][a:b] for (i, j), (a, b) in cut], keep_end)))
            grow: dict[int, list[int | None]] = {}
            for i, side_sizes in sizes.items():
                cuts = [j for j in (0, 1) if side_sizes[j] is not None]
                short = [j for j in cuts if pieces[(i, j)] is None or found[(i, j)][0] < self.need]
                if not short and odd_budget is not None and len(cuts) == 1:
                    count = whole_counts[(i, 1 - cuts[0])]
                    if count > odd_budget and found[(i, cuts[0])][0] <= count:
                        short = cuts
                if short:
                    grow[i] = [2 * s if j in short and s is not None else s for j, s in enumerate(side_sizes)]
                    continue
                for j in cuts:
                    window = pieces[(i, j)]
                    assert window is not None
                    windows[i][j] = window
            sizes = grow
        return [(a, b) for a, b in windows], splits


def longest_first(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """The tokens each side of a pair of ``n1`` and ``n2`` content tokens keeps under ``longest_first`` truncation
    to ``budget`` (the tokenizers library's ``truncate_encodings``: the shorter side keeps what it can, two long
    sides split the budget, the extra token of an odd one to the side with more tokens)."""
    if n1 + n2 <= budget:
        return n1, n2
    swap = n1 > n2
    short, long_ = (n2, n1) if swap else (n1, n2)
    long_ = short if short > budget else max(short, budget - short)
    if short + long_ > budget:
        short = budget // 2
        long_ = short + budget % 2
    return (long_, short) if swap else (short, long_)
