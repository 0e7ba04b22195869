"""The encoder: the part of every backend that reads a model folder, tokenizes texts or text pairs, pads
a micro-batch and runs the transformer. Heads (``dense.py``, ``classify.py``, ``tokens.py``) turn its
output into one kind's rows.

Tokenization follows sentence-transformers 6.x exactly: ``max_seq_length`` → ``model_max_length``, else
the tokenizer's limit capped at ``max_position_embeddings``; pairs are tokenized as one sequence
(``[CLS] a [SEP] b [SEP]``) with ``longest_first`` truncation and segment ids where the model takes them.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedq import errors
from embedq.backends.base import Encoded
from embedq.backends.cutting import Cutter, Window
from embedq.backends.kernels import LinearKernel, pack_linears
from embedq.backends.modules import read_json

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

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


@dataclass
class Details:
    """Everything about one tokenized input (``embedq.tokenize``): ids, token strings, special flags and
    character offsets into the string the model saw (the prompt, if any, then the text)."""

    ids: list[int]
    tokens: list[str] = field(default_factory=list)
    special: list[int] = field(default_factory=list)
    offsets: list[tuple[int, int]] = field(default_factory=list)


def _cut(row: list[Any], limit: int, keep_head: int) -> list[Any]:
    """Left truncation that keeps a prompt: the first ``keep_head`` entries and the end of the row."""
    return row if len(row) <= limit else row[:keep_head] + row[len(row) - (limit - keep_head):]


def _cut_details(d: Details, limit: int, keep_head: int, with_strings: bool) -> Details:
    d.ids = _cut(d.ids, limit, keep_head)
    if with_strings:
        d.tokens, d.special, d.offsets = (_cut(x, limit, keep_head) for x in (d.tokens, d.special, d.offsets))
    return d


class Encoder:
    """A transformer folder loaded for inference: tokenizer, model, padding and the forward pass."""

    def __init__(self, folder: Path, st_config: dict[str, Any], *, task: str = FEATURES, device: str = "cpu",
                 dtype: str = "float32", torch_threads: int | None = None,
                 linear_kernel: LinearKernel = "auto", allow_chat_template: bool = False,
                 batch_tokens: int = 2048, online_tokens: int = 256, trust_remote_code: bool = False) -> None:
        from transformers import (
            AutoConfig,
            AutoModel,
            AutoModelForMaskedLM,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )

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
        self.folder = folder
        self.task = task
        self.device = torch_device
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self._attention = attention_kernels(torch_device)

        # -- tokenizer (as ST: max_seq_length → model_max_length; else capped at max positions) --------
        config_kwargs = clean_kwargs(st_config.get("config_kwargs", st_config.get("config_args")))
        model_kwargs = clean_kwargs(st_config.get("model_kwargs", st_config.get("model_args")))
        tok_kwargs = clean_kwargs(st_config.get("processor_kwargs", st_config.get("tokenizer_args")))
        max_seq_length = st_config.get("max_seq_length")
        if max_seq_length is not None and "model_max_length" not in tok_kwargs:
            tok_kwargs["model_max_length"] = int(max_seq_length)
        trust = check_remote_code(folder, trust_remote_code)
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
            _lowercase(tokenizer)
        self.config = config
        self.max_seq_length = int(tokenizer.model_max_length)
        self.tokenizer = tokenizer
        self._tokenizer_left = copy.deepcopy(tokenizer)
        self._tokenizer_left.truncation_side = "left"
        # Long texts are tokenized only as far as the model reads them (cutting.py): the same ids, bounded work.
        self.cutter = Cutter(tokenizer, need=self.max_seq_length + 1)
        self._lock = threading.Lock()
        self._prompt_lengths: dict[str, int] = {}
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self._pad_id = int(pad_id)
        self.left_padding = tokenizer.padding_side == "left"

        # -- model -----------------------------------------------------------------------------------
        for key in ("dtype", "torch_dtype", "device_map"):
            model_kwargs.pop(key, None)
        if hasattr(config, "use_cache"):
            config.use_cache = False
        auto = {CLASSIFY: AutoModelForSequenceClassification, FILL_MASK: AutoModelForMaskedLM}.get(task, AutoModel)
        try:
            model = auto.from_pretrained(str(folder), config=config, dtype=self.dtype, trust_remote_code=trust,
                                         **model_kwargs)
        except (OSError, ValueError, KeyError) as exc:
            raise errors.UnsupportedModel(f"cannot load the transformer in {folder}: {exc}") from exc
        self.model = model.to(self.device).eval()
        params = inspect.signature(self.model.forward).parameters
        self.takes_token_type_ids = "token_type_ids" in params and "token_type_ids" in tokenizer.model_input_names
        self._position_ids = "position_ids" in params
        self._forward: Any = self.model
        # Bulk micro-batches that may be preempted run here when the chosen runtime cannot stop between layers
        # (runtime.preemptible_alternative); None: they run on the chosen one.
        self._preempt_forward: Any = None
        self.preempt_runtime: str | None = None
        self._override: Any = None  # the forward pass run() uses inside between_layers (not in its callback)
        self.runtime_choice: Any = None  # runtime.Choice when linear_kernel=auto chose by measurement
        if linear_kernel == "auto" and self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16):
            from embedq.backends.runtime import choose

            self.runtime_choice, candidate = choose(self, weights=weights_sha256(folder), tokens=batch_tokens,
                                                    online_tokens=online_tokens)
            self._forward, self.linear_kernel = candidate.forward, self.runtime_choice.runtime
            self._preemptible_runtime()
        elif linear_kernel == "onnxruntime":
            self._forward = self._onnx(folder, task)
            self.linear_kernel = "onnxruntime"
        else:  # an operator's choice (or a GPU / float16, where PyTorch's own kernels run)
            self.linear_kernel = pack_linears(self.model, linear_kernel)

    def _preemptible_runtime(self) -> None:
        """When ``auto`` chose a runtime that runs the graph whole, keep a layered one for bulk micro-batches if the
        measurements say it is nearly as fast on them (runtime.preemptible_alternative), checked for fidelity."""
        name = self.runtime_choice.bulk_runtime
        if name is not None:
            self.layered_for_bulk(name)

    def layered_for_bulk(self, name: str) -> bool:
        """Run preemptible bulk micro-batches (inside :meth:`between_layers`) on the layered runtime ``name``
        (``torch`` or ``onednn``) while the chosen runtime runs the graph whole; checked for fidelity first.
        Returns whether it is in place."""
        from embedq.backends.runtime import LAYERED, Candidate, check

        if name not in LAYERED or self.linear_kernel in LAYERED:
            raise errors.InvalidOption(f"a layered runtime for bulk batches is {LAYERED}, beside onnxruntime")
        candidate = self.make_runtime(name)
        if candidate is None:
            return False
        trial = check(self, [candidate], Candidate("torch", self.model))[0]
        if not trial.faithful:
            log.warning("runtime: %s for preemptible bulk micro-batches is not faithful here (%s)", name,
                        trial.describe())
            return False
        candidate.enter()
        self._preempt_forward, self.preempt_runtime = candidate.forward, name
        log.info("runtime: bulk micro-batches that online ones may preempt run on %s (nearly as fast on token-budget "
                 "batches, and it stops between layers); the rest on %s", name, self.linear_kernel)
        return True

    def make_runtime(self, name: str) -> Any:
        """A :class:`~embedq.backends.runtime.Candidate` running this model with runtime ``name``; None where
        that runtime does not apply (raises with the reason where it should but cannot)."""
        from embedq.backends.kernels import onednn_swaps
        from embedq.backends.runtime import Candidate

        if name == "torch":
            return Candidate("torch", self.model)
        if name == "onednn":
            swaps = onednn_swaps(self.model)
            return None if swaps is None else Candidate("onednn", self.model, swaps.apply, swaps.undo)
        if name == "onnxruntime":
            if self.device.type != "cpu" or self.dtype != torch.float32 or self.left_padding:
                return None
            return Candidate("onnxruntime", self._onnx(self.folder, self.task))
        raise errors.InvalidOption(f"unknown runtime {name!r}")

    def _onnx(self, folder: Path, task: str) -> Any:
        """The forward pass in ONNX Runtime (onnx.py), checked against this model before it serves."""
        from embedq.backends.onnx import load_onnx

        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise errors.InvalidOption("linear_kernel=onnxruntime runs on the CPU in float32 only")
        if self.left_padding:
            raise errors.InvalidOption("linear_kernel=onnxruntime serves right-padded encoders; this tokenizer "
                                       "pads on the left")
        names = ["input_ids", "attention_mask"] + (["token_type_ids"] if self.takes_token_type_ids else [])
        output = TASK_OUTPUTS[task]
        return load_onnx(self.model, weights=weights_sha256(folder), task=task, names=names, output=output,
                         pad_id=self._pad_id, threads=torch.get_num_threads())

    # -- tokenization -------------------------------------------------------------------------------------
    def _call(self, tokenizer: Any, first: list[str], second: list[str] | None, *, truncate: bool,
              details: bool = False, add_special_tokens: bool = True) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "padding": False,
            "return_attention_mask": False,
            "return_token_type_ids": second is not None and self.takes_token_type_ids,
            "add_special_tokens": add_special_tokens,
        }
        if details:
            kwargs.update(return_offsets_mapping=True, return_special_tokens_mask=True)
        if truncate:
            kwargs.update(truncation="longest_first" if second is not None else True, max_length=self.max_seq_length)
        else:
            kwargs.update(truncation=False)
        out = tokenizer(first, second, **kwargs) if second is not None else tokenizer(first, **kwargs)
        if details:
            return {"ids": out["input_ids"], "tokens": [enc.tokens for enc in out.encodings],
                    "special": out["special_tokens_mask"], "offsets": out["offset_mapping"],
                    "sequence": [enc.sequence_ids for enc in out.encodings]}
        return {"ids": out["input_ids"], "type_ids": out.get("token_type_ids")}

    def prompt_length(self, prompt: str) -> int:
        """ST's ``_get_prompt_length``: tokens of the prompt alone, less a trailing special token."""
        cached = self._prompt_lengths.get(prompt)
        if cached is not None:
            return cached
        _, end = self.cutter.plan([prompt], keep_end=False)[0]
        ids = list(self._call(self.tokenizer, [prompt[:end]], None, truncate=True)["ids"][0])
        length = len(ids)
        if ids and ids[-1] in self.tokenizer.all_special_ids:
            length -= 1
        self._prompt_lengths[prompt] = length
        return length

    def _check_side(self, truncation_side: str) -> None:
        if truncation_side not in ("right", "left"):
            raise errors.InvalidOption(f"truncation_side must be 'right' or 'left', not {truncation_side!r}")

    def _too_long(self, rows: list[list[int]], what: str, cut: list[int | None]) -> None:
        """Raises for the first row over the limit; ``cut[i]``: characters of item ``i`` tokenized when only a piece
        was (the cutter found more tokens than the model reads in it), else None."""
        for index, row in enumerate(rows):
            if cut[index] is not None:
                raise errors.TooLong(
                    f"{what} {index} has more tokens than the model's max_seq_length of {self.max_seq_length} "
                    f"(more than {self.max_seq_length} in its first {cut[index]} characters)")
            if len(row) > self.max_seq_length:
                raise errors.TooLong(
                    f"{what} {index} has {len(row)} tokens, over the model's max_seq_length of {self.max_seq_length}"
                )

    def encode_texts(self, texts: Sequence[str], *, prompt: str | None = None, truncate: bool = True,
                     truncation_side: str = "right") -> tuple[list[Encoded], int]:
        """Texts exactly as sentence-transformers tokenizes them (prompt prepended): (items, prompt length).

        Raises :class:`embedq.errors.TooLong` when ``truncate`` is False and a text is over the limit."""
        details = self.details(texts, prompt=prompt, truncate=truncate, truncation_side=truncation_side,
                               with_strings=False)
        plen = self.prompt_length(prompt) if prompt else 0
        return [Encoded(d.ids, None, plen) for d in details], plen

    def details(self, texts: Sequence[str], *, prompt: str | None = None, truncate: bool = True,
                truncation_side: str = "right", add_special_tokens: bool = True,
                with_strings: bool = True) -> list[Details]:
        """Texts tokenized as the model sees them; with ``with_strings`` also token strings, special
        flags and character offsets into ``prompt + text``. A long text is tokenized as far as the model reads it
        (:class:`~embedq.backends.cutting.Cutter`), with the ids the whole text would give."""
        self._check_side(truncation_side)
        full = [prompt + text for text in texts] if prompt else list(texts)
        if truncate and truncation_side == "left" and prompt:
            return self._details_head_tail(full, prompt, add_special_tokens, with_strings)
        keep_end = truncate and truncation_side == "left"
        with self._lock:
            if prompt:
                self.prompt_length(prompt)
            windows = self.cutter.plan(full, keep_end)
            pieces = [s[a:b] for s, (a, b) in zip(full, windows)]
            tokenizer = self._tokenizer_left if keep_end else self.tokenizer
            out = self._call(tokenizer, pieces, None, truncate=truncate, details=with_strings,
                             add_special_tokens=add_special_tokens)
        rows = [list(r) for r in out["ids"]]
        if not truncate:
            self._too_long(rows, "text", [None if (a, b) == (0, len(s)) else b - a
                                          for s, (a, b) in zip(full, windows)])
        result = [Details(r) for r in rows]
        if with_strings:
            for i, d in enumerate(result):
                self._strings(d, out, i, windows[i][0])
        return result

    @staticmethod
    def _strings(d: Details, out: dict[str, Any], i: int, start: int) -> None:
        """Row ``i`` of ``out``'s token strings, special flags and offsets into ``d``; the offsets of the text's
        tokens moved by ``start``, where the piece tokenized began in the text (special tokens keep (0, 0))."""
        d.tokens, d.special = list(out["tokens"][i]), list(out["special"][i])
        d.offsets = [(a + start, b + start) if start and seq is not None else (a, b)
                     for (a, b), seq in zip(out["offsets"][i], out["sequence"][i])]

    def _details_head_tail(self, full: list[str], prompt: str, add_special_tokens: bool,
                           with_strings: bool) -> list[Details]:
        """Left truncation that keeps the prompt: the first ``prompt_length`` tokens (the prompt, with a leading
        special token) and the end of the text, as :func:`_cut` takes them from the untruncated row. A long text:
        the head from a prefix, the end from a suffix, each with more than ``max_seq_length`` stable tokens (so the
        whole row is over the limit, and both ends are its own)."""
        limit = self.max_seq_length
        with self._lock:
            keep = min(self.prompt_length(prompt), limit)
            heads = self.cutter.plan(full, keep_end=False)
            tails = self.cutter.plan(full, keep_end=True)
            # per text: its whole window, or a head and a tail
            parts: list[list[Window]] = []
            for s, head, tail in zip(full, heads, tails):
                whole = (0, len(s))
                parts.append([whole] if whole in (head, tail) or head[1] > tail[0] else [head, tail])
            pieces = [s[a:b] for s, windows in zip(full, parts) for a, b in windows]
            out = self._call(self.tokenizer, pieces, None, truncate=False, details=with_strings,
                             add_special_tokens=add_special_tokens)
        result: list[Details] = []
        k = 0
        for windows in parts:
            if len(windows) == 1:
                d = Details(list(out["ids"][k]))
                if with_strings:
                    self._strings(d, out, k, 0)
                d = _cut_details(d, limit, keep, with_strings)
            else:
                head, tail = Details(list(out["ids"][k])), Details(list(out["ids"][k + 1]))
                if with_strings:
                    self._strings(head, out, k, 0)
                    self._strings(tail, out, k + 1, windows[1][0])
                d = Details(head.ids[:keep] + tail.ids[len(tail.ids) - (limit - keep):])
                if with_strings:
                    d.tokens, d.special, d.offsets = (
                        x[:keep] + y[len(y) - (limit - keep):]
                        for x, y in ((head.tokens, tail.tokens), (head.special, tail.special),
                                     (head.offsets, tail.offsets)))
            result.append(d)
            k += len(windows)
        return result

    def encode_pairs(self, pairs: Sequence[tuple[str, str]], *, truncate: bool = True,
                     truncation_side: str = "right") -> list[Encoded]:
        """Text pairs as one sequence each (``[CLS] a [SEP] b [SEP]``), ``longest_first`` truncation, with
        segment ids when the model takes them (as ``CrossEncoder.predict`` tokenizes them). Long sides are
        tokenized as far as the model reads them (:meth:`Cutter.plan_pairs`), with the whole pair's ids."""
        self._check_side(truncation_side)
        keep_end = truncate and truncation_side == "left"
        tokenizer = self._tokenizer_left if keep_end else self.tokenizer
        odd = None
        if truncate:
            budget = self.max_seq_length - tokenizer.num_special_tokens_to_add(pair=True)
            odd = budget if budget % 2 else None
        with self._lock:
            windows, splits = self.cutter.plan_pairs(pairs, keep_end, odd)
            first = [a[w[0]:w[1]] for (a, _), (w, _) in zip(pairs, windows)]
            second = [b[w[0]:w[1]] for (_, b), (_, w) in zip(pairs, windows)]
            plain = [i for i in range(len(pairs)) if i not in splits]
            out = self._call(tokenizer, [first[i] for i in plain], [second[i] for i in plain],
                             truncate=truncate) if plain else {"ids": [], "type_ids": None}
            split = self._split_pairs(tokenizer, [(first[i], second[i], splits[i]) for i in splits], keep_end)
        rows: list[list[int]] = [[] for _ in pairs]
        types: list[list[int] | None] = [None for _ in pairs]
        for k, i in enumerate(plain):
            rows[i] = list(out["ids"][k])
            types[i] = list(out["type_ids"][k]) if out["type_ids"] is not None else None
        for i, (ids, type_ids) in zip(splits, split):
            rows[i], types[i] = ids, type_ids
        if not truncate:
            cut = [None if (wa, wb) == ((0, len(a)), (0, len(b))) else (wa[1] - wa[0]) + (wb[1] - wb[0])
                   for (a, b), (wa, wb) in zip(pairs, windows)]
            self._too_long(rows, "pair", cut)
        return [Encoded(r, types[i], 0) for i, r in enumerate(rows)]

    def _split_pairs(self, tokenizer: Any, pieces: list[tuple[str, str, tuple[int, int]]],
                     keep_end: bool) -> list[tuple[list[int], list[int] | None]]:
        """Pairs whose kept counts the cutter computed from their whole sides' counts (two long sides, an odd
        budget: :meth:`Cutter.plan_pairs`): each piece encoded alone, truncated to its count, then put together by
        the tokenizer's own post-processor (special tokens, segment ids), as its pair truncation does."""
        if not pieces:
            return []
        out = tokenizer([p for a, b, _ in pieces for p in (a, b)], add_special_tokens=False, truncation=False,
                        padding=False, return_attention_mask=False, return_token_type_ids=False)
        backend = tokenizer.backend_tokenizer  # that call left it without truncation or padding
        direction = "left" if keep_end else "right"
        rows = []
        for k, (_, _, (n1, n2)) in enumerate(pieces):
            first, second = out.encodings[2 * k], out.encodings[2 * k + 1]
            first.truncate(n1, direction=direction)
            second.truncate(n2, direction=direction)
            pair = backend.post_process(first, second, add_special_tokens=True)
            rows.append((list(pair.ids), list(pair.type_ids) if self.takes_token_type_ids else None))
        return rows

    # -- inference ------------------------------------------------------------------------------------------
    def layers(self) -> Any:
        """The model's stack of transformer layers (the ``nn.ModuleList`` of ``num_hidden_layers`` blocks: BERT's
        ``encoder.layer``, a decoder's ``layers``, ...), or None where there is none to find."""
        if getattr(self, "_layers", False) is False:
            count = int(getattr(self.model.config, "num_hidden_layers", 0) or 0)
            stacks = [m for _, m in self.model.named_modules()
                      if isinstance(m, torch.nn.ModuleList) and count and len(m) == count]
            self._layers = stacks[0] if len(stacks) == 1 else None
        return self._layers

    def preemption_blocker(self) -> str | None:
        """None when :meth:`between_layers` can stop this model's forward pass between two layers; else why not."""
        if self.linear_kernel == "onnxruntime" and self._preempt_forward is None:
            return "ONNX Runtime runs the model's graph whole (and no layered runtime is nearly as fast here)"
        if self.layers() is None:
            return (f"its layer stack was not found (no single nn.ModuleList of num_hidden_layers="
                    f"{getattr(self.model.config, 'num_hidden_layers', None)} blocks)")
        return None

    def preemption_points(self) -> list[Any]:
        """The modules a forward pass may stop before: each layer of the stack, and inside it each leaf module that
        holds weights (the projections and norms), so a pause waits at most about one matrix product, not a whole
        layer. Found anew on each call (the oneDNN runtime swaps the Linear modules)."""
        points: list[Any] = []
        for layer in self.layers() or ():
            points.append(layer)
            for module in layer.modules():
                if module is not layer and not any(True for _ in module.children()) and (
                        any(True for _ in module.parameters(recurse=False))
                        or any(True for _ in module.buffers(recurse=False))):
                    points.append(module)
        return points

    @contextlib.contextmanager
    def between_layers(self, callback: Callable[[], None]) -> Iterator[bool]:
        """While inside: ``callback()`` runs before each preemption point (:meth:`preemption_points`: each layer,
        and each weight-holding module in it) of every forward pass on this thread's model, except in forward
        passes ``callback`` itself starts (they run through, unhooked, on the chosen runtime). Forward passes inside
        run on the layered runtime kept for them where the chosen one runs the graph whole. Yields whether the
        hooks are in place: False where no layered runtime runs this model or no layer stack was found."""
        if self.preemption_blocker() is not None:
            yield False
            return
        inside = [False]

        def hook(module: Any, args: Any) -> None:
            if inside[0]:
                return
            inside[0] = True
            override, self._override = self._override, None  # the callback's passes: the chosen runtime
            try:
                callback()
            finally:
                inside[0] = False
                self._override = override

        handles = [point.register_forward_pre_hook(hook) for point in self.preemption_points()]
        self._override = self._preempt_forward
        try:
            yield True
        finally:
            self._override = None
            for handle in handles:
                handle.remove()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """An input array on the model's device. On CUDA through pinned host memory (PyTorch's caching host
        allocator reuses its blocks, and keeps one until the copies from it are done) with a non-blocking copy:
        the copy is queued behind the work already on the device instead of waiting for it."""
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def run(self, batch: Sequence[Encoded], forward: Any = None) -> tuple[Any, torch.Tensor]:
        """One padded forward pass: (the model's output, the attention mask). Call under inference_mode.
        ``forward``: another runtime than the encoder's own (the runtime tuner's candidates)."""
        n = len(batch)
        lengths = [len(item.ids) for item in batch]
        width = max(max(lengths), 1)
        ids = np.full((n, width), self._pad_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        types = np.zeros((n, width), dtype=np.int64) if self.takes_token_type_ids else None
        for i, item in enumerate(batch):
            length = lengths[i]
            if not length:
                continue
            cols = slice(width - length, width) if self.left_padding else slice(0, length)
            ids[i, cols] = item.ids
            mask[i, cols] = 1
            if types is not None and item.type_ids is not None:
                types[i, cols] = item.type_ids
        with self._attention():
            input_ids, attention_mask = self._to_device(ids), self._to_device(mask)
            inputs: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask}
            if types is not None:
                inputs["token_type_ids"] = self._to_device(types)
            if self.left_padding and self._position_ids and min(lengths) < width:
                # Positions as the unpadded text would have them (left padding only).
                inputs["position_ids"] = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
            return (forward or self._override or self._forward)(**inputs, return_dict=True), attention_mask


def _lowercase(tokenizer: Any) -> None:
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
