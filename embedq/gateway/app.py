"""``embedq serve``: TEI's and OpenAI's embedding APIs over the queue (FastAPI on uvicorn).

Each request becomes embedq jobs on the served model's queue (several when it has more inputs than a job may
carry), sent with the producer :class:`~embedq.producers.client.Client` (validation at the edge, backpressure)
and awaited on :class:`~embedq.gateway.results.AsyncResults`: no thread is held while a request waits. The
gateway keeps no state of its own, so any number of replicas can serve the same queues.

Routes of this version: ``POST /v1/embeddings`` and ``/embeddings`` (OpenAI); TEI's ``POST /embed``,
``/embed_sparse``, ``/embed_all``, ``/rerank``, ``/predict``, ``/similarity``, ``/tokenize``, ``/decode`` and
``/`` (and ``/invocations``: the served model's own route, as TEI routes it), ``GET /info``, ``GET /health``,
``GET /metrics``; async jobs: ``POST /jobs``, ``GET /jobs/{id}``, ``DELETE /jobs/{id}``; the API's pages, ``GET /docs``
and ``/redoc`` (their files served from the package, no CDN). Error bodies are TEI's (``{"error", "error_type"}``,
its status codes); the OpenAI routes answer TEI's OpenAI shape plus OpenAI's nested ``error`` object, which the
openai SDK reads.
Headers: ``X-Embedq-Class: bulk`` sends a request's jobs to the bulk queue (default: online);
``X-Embedq-Deadline: <seconds>`` drops its jobs if they have not started by then.

This module wires the app (:func:`create_app`); the rest is in its neighbours: ``schemas`` (request and error
bodies, the declared headers), ``errors`` (error rendering from :mod:`embedq.errors`' table), ``middleware`` (auth,
payload limit, HEAD as GET, metrics), ``state`` (:class:`~embedq.gateway.state.Gateway`: what requests share, how a
plan is sent and awaited), ``plans`` (each kind's planner), ``routes_tei``, ``routes_openai``, ``jobs`` and ``docs``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator

from fastapi import FastAPI

from embedq.gateway import docs, jobs, routes_openai, routes_tei
from embedq.gateway import errors as gateway_errors
from embedq.gateway.middleware import PUBLIC, BearerAuth, HeadAsGet, MetricsMiddleware, PayloadLimit
from embedq.gateway.state import Gateway, served_models
from embedq.gateway.webhooks import Webhooks
from embedq.settings import Settings
from embedq.version import __version__

__all__ = ["PUBLIC", "Gateway", "create_app", "served_models"]


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The gateway's connections and its webhook sender, for the app's life."""
    gateway: Gateway = app.state.gateway
    settings = gateway.settings
    await gateway.start()
    assert gateway.results is not None
    secret = (settings.webhook_secret.get_secret_value() if settings.webhook_secret else "").encode() or None
    hooks = Webhooks(gateway.results.redis, secret=secret, attempts=settings.webhook_attempts,
                     lease=settings.webhook_lease,
                     record=functools.partial(jobs.stored_record, gateway),
                     wait=functools.partial(jobs.wait_record, gateway),
                     state=functools.partial(jobs.job_state, gateway),
                     save=functools.partial(jobs.save_record, gateway),
                     on_outcome=lambda outcome: gateway.meter.webhooks.labels(outcome).inc(),
                     allow=settings.webhook_allow, timeout=settings.webhook_timeout,
                     response_limit=settings.webhook_response_limit)
    app.state.webhooks = hooks
    await hooks.start()
    try:
        yield
    finally:
        await hooks.close()
        await gateway.close()


def create_app(settings: Settings | None = None, *, api_key: str | None = None) -> FastAPI:
    """The ASGI app. ``api_key``: when set, every route but :data:`PUBLIC` needs ``Authorization: Bearer <key>``."""
    settings = settings or Settings()
    app = FastAPI(title="embedq gateway", version=__version__, lifespan=lifespan,
                  description="TEI's and OpenAI's embedding APIs over embedq's queue.",
                  docs_url=None, redoc_url=None)  # docs.router's instead: the pages' files from the package
    app.state.gateway = gateway = Gateway(settings)
    app.state.webhooks = None  # the lifespan's

    if api_key:
        app.add_middleware(BearerAuth, key=api_key.encode())
    app.add_middleware(PayloadLimit, limit=settings.gateway_payload_limit)
    app.add_middleware(HeadAsGet)  # outside BearerAuth: HEAD / is as public as GET /
    origins = [o.strip() for o in (settings.cors_allow_origins or "").split(",") if o.strip()]
    if origins:  # off unless configured (TEI allows any origin by default; we do not)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["content-type", "authorization"])
    gateway_errors.install(app)

    routers = (routes_openai.router, routes_tei.router, jobs.router, docs.router)
    for router in routers:
        app.include_router(router)
    # outermost: every request is counted, refused ones included (by route: the routers' own, since FastAPI
    # may hold an included router as one entry of app.routes)
    paths = frozenset(r.path for r in (*app.routes, *(r for router in routers for r in router.routes))
                      if hasattr(r, "path"))
    app.add_middleware(MetricsMiddleware, meter=gateway.meter, routes=paths)
    return app
