"""TEI's routes: ``POST /embed``, ``/embed_sparse``, ``/embed_all``, ``/rerank``, ``/predict``, ``/tokenize``,
``/decode``, ``/similarity``, ``POST /`` and ``/invocations`` (the served model's own route), ``POST /vertex``
(Google Vertex AI's instances), ``GET /info``,
``GET /health`` (and ``/``, ``/ping``), and ``GET /metrics``. Each job route plans its body
(:mod:`embedq.gateway.plans`), sends it and awaits its answer on the app's :class:`~embedq.gateway.state.Gateway`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from embedq import errors
from embedq.gateway.errors import tei_error
from embedq.gateway.plans import ROUTE_PLANS, parse
from embedq.gateway.schemas import (
    EMPTY_OK,
    JOB_HEADERS,
    MODEL_HEADER,
    TEI_ERRORS,
    DecodeRequest,
    EmbedRequest,
    JSONResponse,
    PredictRequest,
    RerankRequest,
    SimilarityRequest,
    TeiError,
    TextsRequest,
    TokenizeRequest,
    VertexRequest,
    responses,
)
from embedq.gateway.state import gateway_of
from embedq.gateway.tei_meta import respond
from embedq.version import __version__

log = logging.getLogger(__name__)
router = APIRouter()


async def _answer(request: Request, kind: str, body: BaseModel, *, headers: bool = True) -> Response:
    """``body`` planned as jobs of ``kind``, sent, awaited: the route's answer, with TEI's headers and metrics."""
    gateway = gateway_of(request)
    return await respond(gateway, request, lambda: ROUTE_PLANS[kind][1](body, gateway.settings), headers=headers)


def _job_route(path: str, summary: str) -> Any:
    return router.post(path, summary=summary, responses=TEI_ERRORS, openapi_extra=JOB_HEADERS)


@_job_route("/embed", "TEI: dense embeddings")
async def embed(request: Request, body: EmbedRequest) -> Response:
    return await _answer(request, "embed", body)


@_job_route("/embed_sparse", "TEI: SPLADE sparse vectors")
async def embed_sparse(request: Request, body: TextsRequest) -> Response:
    return await _answer(request, "embed_sparse", body)


@_job_route("/embed_all", "TEI: every token's last hidden state")
async def embed_all(request: Request, body: TextsRequest) -> Response:
    return await _answer(request, "embed_all", body)


@_job_route("/rerank", "TEI: a query against texts, best first")
async def rerank(request: Request, body: RerankRequest) -> Response:
    return await _answer(request, "rerank", body)


@_job_route("/predict", "TEI: sequence classification of texts or text pairs")
async def predict(request: Request, body: PredictRequest) -> Response:
    return await _answer(request, "predict", body)


@_job_route("/tokenize", "TEI: the tokens of each text, every one (byte offsets; its slice of the text)")
async def tokenize(request: Request, body: TokenizeRequest) -> Response:
    return await _answer(request, "tokenize", body, headers=False)  # TEI sends none on /tokenize, /decode


@_job_route("/decode", "TEI: token ids back to text (the model's tokenizer)")
async def decode(request: Request, body: DecodeRequest) -> Response:
    return await _answer(request, "decode", body, headers=False)


@_job_route("/similarity", "TEI: cosine similarity of a sentence to others")
async def similarity(request: Request, body: SimilarityRequest) -> Response:
    return await _answer(request, "similarity", body)


@_job_route("/", "TEI: the served model's own route (embed, rerank, predict or embed_sparse)")
@_job_route("/invocations", "SageMaker's path of POST /")
async def root(request: Request) -> Response:
    kind = await _model_route(request)
    return await _answer(request, kind, parse(ROUTE_PLANS[kind][0], await _json(request)))


async def _model_route(request: Request) -> str:
    """The route of the served model's kind (TEI: reranker, classifier, SPLADE, else embeddings)."""
    gateway = gateway_of(request)
    workers = await gateway.workers(gateway.target(request)[1])
    kinds = set((workers[0].get("kinds") or []) if workers else [])
    return next((k for k in ("rerank", "predict", "embed_sparse") if k in kinds), "embed")  # TEI's order


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes (other routes: 400)
        raise errors.InvalidType("Input validation error: the body is not JSON, or is nested too deeply") from None


