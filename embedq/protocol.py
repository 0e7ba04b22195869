"""The wire contract between producers and workers: what a job's message and its result hold.

A job is an ordinary Celery task message: ``send_task(spec.name, args=..., kwargs=options)`` where ``spec`` is one
entry of the table of job kinds (``embedq/kinds.py``). This module holds what every kind shares: the options models
(one per built-in kind, all under :class:`JobOptions`), the checks of texts at the edge and again in the worker, the
message-size check, the encoding of result arrays, and the :class:`Fingerprint` of an embedding space. A result is a
plain JSON/msgpack-able dict so that clients in any language can read it; Python clients turn it back into numpy
with :func:`decode_result` / :func:`decode_arrays`.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from embedq import errors

TASK_NAME = "embedq.embed"  # the embedding task (kept by that name since protocol version 1)
#: Message header of a job a producer sent again after a broker restart (the count of resends).
RESENT_HEADER = "embedq_resent"
#: Message header: when the producer sent the job (Unix time), for the worker's time-in-queue metric.
SENT_HEADER = "embedq_sent_at"
#: Message header: the producer's identity (a client id, the gateway's per-key or per-peer identity), what the
#: worker shares its model time out by between clients (issue 50). At most :data:`MAX_CLIENT_CHARS` characters.
CLIENT_HEADER = "embedq_client"
MAX_CLIENT_CHARS = 128
PROTOCOL_VERSION = 1
#: The longest deadline a job may carry, in seconds from when it is sent (one week). Producers and the gateway
#: refuse a longer one (422); a worker clamps any ``expires`` further out than this to it, so no value a client
#: sends can reach a wait or a timestamp that overflows.
MAX_DEADLINE_SECONDS = 7 * 24 * 3600

Encoding = Literal["float32", "float16", "float"]
TruncationSide = Literal["right", "left"]
#: An input longer than the model reads: cut (``truncate``), failed (``error``), or in windows (``windows``).
LongInputs = Literal["truncate", "error", "windows"]
MAX_WINDOW_OVERLAP = 4096  # a worker also refuses half its model's window or more


class JobOptions(BaseModel):
    """Options every kind takes (the task's keyword arguments). Unknown keys are refused."""

    # strict: "yes" is not a boolean and "64" not a number; a JSON producer sends the real types.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, protected_namespaces=())

    model: str | None = Field(default=None, description="Model the job is meant for; checked by the worker.")
    truncate: bool = Field(default=True, description="False: an input over the model's limit is an error.")
    truncation_side: TruncationSide = "right"
    v: int = Field(default=PROTOCOL_VERSION, description="Protocol version of the job.")

    @field_validator("v")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value != PROTOCOL_VERSION:
            raise ValueError(f"unsupported protocol version {value}; this embedq speaks {PROTOCOL_VERSION}")
        return value

    @classmethod
    def parse(cls, kwargs: dict[str, Any] | None) -> Any:
        """Options from a message's kwargs, or :class:`~embedq.errors.InvalidOption`."""
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, dict):
            raise errors.InvalidOption(f"options must be a mapping, got {type(kwargs).__name__}")
        try:
            options = cls.model_validate(kwargs)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "options"
            raise errors.InvalidOption(f"{where}: {first['msg']}") from None
        if getattr(options, "prompt", None) is not None and getattr(options, "prompt_name", None) is not None:
            raise errors.InvalidOption("give either prompt or prompt_name, not both")
        return options

    def wire(self) -> dict[str, Any]:
        """The kwargs to put on the wire: only what differs from the defaults."""
        return self.model_dump(exclude_defaults=True)


class WindowOptions(JobOptions):
    """Options of the kinds that embed texts (``embed``, ``embed_sparse``, ``embed_all``, ``embed_hybrid``): what
    becomes of an input longer than the model reads (issue 58)."""

    long_inputs: LongInputs | None = Field(
        default=None,
        description="truncate (None's meaning unless truncate=False), error (truncate=False), or windows: the "
        "text cut into windows of the model's length, each its own item.")
    window_overlap: int = Field(default=0, ge=0, le=MAX_WINDOW_OVERLAP,
                                description="windows: tokens each window shares with the one before it.")
    pool_windows: bool = Field(default=True, description="windows: one output per input, pooled over its windows "
                               "(False: per input, each window's output with its character span).")

    @model_validator(mode="after")
    def _long_inputs(self) -> WindowOptions:
        given = self.model_fields_set
        if self.long_inputs != "windows":
            extra = sorted(given & {"window_overlap", "pool_windows"})
            if extra:
                raise ValueError(f"{', '.join(extra)} applies only with long_inputs='windows'")
        if self.long_inputs in ("truncate", "error") and "truncate" in given \
                and self.truncate != (self.long_inputs == "truncate"):
            raise ValueError(f"truncate={self.truncate} contradicts long_inputs={self.long_inputs!r}: give one")
        if self.long_inputs == "error":
            object.__setattr__(self, "truncate", False)
        return self

    @property
    def windows(self) -> bool:  # the job's long inputs are cut into windows
        return self.long_inputs == "windows"


