"""Inputs longer than the model, in token windows (a job's ``long_inputs="windows"``, issue 58).

A text is tokenized whole (its prompt in front, no special tokens) and its tokens are cut into windows of the
model's length: each window is the model's special tokens around the prompt's tokens and a run of the text's
tokens, at most ``max_seq_length`` in all, and neighbouring windows share about ``window_overlap`` tokens. A window
never splits a token; it ends where a sentence starts when one starts within :func:`slack` tokens of its end, else
where a word starts (whitespace before the token), else where the pre-tokenizer starts a word (CJK characters,
punctuation), else after its last token. The next window starts ``window_overlap`` tokens before that end, moved to
a sentence or word start the same way. Each window is an item of its own: the scheduler packs it with every other
job's items, and its row is the model run on its ids alone (a text that fits is one window whose ids are the ones
the text has without windows).

A window's character span ``[start, end)`` is its tokens' text with what follows them up to the next token (the
first window starts at 0, the last ends at the text's end), so ``text[start:end]`` is the window's text and the
spans cover the whole text. A text that needs more than ``max_windows`` windows fails alone
(:class:`~embedq.errors.TooManyWindows`): the job's result lists it under ``failed``.

:func:`finish_windows` turns the rows of a job's windows into its result: each input's windows pooled by its head
(:meth:`~embedq.backends.base.Head.pool`) or, with ``pool_windows=False``, every window's own output, with the
result's ``window_offsets`` (input ``i``'s windows are rows ``window_offsets[i]:window_offsets[i+1]``),
``window_spans`` and ``window_tokens``.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedq import errors
from embedq.backends.base import Encoded, Prepared
from embedq.protocol import encode_array

#: Characters after which a new sentence starts (with whitespace or nothing between it and the next token).
SENTENCE_ENDS = frozenset(".!?;\u3002\uff01\uff1f\uff1b\u2026")
_CLOSE_WITHOUT_SPACE = frozenset("\u3002\uff01\uff1f\uff1b")  # CJK ends: a sentence starts right after them


def slack(budget: int) -> int:
    """Tokens a window's end (or start) may move to meet a sentence boundary: an eighth of the window."""
    return max(1, budget // 8)


@dataclass
class Tokens:
    """One text's tokens as the planner reads them: character offsets into ``text`` (the prompt left out) and the
    pre-tokenizer's word of each token (None: each token is a word of its own)."""

    text: str
    starts: Sequence[int]
    ends: Sequence[int]
    words: Sequence[int | None] | None = None

    def __len__(self) -> int:
        return len(self.starts)

    def _gap(self, k: int) -> str:
        return self.text[self.ends[k - 1]:self.starts[k]]

    def word_start(self, k: int) -> bool:
        """Token ``k`` starts a word: whitespace between it and the token before (or at its first character)."""
        if self.words is not None and self.words[k] == self.words[k - 1] and self.words[k] is not None:
            return False
        gap = self.text[self.ends[k - 1]:self.starts[k] + 1]
        return any(c.isspace() for c in gap)

    def token_start(self, k: int) -> bool:
        """Token ``k`` starts a word of the pre-tokenizer's (a CJK character, a punctuation mark)."""
        return self.words is None or self.words[k] != self.words[k - 1] or self.words[k] is None

    def sentence_start(self, k: int) -> bool:
        """Token ``k`` starts a sentence: a line break before it, or sentence punctuation then whitespace."""
        gap = self._gap(k)
        if "\n" in gap:
            return True
        end = self.ends[k - 1]
        last = self.text[end - 1] if end > 0 else ""
        return last in SENTENCE_ENDS and (last in _CLOSE_WITHOUT_SPACE or (gap != "" and gap.isspace()))

    def span(self, a: int, e: int) -> tuple[int, int]:
        """Characters of the window of tokens ``[a, e)``: see the module's docstring."""
        n = len(self)
        start = 0 if a == 0 else self.starts[a]
        end = len(self.text) if e >= n else self.starts[e]
        return start, max(start, end)


def _last(test: Callable[[int], bool], lo: int, hi: int) -> int | None:
    for k in range(hi, lo - 1, -1):
        if test(k):
            return k
    return None


def _first(test: Callable[[int], bool], lo: int, hi: int) -> int | None:
    for k in range(lo, hi + 1):
        if test(k):
            return k
    return None


def _end(t: Tokens, a: int, budget: int) -> int:
    """Where the window that starts at token ``a`` ends (exclusive), at most ``budget`` tokens on."""
    n = len(t)
    if n - a <= budget:
        return n
    limit = a + budget
    for test, lo in ((t.sentence_start, limit - slack(budget)), (t.word_start, a + 1), (t.token_start, a + 1)):
        k = _last(test, max(lo, a + 1), limit)
        if k is not None:
            return k
    return limit


def _next_start(t: Tokens, a: int, e: int, overlap: int, budget: int) -> int:
    """Where the window after ``[a, e)`` starts: ``overlap`` tokens before ``e``, at a sentence or word start."""
    if overlap <= 0:
        return e
    target = max(e - overlap, a + 1)
    s = slack(budget)
    near = [k for k in (_last(t.sentence_start, max(target - s, a + 1), target),
                        _first(t.sentence_start, target, min(target + s, e))) if k is not None]
    if near:
        return min(near, key=lambda k: abs(k - target))
    for test in (t.word_start, t.token_start):
        k = _last(test, a + 1, target)
        if k is None:
            k = _first(test, target, e)
        if k is not None:
            return k
    return target


def plan(t: Tokens, budget: int, overlap: int, cap: int) -> list[tuple[int, int]] | None:
    """The windows of ``t`` as token ranges ``[a, e)`` of at most ``budget`` tokens; None when they are more than
    ``cap`` (planning stops there: a text's cost is bounded however long it is)."""
    if budget < 1:
        raise errors.TooLong("the prompt and the model's special tokens leave no room for a window of the text")
    windows: list[tuple[int, int]] = []
    a, n = 0, len(t)
    while True:
        e = _end(t, a, budget)
        windows.append((a, e))
        if len(windows) > cap:
            return None
        if e >= n:
            return windows
        a = _next_start(t, a, e, overlap, budget)


@dataclass
class WindowPlan:
    """A job's windows (``Prepared.state["windows"]``): input ``i``'s items are ``offsets[i]:offsets[i+1]``."""

    overlap: int
    pooled: bool
    offsets: list[int] = field(default_factory=lambda: [0])
    spans: list[tuple[int, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    failed: dict[int, errors.EmbedqError] = field(default_factory=dict)

    def add(self, spans: list[tuple[int, int]], tokens: list[int]) -> None:
        self.spans += spans
        self.tokens += tokens
        self.offsets.append(self.offsets[-1] + len(spans))

    def fail(self, index: int, error: errors.EmbedqError) -> None:
        self.failed[index] = error
        self.offsets.append(self.offsets[-1])


def check_overlap(overlap: int, budget: int) -> None:
    if 2 * overlap >= budget:
        raise errors.InvalidOption(f"window_overlap={overlap} is half or more of the {budget} tokens a window of "
                                   "this model holds of the text")


def window_items(t: Tokens, body: Sequence[int], head: Sequence[int], tail: Sequence[int], limit: int,
                 overlap: int, cap: int, plan_: WindowPlan, index: int, prompt_length: int) -> list[Encoded]:
    """One text's window items (``head``: the special tokens and the prompt's tokens in front of every window,
    ``tail``: those behind), recorded in ``plan_`` as input ``index``; a text over ``cap`` windows fails there."""
    budget = limit - len(head) - len(tail)
    if budget >= 1:
        check_overlap(overlap, budget)
    ranges = plan(t, budget, overlap, cap)
    if ranges is None:
        plan_.fail(index, errors.TooManyWindows(
            f"inputs[{index}] needs more than {cap} windows of {limit} tokens (the worker's max_windows)"))
        return []
    items = [Encoded([*head, *body[a:e], *tail], None, prompt_length) for a, e in ranges]
    plan_.add([t.span(a, e) for a, e in ranges], [len(item.ids) for item in items])
    return items


class Windower:
    """Windows of texts for a transformers fast tokenizer (:class:`~embedq.backends.tokenizing.Tokenization`)."""

    def __init__(self, tokenization: Any, max_windows: int) -> None:
        self.tokenization = tokenization
        self.max_windows = max_windows
        self._specials: tuple[list[int], list[int]] | None = None
        # A copy of the tokenizer and a lock of its own: a long text tokenized on the preparer's thread
        # (workers/preparer.py) never holds up the consumer thread's tokenizer calls.
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def specials(self, tokenizer: Any) -> tuple[list[int], list[int]]:
        """The special tokens ``tokenizer`` (the copy, under the lock) puts before and after a text's tokens."""
        if self._specials is None:
            probe = "hello world"
            plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
            whole = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
            at = next((i for i in range(len(whole) - len(plain) + 1) if whole[i:i + len(plain)] == plain), None)
            if at is None or not plain:
                raise errors.UnsupportedTask("long_inputs='windows' is not available for this model's tokenizer "
                                             "(its special tokens do not surround a text)")
            self._specials = whole[:at], whole[at + len(plain):]
        return self._specials

    def encode(self, texts: Sequence[Any], prompt: str | None, options: Any) -> tuple[list[Encoded], WindowPlan]:
        """Every text's windows as items, and the job's :class:`WindowPlan`."""
        if any(not isinstance(text, str) for text in texts):
            raise errors.InvalidOption("long_inputs='windows' takes texts, not token ids")
        tok = self.tokenization
        full = [prompt + text for text in texts] if prompt else list(texts)
        with tok._lock:
            plen = tok.prompt_length(prompt) if prompt else 0
        with self._lock:
            if self._tokenizer is None:
                with tok._lock:
                    self._tokenizer = copy.deepcopy(tok.tokenizer)
            front, back = self.specials(self._tokenizer)
            out = self._tokenizer(full, add_special_tokens=False, truncation=False, padding=False,
                                  return_attention_mask=False, return_token_type_ids=False,
                                  return_offsets_mapping=True)
        shift = len(prompt) if prompt else 0
        windows = WindowPlan(options.window_overlap, options.pool_windows)
        items: list[Encoded] = []
        for i, (text, enc) in enumerate(zip(texts, out.encodings)):
            ids, offsets, words = enc.ids, enc.offsets, enc.word_ids
            m = 0  # the prompt's tokens: those that end inside it (a token across its end is the text's)
            while m < len(ids) and offsets[m][1] <= shift:
                m += 1
            starts = [max(a - shift, 0) for a, _ in offsets[m:]]
            ends = [max(b - shift, 0) for _, b in offsets[m:]]
            t = Tokens(text, starts, ends, words[m:])
            items += window_items(t, ids[m:], [*front, *ids[:m]], back, tok.max_seq_length, options.window_overlap,
                                  self.max_windows, windows, i, plen)
        return items, windows


def window_counts(prepared: Prepared) -> dict[str, int]:
    """The worker's counters of a prepared job: its texts cut into more than one window, and their windows."""
    plan_ = prepared.state.get("windows")
    if plan_ is None:
        return {}
    counts = [b - a for a, b in itertools.pairwise(plan_.offsets) if b - a > 1]
    return {"texts_windowed": len(counts), "windows": sum(counts)} if counts else {}


def finish_windows(rows: list[Any], prepared: Prepared, finish: Callable[[list[Any]], dict[str, Any]],
                   pool: Callable[[list[Any], list[int]], Any]) -> dict[str, Any]:
    """A windows job's result from its items' rows (see the module's docstring); ``finish`` is the head's finish
    over rows, ``pool`` its pooling of one input's window rows (token counts as weights)."""
    plan_: WindowPlan = prepared.state["windows"]
    inputs = len(plan_.offsets) - 1
    if len(plan_.failed) == inputs:
        raise next(iter(plan_.failed.values()))
    at = plan_.offsets
    if plan_.pooled:
        pooled = [pool(rows[at[i]:at[i + 1]], plan_.tokens[at[i]:at[i + 1]]) for i in range(inputs)]
        result = finish(pooled)
    else:
        result = finish(rows)
        result["window_spans"] = encode_array(np.asarray(plan_.spans, dtype=np.int32).reshape(-1, 2))
        result["window_tokens"] = encode_array(np.asarray(plan_.tokens, dtype=np.int32))
    result["window_offsets"] = encode_array(np.asarray(plan_.offsets, dtype=np.int32))
    if plan_.failed:
        result["failed"] = [{"index": i, **error.to_dict()} for i, error in sorted(plan_.failed.items())]
    result["usage"] = {**result["usage"], "texts": inputs, "windows": len(rows)}
    result["fingerprint"] = {**result["fingerprint"], "window_overlap": plan_.overlap, "pool_windows": plan_.pooled}
    return result


def weighted_mean(rows: list[np.ndarray], weights: list[int], width: int) -> np.ndarray:
    """The token-weighted mean of a text's window vectors (float32; zeros for a text without windows)."""
    if not rows:
        return np.zeros(width, dtype=np.float32)
    if len(rows) == 1:
        return np.asarray(rows[0], dtype=np.float32)
    w = np.asarray(weights, dtype=np.float64)
    return (np.stack(rows).astype(np.float64).T @ w / w.sum()).astype(np.float32)


def merge_sparse(rows: list[tuple[np.ndarray, np.ndarray]], strategy: str) -> tuple[np.ndarray, np.ndarray]:
    """Sparse window rows (ids ascending, values) as one: the largest value per id (``max``) or their sum."""
    if len(rows) == 1:
        return rows[0]
    if not rows:
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    ids = np.concatenate([r[0] for r in rows]).astype(np.int64)
    values = np.concatenate([r[1] for r in rows]).astype(np.float32)
    unique, inverse = np.unique(ids, return_inverse=True)
    out = np.full(len(unique), -np.inf if strategy == "max" else 0.0, dtype=np.float32)
    (np.maximum if strategy == "max" else np.add).at(out, inverse, values)
    return unique.astype(np.int32), out


def concat_rows(rows: list[np.ndarray], width: int) -> np.ndarray:
    """Per-token window rows one after the other (a text without windows: no rows)."""
    if not rows:
        return np.zeros((0, width), dtype=np.float32)
    return np.concatenate(rows).astype(np.float32, copy=False)
