"""The fidelity matrix: every model family TEI serves, against sentence-transformers on the same weights.

Each family (``families.py``) is a tiny randomly initialised model saved to disk as a sentence-transformers folder
with the pooling, prompts and tokenizer habits its best-known embedding models use; decoders pool the last token
after an instruction prompt and are saved padded on the left and on the right. For each:

* embedq's vectors, computed as the worker computes them (the job's texts interleaved with another job's in
  mixed-length micro-batches), match ``SentenceTransformer.encode(batch_size=1)`` in fp32: min cosine ≥ 0.99999,
  max |Δ| ≤ 1e-5, for every prompt the model defines and for none (its ``default_prompt_name``);
* a text's vector does not depend on its micro-batch: alone vs padded among longer and shorter texts, ≤ 1e-6;
* token ids are sentence-transformers' own (prompt, BOS/EOS, truncation at ``max_seq_length``) and the token
  budget counts them (real tokens, not padding).

Also here: models that ship their own code (``trust_remote_code``) are refused unless the operator opts in, then run
only from the folder; a pooling override (TEI's ``--pooling``) is another space, and the fingerprint says so.
"""

from __future__ import annotations

import json
import logging
import shutil
from functools import partial

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

from families import FAMILIES, MAX_SEQ_LENGTH, save
from tiny_models import run_as_the_worker

from embedq import errors
from embedq.backends import load_backend, postprocess
from embedq.cli.verify import cosines
from embedq.protocol import EmbedOptions, decode_result

pytestmark = pytest.mark.integration  # builds and loads a model of each family

MIN_COSINE = 0.99999
MAX_DELTA = 1e-5
INVARIANCE = 1e-6
N_TEXTS = 24
EXTRA_TEXTS = ["", "a", "Ünïcödé — 日本語のテキスト ✓", "word " * 200]  # empty, one char, non-ASCII, truncated

# (family, padding side): the encoders as saved; every decoder padded on both sides (left-padded position ids,
# last-token pooling and the prompt left out of a mean must not care).
CASES = [(name, None) for name, fam in FAMILIES.items() if not fam.decoder] + [
    (name, side) for name, fam in FAMILIES.items() if fam.decoder for side in ("left", "right")
]


def _case_id(case: tuple[str, str | None]) -> str:
    return case[0] if case[1] is None else f"{case[0]}-{case[1]}-padded"