class EmbedOptions(WindowOptions):
    """``embedq.embed``: dense vectors."""

    normalize: bool | None = Field(
        default=None,
        description="None: as the model defines it (its Normalize module). True: unit length (after "
        "`dimensions`). False: skip the model's Normalize module.",
    )
    prompt: str | None = None
    prompt_name: str | None = None
    dimensions: int | None = Field(default=None, gt=0, description="Matryoshka: keep the first N dims.")
    encoding: Encoding = Field(default="float32", description="float32/float16: base64 little-endian.")


class SparseOptions(WindowOptions):
    """``embedq.embed_sparse``: SPLADE weights per vocabulary id (TEI's ``/embed_sparse``)."""

    prompt: str | None = None
    prompt_name: str | None = None
    top_k: int | None = Field(default=None, gt=0, description="Keep each text's k largest weights.")
    return_tokens: bool = Field(default=False, description="Also return each kept id's token string.")
    encoding: Encoding = Field(default="float32", description="The weights' encoding: float32, float16, float.")


class EmbedAllOptions(WindowOptions):
    """``embedq.embed_all``: every token's last hidden state (TEI's ``/embed_all``)."""

    prompt: str | None = None
    prompt_name: str | None = None
    encoding: Encoding = Field(default="float32", description="float16 halves the result.")


#: What a BGE-M3 job may ask for (FlagEmbedding's dense_vecs, lexical_weights, colbert_vecs).
HYBRID_OUTPUTS = ("dense", "lexical", "colbert")


class HybridOptions(WindowOptions):
    """``embedq.embed_hybrid``: any of BGE-M3's three outputs from one forward pass."""

    outputs: list[Literal["dense", "lexical", "colbert"]] = Field(
        default_factory=lambda: list(HYBRID_OUTPUTS), min_length=1, description="Which outputs to return.")
    prompt: str | None = None
    prompt_name: str | None = None
    top_k: int | None = Field(default=None, gt=0, description="Lexical: keep each text's k largest weights.")
    return_tokens: bool = Field(default=False, description="Lexical: also return each kept id's token string.")
    encoding: Encoding = Field(default="float32", description="float16 halves dense and ColBERT vectors.")


class RerankOptions(JobOptions):
    """``embedq.rerank``: one query against many texts (TEI's ``/rerank``)."""

    raw_scores: bool = Field(default=False, description="True: the model's logits, not its activation.")


class PredictOptions(JobOptions):
    """``embedq.predict``: sequence classification of texts or text pairs (TEI's ``/predict``)."""

    raw_scores: bool = Field(default=False, description="True: logits; else softmax (sigmoid for one label).")


class TokenizeOptions(JobOptions):
    """``embedq.tokenize``: the tokens the model would see (TEI's ``/tokenize``)."""

    add_special_tokens: bool = True
    prompt: str | None = None
    prompt_name: str | None = None


class DecodeOptions(JobOptions):
    """``embedq.decode``: token ids back to text by the model's tokenizer (TEI's ``/decode``)."""

    skip_special_tokens: bool = Field(default=True, description="False: special tokens ([CLS], </s>) are kept.")


def check_client_id(value: Any) -> str:
    """A producer identity as the client sends it (:data:`CLIENT_HEADER`): a non-empty string of at most
    :data:`MAX_CLIENT_CHARS` printable characters; anything else is :class:`~embedq.errors.InvalidOption`."""
    if not isinstance(value, str) or not value or len(value) > MAX_CLIENT_CHARS or not value.isprintable():
        shown = repr(value)[:40] if isinstance(value, str) else type(value).__name__
        raise errors.InvalidOption(f"a client id must be a non-empty printable string of at most "
                                   f"{MAX_CLIENT_CHARS} characters, got {shown}")
    return value


