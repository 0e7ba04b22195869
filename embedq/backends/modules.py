"""Pooling, Dense and Normalize as sentence-transformers defines them, without sentence-transformers.

The math mirrors ``sentence_transformers`` 6.x (``Pooling._forward_padded``, ``Dense.forward``,
``Normalize.forward``) so vectors match ``SentenceTransformer.encode`` to float rounding. One
generalisation: the prompt length may differ per row (``prompt_lengths``), where sentence-transformers
takes one prompt per batch.
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from embedq import errors

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")

# Ordered like sentence-transformers' concatenation order for the legacy boolean keys.
_LEGACY_POOLING_KEYS: dict[str, str] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise errors.UnsupportedModel(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise errors.UnsupportedModel(f"{path} is not a JSON object")
    return data


# -- Pooling -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolingConfig:
    embedding_dimension: int
    modes: tuple[str, ...]
    include_prompt: bool = True

    @property
    def output_dimension(self) -> int:
        return self.embedding_dimension * len(self.modes)

    @property
    def name(self) -> str:
        return "+".join(self.modes)

    @classmethod
    def from_dict(cls, config: dict[str, Any], *, where: str = "Pooling config") -> PoolingConfig:
        """Both the legacy ``pooling_mode_*`` booleans and the newer ``pooling_mode`` key."""
        config = dict(config)
        dim = config.get("embedding_dimension", config.get("word_embedding_dimension"))
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
            raise errors.UnsupportedModel(f"{where}: missing or invalid embedding_dimension ({dim!r})")
        mode: Any = config.get("pooling_mode")
        if mode is None:
            active = tuple(m for key, m in _LEGACY_POOLING_KEYS.items() if config.get(key, False))
            modes = active or ("mean",)
        elif isinstance(mode, str):
            modes = (mode,)
        elif isinstance(mode, (list, tuple)) and mode and all(isinstance(m, str) for m in mode):
            modes = tuple(mode)
        else:
            raise errors.UnsupportedModel(f"{where}: invalid pooling_mode {mode!r}")
        for m in modes:
            if m not in POOLING_MODES:
                raise errors.UnsupportedModel(f"{where}: unsupported pooling mode {m!r} (known: {POOLING_MODES})")
        return cls(dim, modes, bool(config.get("include_prompt", True)))


def _exclude_prompt(attention_mask: Tensor, prompt_lengths: Tensor) -> Tensor:
    """Zero the (padding and) prompt positions of each row; like ST's ``_exclude_prompt_from_mask``.

    ST zeroes ``positions < pad_length + prompt_length`` (``pad_length`` is 0 for right padding); the
    same here, with one prompt length per row.
    """
    pad_lengths = attention_mask.to(torch.int32).argmax(dim=1)
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device).unsqueeze(0)
    cut = (pad_lengths + prompt_lengths.to(pad_lengths.dtype)).unsqueeze(1)
    return attention_mask.masked_fill(positions < cut, 0)


def pool(
    config: PoolingConfig,
    token_embeddings: Tensor,
    attention_mask: Tensor,
    prompt_lengths: Tensor | None = None,
) -> Tensor:
    """``Pooling._forward_padded`` of sentence-transformers 6.x, with a per-row prompt length."""
    original_mask = attention_mask
    if not config.include_prompt and prompt_lengths is not None and bool((prompt_lengths > 0).any()):
        attention_mask = _exclude_prompt(attention_mask, prompt_lengths)

    floating = token_embeddings.dtype
    accumulation_dtype = torch.float32 if floating in (torch.float16, torch.bfloat16) else floating
    outputs: list[Tensor] = []
    mean_sum: Tensor | None = None
    mean_mask: Tensor | None = None

    for mode in config.modes:
        if mode == "cls":
            hidden = token_embeddings.shape[-1]
            first = attention_mask.to(torch.int).argmax(dim=1)
            index = first.unsqueeze(-1).unsqueeze(1).expand(-1, 1, hidden)
            outputs.append(torch.gather(token_embeddings, 1, index).squeeze(1))
        elif mode == "max":
            mask = attention_mask.unsqueeze(-1).expand_as(token_embeddings).to(floating)
            outputs.append(token_embeddings.masked_fill(mask == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            if mean_sum is None or mean_mask is None:
                mask = attention_mask.unsqueeze(-1).to(floating)
                mean_sum = (token_embeddings * mask).sum(dim=1, dtype=accumulation_dtype)
                mean_mask = torch.clamp(mask.sum(dim=1, dtype=accumulation_dtype), min=1e-9)
            denominator = mean_mask if mode == "mean" else torch.sqrt(mean_mask)
            outputs.append((mean_sum / denominator).to(floating))
        elif mode == "weightedmean":
            mask = attention_mask.unsqueeze(-1).to(accumulation_dtype)
            weights = torch.arange(
                1, token_embeddings.shape[1] + 1, device=token_embeddings.device, dtype=accumulation_dtype
            ).view(1, -1, 1)
            if original_mask.numel():
                pad_lengths = original_mask.to(torch.int32).argmax(dim=1)
                weights = weights - pad_lengths.view(-1, 1, 1)
            weighted_mask = mask * weights
            sum_embeddings = (token_embeddings * weighted_mask).sum(dim=1)
            sum_mask = weighted_mask.sum(dim=1)
            outputs.append((sum_embeddings / torch.clamp(sum_mask, min=1e-9)).to(floating))
        elif mode == "lasttoken":
            _, seq_len, hidden = token_embeddings.shape
            values, indices = attention_mask.flip(1).max(1)
            indices = torch.where(values == 0, seq_len - 1, indices)
            index = (seq_len - indices - 1).unsqueeze(-1).unsqueeze(1).expand(-1, 1, hidden)
            mask = attention_mask.unsqueeze(-1).expand_as(token_embeddings).to(floating)
            outputs.append(torch.gather(token_embeddings * mask, 1, index).squeeze(dim=1))
        else:  # pragma: no cover - validated in PoolingConfig
            raise errors.UnsupportedModel(f"unsupported pooling mode {mode!r}")
    return torch.cat(outputs, dim=-1)


# -- Dense ---------------------------------------------------------------------------------------------
def activation(name: str | None, where: str) -> nn.Module:
    if name is None:
        return nn.Identity()
    if not isinstance(name, str) or not name.startswith("torch."):
        raise errors.UnsupportedModel(f"{where}: activation_function {name!r} is not a torch.nn class")
    module_name, _, class_name = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise errors.UnsupportedModel(f"{where}: cannot import activation_function {name!r}") from exc
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
        raise errors.UnsupportedModel(f"{where}: activation_function {name!r} is not a torch.nn.Module class")
    try:
        return cls()
    except TypeError as exc:
        raise errors.UnsupportedModel(f"{where}: activation_function {name!r} needs arguments") from exc


def _load_state_dict(folder: Path) -> dict[str, Tensor]:
    safetensors_file = folder / "model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file), device="cpu")
    bin_file = folder / "pytorch_model.bin"
    if bin_file.is_file():
        return torch.load(str(bin_file), map_location="cpu", weights_only=True)
    raise errors.UnsupportedModel(f"{folder}: no model.safetensors or pytorch_model.bin for the Dense module")


class DenseModule(nn.Module):
    """``sentence_transformers`` Dense: ``activation(linear(x))`` (+ residual)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        where = f"Dense module {folder}"
        config = read_json(folder / "config.json")
        try:
            self.in_features = int(config["in_features"])
            self.out_features = int(config["out_features"])
        except (KeyError, TypeError, ValueError) as exc:
            raise errors.UnsupportedModel(f"{where}: config.json needs in_features and out_features") from exc
        for key in ("module_input_name", "module_output_name"):
            if config.get(key) not in (None, "sentence_embedding"):
                raise errors.UnsupportedModel(f"{where}: {key}={config[key]!r} is not supported")
        bias = bool(config.get("bias", True))
        self.use_residual = bool(config.get("use_residual", False))
        # ST's default activation (key absent) is Tanh.
        self.activation = activation(config.get("activation_function", "torch.nn.modules.activation.Tanh"), where)
        self.linear = nn.Linear(self.in_features, self.out_features, bias=bias)
        if self.use_residual and self.in_features != self.out_features:
            self.residual = nn.Linear(self.in_features, self.out_features, bias=False)
        state = _load_state_dict(folder)
        try:
            self.load_state_dict(
                {k: v for k, v in state.items() if k.split(".")[0] in ("linear", "residual")}, strict=True
            )
        except RuntimeError as exc:
            raise errors.UnsupportedModel(f"{where}: weights do not match config: {exc}") from exc

    def forward(self, x: Tensor) -> Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.in_features == self.out_features else self.residual(x))
        return out