@pytest.fixture(scope="module")
def texts(corpus) -> list[str]:
    step = max(1, len(corpus) // N_TEXTS)
    return corpus[::step][:N_TEXTS] + EXTRA_TEXTS


@pytest.fixture(scope="module")
def train_corpus(corpus) -> list[str]:
    return corpus[:2000]


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def case(request, tmp_path_factory, train_corpus):
    from sentence_transformers import SentenceTransformer

    name, side = request.param
    folder = save(FAMILIES[name], tmp_path_factory.mktemp("families") / _case_id(request.param), train_corpus,
                  padding_side=side)
    st = SentenceTransformer(str(folder), device="cpu")
    backend = load_backend(str(folder), device="cpu", dtype="float32", linear_kernel="torch")
    if side is not None:  # saved as asked (transformers 5 keeps padding_side only as a constructor argument)
        assert st.tokenizer.padding_side == backend.encoder.tokenizer.padding_side == side
        assert backend.encoder.left_padding == (side == "left")
    return FAMILIES[name], folder, st, backend


def _prompt_names(family) -> list[str | None]:
    return [None, *family.prompts]


def test_family_matches_sentence_transformers(case, texts):
    family, _folder, st, backend = case
    if family.decoder:
        assert st.tokenizer.padding_side == backend.encoder.tokenizer.padding_side
        assert backend.encoder.left_padding == (st.tokenizer.padding_side == "left")
    assert backend.info.pooling == family.pooling
    assert backend.info.max_seq_length == MAX_SEQ_LENGTH
    other = list(reversed(texts))
    for prompt_name in _prompt_names(family):
        options = EmbedOptions.parse({"prompt_name": prompt_name} if prompt_name else {})
        # the prompt sentence-transformers uses (its default_prompt_name when none is named) and its token ids
        prompt = st.prompts.get(prompt_name or st.default_prompt_name or "", None) or None
        reference = st.encode(texts, batch_size=1, prompt_name=prompt_name, convert_to_numpy=True)
        st_ids = [st.tokenize([(prompt or "") + t])["input_ids"][0] for t in texts]
        st_ids = [ids[ids != st.tokenizer.pad_token_id].tolist() if st.tokenizer.pad_token_id is not None
                  else ids.tolist() for ids in st_ids]
        prepared = backend.prepare("embed", texts, options)
        ours_ids = [item.ids for item in prepared.items]
        pad = st.tokenizer.pad_token_id
        assert [[i for i in ids if i != pad] for ids in ours_ids] == st_ids
        assert prepared.tokens == sum(len(ids) for ids in ours_ids)  # the budget counts real tokens
        assert max(len(ids) for ids in ours_ids) == MAX_SEQ_LENGTH  # the long text was truncated as ST does

        # as the worker runs it: interleaved with another job (other prompt) in mixed-length micro-batches
        other_options = EmbedOptions.parse({"prompt_name": list(family.prompts)[-1]} if family.prompts else {})
        payload = run_as_the_worker(backend, "embed", texts, options, step=5, other=other,
                                    other_options=other_options)
        vectors, fingerprint = decode_result(payload)
        assert fingerprint.prompt == prompt and fingerprint.pooling == family.pooling
        assert fingerprint.normalize == family.normalize and fingerprint.dtype == "float32"
        assert vectors.shape == reference.shape
        delta = float(np.abs(vectors - reference).max())
        cos = cosines(vectors, reference)
        assert delta <= MAX_DELTA, (prompt_name, delta)
        assert float(cos.min()) >= MIN_COSINE, (prompt_name, float(cos.min()))

        # batch invariance: each text alone (no padding at all) against the mixed micro-batches above
        # on unit vectors: an unnormalised model's rows are compared relative to their norm (up to ~10 here)
        served = partial(postprocess, normalize=True, dimensions=None)
        alone = served(np.stack([backend.forward([item])[0] for item in prepared.items]))
        mixed = served(np.stack(_mixed_rows(backend, prepared.items, other_options, other)))
        assert float(np.abs(alone - mixed).max()) <= INVARIANCE, (prompt_name, float(np.abs(alone - mixed).max()))


def _mixed_rows(backend, items, other_options, other) -> list[np.ndarray]:
    """``items`` in micro-batches of 6 padded with longer and shorter texts of another job, unnormalised rows."""
    theirs = backend.prepare("embed", other, other_options).items
    rows: list[np.ndarray] = []
    for start in range(0, len(items), 3):
        mine = items[start:start + 3]
        partners = theirs[start:start + 3]
        out = backend.forward([x for pair in zip(partners, mine) for x in pair] + partners[len(mine):])
        rows += out[1:2 * len(mine):2]
    return rows


# -- a pooling override is another space ------------------------------------------------------------------------
def test_pooling_override_is_named_in_the_fingerprint(tmp_path, train_corpus, caplog):
    folder = save(FAMILIES["qwen3"], tmp_path / "qwen3", train_corpus)
    own = load_backend(str(folder), linear_kernel="torch")
    with caplog.at_level(logging.WARNING):
        mean = load_backend(str(folder), linear_kernel="torch", pooling="mean")
    assert "overrides" in caplog.text and "lasttoken" in caplog.text
    assert own.info.pooling == "lasttoken" and mean.info.pooling == "mean"
    options = EmbedOptions.parse({})
    a, fa = decode_result(run_as_the_worker(own, "embed", ["some text", "another"], options))
    b, fb = decode_result(run_as_the_worker(mean, "embed", ["some text", "another"], options))
    assert not fa.same_space(fb) and fb.pooling == "mean"
    assert float((a * b).sum(1).min()) < 0.99  # a different space indeed
    with pytest.raises(errors.InvalidOption):
        load_backend(str(folder), linear_kernel="torch", pooling="median")


def test_tei_pooling_names_are_settings():
    from embedq.settings import Settings

    assert Settings(pooling="last-token").pooling == "lasttoken"
    assert Settings(pooling="cls").pooling == "cls"
    with pytest.raises(ValueError):
        Settings(pooling="median")


# -- models that ship their own code ------------------------------------------------------------------------------
CUSTOM_CODE = '''
from transformers import BertConfig, BertModel


class ScaledBertConfig(BertConfig):
    model_type = "scaled-bert"


class ScaledBertModel(BertModel):
    """BERT whose hidden states are doubled and shifted: stock BertModel on the same weights gives other vectors."""

    config_class = ScaledBertConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.last_hidden_state = out.last_hidden_state * 2.0 + 1.0
        return out
'''


@pytest.fixture(scope="module")
def remote_code_folder(tmp_path_factory, train_corpus):
    """The bert family's folder turned into a model with its own code (auto_map), as Jina's and Nomic's are:
    ``model_type`` stays ``bert``, so transformers without the code would load a stock BertModel silently."""
    folder = save(FAMILIES["bert"], tmp_path_factory.mktemp("remote") / "custom", train_corpus)
    (folder / "modeling_scaled.py").write_text(CUSTOM_CODE)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_scaled.ScaledBertConfig",
                          "AutoModel": "modeling_scaled.ScaledBertModel"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_remote_code_is_refused_without_the_opt_in(remote_code_folder):
    with pytest.raises(errors.UnsupportedModel, match="EMBEDQ_TRUST_REMOTE_CODE") as info:
        load_backend(str(remote_code_folder), linear_kernel="torch")
    assert "modeling_scaled.ScaledBertModel" in str(info.value)


def test_remote_code_runs_from_the_folder_with_the_opt_in(remote_code_folder, texts):
    from sentence_transformers import SentenceTransformer

    folder = remote_code_folder
    backend = load_backend(str(folder), linear_kernel="torch", trust_remote_code=True)
    assert type(backend.encoder.model).__name__ == "ScaledBertModel"
    reference = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True).encode(texts, batch_size=1)
    vectors, _ = decode_result(run_as_the_worker(backend, "embed", texts, EmbedOptions.parse({})))
    assert float(np.abs(vectors - reference).max()) <= MAX_DELTA
    stock = shutil.copytree(folder, folder.with_name("stock"))  # what transformers serves without the code
    config = json.loads((stock / "config.json").read_text())
    del config["auto_map"]
    (stock / "config.json").write_text(json.dumps(config))
    plain = SentenceTransformer(str(stock), device="cpu").encode(texts[:4], batch_size=1)
    assert float(np.abs(plain - reference[:4]).max()) > 1e-2


def test_remote_code_from_elsewhere_is_refused_even_with_the_opt_in(remote_code_folder, tmp_path):
    copy = shutil.copytree(remote_code_folder, tmp_path / "elsewhere")
    config = json.loads((copy / "config.json").read_text())
    config["auto_map"]["AutoModel"] = "someorg/some-repo--modeling_scaled.ScaledBertModel"
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.UnsupportedModel, match="not inside the model folder"):
        load_backend(str(copy), linear_kernel="torch", trust_remote_code=True)


def test_the_model_code_is_part_of_the_weights_hash(remote_code_folder, tmp_path):
    from embedq.backends.folder import weights_sha256

    copy = shutil.copytree(remote_code_folder, tmp_path / "edited")
    before = weights_sha256(copy)
    (copy / "modeling_scaled.py").write_text(CUSTOM_CODE.replace("* 2.0", "* 3.0"))
    assert weights_sha256(copy) != before
