"""Loading a transformer folder as sentence-transformers 6.x loads it, one step a function: where it runs
(:func:`placement`), its config and fast tokenizer (:func:`load_tokenizer`: ``max_seq_length`` → ``model_max_length``,
else the tokenizer's limit capped at ``max_position_embeddings``; ``do_lower_case``), and the model for its task
(:func:`load_transformer`). The :class:`~embedq.backends.encoder.Encoder` calls them in that order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from embedq import errors
from embedq.backends.folder import CLASSIFY, FILL_MASK, clean_kwargs
from embedq.settings import BackendSettings

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def placement(settings: BackendSettings) -> tuple[torch.device, torch.dtype]:
    """The device and dtype ``settings`` ask for, checked (:class:`~embedq.errors.InvalidOption`); sets PyTorch's
    threads where ``torch_threads`` says how many."""
    if settings.dtype not in DTYPES:
        raise errors.InvalidOption(f"dtype must be one of {sorted(DTYPES)}, not {settings.dtype!r}")
    try:
        device = torch.device(settings.device)
    except RuntimeError as exc:
        raise errors.InvalidOption(f"invalid device {settings.device!r}: {exc}") from exc
    if device.type not in ("cpu", "cuda"):
        raise errors.InvalidOption(f"device must be 'cpu' or 'cuda[:N]', not {settings.device!r}")
    if settings.torch_threads is not None:
        torch.set_num_threads(int(settings.torch_threads))
    return device, DTYPES[settings.dtype]


def load_tokenizer(folder: Path, st_config: dict[str, Any], *, trust: bool,
                   allow_chat_template: bool) -> tuple[Any, Any]:
    """(the transformers config, the fast tokenizer) of ``folder``, the tokenizer's limit as sentence-transformers sets
    it: its ``max_seq_length`` as ``model_max_length``, else the tokenizer's own capped at the model's positions."""
    from transformers import AutoConfig, AutoTokenizer

    config_kwargs = clean_kwargs(st_config.get("config_kwargs", st_config.get("config_args")))
    tok_kwargs = clean_kwargs(st_config.get("processor_kwargs", st_config.get("tokenizer_args")))
    max_seq_length = st_config.get("max_seq_length")
    if max_seq_length is not None and "model_max_length" not in tok_kwargs:
        tok_kwargs["model_max_length"] = int(max_seq_length)
    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust, **config_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust, **tok_kwargs)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise errors.UnsupportedModel(f"cannot load the transformer in {folder}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise errors.UnsupportedModel(f"{folder}: embedq needs a fast tokenizer")
    if getattr(config, "is_encoder_decoder", False):
        raise errors.UnsupportedModel(f"{folder}: encoder-decoder models are not supported")
    if "model_max_length" not in tok_kwargs:
        max_pos = getattr(config, "max_position_embeddings", None)
        if isinstance(max_pos, int) and max_pos != -1:
            tokenizer.model_max_length = min(tokenizer.model_max_length, max_pos)
    if not allow_chat_template and getattr(tokenizer, "chat_template", None):
        raise errors.UnsupportedModel(
            f"{folder} has no modules.json and its tokenizer has a chat template: sentence-transformers "
            "would render texts as chat messages, which embedq does not implement"
        )
    if st_config.get("do_lower_case", False):
        lowercase(tokenizer)
    return config, tokenizer


def load_transformer(folder: Path, st_config: dict[str, Any], config: Any, *, task: str, device: torch.device,
                     dtype: torch.dtype, trust: bool) -> Any:
    """The model of ``folder`` for ``task`` (the bare transformer, a sequence classifier or a masked-LM head), in
    ``dtype`` on ``device``, in eval mode, without a key-value cache."""
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

    model_kwargs = clean_kwargs(st_config.get("model_kwargs", st_config.get("model_args")))
    for key in ("dtype", "torch_dtype", "device_map"):
        model_kwargs.pop(key, None)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    auto = {CLASSIFY: AutoModelForSequenceClassification, FILL_MASK: AutoModelForMaskedLM}.get(task, AutoModel)
    try:
        model = auto.from_pretrained(str(folder), config=config, dtype=dtype, trust_remote_code=trust, **model_kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise errors.UnsupportedModel(f"cannot load the transformer in {folder}: {exc}") from exc
    return model.to(device).eval()


def pad_id(tokenizer: Any) -> int:
    """The id a micro-batch is padded with: the tokenizer's pad token, else its EOS token, else 0."""
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return int(pad)


def lowercase(tokenizer: Any) -> None:
    """ST's ``do_lower_case``: a Lowercase normalizer in front, unless the tokenizer already has one."""
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
