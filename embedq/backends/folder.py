"""What a model folder holds, read without loading it: the task its transformer runs, the digest of the files
that define its embedding space, its sentence-transformers config, and whether it ships code of its own."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from embedq import errors
from embedq.backends.modules import read_json

# Files that define the embedding space (weights, configs, tokenizer vocabularies).
# ``.py``: a model that ships its own code (``auto_map``, loaded only with EMBEDQ_TRUST_REMOTE_CODE) is that code too.
_HASHED_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".txt", ".model", ".py")
_CHUNK = 1 << 20
SENTENCE_BERT_CONFIGS = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
_TRUST_KEYS = ("trust_remote_code",)

#: What the encoder runs: the bare transformer (hidden states), a sequence classifier (logits per text) or a
#: masked-language-model head (logits per token over the vocabulary: SPLADE).
FEATURES = "feature-extraction"
CLASSIFY = "sequence-classification"
FILL_MASK = "fill-mask"
#: The model output each task's heads read.
TASK_OUTPUTS = {FEATURES: "last_hidden_state", CLASSIFY: "logits", FILL_MASK: "logits"}


def weights_sha256(folder: Path) -> str:
    """sha256 over (relative path, bytes) of every weight/config/vocabulary file, in sorted order."""
    digest = hashlib.sha256()
    files = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix in _HASHED_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    for rel in files:
        digest.update(rel.encode("utf8") + b"\0")
        with open(folder / rel, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def clean_kwargs(kwargs: Any) -> dict[str, Any]:
    if not isinstance(kwargs, dict):
        return {}
    return {k: v for k, v in kwargs.items() if k not in _TRUST_KEYS}


def remote_code(folder: Path) -> list[str]:
    """The ``auto_map`` references of the folder's ``config.json`` and ``tokenizer_config.json``: the model's own
    code, which transformers runs only with ``trust_remote_code`` (``["modeling_x.XModel", ...]``)."""
    refs: list[str] = []
    for name in ("config.json", "tokenizer_config.json"):
        auto_map = read_json(folder / name).get("auto_map")
        if isinstance(auto_map, dict):
            for value in auto_map.values():
                refs += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, str)]
    return sorted(set(refs))


def check_remote_code(folder: Path, trust: bool) -> bool:
    """Whether transformers must be told ``trust_remote_code=True`` for ``folder``; refuses what must not load.

    A folder with ``auto_map`` (Jina, Nomic, GTE-new) is refused unless the operator opted in: without the
    model's code, transformers either fails or, worse, loads the stock class of a ``model_type`` it knows (a
    Jina BERT read as a plain BERT) and serves another vector space without a word. With the opt-in, only code
    inside the folder may run: a reference to another repository (``org/repo--module.Class``) would be
    downloaded and is refused."""
    refs = remote_code(folder)
    if not refs:
        return False
    if not trust:
        raise errors.UnsupportedModel(
            f"{folder} ships its own model code (auto_map: {', '.join(refs)}): without it transformers would fail "
            "or load a stock architecture that computes other vectors. Read the code, then set "
            "EMBEDQ_TRUST_REMOTE_CODE=true to run it (only code inside the model folder is ever run)")
    for ref in refs:
        module = ref.rsplit(".", 1)[0]
        if "--" in ref or not (folder / (module.replace(".", "/") + ".py")).is_file():
            raise errors.UnsupportedModel(
                f"{folder}: auto_map names {ref!r}, code that is not inside the model folder (embedq never downloads "
                "code or weights); copy the module into the folder and point auto_map at it")
    return True


def sentence_bert_config(folder: Path) -> dict[str, Any]:
    for name in SENTENCE_BERT_CONFIGS:
        config = read_json(folder / name)
        if config:
            return config
    return {}
