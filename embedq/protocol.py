"""The wire contract between producers and workers.

A job is an ordinary Celery task message: ``send_task(TASK_NAME, args=[texts], kwargs=options)``.
Its result is a plain JSON/msgpack-able dict (see :func:`encode_result`) so that clients in any
language can read it; Python clients turn it back into numpy with :func:`decode_result`.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from embedq import errors

TASK_NAME = "embedq.embed"
#: Message header of a job a producer sent again after a broker restart (the count of resends).
RESENT_HEADER = "embedq_resent"
#: Message header: when the producer sent the job (Unix time), for the worker's time-in-queue metric.
SENT_HEADER = "embedq_sent_at"
PROTOCOL_VERSION = 1

Encoding = Literal["float32", "float16", "float"]
TruncationSide = Literal["right", "left"]


class EmbedOptions(BaseModel):
    """Per-job options (the task's keyword arguments). Unknown keys are refused."""

    # strict: "yes" is not a boolean and "64" not a number; a JSON producer sends the real types.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, protected_namespaces=())

    model: str | None = Field(default=None, description="Model the job is meant for; checked by the worker.")
    normalize: bool | None = Field(
        default=None,
        description="None: as the model defines it (its Normalize module). True: unit length (after "
        "`dimensions`). False: skip the model's Normalize module.",
    )
    truncate: bool = Field(default=True, description="False: a text over the model's limit is an error.")
    truncation_side: TruncationSide = "right"
    prompt: str | None = None
    prompt_name: str | None = None
    dimensions: int | None = Field(default=None, gt=0, description="Matryoshka: keep the first N dims.")
    encoding: Encoding = Field(default="float32", description="float32/float16: base64 little-endian.")
    v: int = Field(default=PROTOCOL_VERSION, description="Protocol version of the job.")

    @field_validator("v")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value != PROTOCOL_VERSION:
            raise ValueError(f"unsupported protocol version {value}; this embedq speaks {PROTOCOL_VERSION}")
        return value

    @classmethod
    def parse(cls, kwargs: dict[str, Any] | None) -> EmbedOptions:
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
        if options.prompt is not None and options.prompt_name is not None:
            raise errors.InvalidOption("give either prompt or prompt_name, not both")
        return options

    def wire(self) -> dict[str, Any]:
        """The kwargs to put on the wire: only what differs from the defaults."""
        return self.model_dump(exclude_defaults=True)


def short_options(options: Any) -> str:
    """A job's options as monitoring shows them: never a user's text (a custom prompt shows its length)."""
    if not isinstance(options, dict):
        return ""
    shown = {k: (f"<{len(v)} chars>" if k == "prompt" and isinstance(v, str) else v) for k, v in options.items()}
    return repr(shown)[:200]


def task_reprs(texts: Sequence[str], options: dict[str, Any]) -> dict[str, str]:
    """Celery's ``argsrepr``/``kwargsrepr`` for a job: what Celery and Flower show instead of the texts."""
    return {"argsrepr": f"[{len(texts)} texts]", "kwargsrepr": short_options(options)}


def validate_texts(texts: Any, *, max_texts: int, max_chars: int) -> list[str]:
    """Check a job's inputs at the edge (producer) and again in the worker."""
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, (list, tuple)):
        raise errors.InvalidType(f"inputs must be a list of strings, got {type(texts).__name__}")
    if not texts:
        raise errors.EmptyInput("inputs is empty: send at least one text")
    if len(texts) > max_texts:
        raise errors.TooManyTexts(f"{len(texts)} texts in one job; the limit is {max_texts}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise errors.InvalidType(f"inputs[{i}] is {type(text).__name__}, not a string")
        if len(text) > max_chars:
            raise errors.TextTooLong(f"inputs[{i}] has {len(text)} characters; the limit is {max_chars}")
        if not text.strip():
            raise errors.EmptyText(f"inputs[{i}] is empty or whitespace only")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise errors.InvalidText(f"inputs[{i}] is not valid Unicode (a lone surrogate)") from None
    return list(texts)


def check_message_size(texts: list[str], options: dict[str, Any], *, serializer: str, limit: int) -> None:
    """Producer side: the job's message body must stay under ``limit`` bytes (workers check it again).

    A JSON-escaped character takes at most 12 bytes, so only jobs that could reach the limit are
    serialised to measure them."""
    if sum(len(t) for t in texts) * 12 + 4096 <= limit:
        return
    from kombu.serialization import dumps

    _, _, body = dumps([texts, options, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}],
                       serializer=serializer)
    if len(body) > limit:
        raise errors.MessageTooLarge(
            f"the job's message would have {len(body)} bytes; the limit is {limit} (send fewer texts per job)")


