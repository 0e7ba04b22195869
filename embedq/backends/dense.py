"""The dense head (``embed``): Pooling → (Dense | Normalize)* exactly as sentence-transformers defines them.

The folder is read as sentence-transformers 6.x reads it (``modules.json``, ``sentence_bert_config.json``,
``1_Pooling/config.json``, Dense/Normalize folders, ``config_sentence_transformers.json``), so token ids
are identical and vectors match ``SentenceTransformer.encode`` to float rounding. sentence-transformers
itself is not imported. A trailing Normalize module is applied per job in ``finish`` (a job may ask for
``normalize=False`` or fewer ``dimensions``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedq import errors
from embedq.backends.base import Encoded, Head, ModelInfo, Prepared, RuntimeFacts, Tokenized, postprocess
from embedq.backends.encoder import Encoder
from embedq.backends.folder import FEATURES
from embedq.backends.hybrid import is_m3_folder, m3_heads
from embedq.backends.model import ModelBackend, base_info, check_modality, model_task, read_modules
from embedq.backends.modules import (
    POOLING_MODES,
    DenseModule,
    PoolingConfig,
    check_normalize,
    normalize,
    pool,
    read_json,
)
from embedq.backends.multi import TokenEmbeddingsHead
from embedq.backends.tokenizing import Tokenization
from embedq.backends.tokens import (
    TOKENIZER_KINDS,
    prepare_texts,
    prepare_texts_many,
    read_prompts,
    tokenizer_heads,
)
from embedq.backends.windowing import weighted_mean
from embedq.protocol import Fingerprint, encode_result
from embedq.settings import BackendSettings
from embedq.version import __version__

log = logging.getLogger(__name__)


def ends_with_eos(tokenizer: Any) -> bool:
    """Whether the tokenizer ends a text with its EOS token, as last-token models are trained (Qwen3-Embedding,
    gte-Qwen2, e5-mistral with ``add_eos_token``); no EOS token at all counts as yes (nothing to append)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        return True
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[-1] == eos


#: Heads a folder's layout adds beside the dense one: (whether a folder has the layout, the kind its heads serve, the
#: heads: the kind's own first, then the variants it hands items to). BGE-M3 (FlagEmbedding's layout:
#: ``sparse_linear.pt`` and ``colbert_linear.pt`` beside the weights): ``embed_hybrid``.
LAYOUT_HEADS: tuple[tuple[Callable[[Path], bool], str, Callable[[Path, Encoder], Sequence[Head]]], ...] = (
    (is_m3_folder, "embed_hybrid", m3_heads),
)


def layout_heads(folder: Path, encoder: Encoder) -> dict[str, Sequence[Head]]:
    """The heads ``folder``'s layout adds (:data:`LAYOUT_HEADS`), by kind: the kind's own first, then its variants."""
    return {kind: make(folder, encoder) for applies, kind, make in LAYOUT_HEADS if applies(folder)}


class DenseHead(Head):
    name = "dense"
    kinds = ("embed",)
    pools_windows = True

    def __init__(self, tokenization: Tokenization, pooling: PoolingConfig,
                 steps: list[tuple[str, torch.nn.Module | None]], normalizes: bool, dimension: int) -> None:
        self.tokenization = tokenization
        self.pooling = pooling
        self.steps = steps
        self.normalizes = normalizes
        self.dimension = dimension
        self.info: ModelInfo | None = None  # set once the backend's info exists (fingerprints)

    def prepare(self, kind: str, items: list[Any], options: Any) -> Prepared:
        self._check(options)
        return prepare_texts(self.tokenization, self.info, items, options)

    def prepare_many(self, kind: str, jobs: list[tuple[list[Any], Any]]) -> list[Prepared | errors.EmbedqError]:
        """The texts of many jobs tokenized together (:func:`prepare_texts_many`); each job checked on its own."""
        return prepare_texts_many(self.tokenization, self.info, jobs, check=self._check)

    def _check(self, options: Any) -> None:
        assert self.info is not None
        if options.dimensions is not None and options.dimensions > self.dimension:
            raise errors.InvalidDimensions(f"dimensions={options.dimensions} but the model's vectors have "
                                           f"{self.dimension}")

    def pool(self, rows: list[Any], weights: list[int], options: Any) -> np.ndarray:
        """The token-weighted mean of the windows' vectors before the model's trailing Normalize (``finish``
        applies it to the mean, as to any vector), as vLLM pools the chunks of a long input."""
        return weighted_mean(rows, weights, self.dimension)

    def rows(self, output: Any, mask: torch.Tensor, index: Any, batch: Sequence[Encoded]) -> list[np.ndarray]:
        return list(self.vectors(output, mask, index, batch).cpu().numpy().astype(np.float32, copy=False))

    def vectors(self, output: Any, mask: torch.Tensor, index: Any, batch: Sequence[Encoded]) -> torch.Tensor:
        """The batch's vectors (pooled, then the Dense steps; the trailing Normalize is left to finish), in float32
        on the model's device."""
        tokens = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        items = list(batch)
        if index is not None:
            tokens, mask = tokens.index_select(0, index), mask.index_select(0, index)
            items = [batch[i] for i in index.tolist()]
        plens = None
        if not self.pooling.include_prompt:
            plens = torch.tensor([item.prompt_length for item in items], dtype=torch.int64, device=mask.device)
        vectors = pool(self.pooling, tokens, mask, plens)
        for _kind, module in self.steps:
            vectors = module(vectors) if module is not None else normalize(vectors)
        return vectors.float()

    def finish(self, kind: str, rows: list[np.ndarray], prepared: Prepared, options: Any) -> dict[str, Any]:
        assert self.info is not None
        norm = self.normalizes if options.normalize is None else options.normalize
        vectors = postprocess(np.stack(rows), normalize=norm, dimensions=options.dimensions)
        if not np.isfinite(vectors).all():  # never a success
            raise errors.BackendError("a vector is not finite after post-processing")
        info = self.info
        fingerprint = Fingerprint(
            kind="embed", model=info.model_id, weights_sha256=info.weights_sha256, pooling=info.pooling,
            normalize=norm, dimensions=options.dimensions or self.dimension, dtype=info.dtype,
            prompt=prepared.state["prompt"], embedq_version=__version__,
        )
        return encode_result("embed", {"vectors": vectors}, fingerprint, items=len(rows), tokens=prepared.tokens,
                             encoding=options.encoding)


