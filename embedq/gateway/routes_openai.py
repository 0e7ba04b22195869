"""OpenAI's routes: ``POST /v1/embeddings`` (and ``/embeddings``) and ``GET /v1/models`` (and ``/models``). Their
error bodies are TEI's OpenAI shape plus OpenAI's nested ``error`` (:mod:`embedq.gateway.errors`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from embedq.gateway.plans import plan_openai
from embedq.gateway.schemas import (
    JOB_HEADERS,
    OPENAI_ERRORS,
    JSONResponse,
    OpenAIEmbeddingRequest,
    OpenAIError,
    responses,
)
from embedq.gateway.state import gateway_of
from embedq.gateway.tei_meta import respond

router = APIRouter()


@router.post("/embeddings", summary="OpenAI embeddings (without /v1)", responses=OPENAI_ERRORS,
             openapi_extra=JOB_HEADERS)
@router.post("/v1/embeddings", summary="OpenAI embeddings", responses=OPENAI_ERRORS, openapi_extra=JOB_HEADERS)
async def openai_embeddings(request: Request, body: OpenAIEmbeddingRequest) -> Response:
    gateway = gateway_of(request)
    name = gateway.target(request, body.model)[0]
    return await respond(gateway, request, lambda: plan_openai(body, gateway.settings, name), body.model)


@router.get("/v1/models", summary="OpenAI: the models this gateway serves (ready: a live worker serves it)",
            responses=responses(OpenAIError, 401))
@router.get("/models", summary="OpenAI: the models this gateway serves (without /v1)",
            responses=responses(OpenAIError, 401))
async def list_models(request: Request) -> Response:
    gateway = gateway_of(request)
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "embedq",
             "ready": bool(await gateway.workers(target))} for name, target in gateway.models.items()]
    return JSONResponse({"object": "list", "data": data})
