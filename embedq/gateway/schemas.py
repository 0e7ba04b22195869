"""The gateway's request bodies, its documented error bodies and responses, the request headers it declares, and
its JSON response class (orjson)."""

from __future__ import annotations

from typing import Any, Literal

import orjson
from fastapi.responses import JSONResponse as _StarletteJSON
from pydantic import BaseModel, ConfigDict, Field

from embedq import errors
from embedq.protocol import MAX_DEADLINE_SECONDS, MAX_WINDOW_OVERLAP


class JSONResponse(_StarletteJSON):
    """JSON by orjson: numpy arrays are written as they are (float32 in float32's shortest form, as TEI's serde
    writes them: shorter than float64's digits, and the same float32 once read back), several times faster
    than ``json.dumps`` of ``tolist()`` on a request's vectors. NaN is written as ``null``, never as ``NaN``."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


# -- documented responses -----------------------------------------------------------------------------------
class TeiError(BaseModel):
    """TEI's error body."""

    error: str
    error_type: str


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class OpenAIError(BaseModel):
    """TEI's OpenAI-route error body, plus OpenAI's nested ``error`` (what the openai SDK reads)."""

    message: str
    code: int
    type: str
    error: OpenAIErrorDetail


_STATUSES = {400: "empty input, or a body that is not JSON", 401: "missing or wrong API key (when one is set)",
             404: "no such job, or a model this gateway does not serve", 409: "the job was cancelled",
             413: "request body or result too large", 415: "a body sent without Content-Type: application/json",
             422: "invalid request", 424: "the job failed in its worker, or "
             "the model does not serve this route", 429: "the queue is full (Retry-After)",
             503: "no worker, or the broker is unreachable (Retry-After)", 504: "the deadline passed"}


