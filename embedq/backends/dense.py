"""The dense backend: a sentence-transformers folder run with transformers + torch only.

The folder is read exactly as sentence-transformers 6.x reads it (``modules.json``,
``sentence_bert_config.json``, ``1_Pooling/config.json``, Dense/Normalize folders,
``config_sentence_transformers.json``), so token ids are identical and vectors match
``SentenceTransformer.encode`` to float rounding. sentence-transformers itself is not imported.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedq import errors
from embedq.backends.base import Backend, ModelInfo, Tokenized
from embedq.backends.kernels import LinearKernel, pack_linears
from embedq.backends.modules import (
    DenseModule,
    PoolingConfig,
    check_normalize,
    module_kind,
    normalize,
    pool,
    read_json,
)

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# Files that define the embedding space (weights, configs, tokenizer vocabularies).
_HASHED_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".txt", ".model")
_CHUNK = 1 << 20
_SENTENCE_BERT_CONFIGS = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
_TRUST_KEYS = ("trust_remote_code",)


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


def _clean_kwargs(kwargs: Any) -> dict[str, Any]:
    if not isinstance(kwargs, dict):
        return {}
    return {k: v for k, v in kwargs.items() if k not in _TRUST_KEYS}


def _sentence_bert_config(folder: Path) -> dict[str, Any]:
    for name in _SENTENCE_BERT_CONFIGS:
        config = read_json(folder / name)
        if config:
            return config
    return {}


def attention_kernels(device: torch.device) -> Any:
    """The attention kernels a forward pass may use: on CUDA, every kernel but cuDNN's fused attention.

    PyTorch picks cuDNN attention for fp16/bf16 on Hopper GPUs, and cuDNN builds a graph for each new input
    shape: measured on an H100 (torch 2.11), 45-130 ms the first time a shape is seen against 3 ms after,
    and a coalescing worker meets a new (batch, width) shape in almost every micro-batch. Flash and
    memory-efficient attention need no per-shape step (4.5 ms for a new shape). Returns a context factory;
    a no-op on CPU and on PyTorch without ``torch.nn.attention``.
    """
    if device.type != "cuda":
        return contextlib.nullcontext
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # PyTorch < 2.3
        return contextlib.nullcontext
    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return lambda: sdpa_kernel(kernels)


class DenseBackend(Backend):
    """Transformer → Pooling → (Dense | Normalize)* on padded micro-batches."""

    is_padded = True

    def __init__(
        self,
        path: str | Path,
        *,
        model_id: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        torch_threads: int | None = None,
        linear_kernel: LinearKernel = "auto",
    ) -> None:
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        folder = Path(path).resolve()
        if dtype not in DTYPES:
            raise errors.InvalidOption(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
        try:
            torch_device = torch.device(device)
        except RuntimeError as exc:
            raise errors.InvalidOption(f"invalid device {device!r}: {exc}") from exc
        if torch_device.type not in ("cpu", "cuda"):
            raise errors.InvalidOption(f"device must be 'cpu' or 'cuda[:N]', not {device!r}")
        if torch_threads is not None:
            torch.set_num_threads(int(torch_threads))
        self._device = torch_device
        self._dtype = DTYPES[dtype]
        self._attention = attention_kernels(torch_device)

        # -- the module list ----------------------------------------------------------------------------
        transformer_dir, pooling_config, steps = self._read_modules(folder)
        st_config = _sentence_bert_config(transformer_dir) if (folder / "modules.json").is_file() else {}

        task = st_config.get("transformer_task", "feature-extraction")
        if task != "feature-extraction":
            raise errors.UnsupportedModel(f"Transformer transformer_task={task!r} is not supported")
        modality = st_config.get("modality_config")
        if modality is not None:
            text = modality.get("text") if isinstance(modality, dict) else None
            if (
                not isinstance(text, dict)
                or text.get("method") != "forward"
                or text.get("method_output_name") not in ("last_hidden_state", ["last_hidden_state"])
            ):
                raise errors.UnsupportedModel(f"Transformer modality_config {modality!r} is not supported")
            if "message" in modality:
                raise errors.UnsupportedModel(
                    "Transformer modality_config has a 'message' (chat template) modality, which embedq "
                    "does not implement"
                )
        if st_config.get("module_output_name", "token_embeddings") != "token_embeddings":
            raise errors.UnsupportedModel(
                f"Transformer module_output_name={st_config['module_output_name']!r} is not supported"
            )

        # -- tokenizer (as ST: max_seq_length → model_max_length; else capped at max positions) --------
        config_kwargs = _clean_kwargs(st_config.get("config_kwargs", st_config.get("config_args")))
        model_kwargs = _clean_kwargs(st_config.get("model_kwargs", st_config.get("model_args")))
        tok_kwargs = _clean_kwargs(st_config.get("processor_kwargs", st_config.get("tokenizer_args")))
        max_seq_length = st_config.get("max_seq_length")
        if max_seq_length is not None and "model_max_length" not in tok_kwargs:
            tok_kwargs["model_max_length"] = int(max_seq_length)
        try:
            config = AutoConfig.from_pretrained(str(transformer_dir), **config_kwargs)
            tokenizer = AutoTokenizer.from_pretrained(str(transformer_dir), **tok_kwargs)
        except (OSError, ValueError, KeyError) as exc:
            raise errors.UnsupportedModel(f"cannot load the transformer in {transformer_dir}: {exc}") from exc
        if not getattr(tokenizer, "is_fast", False):
            raise errors.UnsupportedModel(f"{transformer_dir}: embedq needs a fast tokenizer")
        if getattr(config, "is_encoder_decoder", False):
            raise errors.UnsupportedModel(f"{transformer_dir}: encoder-decoder models are not supported")
        if "model_max_length" not in tok_kwargs:
            max_pos = getattr(config, "max_position_embeddings", None)
            if isinstance(max_pos, int) and max_pos != -1:
                tokenizer.model_max_length = min(tokenizer.model_max_length, max_pos)
        if not (folder / "modules.json").is_file() and getattr(tokenizer, "chat_template", None):
            raise errors.UnsupportedModel(
                f"{folder} has no modules.json and its tokenizer has a chat template: sentence-transformers "
                "would render texts as chat messages, which embedq does not implement"
            )
        if st_config.get("do_lower_case", False):
            from tokenizers.normalizers import Lowercase
            from tokenizers.normalizers import Sequence as NormalizerSequence

            normalizer = tokenizer.backend_tokenizer.normalizer
            has_lower = isinstance(normalizer, Lowercase) or (
                isinstance(normalizer, NormalizerSequence) and any(isinstance(n, Lowercase) for n in normalizer)
            )
            if not has_lower:
                parts: list[Any] = [Lowercase()]
                if isinstance(normalizer, NormalizerSequence):
                    parts += list(normalizer)
                elif normalizer is not None:
                    parts.append(normalizer)
                tokenizer.backend_tokenizer.normalizer = NormalizerSequence(parts)
        self.max_seq_length = int(tokenizer.model_max_length)
        self._tokenizer = tokenizer
        self._tokenizer_left = copy.deepcopy(tokenizer)
        self._tokenizer_left.truncation_side = "left"
        self._tokenizer_lock = threading.Lock()
        self._prompt_lengths: dict[str, int] = {}
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self._pad_id = int(pad_id)
        self._left_padding = tokenizer.padding_side == "left"

        # -- model -----------------------------------------------------------------------------------
        for key in ("dtype", "torch_dtype", "device_map"):
            model_kwargs.pop(key, None)
        if hasattr(config, "use_cache"):
            config.use_cache = False
        try:
            model = AutoModel.from_pretrained(str(transformer_dir), config=config, dtype=self._dtype, **model_kwargs)
        except (OSError, ValueError, KeyError) as exc:
            raise errors.UnsupportedModel(f"cannot load the transformer in {transformer_dir}: {exc}") from exc
        self.model = model.to(self._device).eval()
        # On CPU, oneDNN with prepacked weights runs the Linear layers ~2x faster than MKL (kernels.py).
        kernel = pack_linears(self.model, linear_kernel)
        params = inspect.signature(self.model.forward).parameters
        self._token_type_ids = "token_type_ids" in params and "token_type_ids" in tokenizer.model_input_names
        self._position_ids = "position_ids" in params
        hidden = getattr(config, "hidden_size", None)
        if pooling_config is None:
            if not isinstance(hidden, int):
                raise errors.UnsupportedModel(f"{transformer_dir}: cannot tell the hidden size")
            archs = getattr(config, "architectures", None) or []
            causal = bool(archs) and archs[0].endswith("ForCausalLM") and getattr(config, "is_causal", True)
            pooling_config = PoolingConfig(hidden, ("lasttoken",) if causal else ("mean",))
        elif isinstance(hidden, int) and hidden != pooling_config.embedding_dimension:
            raise errors.UnsupportedModel(
                f"Pooling embedding_dimension {pooling_config.embedding_dimension} != model hidden size {hidden}"
            )
        self.pooling_config = pooling_config

        # -- the steps after pooling; a trailing Normalize is left to postprocess ----------------------
        normalizes = bool(steps) and steps[-1][0] == "Normalize"
        if normalizes:
            steps = steps[:-1]
        self._steps: list[tuple[str, torch.nn.Module | None]] = []
        dimension = pooling_config.output_dimension
        for kind, step_dir in steps:
            if kind == "Dense":
                dense = DenseModule(step_dir)
                if dense.in_features != dimension:
                    raise errors.UnsupportedModel(
                        f"Dense module {step_dir}: in_features {dense.in_features} != input dimension {dimension}"
                    )
                dimension = dense.out_features
                self._steps.append((kind, dense.to(device=self._device, dtype=self._dtype).eval()))
            else:
                self._steps.append((kind, None))

        prompts_config = read_json(folder / "config_sentence_transformers.json")
        prompts = prompts_config.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
        ):
            raise errors.UnsupportedModel(f"invalid prompts in config_sentence_transformers.json: {prompts!r}")
        default_prompt_name = prompts_config.get("default_prompt_name")
        if default_prompt_name is not None and default_prompt_name not in prompts:
            raise errors.UnsupportedModel(f"default_prompt_name {default_prompt_name!r} is not among the prompts")

        self.info = ModelInfo(
            model_id=model_id if model_id is not None else str(path),
            path=str(folder),
            dimension=dimension,
            max_seq_length=self.max_seq_length,
            pooling=pooling_config.name,
            normalizes=normalizes,
            weights_sha256=weights_sha256(folder),
            dtype=dtype,
            device=str(self._device),
            prompts=dict(prompts),
            default_prompt_name=default_prompt_name,
            linear_kernel=kernel,
        )

    # -- loading ------------------------------------------------------------------------------------------
    @staticmethod
    def _read_modules(folder: Path) -> tuple[Path, PoolingConfig | None, list[tuple[str, Path]]]:
        """(transformer folder, pooling config or None for the fallback, [(Dense|Normalize, folder)])."""
        if not folder.is_dir():
            raise errors.UnknownModel(f"model folder {folder} does not exist")
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            # sentence-transformers' fallback: Transformer + mean (lasttoken for *ForCausalLM) pooling.
            return folder, None, []
        import json

        try:
            modules = json.loads(modules_file.read_text(encoding="utf8"))
        except (OSError, ValueError) as exc:
            raise errors.UnsupportedModel(f"cannot read {modules_file}: {exc}") from exc
        if not isinstance(modules, list) or not modules:
            raise errors.UnsupportedModel(f"{modules_file} is not a non-empty list")
        modules = sorted(modules, key=lambda m: m.get("idx", 0)) if all("idx" in m for m in modules) else modules
        kinds: list[tuple[str, Path]] = []
        for entry in modules:
            kind = module_kind(entry.get("type"))
            rel = entry.get("path", "") or ""
            sub = (folder / rel).resolve()
            if sub != folder and folder not in sub.parents:
                raise errors.UnsupportedModel(f"module path {rel!r} leaves the model folder")
            kinds.append((kind, sub))
        if len(kinds) < 2 or kinds[0][0] != "Transformer" or kinds[1][0] != "Pooling":
            raise errors.UnsupportedModel(
                f"embedq needs modules Transformer, Pooling, then Dense/Normalize; got {[k for k, _ in kinds]}"
            )
        pooling_config = PoolingConfig.from_dict(
            read_json(kinds[1][1] / "config.json"), where=f"Pooling config {kinds[1][1]}"
        )
        steps = kinds[2:]
        for kind, sub in steps:
            if kind not in ("Dense", "Normalize"):
                raise errors.UnsupportedModel(f"a {kind} module after Pooling is not supported")
            if kind == "Normalize":
                check_normalize(sub)
        return kinds[0][1], pooling_config, steps

    # -- tokenization -------------------------------------------------------------------------------------
    def _encode(self, tokenizer: Any, texts: list[str], truncate: bool) -> list[list[int]]:
        kwargs: dict[str, Any] = {
            "padding": False,
            "return_attention_mask": False,
            "return_token_type_ids": False,
        }
        if truncate:
            kwargs.update(truncation=True, max_length=self.max_seq_length)
        else:
            kwargs.update(truncation=False)
        return [list(row) for row in tokenizer(texts, **kwargs)["input_ids"]]

    def _prompt_length(self, prompt: str) -> int:
        """ST's ``_get_prompt_length``: tokens of the prompt alone, less a trailing special token."""
        cached = self._prompt_lengths.get(prompt)
        if cached is not None:
            return cached
        ids = self._encode(self._tokenizer, [prompt], truncate=True)[0]
        length = len(ids)
        if ids and ids[-1] in self._tokenizer.all_special_ids:
            length -= 1
        self._prompt_lengths[prompt] = length
        return length

    def tokenize(
        self,
        texts: Sequence[str],
        *,
        prompt: str | None = None,
        truncate: bool = True,
        truncation_side: str = "right",
    ) -> Tokenized:
        if truncation_side not in ("right", "left"):
            raise errors.InvalidOption(f"truncation_side must be 'right' or 'left', not {truncation_side!r}")
        full = [prompt + text for text in texts] if prompt else list(texts)
        limit = self.max_seq_length
        with self._tokenizer_lock:
            prompt_length = self._prompt_length(prompt) if prompt else 0
            if not truncate:
                ids = self._encode(self._tokenizer, full, truncate=False)
                for index, row in enumerate(ids):
                    if len(row) > limit:
                        raise errors.TooLong(
                            f"text {index} has {len(row)} tokens, over the model's max_seq_length of {limit}"
                        )
            elif truncation_side == "right":
                ids = self._encode(self._tokenizer, full, truncate=True)
            elif not prompt:
                ids = self._encode(self._tokenizer_left, full, truncate=True)
            else:
                # Keep the prompt (and leading special tokens) and the end of the text.
                ids = self._encode(self._tokenizer, full, truncate=False)
                keep_head = min(prompt_length, limit)
                ids = [
                    row if len(row) <= limit else row[:keep_head] + row[len(row) - (limit - keep_head) :] for row in ids
                ]
        return Tokenized(ids=ids, prompt_length=prompt_length)

    # -- inference ------------------------------------------------------------------------------------------
    def embed(self, batch: Sequence[Sequence[int]], prompt_lengths: Sequence[int] | None = None) -> np.ndarray:
        n = len(batch)
        if n == 0:
            return np.zeros((0, self.info.dimension), dtype=np.float32)
        if prompt_lengths is not None and len(prompt_lengths) != n:
            raise errors.BackendError(f"{len(prompt_lengths)} prompt lengths for a batch of {n}")
        lengths = [len(row) for row in batch]
        width = max(max(lengths), 1)
        ids = np.full((n, width), self._pad_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        for i, row in enumerate(batch):
            length = lengths[i]
            if not length:
                continue
            if self._left_padding:
                ids[i, width - length :] = row
                mask[i, width - length :] = 1
            else:
                ids[i, :length] = row
                mask[i, :length] = 1
        try:
            with torch.inference_mode(), self._attention():
                input_ids = torch.from_numpy(ids).to(self._device)
                attention_mask = torch.from_numpy(mask).to(self._device)
                inputs: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask}
                if self._token_type_ids:
                    inputs["token_type_ids"] = torch.zeros_like(input_ids)
                if self._left_padding and self._position_ids and min(lengths) < width:
                    # Positions as the unpadded text would have them (left padding only).
                    inputs["position_ids"] = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
                output = self.model(**inputs, return_dict=True)
                token_embeddings = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
                plens = None
                if prompt_lengths is not None and not self.pooling_config.include_prompt:
                    plens = torch.tensor(list(prompt_lengths), dtype=torch.int64, device=self._device)
                vectors = pool(self.pooling_config, token_embeddings, attention_mask, plens)
                for _kind, module in self._steps:
                    vectors = module(vectors) if module is not None else normalize(vectors)
                return vectors.float().cpu().numpy().astype(np.float32, copy=False)
        except errors.EmbedqError:
            raise
        except (RuntimeError, ValueError) as exc:
            raise errors.BackendError(f"embedding failed: {exc}") from exc

    def health(self) -> dict[str, Any]:
        return {**super().health(), "max_seq_length": self.max_seq_length, "pooling": self.info.pooling}