def _dense_modules(folder: Path) -> tuple[Path, dict[str, Any], PoolingConfig | None, list[tuple[str, Path]]]:
    """(transformer folder, its ST config, pooling config or None for the fallback, [(Dense|Normalize, folder)])."""
    modules = read_modules(folder)
    transformer_dir, st_config, task = model_task(folder, modules)
    if task != FEATURES:
        raise errors.UnsupportedModel(f"{folder} is a {task} model, not an embedding model")
    if not modules:
        # sentence-transformers' fallback: Transformer + mean (lasttoken for *ForCausalLM) pooling.
        return folder, st_config, None, []
    kinds = [k for k, _ in modules]
    if len(modules) < 2 or kinds[1] != "Pooling":
        raise errors.UnsupportedModel(f"embedq needs modules Transformer, Pooling, then Dense/Normalize; got {kinds}")
    pooling_config = PoolingConfig.from_dict(read_json(modules[1][1] / "config.json"),
                                             where=f"Pooling config {modules[1][1]}")
    steps = modules[2:]
    for kind, sub in steps:
        if kind not in ("Dense", "Normalize"):
            raise errors.UnsupportedModel(f"a {kind} module after Pooling is not supported")
        if kind == "Normalize":
            check_normalize(sub)
    return transformer_dir, st_config, pooling_config, steps


def folder_pooling(folder: Path, encoder: Encoder, pooling_config: PoolingConfig | None,
                   override: str | None) -> PoolingConfig:
    """The pooling of ``folder``'s vectors: its Pooling module's (none: sentence-transformers' fallback, mean, or the
    last token for a ``*ForCausalLM``), checked against the model's hidden size, or the operator's ``override``."""
    config = encoder.config
    hidden = getattr(config, "hidden_size", None)
    if pooling_config is None:
        if not isinstance(hidden, int):
            raise errors.UnsupportedModel(f"{encoder.folder}: cannot tell the hidden size")
        archs = getattr(config, "architectures", None) or []
        causal = bool(archs) and archs[0].endswith("ForCausalLM") and getattr(config, "is_causal", True)
        pooling_config = PoolingConfig(hidden, ("lasttoken",) if causal else ("mean",))
    elif isinstance(hidden, int) and hidden != pooling_config.embedding_dimension:
        raise errors.UnsupportedModel(
            f"Pooling embedding_dimension {pooling_config.embedding_dimension} != model hidden size {hidden}")
    if override is not None and pooling_config.modes != (override,):
        # An operator's override (EMBEDQ_POOLING, TEI's --pooling): another vector space than the folder's.
        # Allowed, as TEI allows it, but said, and the fingerprint's pooling names it.
        log.warning("pooling=%s overrides %s's own %s pooling: its vectors are not the model's own space",
                    override, folder, pooling_config.name)
        pooling_config = PoolingConfig(pooling_config.embedding_dimension, (override,), pooling_config.include_prompt)
    if pooling_config.modes[-1] == "lasttoken" and not ends_with_eos(encoder.tokenizer):
        log.warning("%s pools the last token but its tokenizer does not end a text with the EOS token; if the "
                    "model was trained with EOS appended, its vectors differ from the model card's", folder)
    return pooling_config