def client_of(headers: Any) -> str:
    """The producer identity a message carries (worker side): its :data:`CLIENT_HEADER`, else Celery's ``origin``
    header (the sending process's node name), else ``""``. Whatever a header holds, this returns a string of at
    most :data:`MAX_CLIENT_CHARS` characters: a value that is not a usable identity is passed over, never raised."""
    if not isinstance(headers, dict):
        return ""
    for name in (CLIENT_HEADER, "origin"):
        value = headers.get(name)
        if isinstance(value, str) and value and len(value) <= MAX_CLIENT_CHARS and value.isprintable():
            return value
    return ""


def short_options(options: Any) -> str:
    """A job's options as monitoring shows them: never a user's text (a custom prompt shows its length)."""
    if not isinstance(options, dict):
        return ""
    shown = {k: (f"<{len(v)} chars>" if k == "prompt" and isinstance(v, str) else v) for k, v in options.items()}
    return repr(shown)[:200]


def job_list(values: Any, *, max_texts: int, what: str, one: str, many: str) -> list[Any]:
    """A job's inputs as a non-empty list of at most ``max_texts`` entries (a single string is a list of one)."""
    if isinstance(values, str):
        values = [values]
    if not isinstance(values, (list, tuple)):
        raise errors.InvalidType(f"inputs must be a list of {what}, got {type(values).__name__}")
    if not values:
        raise errors.EmptyInput(f"inputs is empty: send at least one {one}")
    if len(values) > max_texts:
        raise errors.TooManyTexts(f"{len(values)} {many} in one job; the limit is {max_texts}")
    return list(values)


def check_text(text: Any, where: str, max_chars: int, *, empty_ok: bool = False) -> str:
    """One text of a job, checked where the producer and the worker both check it. Only ``""`` is empty: a text of
    whitespace is embedded as sentence-transformers and TEI embed it (its special tokens alone). ``empty_ok``: one
    side of a pair, which may be empty when the other is not (TEI)."""
    if not isinstance(text, str):
        raise errors.InvalidType(f"{where} is {type(text).__name__}, not a string")
    if len(text) > max_chars:
        raise errors.TextTooLong(f"{where} has {len(text)} characters; the limit is {max_chars}")
    if not text and not empty_ok:
        raise errors.EmptyText(f"{where} is empty")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise errors.InvalidText(f"{where} is not valid Unicode (a lone surrogate)") from None
    return text


def validate_texts(texts: Any, *, max_texts: int, max_chars: int) -> list[str]:
    """Check a job's inputs at the edge (producer) and again in the worker."""
    texts = job_list(texts, max_texts=max_texts, what="strings", one="text", many="texts")
    for i, text in enumerate(texts):
        # The common case (a non-empty ASCII str within the limit) in one expression; anything else is checked, and
        # named in its error, by _text.
        if type(text) is not str or len(text) > max_chars or not text.isascii() or not text:
            texts[i] = check_text(text, f"inputs[{i}]", max_chars)
    return texts


def check_message_size(args: list[Any], options: dict[str, Any], *, serializer: str, limit: int) -> None:
    """Producer side: the job's message body (``args``: the task's positional arguments) must stay
    under ``limit`` bytes (workers check it again).

    A JSON-escaped character takes at most 12 bytes, so only jobs that could reach the limit are
    serialised to measure them."""
    if _chars(args) * 12 + 4096 <= limit:
        return
    from kombu.serialization import dumps

    _, _, body = dumps([args, options, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}],
                       serializer=serializer)
    if len(body) > limit:
        raise errors.MessageTooLarge(
            f"the job's message would have {len(body)} bytes; the limit is {limit} (send fewer texts per job)")


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value) + 4
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value) + 2
    return 8


# -- arrays ------------------------------------------------------------------------------------
_DTYPES = {"float32": "<f4", "float16": "<f2", "int32": "<i4", "uint8": "u1"}


def encode_array(values: np.ndarray, encoding: Encoding = "float32") -> dict[str, Any]:
    """An array as ``{"encoding", "dtype", "shape", "data"}``.

    ``data`` is base64 of little-endian bytes, or nested lists with ``encoding="float"`` (JSON-only
    clients). Float arrays are stored as ``encoding`` (float32 or float16); integer arrays as int32 and
    boolean ones as uint8, whatever the encoding.
    """
    values = np.asarray(values)
    shape = [int(n) for n in values.shape]
    if values.dtype.kind == "b":
        dtype = "uint8"
    elif values.dtype.kind in "iu":
        dtype = "int32"
    elif values.dtype.kind == "f":
        dtype = "float32" if encoding == "float" else encoding
    else:
        raise ValueError(f"cannot encode an array of {values.dtype}")
    if encoding == "float":
        return {"encoding": "float", "dtype": dtype, "shape": shape, "data": values.astype(_DTYPES[dtype]).tolist()}
    raw = np.ascontiguousarray(values, dtype=_DTYPES[dtype]).tobytes()
    return {"encoding": "base64", "dtype": dtype, "shape": shape, "data": base64.b64encode(raw).decode("ascii")}