def check_normalize(folder: Path) -> None:
    config = read_json(folder / "config.json")
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in (None, "sentence_embedding"):
            raise errors.UnsupportedModel(f"Normalize module {folder}: {key}={config[key]!r} is not supported")


def normalize(x: Tensor) -> Tensor:
    return torch.nn.functional.normalize(x, p=2, dim=-1)


# -- modules.json ----------------------------------------------------------------------------------------
KNOWN_MODULES = ("Transformer", "MLMTransformer", "Pooling", "SpladePooling", "Dense", "Normalize")


def module_kind(type_name: str) -> str:
    """``Transformer`` | ``Pooling`` | ``Dense`` | ``Normalize`` | ``SpladePooling`` for any sentence-transformers
    spelling (``sentence_transformers.models.Pooling``, ``...sentence_transformer.modules.pooling.Pooling``, ...).
    The older ``MLMTransformer`` (a SparseEncoder's first module) keeps its name: a Transformer whose task
    defaults to ``fill-mask`` (``model.model_task``)."""
    if isinstance(type_name, str) and type_name.startswith("sentence_transformers."):
        kind = type_name.rsplit(".", 1)[-1]
        if kind in KNOWN_MODULES:
            return kind
    raise errors.UnsupportedModel(
        f"module type {type_name!r} is not supported by embedq (supported: sentence-transformers "
        f"{', '.join(KNOWN_MODULES)})"
    )
