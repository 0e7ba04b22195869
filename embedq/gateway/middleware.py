"""The gateway's middleware, all plain ASGI (no ``BaseHTTPMiddleware``, so the routes still see a client's
disconnect): bearer auth, the payload limit, ``HEAD`` answered as ``GET``, and the request metrics."""

from __future__ import annotations

import hmac
import time
from typing import Any

from fastapi.responses import Response

from embedq.gateway import docs
from embedq.gateway.errors import tei_error

#: Routes anyone may call when an API key is set (TEI's public routes; the API pages, /docs and /redoc, and the
#: files they load).
PUBLIC = frozenset({"/health", "/ping", "/metrics", "/openapi.json", *docs.PATHS})


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