# -- vectors -----------------------------------------------------------------------------------
_DTYPES = {"float32": "<f4", "float16": "<f2"}


def encode_vectors(vectors: np.ndarray, encoding: Encoding) -> dict[str, Any]:
    """A 2-D float array as ``{"encoding", "dtype", "shape", "data"}``.

    ``data`` is base64 of little-endian bytes for float32/float16 and nested float lists for
    ``float`` (JSON-only clients).
    """
    vectors = np.asarray(vectors)
    if vectors.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {vectors.shape}")
    shape = [int(vectors.shape[0]), int(vectors.shape[1])]
    if encoding == "float":
        return {"encoding": "float", "dtype": "float32", "shape": shape,
                "data": vectors.astype(np.float32).tolist()}
    raw = np.ascontiguousarray(vectors, dtype=_DTYPES[encoding]).tobytes()
    return {"encoding": "base64", "dtype": encoding, "shape": shape,
            "data": base64.b64encode(raw).decode("ascii")}


def decode_vectors(payload: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`encode_vectors`; always returns float32 of the stored shape."""
    shape = tuple(payload["shape"])
    if payload["encoding"] == "float":
        return np.asarray(payload["data"], dtype=np.float32).reshape(shape)
    data = payload["data"]
    raw = data if isinstance(data, (bytes, bytearray)) else base64.b64decode(data)
    return np.frombuffer(raw, dtype=_DTYPES[payload["dtype"]]).reshape(shape).astype(np.float32)


class Fingerprint(BaseModel):
    """Identifies an embedding space: vectors with different fingerprints must never be mixed."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    model: str
    weights_sha256: str
    pooling: str
    normalize: bool
    dimensions: int
    dtype: str
    prompt: str | None = None
    embedq_version: str

    def space(self) -> tuple[object, ...]:
        """What decides the vector space: the weights (their hash also covers config and vocabulary),
        pooling, normalisation, dimensions, compute dtype and prompt. Not the name the model was
        loaded by, nor the embedq version."""
        return (self.weights_sha256, self.pooling, self.normalize, self.dimensions, self.dtype, self.prompt)

    def same_space(self, other: Fingerprint) -> bool:
        return self.space() == other.space()

    def describe(self) -> str:
        prompt = f", prompt {self.prompt!r}" if self.prompt else ""
        norm = "normalized" if self.normalize else "not normalized"
        return (f"{self.model} ({self.weights_sha256[:12]}), {self.pooling} pooling, {self.dimensions} dims, "
                f"{norm}, {self.dtype}{prompt}")


def encode_result(vectors: np.ndarray, options: EmbedOptions, fingerprint: Fingerprint,
                  tokens: int) -> dict[str, Any]:
    return {
        "v": PROTOCOL_VERSION,
        "vectors": encode_vectors(vectors, options.encoding),
        "fingerprint": fingerprint.model_dump(),
        "usage": {"texts": int(vectors.shape[0]), "tokens": int(tokens)},
    }


def decode_result(payload: dict[str, Any]) -> tuple[np.ndarray, Fingerprint]:
    return decode_vectors(payload["vectors"]), Fingerprint.model_validate(payload["fingerprint"])


def texts_list(texts: str | Sequence[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)
