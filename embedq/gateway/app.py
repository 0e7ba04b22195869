"""``embedq serve``: TEI's and OpenAI's embedding APIs over the queue (FastAPI on uvicorn).

Each request becomes embedq jobs on the served model's queue (several when it has more inputs than a job may
carry), sent with the producer :class:`~embedq.producers.client.Client` (validation at the edge, backpressure)
and awaited on :class:`~embedq.gateway.results.AsyncResults`: no thread is held while a request waits. The
gateway keeps no state of its own, so any number of replicas can serve the same queues.

Routes of this version: ``POST /v1/embeddings`` and ``/embeddings`` (OpenAI); TEI's ``POST /embed``,
``/embed_sparse``, ``/embed_all``, ``/rerank``, ``/predict``, ``/similarity``, ``/tokenize``, ``/decode`` and
``/`` (and ``/invocations``: the served model's own route, as TEI routes it), ``GET /info``, ``GET /health``,
``GET /metrics``; async jobs: ``POST /jobs``, ``GET /jobs/{id}``, ``DELETE /jobs/{id}``. Error bodies are TEI's
(``{"error", "error_type"}``, its status codes); the OpenAI routes answer TEI's OpenAI shape plus OpenAI's
nested ``error`` object, which the openai SDK reads.
Headers: ``X-Embedq-Class: bulk`` sends a request's jobs to the bulk queue (default: online);
``X-Embedq-Deadline: <seconds>`` drops its jobs if they have not started by then.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse as _StarletteJSON
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from pydantic import ValidationError as PydanticValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from embedq import errors, monitor
from embedq.batching.traffic import BULK, ONLINE
from embedq.broker import tls_options
from embedq.gateway.results import AsyncResults
from embedq.gateway.webhooks import Webhooks, check_url
from embedq.keys import GATEWAY_JOB_KEY
from embedq.producers.client import DEADLINE_GRACE, DEFAULT_RESULT_TIMEOUT, Client, decode_output
from embedq.protocol import MAX_DEADLINE_SECONDS, decode_result, id_lists
from embedq.settings import Settings
from embedq.version import __version__

log = logging.getLogger(__name__)

#: Routes anyone may call when an API key is set (TEI's public routes).
PUBLIC = frozenset({"/health", "/ping", "/metrics", "/docs", "/openapi.json", "/docs/oauth2-redirect"})
#: Seconds a read of the live-worker registry is reused (``/health``, ``/info``).
REGISTRY_TTL = 1.0
#: Seconds an overloaded client is told to wait (``Retry-After``).
RETRY_AFTER = 1
#: Seconds between looks, while requests wait, at whether Redis restarted or lost its data (then: resend).
EPOCH_CHECK = 1.0


class JSONResponse(_StarletteJSON):
    """JSON by orjson: numpy arrays are written as they are (float32 in float32's shortest form, as TEI's serde
    writes them: shorter than float64's digits, and the same float32 once read back), several times faster
    than ``json.dumps`` of ``tolist()`` on a request's vectors. NaN is written as ``null``, never as ``NaN``."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


# -- errors -------------------------------------------------------------------------------------------------
def http_status(exc: errors.EmbedqError) -> tuple[int, str]:
    """(HTTP status, TEI ``error_type``) of an embedq error, by TEI's mapping."""
    if isinstance(exc, (JobNotFound, ModelNotFound)):
        return 404, "NotFound"
    if isinstance(exc, (errors.EmptyInput, errors.EmptyText)):
        return 400, "Empty"
    if isinstance(exc, errors.ResultTooLarge):
        return 413, "Backend"
    if isinstance(exc, errors.PayloadTooLarge):
        return 413, "Validation"
    if isinstance(exc, errors.UnsupportedTask):  # TEI: a route the model's type does not serve
        return 424, "Backend"
    if isinstance(exc, errors.ValidationError):
        return 422, "Validation"
    if isinstance(exc, errors.Overloaded):
        return 429, "Overloaded"
    if isinstance(exc, errors.Cancelled):  # the client went away (nginx's 499) or cancelled its job
        return 499, "Cancelled"
    if isinstance(exc, (errors.Expired, errors.JobTimeout)):
        return 504, "Timeout"
    if isinstance(exc, errors.Unavailable):
        return 503, "Unhealthy"
    return 424, "Backend"  # the job failed in its worker: BackendError, UnsupportedModel, dead letters


def _headers(status: int) -> dict[str, str]:
    if status in (429, 503):
        return {"Retry-After": str(RETRY_AFTER)}
    if status >= 500:
        return {"x-should-retry": "false"}
    return {}


def tei_error(status: int, error_type: str, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status, headers=_headers(status))


def openai_error(status: int, error_type: str, message: str) -> JSONResponse:
    """TEI's OpenAI-route body plus OpenAI's nested ``error`` object (the openai SDK reads the latter)."""
    body = {"message": message, "code": status, "type": error_type,
            "error": {"message": message, "type": error_type, "param": None, "code": str(status)}}
    return JSONResponse(body, status_code=status, headers=_headers(status))


def _is_openai(request: Request) -> bool:
    return request.url.path in ("/v1/embeddings", "/embeddings", "/v1/models", "/models")


def _error_response(request: Request, status: int, error_type: str, message: str) -> JSONResponse:
    return (openai_error if _is_openai(request) else tei_error)(status, error_type, message)


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
             404: "no such job, or a model this gateway does not serve",
             413: "request body or result too large", 422: "invalid request", 424: "the job failed in its worker, or "
             "the model does not serve this route", 429: "the queue is full (Retry-After)", 499: "cancelled",
             503: "no worker, or the broker is unreachable (Retry-After)", 504: "the deadline passed"}