@router.post("/vertex", summary="Google Vertex AI: {\"instances\": [...]}, each instance a request of the served "
             "model's route", responses=TEI_ERRORS, openapi_extra=JOB_HEADERS)
async def vertex(request: Request, body: VertexRequest) -> Response:
    """TEI's ``/vertex``: each instance is a rerank request if it reads as one, else a request of the model's own
    route (predict for a classifier or reranker, embed_sparse for SPLADE, else embed); the answer is
    ``{"predictions": [each instance's answer]}``. The instances' jobs are sent together and awaited at once."""
    gateway = gateway_of(request)
    own = await _model_route(request)
    plans = []
    for instance in body.instances:
        try:
            kind, parsed = "rerank", RerankRequest.model_validate(instance)
        except PydanticValidationError:
            kind = "predict" if own == "rerank" else own
            parsed = parse(ROUTE_PLANS[kind][0], instance)
        plans.append(ROUTE_PLANS[kind][1](parsed, gateway.settings))
    inputs, cap = sum(len(plan.items) for plan in plans), gateway.settings.max_client_batch_size
    if inputs > cap:  # one request's inputs, however many instances carry them
        raise errors.TooManyInputs(f"Input validation error: batch size {inputs} > maximum allowed batch size {cap} "
                                   "(EMBEDQ_MAX_CLIENT_BATCH_SIZE), over all instances")
    payloads = await gateway.payloads(request, plans) if plans else []
    return JSONResponse({"predictions": [plan.answer(p) for plan, p in zip(plans, payloads)]})


@router.get("/metrics", summary="Prometheus: the gateway's requests, latencies, disconnects (public)",
            response_class=Response,
            responses={200: {"description": "Prometheus text", "content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    gateway = gateway_of(request)
    try:  # TEI's te_queue_size: the messages waiting now (Redis away: the last figure stays)
        gateway.tei.queue_size.set(await asyncio.to_thread(gateway.queue_size))
    except Exception as exc:
        log.debug("te_queue_size: cannot read the queues (%s)", exc)
    return Response(generate_latest(gateway.meter.registry) + gateway.tei.counters.exposition(),
                    media_type=CONTENT_TYPE_LATEST)


@router.get("/", summary="TEI: health (GET)", response_class=Response,
            responses={**EMPTY_OK, **responses(TeiError, 503)})
@router.get("/ping", summary="SageMaker's health path", response_class=Response,
            responses={**EMPTY_OK, **responses(TeiError, 503)})
async def ping(request: Request) -> Response:
    return await health(request)


@router.get("/health", summary="200 when a worker serves the model, else 503", response_class=Response,
            responses={**EMPTY_OK, **responses(TeiError, 503)})
async def health(request: Request) -> Response:
    if await gateway_of(request).workers():
        return Response(status_code=200, media_type="text/plain")
    return tei_error(503, "Unhealthy", "unhealthy")


@router.get("/info", summary="TEI's model and router information (X-Embedq-Model: of which model)",
            responses=responses(TeiError, 401, 404, 503), openapi_extra={"parameters": [MODEL_HEADER]})
async def info(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
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
            "max_concurrent_requests": gateway.settings.online_queue_limit or 0,
            "max_input_length": w.get("max_seq_length"), "max_batch_tokens": w.get("max_batch_tokens"),
            "max_batch_requests": None, "max_client_batch_size": gateway.settings.max_texts_per_job,
            "auto_truncate": True, "tokenization_workers": len(workers), "version": __version__,
            "sha": None, "docker_label": None}