def responses(model: type[BaseModel], *codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": model, "description": _STATUSES[code]} for code in codes}


TEI_ERRORS = responses(TeiError, 400, 401, 404, 409, 413, 415, 422, 424, 429, 503, 504)
OPENAI_ERRORS = responses(OpenAIError, 400, 401, 404, 409, 413, 415, 422, 424, 429, 503, 504)


def _header(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False, "schema": schema, "description": description}


#: The request headers the gateway reads, declared in its OpenAPI document (``openapi_extra``): they are read from
#: the request by hand (``/jobs`` and ``POST /`` read their body by hand too), so FastAPI cannot see them.
MODEL_HEADER = _header("X-Embedq-Model", {"type": "string"},
                       "Which served model (a gateway of several models answers 404 for a name it does not serve).")
CLASS_HEADER = _header("X-Embedq-Class", {"type": "string"},
                       "`bulk` (any case) sends the request's jobs to the bulk queue; anything else: online.")
DEADLINE_HEADER = _header("X-Embedq-Deadline", {"type": "number", "exclusiveMinimum": 0,
                                                "maximum": MAX_DEADLINE_SECONDS},
                          "Seconds the request's jobs may wait to start (at most one week); past it: 504.")
JOB_HEADERS = {"parameters": [MODEL_HEADER, CLASS_HEADER, DEADLINE_HEADER]}
EMPTY_OK = {200: {"description": "healthy (empty body)", "content": {"text/plain": {}}}}


# -- request bodies -----------------------------------------------------------------------------------------
class _Body(BaseModel):
    # extra: clients send fields of other servers (parameters, options). strict: JSON's types as they are, so
    # `true` is no integer (`"dimensions": true` is not 1) and `1` no boolean; an integer still is a number.
    model_config = ConfigDict(extra="ignore", strict=True)


class WindowFields(_Body):
    """The request fields of issue 58 (embedq's own; a client that sends none gets the route's usual behaviour)."""

    long_inputs: Literal["truncate", "error", "windows"] | None = Field(
        default=None, description="embedq: an input longer than the model reads is cut (`truncate`), refused "
        "(`error`: 422 too_many_tokens) or embedded in windows of the model's length (`windows`; an input that "
        "needs more than the worker's max_windows fails the request: 413 too_many_windows naming its index). "
        "Absent: the route's usual behaviour (TEI's `truncate`; the OpenAI route cuts). Given, `truncate` may only "
        "agree with it (true: truncate; false: error or windows), else 422 invalid_option.")
    window_overlap: int | None = Field(
        default=None, ge=0, le=MAX_WINDOW_OVERLAP,
        description="embedq, with long_inputs=windows: tokens each window shares with the one before it (0).")
    pool_windows: bool | None = Field(
        default=None, description="embedq, with long_inputs=windows: true (default): one output per input, pooled "
        "over its windows, in the route's usual shape; false: per input the list of its windows "
        "`{window, start, end, tokens, embedding}` (`[start, end)`: the window's characters of the input; "
        "`embedding`: the route's output for the window). TEI routes: a list of windows per input; OpenAI: "
        "`data[i].embedding` is null and `data[i].windows` holds them, each `embedding` in `encoding_format`.")

    def window_options(self, truncate: bool | None) -> dict[str, Any]:
        """The job options of these fields (none when ``long_inputs`` is absent); ``truncate``: TEI's field as the
        request gave it (None: absent), which must agree with ``long_inputs``."""
        if self.long_inputs is None:
            extra = [name for name in ("window_overlap", "pool_windows") if getattr(self, name) is not None]
            if extra:
                raise errors.InvalidOption(f"{', '.join(extra)} applies only with long_inputs='windows'")
            return {}
        if truncate is not None and truncate != (self.long_inputs == "truncate"):
            raise errors.InvalidOption(f"truncate={str(truncate).lower()} contradicts long_inputs="
                                       f"{self.long_inputs!r}: give one of them")
        options: dict[str, Any] = {"long_inputs": self.long_inputs}
        if self.window_overlap is not None:
            options["window_overlap"] = self.window_overlap
        if self.pool_windows is not None:
            options["pool_windows"] = self.pool_windows
        return options

    @property
    def per_window(self) -> bool:
        """The answer lists each input's windows (``pool_windows: false``)."""
        return self.long_inputs == "windows" and self.pool_windows is False


# TEI's fields with a default and no `null` (serde's ``#[serde(default)]`` on a plain type: `null` is refused, 422)
# are plain types here; only its ``Option`` fields (truncate, prompt_name, dimensions, model, user) take `null`.
class OpenAIEmbeddingRequest(WindowFields):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class _TeiOptions(_Body):
    truncate: bool | None = None
    truncation_direction: Literal["left", "right", "Left", "Right"] = "right"

    def job_options(self) -> dict[str, Any]:
        return {"truncate": True if self.truncate is None else self.truncate,
                "truncation_side": self.truncation_direction.lower()}


#: TEI's ``Input``: a text, one input's token ids, or a batch of texts and id lists mixed.
TeiInput = str | list[int] | list[str | list[int]]


class EmbedRequest(_TeiOptions, WindowFields):
    inputs: TeiInput
    normalize: bool = True
    prompt_name: str | None = None
    dimensions: int | None = None


class TextsRequest(_TeiOptions, WindowFields):
    """``/embed_sparse`` and ``/embed_all``."""

    inputs: TeiInput
    prompt_name: str | None = None


class TokenizeRequest(_Body):
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(_Body):
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class RerankRequest(_TeiOptions):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False


class PredictRequest(_TeiOptions):
    """TEI's ``PredictInput``: a text, a pair ``[a, b]`` (or ``[a]``: one text) — one input, answered as one list of
    scores; or a batch ``[[a], [a, b], ...]`` — one list per input. Three texts, or texts after a list, are refused."""

    inputs: str | list[str] | list[list[str]]
    raw_scores: bool = False


class SimilarityInputs(_Body):
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(_TeiOptions):
    prompt_name: str | None = None


class SimilarityRequest(_Body):
    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None


class VertexRequest(_Body):
    """Google Vertex AI's prediction body (TEI's ``/vertex``): each instance a request body of a TEI route."""

    instances: list[dict[str, Any]]


class JobInputs(BaseModel):
    """The body of a ``/jobs`` job of a kind no TEI route serves (a plugin's): its ``inputs`` and the kind's
    options (checked by the kind's options model when the jobs are sent)."""

    model_config = ConfigDict(extra="allow", strict=True)

    inputs: str | list[Any]


class JobRequest(_Body):
    """``POST /jobs``: the job's ``kind`` — any kind of the kinds table (embed, embed_sparse, embed_all, rerank,
    predict, tokenize, decode, a plugin's) or similarity — and its body: what its TEI route takes, or
    ``{"inputs": ..., <options>}`` for a kind no TEI route serves."""

    kind: str
    body: dict[str, Any]
    webhook: str | None = None  # called with the job's state once it is done (EMBEDQ_WEBHOOK_ALLOW)
    model: str | None = None  # of a gateway's several models (else X-Embedq-Model, else its own)