def decode_array(payload: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`encode_array`: float arrays come back as float32, integer ones as int32."""
    shape = tuple(payload["shape"])
    dtype = payload.get("dtype", "float32")
    out_dtype = np.float32 if dtype.startswith("float") else np.dtype(_DTYPES[dtype]).newbyteorder("=")
    if payload["encoding"] == "float":
        return np.asarray(payload["data"], dtype=out_dtype).reshape(shape)
    data = payload["data"]
    raw = data if isinstance(data, (bytes, bytearray)) else base64.b64decode(data)
    return np.frombuffer(raw, dtype=_DTYPES[dtype]).reshape(shape).astype(out_dtype)


def encode_vectors(vectors: np.ndarray, encoding: Encoding) -> dict[str, Any]:
    """A 2-D float array (one vector per text): :func:`encode_array`, checked to be 2-D."""
    vectors = np.asarray(vectors)
    if vectors.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {vectors.shape}")
    return encode_array(vectors.astype(np.float32, copy=False), encoding)


decode_vectors = decode_array


class Fingerprint(BaseModel):
    """Identifies an embedding space: vectors with different fingerprints must never be mixed."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    kind: str = "embed"  # the job kind whose outputs these are: an indexer never mixes kinds
    model: str
    weights_sha256: str
    pooling: str
    normalize: bool
    dimensions: int
    dtype: str
    prompt: str | None = None
    embedq_version: str
    #: ``long_inputs="windows"`` jobs: the tokens neighbouring windows share, and whether each input's output was
    #: pooled over its windows (None, None: no windows; a result leaves them out)
    window_overlap: int | None = None
    pool_windows: bool | None = None

    def space(self) -> tuple[object, ...]:
        """What decides the vector space: the weights (their hash also covers config and vocabulary),
        pooling, normalisation, dimensions, compute dtype, prompt and windows. Not the name the model was
        loaded by, nor the embedq version."""
        return (self.kind, self.weights_sha256, self.pooling, self.normalize, self.dimensions, self.dtype, self.prompt,
                self.window_overlap, self.pool_windows)

    def wire(self) -> dict[str, Any]:
        """As a result carries it: every field, the window fields only when the job had windows."""
        out = self.model_dump()
        if self.window_overlap is None and self.pool_windows is None:
            del out["window_overlap"], out["pool_windows"]
        return out

    def same_space(self, other: Fingerprint) -> bool:
        return self.space() == other.space()

    def describe(self) -> str:
        prompt = f", prompt {self.prompt!r}" if self.prompt else ""
        norm = "normalized" if self.normalize else "not normalized"
        kind = "" if self.kind == "embed" else f"{self.kind}: "
        windows = ""
        if self.window_overlap is not None:
            windows = (f", {'pooled ' if self.pool_windows else ''}windows overlapping by {self.window_overlap} "
                       "tokens")
        return (f"{kind}{self.model} ({self.weights_sha256[:12]}), {self.pooling} pooling, {self.dimensions} dims, "
                f"{norm}, {self.dtype}{prompt}{windows}")


def encode_result(kind: str, arrays: dict[str, Any], fingerprint: Fingerprint, *, items: int, tokens: int,
                  encoding: Encoding = "float32", extra: dict[str, Any] | None = None,
                  exact: tuple[str, ...] = ()) -> dict[str, Any]:
    """A job's result: ``{"v", "kind", <named arrays>, <extra>, "fingerprint", "usage"}``.

    ``arrays`` are numpy arrays (encoded with :func:`encode_array`); ``extra`` holds plain JSON values
    (labels, token strings). ``usage.texts`` counts items (a rerank or predict pair is one)."""
    out: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind}
    for name, values in arrays.items():  # ``exact`` arrays stay float32 whatever the job's encoding
        out[name] = encode_array(values, "float32" if name in exact and encoding == "float16" else encoding)
    if extra:
        out.update(extra)
    out["fingerprint"] = fingerprint.wire()
    out["usage"] = {"texts": int(items), "tokens": int(tokens)}
    return out