def dense_steps(steps: list[tuple[str, Path]], dimension: int,
                encoder: Encoder) -> tuple[list[tuple[str, torch.nn.Module | None]], bool, int]:
    """The steps after pooling, loaded (a Dense module, or None for a Normalize), a trailing Normalize left out (each
    job's ``finish`` applies it, or not): (steps, whether the folder normalizes, the vectors' dimension)."""
    normalizes = bool(steps) and steps[-1][0] == "Normalize"
    if normalizes:
        steps = steps[:-1]
    modules: list[tuple[str, torch.nn.Module | None]] = []
    for kind, step_dir in steps:
        if kind == "Dense":
            dense = DenseModule(step_dir)
            if dense.in_features != dimension:
                raise errors.UnsupportedModel(
                    f"Dense module {step_dir}: in_features {dense.in_features} != input dimension {dimension}")
            dimension = dense.out_features
            modules.append((kind, dense.to(device=encoder.device, dtype=encoder.dtype).eval()))
        else:
            modules.append((kind, None))
    return modules, normalizes, dimension


class DenseBackend(ModelBackend):
    """An embedding model: the encoder with the dense head (``embed``), the per-token head (``embed_all``), the heads
    its folder's layout adds (:data:`LAYOUT_HEADS`) and the tokenizer's heads."""

    def __init__(self, path: str | Path, settings: BackendSettings | None = None, *, model_id: str | None = None,
                 on_runtime_chosen: Callable[[RuntimeFacts], None] | None = None) -> None:
        settings = settings or BackendSettings()
        if settings.pooling is not None and settings.pooling not in POOLING_MODES:
            raise errors.InvalidOption(f"pooling must be one of {POOLING_MODES}, not {settings.pooling!r}")
        folder = Path(path).resolve()
        transformer_dir, st_config, pooling_config, steps = _dense_modules(folder)
        check_modality(st_config, "last_hidden_state")
        if st_config.get("module_output_name", "token_embeddings") != "token_embeddings":
            raise errors.UnsupportedModel(
                f"Transformer module_output_name={st_config['module_output_name']!r} is not supported")
        encoder = Encoder(transformer_dir, st_config, settings, task=FEATURES,
                          allow_chat_template=(folder / "modules.json").is_file(), on_runtime_chosen=on_runtime_chosen)
        pooling_config = folder_pooling(folder, encoder, pooling_config, settings.pooling)
        modules, normalizes, dimension = dense_steps(steps, pooling_config.output_dimension, encoder)
        head = DenseHead(encoder.tokenization, pooling_config, modules, normalizes, dimension)
        per_token = TokenEmbeddingsHead(encoder.tokenization, pooling_config.embedding_dimension)
        more = layout_heads(folder, encoder)
        prompts, default_prompt_name = read_prompts(folder)
        info = base_info(folder, encoder, model_id=model_id if model_id is not None else str(path),
                         dimension=dimension, pooling=pooling_config.name, normalizes=normalizes, prompts=prompts,
                         default_prompt_name=default_prompt_name, kinds=("embed", "embed_all", *more, *TOKENIZER_KINDS))
        variants = [each for heads in more.values() for each in heads]
        for each in [head, per_token, *variants]:
            each.info = info
        heads: dict[str, Head] = {"embed": head, "embed_all": per_token, **{k: v[0] for k, v in more.items()},
                                  **tokenizer_heads(encoder.tokenization, info)}
        super().__init__(encoder, heads, info, more_heads=variants)

    # -- direct use (tests, benchmarks): the same code paths the worker takes --------------------------
    def tokenize(self, texts: Sequence[str], *, prompt: str | None = None, truncate: bool = True,
                 truncation_side: str = "right") -> Tokenized:
        """Tokenize texts exactly as sentence-transformers would (prompt prepended)."""
        encoded, plen = self.encoder.tokenization.encode_texts(texts, prompt=prompt, truncate=truncate,
                                                               truncation_side=truncation_side)
        return Tokenized(ids=[e.ids for e in encoded], prompt_length=plen)

    def embed(self, batch: Sequence[Sequence[int]], prompt_lengths: Sequence[int] | None = None) -> np.ndarray:
        """One micro-batch of token ids → ``(len(batch), info.dimension)`` float32, without the trailing
        Normalize module (``postprocess`` applies it per job)."""
        if not batch:
            return np.zeros((0, self.info.dimension), dtype=np.float32)
        if prompt_lengths is not None and len(prompt_lengths) != len(batch):
            raise errors.BackendError(f"{len(prompt_lengths)} prompt lengths for a batch of {len(batch)}")
        plens = prompt_lengths or [0] * len(batch)
        return np.stack(self.forward([Encoded(list(ids), None, p, "dense") for ids, p in zip(batch, plens)]))
