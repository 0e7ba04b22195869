"""The repository carries its own sample corpus (issue 51, item 1): the README's main job, the tests and the benchmarks
read ``data/corpus.jsonl`` from the checkout, never a file beside the checkout (which a user does not have)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_main_job_reads_a_file_the_repository_carries():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):]
    command = re.search(r"^\.venv/bin/embedq index (\S+) ", quick_start, re.M)
    assert command, "the quick start has no `embedq index` command"
    source = (ROOT / command.group(1)).resolve()
    assert source.is_file() and ROOT in source.parents, f"{command.group(1)} is not in the repository"


def test_no_code_test_or_readme_reads_outside_the_checkout():
    """Nothing a user runs looks for data beside the checkout (the tests that did skipped on a fresh clone)."""
    outside = re.compile(r"\.\./shared|parents\[1\]\.parent|ROOT(_DIR)?\.parent\b")
    paths = [ROOT / "README.md", *ROOT.glob("embedq/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py"),
             *ROOT.glob("scripts/*")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in paths if p.is_file() and "node_modules" not in p.parts
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert not found, found


def test_the_sample_corpus_is_real_text_of_every_length():
    rows = [json.loads(line) for line in (ROOT / "data" / "corpus.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 4000 and len({row["id"] for row in rows}) == 4000
    assert Counter(row["kind"] for row in rows) == {"query": 1600, "medium": 1000, "chunk": 1400}
    assert all(isinstance(row["text"], str) and row["text"].strip() for row in rows)
    lengths = sorted(len(row["text"]) for row in rows)
    assert lengths[0] < 40 and lengths[-1] > 1500  # one-line queries to 400-token chunks


def test_install_hints_name_the_checkout_not_a_package_index():
    """Issue 51, item 5: no `pip install 'embedq[...]'` (embedq is on no package index) in the README, the docs, the
    code's messages or --help; the README says how to install from the checkout, extras and a wheel included."""
    wrong = re.compile(r"pip install ['\"]?embedq\b")
    paths = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("embedq/**/*.py"), *ROOT.glob("scripts/*")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in paths if p.is_file() and p.name != "BENCHMARKS.md"
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if wrong.search(line) and "that would find nothing" not in line]
    assert not found, found
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install"):]
    assert "pip install -e '.[" in install and "pip wheel" in install
    from embedq import errors

    assert errors.install_hint("gateway") == "pip install -e '.[gateway]' in embedq's checkout (README: Install)"