def _responses(model: type[BaseModel], *codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": model, "description": _STATUSES[code]} for code in codes}


TEI_ERRORS = _responses(TeiError, 400, 401, 404, 413, 422, 424, 429, 499, 503, 504)
OPENAI_ERRORS = _responses(OpenAIError, 400, 401, 404, 413, 422, 424, 429, 499, 503, 504)


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


class OpenAIEmbeddingRequest(_Body):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class _TeiOptions(_Body):
    truncate: bool | None = None
    truncation_direction: Literal["left", "right", "Left", "Right"] | None = None

    def job_options(self) -> dict[str, Any]:
        return {"truncate": True if self.truncate is None else self.truncate,
                "truncation_side": (self.truncation_direction or "right").lower()}


class EmbedRequest(_TeiOptions):
    inputs: str | list[str] | list[int] | list[list[int]]
    normalize: bool | None = True
    prompt_name: str | None = None
    dimensions: int | None = None


class TextsRequest(_TeiOptions):
    """``/embed_sparse`` and ``/embed_all``."""

    inputs: str | list[str] | list[int] | list[list[int]]
    prompt_name: str | None = None


class TokenizeRequest(_Body):
    inputs: str | list[str]
    add_special_tokens: bool | None = True
    prompt_name: str | None = None


class DecodeRequest(_Body):
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool | None = True


class RerankRequest(_TeiOptions):
    query: str
    texts: list[str]
    raw_scores: bool | None = False
    return_text: bool | None = False


class PredictRequest(_TeiOptions):
    inputs: str | list[str] | list[list[str]]
    raw_scores: bool | None = False


class SimilarityInputs(_Body):
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(_TeiOptions):
    prompt_name: str | None = None


class SimilarityRequest(_Body):
    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None


class JobRequest(_Body):
    """``POST /jobs``: the job's ``kind`` (embed, embed_sparse, embed_all, rerank, predict, tokenize, decode,
    similarity) and the body its TEI route takes."""

    kind: str
    body: dict[str, Any]
    webhook: str | None = None  # called with the job's state once it is done (EMBEDQ_WEBHOOK_ALLOW)
    model: str | None = None  # of a gateway's several models (else X-Embedq-Model, else its own)


class JobNotFound(errors.ValidationError):
    code = "job_not_found"


class ModelNotFound(errors.ValidationError):
    code = "model_not_found"


def _texts(inputs: Any) -> list[str]:
    """Strings as a list; token-id arrays are refused (never read as text)."""
    if isinstance(inputs, str):
        return [inputs]
    if any(not isinstance(x, str) for x in inputs):
        raise errors.InvalidType("token-id inputs are not supported by this gateway; send the texts")
    return list(inputs)


# -- the gateway --------------------------------------------------------------------------------------------
def _as_job(items: list[Any]) -> Any:
    return items


@dataclass
class Plan:
    """What a request asks for: the kind of its jobs (``Client.submit_many``'s ``kind``), its items (split into
    jobs), the job options, how the jobs' result payloads become the route's answer, and how a slice of the items
    becomes one job's input (rerank: the query with it)."""

    kind: str
    items: list[Any]
    options: dict[str, Any]
    answer: Callable[[list[dict[str, Any]]], Any]
    job: Callable[[list[Any]], Any] = _as_job


def served_models(settings: Settings) -> dict[str, Settings]:
    """The models a gateway serves, by the name a request gives (OpenAI's ``model``, ``X-Embedq-Model``): the
    settings' own model, then each entry of ``EMBEDQ_GATEWAY_MODELS`` (``name`` or ``name=queue``; a bare name is
    a model id and its queue the one a worker of that model consumes by default)."""
    models = {settings.model: settings}
    for entry in (e.strip() for e in (settings.gateway_models or "").split(",") if e.strip()):
        name, _, queue = (part.strip() for part in entry.partition("="))
        if not name:
            raise errors.InvalidOption(f"EMBEDQ_GATEWAY_MODELS: an entry has no name ({entry!r})")
        models[name] = settings.model_copy(update={"model": name, "queue": queue or None, "bulk_queue": None})
    return models


class Gateway:
    """The client, the result waiter and the registry reads one gateway process shares between requests."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models = served_models(settings)
        self.client = Client(settings, follow_results=False)
        self.results: AsyncResults | None = None
        self._registry: tuple[float, list[dict[str, Any]]] = (0.0, [])
        self.meter = GatewayMetrics()
        self._cancelling: set[asyncio.Future[Any]] = set()  # cancels of jobs sent for requests gone meanwhile
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        url = self.settings.result_url or self.settings.broker_url
        tls = tls_options(self.settings.model_copy(update={"broker_url": url})) or {}
        self.results = AsyncResults(self.client.app, url, **tls)
        await self.results.start()
        self._watch = asyncio.create_task(self._watch_broker(), name="embedq-gateway-broker-epoch")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.results is not None:
            await self.results.close()
        self.client.close()

    async def _watch_broker(self) -> None:
        """While requests wait: has Redis restarted or lost its data since their jobs were sent? Then the jobs
        still waiting are sent again under their ids (``Client.resend_lost``; a worker that holds or has stored
        a job takes the copy as the same job), as a blocking ``JobHandle.result`` does for its own."""
        while True:
            await asyncio.sleep(EPOCH_CHECK)
            if not self.client.pending:
                continue
            try:
                epoch = await asyncio.to_thread(self.client.epoch, refresh=True)
                await asyncio.to_thread(self.client.resend_lost, epoch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis is away: the next look tries again
                log.warning("cannot check the broker for lost jobs (%s: %s)", type(exc).__name__, exc)

    def target(self, request: Request, model: str | None = None) -> tuple[str, Settings]:
        """The model a request is for, and its settings (its queues): ``model`` (OpenAI's field), else the
        ``X-Embedq-Model`` header, else the gateway's own model. A gateway of one model takes any name (and
        answers with it, as TEI does); a gateway of several refuses a name it does not serve (404)."""
        name = model or request.headers.get("x-embedq-model") or self.settings.model
        if name in self.models:
            return name, self.models[name]
        if len(self.models) == 1:
            return name, self.settings
        short = {k.rstrip("/").rsplit("/", 1)[-1]: k for k in self.models}  # "all-MiniLM-L6-v2" for a repo id
        if name in short:
            return name, self.models[short[name]]
        raise ModelNotFound(f"The model `{name}` is not served here (served: {', '.join(self.models)})")

    async def workers(self, target: Settings | None = None) -> list[dict[str, Any]]:
        """Live workers serving ``target``'s online queue (default: the gateway's own model; the registry is
        re-read at most once a second)."""
        at, records = self._registry
        if time.monotonic() - at > REGISTRY_TTL:
            records = await asyncio.to_thread(monitor.live_workers, self.client.redis())
            self._registry = (time.monotonic(), records)
        queue = (target or self.settings).queue_name
        return [r for r in records if r.get("ready") and queue in (r.get("queues") or [])]

    async def send(self, request: Request, plan: Plan, model: str | None = None) -> list[Any]:
        """``plan``'s items as jobs of at most ``max_texts_per_job`` items, sent to the queue of the request's
        model (:meth:`target`) together (``Client.submit_many``: one round trip, nothing sent unless every job
        is valid and admitted): their handles, in order."""
        if not plan.items:
            raise errors.EmptyInput("Input validation error: `inputs` cannot be empty")
        cap = self.settings.max_client_batch_size
        if len(plan.items) > cap:  # TEI's wording and status (422)
            raise errors.TooManyInputs(f"Input validation error: batch size {len(plan.items)} > maximum allowed batch "
                                       f"size {cap} (EMBEDQ_MAX_CLIENT_BATCH_SIZE)")
        traffic_class = BULK if request.headers.get("x-embedq-class", "").lower() == BULK else ONLINE
        deadline = _deadline(request)
        queue = self.target(request, model)[1].queue_for(traffic_class)
        size = self.settings.max_texts_per_job
        jobs = [plan.job(plan.items[i:i + size]) for i in range(0, len(plan.items), size)]
        sending = asyncio.ensure_future(asyncio.to_thread(
            self.client.submit_many, jobs, kind=plan.kind, queue=queue, traffic_class=traffic_class,
            deadline=deadline, **plan.options))
        try:
            return await asyncio.shield(sending)
        except asyncio.CancelledError:
            # the thread sends the jobs all the same: cancel them once it has, nobody will read them
            sending.add_done_callback(self._cancel_sent)
            raise

    def _cancel_sent(self, sending: asyncio.Future[Any]) -> None:
        if sending.cancelled() or sending.exception() is not None:
            return
        cancelling = asyncio.ensure_future(asyncio.gather(*(self._forget(h) for h in sending.result())))
        self._cancelling.add(cancelling)
        cancelling.add_done_callback(self._cancelling.discard)

    async def run(self, request: Request, plan: Plan, model: str | None = None) -> Any:
        """``plan`` sent and awaited: its answer."""
        assert self.results is not None
        handles = await self.send(request, plan, model)
        deadline = _deadline(request)
        # past its deadline (and a grace for a job that started just in time) no result will come
        timeout = DEFAULT_RESULT_TIMEOUT if deadline is None else deadline + DEADLINE_GRACE
        waiting = asyncio.ensure_future(asyncio.gather(*(self.results.wait(h.id, timeout) for h in handles),
                                                       return_exceptions=True))
        # The body has been read, so the server's next message for this request is its client leaving: one
        # waiter per request, woken at once, instead of a look every so often.
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                self.meter.disconnects.inc()  # nobody reads the answer: the jobs must not cost compute
                raise errors.Cancelled("the client disconnected; its jobs were cancelled")
            outcomes = waiting.result()
        except BaseException:
            waiting.cancel()
            waiting.add_done_callback(_retrieve)  # its cancellation is expected: not "never retrieved"
            await asyncio.gather(*(self._forget(h) for h in handles))
            raise
        finally:
            gone.cancel()
        for handle in handles:  # answered: nothing to send again if Redis restarts now
            self.client.pending.discard(handle)
        for outcome in outcomes:
            if isinstance(outcome, errors.JobTimeout) and deadline is not None:
                await asyncio.gather(*(self._forget(h) for h in handles))
                raise errors.Expired(f"the request's jobs did not run within its deadline ({deadline:g}s)")
            if isinstance(outcome, BaseException):
                raise outcome
        return plan.answer(list(outcomes))

    async def _forget(self, handle: Any) -> None:
        self.client.pending.discard(handle)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.client.cancel, handle.id)


class GatewayMetrics:
    """The gateway's own Prometheus metrics (``GET /metrics``): requests by route and status, their latency by
    route, requests in flight, disconnects."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("embedq_gateway_requests", "HTTP requests answered, by route and status.",
                                ["route", "status"], registry=self.registry)
        self.seconds = Histogram("embedq_gateway_request_seconds", "Time to answer a request, by route.", ["route"],
                                 registry=self.registry,
                                 buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.in_flight = Gauge("embedq_gateway_requests_in_flight", "Requests being answered.", registry=self.registry)
        self.disconnects = Counter("embedq_gateway_disconnects", "Requests whose client went away before the "
                                   "answer (their jobs cancelled).", registry=self.registry)
        self.webhooks = Counter("embedq_gateway_webhooks", "Webhooks of async jobs, by outcome (delivered, "
                                "failed).", ["outcome"], registry=self.registry)


class MetricsMiddleware:
    """Counts and times every request (plain ASGI, outermost, so refusals count too). Paths that are not routes
    count as ``other``: a scanner cannot grow the label set."""

    def __init__(self, app: Any, meter: GatewayMetrics, routes: frozenset[str]) -> None:
        self.app, self.meter, self.routes = app, meter, routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        status = [500]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        started = time.perf_counter()
        self.meter.in_flight.inc()
        try:
            await self.app(scope, receive, sending)
        finally:
            self.meter.in_flight.dec()
            self.meter.seconds.labels(route).observe(time.perf_counter() - started)
            self.meter.requests.labels(route, str(status[0])).inc()


class PayloadLimit:
    """Refuses a request body over ``limit`` bytes with 413 and TEI's error body (plain ASGI): by its Content-Length
    before reading any of it, or, for a body without one (``Transfer-Encoding: chunked``), as soon as what has come
    passes the limit; the rest is never read. A chunked body within the limit is read here and handed on as it
    came (the routes read a whole body anyway), so the refusal never depends on how a route reads its body (a
    failure inside FastAPI's body read would be its 400)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            digits = length.strip().lstrip(b"0") or b"0"
            if digits.isdigit() and (len(digits) > 18 or int(digits) > self.limit):
                await self._refuse(scope, receive, send)
                return
            if b"transfer-encoding" not in headers:  # the server holds the body to its Content-Length
                await self.app(scope, receive, send)
                return
        messages: list[Any] = []
        seen = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client left
                break
            seen += len(message.get("body", b""))
            if seen > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        await tei_error(413, "Validation", f"the request body is over {self.limit} bytes "
                        "(EMBEDQ_GATEWAY_PAYLOAD_LIMIT)")(scope, receive, send)


class HeadAsGet:
    """``HEAD`` answered as ``GET`` without its body, on every route that answers GET (load balancers probe
    ``/health`` with HEAD; FastAPI's routes take only the methods they name). Plain ASGI."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Any) -> None:
            if message["type"] == "http.response.body":  # the GET's headers (its Content-Length too), no body
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class BearerAuth:
    """``Authorization: Bearer <key>``, exact match, compared in constant time, on every route but :data:`PUBLIC`;
    otherwise a bare 401, as TEI answers. Plain ASGI (no ``BaseHTTPMiddleware``), so the routes still see a
    client's disconnect."""

    def __init__(self, app: Any, key: bytes) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not (scope["path"] in PUBLIC or (scope["path"] == "/" and
                                                                         scope.get("method") == "GET")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token, self.key):
                await Response(status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _disconnected(request: Request) -> None:
    """Returns when the request's client has gone (the ASGI server's ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


#: Headers in which clients say how long they will wait: the OpenAI SDKs' (Python: its read timeout; Node).
CLIENT_TIMEOUT_HEADERS = ("x-stainless-read-timeout", "x-stainless-timeout")
#: Seconds as a header gives them: a plain decimal number (no sign, no "inf", "nan" or "1_0", which float() takes).
_SECONDS = re.compile(r"\s*(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _seconds(value: str | None) -> float | None:
    """A header's seconds (``inf`` when it overflows a float), or None when it is not a plain number."""
    return float(value) if value is not None and _SECONDS.fullmatch(value) else None


def _deadline(request: Request) -> float | None:
    """Seconds the request's jobs may wait to start: ``X-Embedq-Deadline`` (more than 0, at most
    :data:`~embedq.protocol.MAX_DEADLINE_SECONDS`, else 422), else the client's own timeout when it sends it (past
    it the client has given up, and its SDK may be retrying: the first jobs would be wasted)."""
    value = request.headers.get("x-embedq-deadline")
    if value is None or value == "":
        for name in CLIENT_TIMEOUT_HEADERS:
            seconds = _seconds(request.headers.get(name))
            if seconds is not None and seconds > 0:  # else absent or not a number: not ours to refuse
                return min(seconds, DEFAULT_RESULT_TIMEOUT)  # clamped: a huge (or inf) one reaches no clock
        return None
    seconds = _seconds(value)
    if seconds is None or not 0 < seconds <= MAX_DEADLINE_SECONDS:
        raise errors.InvalidOption(f"X-Embedq-Deadline must be seconds, more than 0 and at most "
                                   f"{MAX_DEADLINE_SECONDS} (one week), got {value[:40]!r}")
    return seconds


def _vectors(payloads: list[dict[str, Any]]) -> tuple[np.ndarray, int]:
    vectors = [decode_result(p)[0] for p in payloads]
    tokens = sum(int((p.get("usage") or {}).get("tokens", 0)) for p in payloads)
    return (np.concatenate(vectors) if len(vectors) > 1 else vectors[0]), tokens


def create_app(settings: Settings | None = None, *, api_key: str | None = None) -> FastAPI:
    """The ASGI app. ``api_key``: when set, every route but :data:`PUBLIC` needs ``Authorization: Bearer <key>``."""
    settings = settings or Settings()
    gateway = Gateway(settings)
    meter = gateway.meter

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        assert gateway.results is not None
        secret = (settings.webhook_secret.get_secret_value() if settings.webhook_secret else "").encode() or None
        hooks = Webhooks(gateway.results.redis, secret=secret, attempts=settings.webhook_attempts,
                         lease=settings.webhook_lease,
                         record=stored_record, wait=wait_record, state=job_state, save=save_record,
                         on_outcome=lambda outcome: meter.webhooks.labels(outcome).inc(),
                         allow=settings.webhook_allow, timeout=settings.webhook_timeout,
                         response_limit=settings.webhook_response_limit)
        webhooks.append(hooks)
        await hooks.start()
        try:
            yield
        finally:
            await hooks.close()
            await gateway.close()

    app = FastAPI(title="embedq gateway", version=__version__, lifespan=lifespan,
                  description="TEI's and OpenAI's embedding APIs over embedq's queue.")
    key = api_key.encode() if api_key else None

    if key is not None:
        app.add_middleware(BearerAuth, key=key)
    app.add_middleware(PayloadLimit, limit=settings.gateway_payload_limit)
    app.add_middleware(HeadAsGet)  # outside BearerAuth: HEAD / is as public as GET /
    origins = [o.strip() for o in (settings.cors_allow_origins or "").split(",") if o.strip()]
    if origins:  # off unless configured (TEI allows any origin by default; we do not)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["content-type", "authorization"])

    @app.exception_handler(errors.EmbedqError)
    async def embedq_error(request: Request, exc: errors.EmbedqError) -> JSONResponse:
        status, error_type = http_status(exc)
        return _error_response(request, status, error_type, str(exc))

    @app.exception_handler(RedisError)
    async def redis_error(request: Request, exc: RedisError) -> JSONResponse:  # the broker is away or refusing
        log.warning("%s %s: Redis error (%s: %s)", request.method, request.url.path, type(exc).__name__, exc)
        return _error_response(request, 503, "Unhealthy", f"the broker cannot be reached ({type(exc).__name__})")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code in (404, 405):  # no such route: the framework's own answer
            return JSONResponse({"error": str(exc.detail), "error_type": "NotFound"}, status_code=exc.status_code)
        message = f"Input validation error: {exc.detail}" if exc.status_code < 500 else str(exc.detail)
        return _error_response(request, exc.status_code, "Validation" if exc.status_code < 500 else "Backend",
                               message)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        return _error_response(request, 422, "Validation", f"Input validation error: {problems}")

    client = gateway.client

    def _options(**options: Any) -> dict[str, Any]:
        return {k: v for k, v in options.items() if v is not None}

    def decoded(kind: str) -> Callable[[list[dict[str, Any]]], list[Any]]:
        return lambda payloads: [decode_output(kind, p) for p in payloads]

    def embed_plan(texts: list[str], answer: Callable[[np.ndarray, int], Any], **options: Any) -> Plan:
        return Plan("embed", texts, _options(**options), lambda payloads: answer(*_vectors(payloads)))

    def plan_embed(body: EmbedRequest) -> Plan:
        return embed_plan(_texts(body.inputs), lambda vectors, tokens: vectors, normalize=body.normalize,
                          dimensions=body.dimensions, prompt_name=body.prompt_name, **body.job_options())

    def plan_sparse(body: TextsRequest) -> Plan:
        answer = decoded("embed_sparse")
        return Plan("embed_sparse", _texts(body.inputs),
                    _options(prompt_name=body.prompt_name, **body.job_options()),
                    lambda payloads: [v.to_tei() for chunk in answer(payloads) for v in chunk])

    def plan_all(body: TextsRequest) -> Plan:
        answer = decoded("embed_all")
        return Plan("embed_all", _texts(body.inputs),
                    _options(prompt_name=body.prompt_name, **body.job_options()),
                    lambda payloads: [m for chunk in answer(payloads) for m in chunk])

    def plan_rerank(body: RerankRequest) -> Plan:
        def answer(payloads: list[dict[str, Any]]) -> Any:
            size = settings.max_texts_per_job
            ranked = [{"index": e["index"] + n * size, "score": e["score"]}
                      for n, chunk in enumerate(decoded("rerank")(payloads)) for e in chunk]
            ranked.sort(key=lambda e: (-e["score"], e["index"]))
            if body.return_text:
                ranked = [{"index": e["index"], "text": body.texts[e["index"]], "score": e["score"]} for e in ranked]
            return ranked

        return Plan("rerank", body.texts, _options(raw_scores=bool(body.raw_scores), **body.job_options()), answer,
                    lambda texts: (body.query, texts))

    def plan_predict(body: PredictRequest) -> Plan:
        inputs = body.inputs  # TEI: "text" and ["a", "b"] (a pair) are one input; anything else a batch
        single = isinstance(inputs, str) or (len(inputs) == 2 and all(isinstance(x, str) for x in inputs))
        items: list[Any] = [inputs] if single else [[x] if isinstance(x, str) else list(x) for x in inputs]
        for item in items:
            if isinstance(item, list) and len(item) not in (1, 2):
                raise errors.InvalidType(f"a /predict input is a text or a pair of texts, got {len(item)} texts")
        items = [item[0] if isinstance(item, list) and len(item) == 1 else item for item in items]

        def answer(payloads: list[dict[str, Any]]) -> Any:
            scores = [row for chunk in decoded("predict")(payloads) for row in chunk]
            return scores[0] if single else scores

        return Plan("predict", items, _options(raw_scores=bool(body.raw_scores), **body.job_options()),
                    answer)

    def plan_tokenize(body: TokenizeRequest) -> Plan:
        texts = _texts(body.inputs)

        def answer(payloads: list[dict[str, Any]]) -> Any:
            size, out = settings.max_texts_per_job, []
            for n, payload in enumerate(payloads):  # TEI's offsets are bytes of the prompted text; none on specials
                for text, tokens in zip(texts[n * size:(n + 1) * size], decode_output("tokenize", payload)):
                    seen = (payload.get("prompt") or "") + text
                    for t in tokens:
                        if t["special"]:
                            t["start"] = t["stop"] = None
                        else:
                            t["start"] = len(seen[:t["start"]].encode())
                            t["stop"] = len(seen[:t["stop"]].encode())
                    out.append(tokens)
            return out

        return Plan("tokenize", texts, _options(add_special_tokens=body.add_special_tokens,
                                                prompt_name=body.prompt_name), answer)

    def plan_decode(body: DecodeRequest) -> Plan:
        lists = id_lists(body.ids)
        skip = True if body.skip_special_tokens is None else body.skip_special_tokens
        return Plan("decode", lists, {"skip_special_tokens": skip},
                    lambda payloads: [t for p in payloads for t in decode_output("decode", p)])

    def plan_similarity(body: SimilarityRequest) -> Plan:
        params = body.parameters or SimilarityParameters()
        if not body.inputs.sentences:
            raise errors.EmptyInput("Input validation error: `sentences` cannot be empty")

        def answer(vectors: np.ndarray, tokens: int) -> list[float]:
            v = vectors.astype(np.float64)
            norms = np.linalg.norm(v, axis=1)
            return [float(c) for c in v[1:] @ v[0] / np.maximum(norms[1:] * norms[0], 1e-300)]

        return embed_plan([body.inputs.source_sentence, *body.inputs.sentences], answer, normalize=False,
                          prompt_name=params.prompt_name, **params.job_options())

    async def openai_embeddings(request: Request, body: OpenAIEmbeddingRequest) -> Response:
        def answer(vectors: np.ndarray, tokens: int) -> dict[str, Any]:
            vectors = np.ascontiguousarray(vectors, dtype="<f4")
            if body.encoding_format == "base64":
                data: list[Any] = [base64.b64encode(v.tobytes()).decode("ascii") for v in vectors]
            else:
                data = list(vectors)
            return {"object": "list", "model": name,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                    "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)]}

        name = gateway.target(request, body.model)[0]
        return JSONResponse(await gateway.run(request, embed_plan(_texts(body.input), answer, normalize=True,
                                                                  dimensions=body.dimensions), body.model))

    app.post("/v1/embeddings", summary="OpenAI embeddings", responses=OPENAI_ERRORS,
             openapi_extra=JOB_HEADERS)(openai_embeddings)
    app.post("/embeddings", summary="OpenAI embeddings (without /v1)", responses=OPENAI_ERRORS,
             openapi_extra=JOB_HEADERS)(openai_embeddings)

    # TEI's routes, /jobs and POST / from one table: path -> (job kind, request body, its plan, summary)
    tei_routes: dict[str, tuple[str, type[BaseModel], Callable[[Any], Plan], str]] = {
        "/embed": ("embed", EmbedRequest, plan_embed, "TEI: dense embeddings"),
        "/embed_sparse": ("embed_sparse", TextsRequest, plan_sparse, "TEI: SPLADE sparse vectors"),
        "/embed_all": ("embed_all", TextsRequest, plan_all, "TEI: every token's last hidden state"),
        "/rerank": ("rerank", RerankRequest, plan_rerank, "TEI: a query against texts, best first"),
        "/predict": ("predict", PredictRequest, plan_predict, "TEI: sequence classification of texts or text pairs"),
        "/tokenize": ("tokenize", TokenizeRequest, plan_tokenize,
                      "TEI: the tokens the model sees (byte offsets; truncated at its limit)"),
        "/decode": ("decode", DecodeRequest, plan_decode, "TEI: token ids back to text (the model's tokenizer)"),
        "/similarity": ("similarity", SimilarityRequest, plan_similarity,
                        "TEI: cosine similarity of a sentence to others"),
    }
    planners = {kind: (model, planner) for kind, model, planner, _ in tei_routes.values()}

    def tei_endpoint(kind: str, model: type[BaseModel], planner: Callable[[Any], Plan]) -> Callable[..., Any]:
        async def endpoint(request: Request, body: Any) -> Response:
            return JSONResponse(await gateway.run(request, planner(body)))

        endpoint.__name__ = kind
        endpoint.__annotations__ = {"request": Request, "body": model, "return": Response}  # FastAPI reads the body
        return endpoint

    for path, (kind, model, planner, summary) in tei_routes.items():
        app.post(path, summary=summary, responses=TEI_ERRORS, openapi_extra=JOB_HEADERS)(
            tei_endpoint(kind, model, planner))

    def parse(model: type[BaseModel], payload: Any) -> Any:
        """A body read by hand (``/jobs``, ``POST /``) validated like a route's own, with the same 422."""
        try:
            return model.model_validate(payload)
        except PydanticValidationError as exc:
            raise RequestValidationError(exc.errors()) from None

    # -- async jobs: a web app that should not wait posts, then polls (or deletes) ------------------------------
    def job_plan(record: dict[str, Any]) -> Plan:
        model, planner = planners[record["kind"]]
        return planner(model.model_validate(record["body"]))

    webhooks: list[Webhooks] = []  # the lifespan's (one)

    @app.post("/jobs", status_code=202, summary="Start a job of any kind; answers at once with its id (and calls "
              "its webhook, if it names one, once it is done)", responses=TEI_ERRORS, openapi_extra=JOB_HEADERS)
    async def create_job(request: Request, body: JobRequest) -> Response:
        if body.kind not in planners:
            raise errors.InvalidOption(f"unknown job kind {body.kind!r} (known: {', '.join(planners)})")
        # the URL normalised (dot segments, escapes, case, default port): the one checked is the one called
        webhook = check_url(body.webhook, settings.webhook_allow) if body.webhook is not None else None
        model, planner = planners[body.kind]
        parsed = parse(model, body.body)
        handles = await gateway.send(request, planner(parsed), body.model)
        job_id = uuid.uuid4().hex  # random: a job id cannot be guessed
        # the validated request, not the raw body: fields the route does not know are dropped (as every route
        # ignores them), so they cost no Redis memory for EMBEDQ_RESULT_TTL
        stored = parsed.model_dump(mode="json", exclude_unset=True)
        record: dict[str, Any] = {"kind": body.kind, "body": stored, "jobs": [h.id for h in handles],
                                  "model": gateway.target(request, body.model)[0], "created": time.time()}
        if webhook is not None:
            record["webhook"] = {"url": webhook, "state": "pending"}
        await gateway.results.redis.set(GATEWAY_JOB_KEY.format(job_id), json.dumps(record), ex=settings.result_ttl)
        if webhook is not None:
            await webhooks[0].owe(job_id)
        return JSONResponse({"id": job_id, "status": "queued"}, status_code=202,
                            headers={"Location": f"/jobs/{job_id}"})

    async def stored_record(job_id: str) -> dict[str, Any] | None:
        raw = await gateway.results.redis.get(GATEWAY_JOB_KEY.format(job_id))
        return None if raw is None else json.loads(raw)

    async def save_record(job_id: str, record: dict[str, Any]) -> None:
        await gateway.results.redis.set(GATEWAY_JOB_KEY.format(job_id), json.dumps(record), keepttl=True)

    async def job_record(job_id: str) -> dict[str, Any]:
        record = await stored_record(job_id)
        if record is None:
            raise JobNotFound(f"no job {job_id!r} (unknown, deleted, or older than EMBEDQ_RESULT_TTL)")
        return record

    async def wait_record(record: dict[str, Any]) -> None:
        """Until every embedq job of an async job has an outcome (kept in Redis for GET /jobs)."""
        await asyncio.gather(*(gateway.results.wait(j, settings.result_ttl, forget=False) for j in record["jobs"]),
                             return_exceptions=True)

    async def job_state(job_id: str, record: dict[str, Any]) -> dict[str, Any]:
        """What ``GET /jobs/{id}`` answers (and a webhook is sent)."""
        results = gateway.results
        stored = await results.redis.mget([results.key(j) for j in record["jobs"]])
        hook = {"webhook": record["webhook"]} if "webhook" in record else {}
        if any(raw is None for raw in stored):
            done = sum(raw is not None for raw in stored)
            return {"id": job_id, "status": "queued", "done_jobs": done, "jobs": len(stored), **hook}
        try:
            payloads = [results.decode(raw) for raw in stored]
        except errors.EmbedqError as exc:
            status, error_type = http_status(exc)
            return {"id": job_id, "status": "failed", "code": status,
                    "error": {"error": str(exc), "error_type": error_type}, **hook}
        return {"id": job_id, "status": "done", "result": job_plan(record).answer(payloads), **hook}

    @app.get("/jobs/{job_id}", summary="A job's status, and its answer once done",
             responses=_responses(TeiError, 401, 404, 503))
    async def get_job(job_id: str) -> Response:
        return JSONResponse(await job_state(job_id, await job_record(job_id)))

    @app.delete("/jobs/{job_id}", summary="Cancel a job (its work is dropped unrun) and delete its results",
                responses=_responses(TeiError, 401, 404, 503))
    async def delete_job(job_id: str) -> Response:
        record = await job_record(job_id)
        if "webhook" in record:  # nothing is owed for a deleted job
            webhooks[0].cancel(job_id)
            await webhooks[0].settle(job_id)
        cancelled = [await asyncio.to_thread(client.cancel, j) for j in record["jobs"]]
        await gateway.results.redis.delete(GATEWAY_JOB_KEY.format(job_id),
                                           *[gateway.results.key(j) for j in record["jobs"]])
        return JSONResponse({"id": job_id, "status": "cancelled" if any(cancelled) else "deleted"})

    @app.post("/", summary="TEI: the served model's own route (embed, rerank, predict or embed_sparse)",
              responses=TEI_ERRORS, openapi_extra=JOB_HEADERS)
    @app.post("/invocations", summary="SageMaker's path of POST /", responses=TEI_ERRORS, openapi_extra=JOB_HEADERS)
    async def root(request: Request) -> Response:
        workers = await gateway.workers(gateway.target(request)[1])
        kinds = set((workers[0].get("kinds") or []) if workers else [])
        try:
            payload = await request.json()
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes (other routes: 400)
            raise errors.InvalidType("Input validation error: the body is not JSON, or is nested too deeply") from None
        kind = next((k for k in ("rerank", "predict", "embed_sparse") if k in kinds), "embed")  # TEI's order
        model, planner = planners[kind]
        return JSONResponse(await gateway.run(request, planner(parse(model, payload))))

    @app.get("/metrics", summary="Prometheus: the gateway's requests, latencies, disconnects (public)",
             response_class=Response,
             responses={200: {"description": "Prometheus text", "content": {"text/plain": {}}}})
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(meter.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", summary="TEI: health (GET)", response_class=Response,
             responses={**EMPTY_OK, **_responses(TeiError, 503)})
    @app.get("/ping", summary="SageMaker's health path", response_class=Response,
             responses={**EMPTY_OK, **_responses(TeiError, 503)})
    async def ping() -> Response:
        return await health()

    @app.get("/health", summary="200 when a worker serves the model, else 503", response_class=Response,
             responses={**EMPTY_OK, **_responses(TeiError, 503)})
    async def health() -> Response:
        if await gateway.workers():
            return Response(status_code=200, media_type="text/plain")
        return tei_error(503, "Unhealthy", "unhealthy")

    @app.get("/v1/models", summary="OpenAI: the models this gateway serves (ready: a live worker serves it)",
             responses=_responses(OpenAIError, 401))
    @app.get("/models", summary="OpenAI: the models this gateway serves (without /v1)",
             responses=_responses(OpenAIError, 401))
    async def list_models() -> Response:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "embedq",
                 "ready": bool(await gateway.workers(target))} for name, target in gateway.models.items()]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/info", summary="TEI's model and router information (X-Embedq-Model: of which model)",
             responses=_responses(TeiError, 401, 404, 503), openapi_extra={"parameters": [MODEL_HEADER]})
    async def info(request: Request) -> dict[str, Any]:
        name, target = gateway.target(request)
        workers = await gateway.workers(target)
        if not workers:
            raise errors.Unavailable(f"no live worker serves queue {target.queue_name}")
        w = workers[0]
        kinds = w.get("kinds") or []
        labels = w.get("labels") or []
        if "rerank" in kinds:
            model_type: dict[str, Any] = {"reranker": {"id2label": dict(enumerate(labels)),
                                                       "label2id": {v: i for i, v in enumerate(labels)}}}
        elif "predict" in kinds:
            model_type = {"classifier": {"id2label": dict(enumerate(labels)),
                                         "label2id": {v: i for i, v in enumerate(labels)}}}
        else:
            model_type = {"embedding": {"pooling": str(w.get("pooling", "")).replace("lasttoken", "last_token")}}
        return {"model_id": w.get("model", name), "model_sha": w.get("weights_sha256"),
                "model_dtype": w.get("dtype"), "served_model_name": name, "model_type": model_type,
                "max_concurrent_requests": settings.online_queue_limit or 0,
                "max_input_length": w.get("max_seq_length"), "max_batch_tokens": w.get("max_batch_tokens"),
                "max_batch_requests": None, "max_client_batch_size": settings.max_texts_per_job,
                "auto_truncate": True, "tokenization_workers": len(workers), "version": __version__,
                "sha": None, "docker_label": None}

    # outermost: every request is counted, refused ones included
    app.add_middleware(MetricsMiddleware, meter=meter, routes=frozenset(r.path for r in app.routes
                                                                         if hasattr(r, "path")))
    return app
