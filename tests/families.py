"""Tiny randomly initialised models of every family TEI serves, saved as sentence-transformers folders.

Each family is saved with the pooling, prompts and tokenizer habits its best-known embedding models use, so the
fidelity matrix (``test_families.py``) runs the real loading code on each:

============  ===================  ==================================================================================
family        like                 pooling, prompts, tokenizer
============  ===================  ==================================================================================
bert          BGE                  CLS + Normalize; a ``query`` instruction prompt; WordPiece with segment ids
distilbert    msmarco-distilbert   mean, no Normalize; WordPiece without segment ids
roberta       all-roberta-large    mean + Normalize; byte-level BPE
camembert     sentence-camembert   mean; unigram (SentencePiece-like)
xlm-roberta   multilingual-e5      mean + Normalize; ``query: ``/``passage: `` prompts, ``default_prompt_name``
mpnet         all-mpnet-base-v2    mean + Normalize; WordPiece with MPNet's special tokens
modernbert    modernbert-embed     mean + Normalize; ``search_query: ``/``search_document: `` prompts
qwen2         gte-Qwen2-instruct   last token + Normalize, padded on the right, EOS appended; an instruction prompt
qwen3         Qwen3-Embedding      last token + Normalize, padded on the left, EOS appended; an instruction prompt
mistral       e5-mistral           last token + Normalize, padded on the right, BOS + EOS (``add_eos_token``)
llama         NV-Embed-like        mean with the prompt left out of the pooling, padded on the left
gemma3        EmbeddingGemma       bidirectional attention, mean + Dense + Dense + Normalize; task prompts
============  ===================  ==================================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HIDDEN = 32
MAX_SEQ_LENGTH = 48  # sentence_bert_config's max_seq_length: long texts are truncated
MAX_POSITIONS = 128
QUERY_INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "


@dataclass
class Family:
    name: str
    build: Callable[[Path, list[str]], Any]  # (folder, corpus) -> (hf model, tokenizer)
    pooling: str
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True
    dense: tuple[int, ...] = ()  # Dense modules' output widths after pooling
    decoder: bool = False


# -- tokenizers -------------------------------------------------------------------------------------------
def _wordpiece(corpus: list[str], specials: list[str], unk: str, lowercase: bool = True):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=800, special_tokens=specials))
    return tok


def _bytelevel(corpus: list[str], specials: list[str], vocab_size: int = 800):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _unigram(corpus: list[str], specials: list[str], unk: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=800, special_tokens=specials, unk_token=unk))
    return tok


def _template(tok, single: str, pair: str, *names: str):
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(n, tok.token_to_id(n)) for n in names])


def _bert_tokenizer(corpus: list[str], cls_name: str = "BertTokenizerFast"):
    import transformers
    from tokenizers import processors

    tok = _wordpiece(corpus, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "[UNK]")
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    return getattr(transformers, cls_name)(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                           cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                           model_max_length=512)


def _roberta_specials(tok, cls_name: str, **extra):
    import transformers
    from tokenizers import processors

    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                      ("<s>", tok.token_to_id("<s>")))
    return getattr(transformers, cls_name)(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                           cls_token="<s>", unk_token="<unk>", pad_token="<pad>",
                                           mask_token="<mask>", model_max_length=512, **extra)


_ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


# -- models -------------------------------------------------------------------------------------------------
def _encoder_config(cls, vocab: int, **extra):
    return cls(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=MAX_POSITIONS, initializer_range=0.2, **extra)


def bert(folder: Path, corpus: list[str]):
    from transformers import BertConfig, BertModel

    tokenizer = _bert_tokenizer(corpus)
    return BertModel(_encoder_config(BertConfig, len(tokenizer)), add_pooling_layer=False), tokenizer


def distilbert(folder: Path, corpus: list[str]):
    from transformers import DistilBertConfig, DistilBertModel

    tokenizer = _bert_tokenizer(corpus, "DistilBertTokenizerFast")
    config = DistilBertConfig(vocab_size=len(tokenizer), dim=HIDDEN, n_layers=2, n_heads=2, hidden_dim=64,
                              max_position_embeddings=MAX_POSITIONS, initializer_range=0.2)
    return DistilBertModel(config), tokenizer


def _roberta_like(corpus: list[str], kind: str, tokenizer_model: str):
    """RoBERTa, CamemBERT or XLM-RoBERTa (``kind``: the transformers class prefix): RoBERTa's special tokens and
    position offset (padding_idx + 1), with a byte-level BPE or unigram vocabulary."""
    import transformers

    if tokenizer_model == "bpe":
        tok = _bytelevel(corpus, _ROBERTA_SPECIALS)
    else:
        tok = _unigram(corpus, _ROBERTA_SPECIALS, "<unk>")
    tokenizer = _roberta_specials(tok, f"{kind}TokenizerFast")
    config = _encoder_config(getattr(transformers, f"{kind}Config"), len(tokenizer), pad_token_id=1,
                             bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    config.max_position_embeddings = MAX_POSITIONS + 2
    return getattr(transformers, f"{kind}Model")(config, add_pooling_layer=False), tokenizer


def roberta(folder: Path, corpus: list[str]):
    return _roberta_like(corpus, "Roberta", "bpe")


def camembert(folder: Path, corpus: list[str]):
    return _roberta_like(corpus, "Camembert", "unigram")


def xlm_roberta(folder: Path, corpus: list[str]):
    return _roberta_like(corpus, "XLMRoberta", "unigram")


def mpnet(folder: Path, corpus: list[str]):
    import transformers
    from tokenizers import processors
    from transformers import MPNetConfig, MPNetModel

    tok = _wordpiece(corpus, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "<unk>")
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                      ("<s>", tok.token_to_id("<s>")))
    tokenizer = transformers.MPNetTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                                                pad_token="<pad>", mask_token="<mask>", model_max_length=512)
    config = _encoder_config(MPNetConfig, len(tokenizer), pad_token_id=1, bos_token_id=0, eos_token_id=2)
    config.max_position_embeddings = MAX_POSITIONS + 2
    return MPNetModel(config, add_pooling_layer=False), tokenizer


def modernbert(folder: Path, corpus: list[str]):
    import transformers
    from transformers import ModernBertConfig, ModernBertModel

    tok = _bytelevel(corpus, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    _template(tok, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B [SEP]", "[CLS]", "[SEP]")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                     cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                                     model_max_length=512)
    tokenizer.model_input_names = ["input_ids", "attention_mask"]
    config = ModernBertConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=3,
                              num_attention_heads=2, intermediate_size=64, max_position_embeddings=MAX_POSITIONS,
                              global_attn_every_n_layers=2, local_attention=16, initializer_range=0.2,
                              pad_token_id=tok.token_to_id("[PAD]"), bos_token_id=tok.token_to_id("[CLS]"),
                              eos_token_id=tok.token_to_id("[SEP]"), cls_token_id=tok.token_to_id("[CLS]"),
                              sep_token_id=tok.token_to_id("[SEP]"))
    return ModernBertModel(config), tokenizer


def _decoder_tokenizer(corpus: list[str], specials: list[str], *, bos: str | None, eos: str, pad: str,
                       padding_side: str, append_eos: bool, cls_name: str = "PreTrainedTokenizerFast", **extra):
    import transformers

    tok = _bytelevel(corpus, specials)
    if append_eos:  # what Qwen3-Embedding's and gte-Qwen2's tokenizer.json do: every text ends in EOS
        head = f"{bos} " if bos else ""
        _template(tok, f"{head}$A {eos}", f"{head}$A {eos} $B {eos}", *([bos] if bos else []), eos)
    elif bos:
        _template(tok, f"{bos} $A", f"{bos} $A $B", bos)
    # padding_side as a constructor argument: set afterwards, transformers 5 does not save it
    tokenizer = getattr(transformers, cls_name)(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                                                unk_token=None, model_max_length=32768, padding_side=padding_side,
                                                **({"bos_token": bos} if bos else {}), **extra)
    tokenizer.model_input_names = ["input_ids", "attention_mask"]
    return tokenizer


def _decoder_config(cls, tokenizer, **extra):
    return cls(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=MAX_POSITIONS,
               initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
               # pad_token_id unset: the embedding's padding row stays random, as trained weights are (zeroed, an
               # EOS that doubles as padding would make every last-token vector of an empty text zero)
               pad_token_id=None, **extra)


def qwen2(folder: Path, corpus: list[str], padding_side: str = "right"):
    from transformers import Qwen2Config, Qwen2Model

    tokenizer = _decoder_tokenizer(corpus, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None,
                                   eos="<|endoftext|>", pad="<|endoftext|>", padding_side=padding_side,
                                   append_eos=True)
    return Qwen2Model(_decoder_config(Qwen2Config, tokenizer)), tokenizer


def qwen3(folder: Path, corpus: list[str], padding_side: str = "left"):
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = _decoder_tokenizer(corpus, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None,
                                   eos="<|endoftext|>", pad="<|endoftext|>", padding_side=padding_side,
                                   append_eos=True)
    return Qwen3Model(_decoder_config(Qwen3Config, tokenizer, head_dim=8)), tokenizer


def mistral(folder: Path, corpus: list[str], padding_side: str = "right"):
    from transformers import MistralConfig, MistralModel

    tokenizer = _decoder_tokenizer(corpus, ["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>", pad="</s>",
                                   padding_side=padding_side, append_eos=True)
    return MistralModel(_decoder_config(MistralConfig, tokenizer, sliding_window=None)), tokenizer


def llama(folder: Path, corpus: list[str], padding_side: str = "left"):
    from transformers import LlamaConfig, LlamaModel

    tokenizer = _decoder_tokenizer(corpus, ["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>", pad="<unk>",
                                   padding_side=padding_side, append_eos=False)
    return LlamaModel(_decoder_config(LlamaConfig, tokenizer)), tokenizer


def gemma3(folder: Path, corpus: list[str], padding_side: str = "right"):
    from transformers import Gemma3TextConfig, Gemma3TextModel

    tokenizer = _decoder_tokenizer(corpus, ["<pad>", "<eos>", "<bos>", "<unk>"], bos="<bos>", eos="<eos>",
                                   pad="<pad>", padding_side=padding_side, append_eos=True)
    config = _decoder_config(Gemma3TextConfig, tokenizer, head_dim=8, sliding_window=16, query_pre_attn_scalar=8,
                             use_bidirectional_attention=True, bos_token_id=tokenizer.bos_token_id)
    return Gemma3TextModel(config), tokenizer


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("bert", bert, "cls", prompts={"query": "Represent this sentence for searching relevant passages: "}),
    Family("distilbert", distilbert, "mean", normalize=False),
    Family("roberta", roberta, "mean"),
    Family("camembert", camembert, "mean", normalize=False),
    Family("xlm-roberta", xlm_roberta, "mean", prompts={"query": "query: ", "passage": "passage: "},
           default_prompt_name="query"),
    Family("mpnet", mpnet, "mean"),
    Family("modernbert", modernbert, "mean",
           prompts={"query": "search_query: ", "document": "search_document: "}),
    Family("qwen2", qwen2, "lasttoken", prompts={"query": QUERY_INSTRUCTION}, decoder=True),
    Family("qwen3", qwen3, "lasttoken", prompts={"query": QUERY_INSTRUCTION, "document": ""}, decoder=True),
    Family("mistral", mistral, "lasttoken", prompts={"web_search_query": QUERY_INSTRUCTION}, decoder=True),
    Family("llama", llama, "mean", prompts={"query": "Instruct: retrieve passages\nQuery: "}, include_prompt=False,
           decoder=True),
    Family("gemma3", gemma3, "mean", prompts={"query": "task: search result | query: ",
                                               "document": "title: none | text: "}, dense=(4 * HIDDEN, HIDDEN),
           decoder=True),
]}


def save(family: Family, path: Path, corpus: list[str], *, seed: int = 0, padding_side: str | None = None) -> Path:
    """``family``'s tiny model saved at ``path`` as sentence-transformers saves it (``path``-hf: the bare model)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    torch.manual_seed(seed)
    kwargs = {"padding_side": padding_side} if padding_side else {}
    model, tokenizer = family.build(path, corpus, **kwargs)
    hf = path.with_name(path.name + "-hf")
    model.eval().save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    modules: list[Any] = [Transformer(str(hf), max_seq_length=MAX_SEQ_LENGTH),
                          Pooling(HIDDEN, family.pooling, include_prompt=family.include_prompt)]
    width = HIDDEN
    for out in family.dense:
        torch.manual_seed(seed + out)
        modules.append(Dense(width, out, bias=False, activation_function=torch.nn.Identity()))
        width = out
    if family.normalize:
        modules.append(Normalize())
    st = SentenceTransformer(modules=modules, device="cpu", prompts=family.prompts or None,
                             default_prompt_name=family.default_prompt_name)
    st.save(str(path))
    return path