def result_size(payload: Any) -> int:
    """About how many bytes ``payload`` takes once serialised (JSON), without serialising it."""
    if isinstance(payload, str):
        return len(payload) + 2
    if isinstance(payload, dict):
        return sum(len(str(k)) + 4 + result_size(v) for k, v in payload.items()) + 2
    if isinstance(payload, (list, tuple)):
        return sum(result_size(v) + 1 for v in payload) + 2
    return 12


def decode_result(payload: dict[str, Any]) -> tuple[np.ndarray, Fingerprint]:
    """An embedding result: (vectors, fingerprint)."""
    return decode_vectors(payload["vectors"]), Fingerprint.model_validate(payload["fingerprint"])


def json_result(payload: dict[str, Any]) -> dict[str, Any]:
    """A result in its plain JSON form, what Celery callbacks receive (``link``, a chain's next step, a chord's
    body): the same dict with every encoded array as ``{"encoding": "float", "dtype", "shape", "data"}``, ``data``
    nested lists of numbers (float arrays as float32 values, whatever the job's encoding), as a job that asked
    ``encoding="float"`` gets it. Any Celery client reads it without numpy or base64; :func:`decode_arrays` still
    turns it back into arrays."""
    out = dict(payload)
    for name, value in payload.items():
        if isinstance(value, dict) and "encoding" in value and "shape" in value and value["encoding"] != "float":
            dtype = value.get("dtype", "float32")
            out[name] = {"encoding": "float", "dtype": "float32" if dtype.startswith("float") else dtype,
                         "shape": list(value["shape"]), "data": decode_array(value).tolist()}
    return out


def decode_arrays(payload: dict[str, Any]) -> dict[str, Any]:
    """Every encoded array of a result, decoded, with its other fields as they are."""
    return {k: decode_array(v) if isinstance(v, dict) and "encoding" in v and "shape" in v else v
            for k, v in payload.items()}


@dataclass(frozen=True)
class SparseVector:
    """One text's sparse weights: vocabulary ids (ascending) and their values, with the token strings when
    the job asked for them (``return_tokens``)."""

    indices: np.ndarray  # int32
    values: np.ndarray  # float32
    tokens: list[str] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def to_dict(self) -> dict[Any, float]:
        """``{token: value}`` when the tokens are known, else ``{id: value}`` (as search engines take them)."""
        keys = self.tokens if self.tokens is not None else self.indices.tolist()
        return dict(zip(keys, self.values.tolist()))

    def to_tei(self) -> list[dict[str, Any]]:
        """TEI's ``/embed_sparse`` shape: ``[{"index", "value"}]``."""
        return [{"index": int(i), "value": float(v)} for i, v in zip(self.indices, self.values)]


def decode_sparse(payload: dict[str, Any]) -> list[SparseVector]:
    """An ``embed_sparse`` result: one :class:`SparseVector` per text, in input order."""
    offsets = decode_array(payload["offsets"])
    indices, values = decode_array(payload["indices"]), decode_array(payload["values"])
    tokens = payload.get("tokens")
    return [SparseVector(indices[a:b], values[a:b], None if tokens is None else list(tokens[a:b]))
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


@dataclass(frozen=True)
class HybridEmbedding:
    """A BGE-M3 job's outputs, each None when the job did not ask for it: ``dense`` (texts × dim),
    ``lexical`` (a :class:`SparseVector` per text), ``colbert`` (per text, tokens × dim, CLS left out)."""

    dense: np.ndarray | None
    lexical: list[SparseVector] | None
    colbert: list[np.ndarray] | None


def decode_ragged(payload: dict[str, Any], offsets: str = "offsets", values: str = "tokens") -> list[np.ndarray]:
    """A ragged result (one array of rows per text): the texts' arrays, in input order."""
    at, rows = decode_array(payload[offsets]), decode_array(payload[values])
    return [rows[a:b] for a, b in zip(at[:-1].tolist(), at[1:].tolist())]


def decode_hybrid(payload: dict[str, Any]) -> HybridEmbedding:
    dense = decode_array(payload["dense"]) if "dense" in payload else None
    lexical = None
    if "lexical_offsets" in payload:
        lexical = decode_sparse({"offsets": payload["lexical_offsets"], "indices": payload["lexical_indices"],
                                 "values": payload["lexical_values"], "tokens": payload.get("lexical_tokens")})
    colbert = decode_ragged(payload, "colbert_offsets", "colbert") if "colbert" in payload else None
    return HybridEmbedding(dense, lexical, colbert)


def texts_list(texts: str | Sequence[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)
