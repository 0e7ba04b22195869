"""Error rendering: every error the gateway answers becomes TEI's body (``{"error", "error_type"}``) or, on the
OpenAI routes, TEI's OpenAI body plus OpenAI's nested ``error`` object (which the openai SDK reads). An embedq error's
status and ``error_type`` are its class's (:mod:`embedq.errors`, the one table); the framework's own refusals (a
body that does not validate, no such route) and an unreachable Redis are rendered here too."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from embedq import errors
from embedq.gateway.schemas import JSONResponse

log = logging.getLogger(__name__)

#: Seconds a client is told to wait (``Retry-After``) where the error gives none (an Overloaded refusal gives its
#: own ``retry_after``: embedq/admission.py).
RETRY_AFTER = 1
#: The OpenAI routes (their error body is OpenAI's).
OPENAI_PATHS = frozenset({"/v1/embeddings", "/embeddings", "/v1/models", "/models"})


def http_status(exc: errors.EmbedqError) -> tuple[int, str]:
    """(HTTP status, TEI ``error_type``) of an embedq error: its class's, from the one table (``embedq.errors``)."""
    return exc.http_status, exc.error_type


def _headers(status: int, retry_after: float | None = None) -> dict[str, str]:
    if status in (429, 503):
        seconds = RETRY_AFTER if retry_after is None else max(1, math.ceil(retry_after))
        return {"Retry-After": str(seconds)}
    if status >= 500:
        return {"x-should-retry": "false"}
    return {}


def tei_error(status: int, error_type: str, message: str, retry_after: float | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status,
                        headers=_headers(status, retry_after))


def openai_error(status: int, error_type: str, message: str, retry_after: float | None = None) -> JSONResponse:
    """TEI's OpenAI-route body plus OpenAI's nested ``error`` object (the openai SDK reads the latter)."""
    body = {"message": message, "code": status, "type": error_type,
            "error": {"message": message, "type": error_type, "param": None, "code": str(status)}}
    return JSONResponse(body, status_code=status, headers=_headers(status, retry_after))


def error_response(request: Request, status: int, error_type: str, message: str,
                   retry_after: float | None = None) -> JSONResponse:
    """The error body of ``request``'s route: OpenAI's on the OpenAI routes, else TEI's."""
    return (openai_error if request.url.path in OPENAI_PATHS else tei_error)(status, error_type, message, retry_after)


async def embedq_error(request: Request, exc: errors.EmbedqError) -> JSONResponse:
    status, error_type = http_status(exc)
    return error_response(request, status, error_type, str(exc), getattr(exc, "retry_after", None))


async def redis_error(request: Request, exc: RedisError) -> JSONResponse:  # the broker is away or refusing
    log.warning("%s %s: Redis error (%s: %s)", request.method, request.url.path, type(exc).__name__, exc)
    unavailable = errors.Unavailable
    return error_response(request, unavailable.http_status, unavailable.error_type,
                          f"the broker cannot be reached ({type(exc).__name__})")


async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code in (404, 405):  # no such route: the framework's own answer (a 405 names what is allowed)
        return JSONResponse({"error": str(exc.detail), "error_type": "NotFound"}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
    message = f"Input validation error: {exc.detail}" if exc.status_code < 500 else str(exc.detail)
    return error_response(request, exc.status_code, "Validation" if exc.status_code < 500 else "Backend", message)


async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 for a body that does not fit the route's schema; as TEI (axum's JSON extractor) answers: 400 for a body that
    is not JSON at all, 415 for a body sent without a JSON ``Content-Type`` (FastAPI then does not parse it)."""
    found = exc.errors()
    problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in found)
    if any(e.get("type") == "json_invalid" for e in found):
        return error_response(request, 400, "Validation", f"Input validation error: the body is not valid JSON "
                              f"({problems})")
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not (media == "application/json" or media.endswith("+json")) and found and all(
            tuple(e.get("loc", ()))[:1] == ("body",) for e in found):
        return error_response(request, 415, "Validation", "Expected request with `Content-Type: application/json` "
                              f"(got {media or 'none'})")
    invalid = errors.ValidationError
    return error_response(request, invalid.http_status, invalid.error_type, f"Input validation error: {problems}")


def install(app: FastAPI) -> None:
    """The handlers above, on ``app``."""
    app.add_exception_handler(errors.EmbedqError, embedq_error)  # type: ignore[arg-type]
    app.add_exception_handler(RedisError, redis_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid_body)  # type: ignore[arg-type]
