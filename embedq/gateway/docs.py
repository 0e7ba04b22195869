"""The gateway's API pages, Swagger UI at ``/docs`` and ReDoc at ``/redoc``, with their scripts, stylesheet and icon
served by the gateway itself: no CDN, so the pages work on a machine without internet.

The assets come from the ``fastapi-offline`` package (MIT; a dependency of the ``gateway`` extra), whose releases
carry Swagger UI's and ReDoc's standalone bundles from npm (``swagger-ui-dist``, ``redoc``); ``pip install -U
fastapi-offline`` updates them. The pages are FastAPI's own (``get_swagger_ui_html``, ``get_redoc_html``) with local
URLs, ReDoc without Google's fonts. Every path here is public when an API key is set (:data:`PATHS`), like
``/openapi.json``: a browser sends no bearer token.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

DOCS, REDOC, OAUTH2_REDIRECT = "/docs", "/redoc", "/docs/oauth2-redirect"
#: TEI's path of its OpenAPI document (FastAPI's own is ``/openapi.json``; both answer the same document).
TEI_OPENAPI = "/api-doc/openapi.json"
#: The files the pages load, each served at ``/docs/<name>`` (their names in fastapi-offline's ``static`` folder).
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
          "redoc.standalone.js": "text/javascript", "favicon.png": "image/png"}
#: Every path of the pages and their assets (all public).
PATHS = frozenset({DOCS, REDOC, OAUTH2_REDIRECT, TEI_OPENAPI, *(f"{DOCS}/{name}" for name in ASSETS)})
# A week: the files change only with the installed package.
_CACHE = {"Cache-Control": "public, max-age=604800"}

router = APIRouter(include_in_schema=False)


def asset_dir() -> Path:
    """fastapi-offline's folder of the bundles."""
    return Path(str(resources.files("fastapi_offline") / "static"))


def _asset_route(name: str, media_type: str) -> None:
    path = asset_dir() / name

    async def asset() -> FileResponse:
        return FileResponse(path, media_type=media_type, headers=_CACHE)

    router.add_api_route(f"{DOCS}/{name}", asset, methods=["GET"], name=f"docs-{name}")


for _name, _type in ASSETS.items():
    _asset_route(_name, _type)


def _url(request: Request, path: str) -> str:
    return f"{request.scope.get('root_path', '')}{path}"  # behind a proxy that mounts the gateway under a prefix


@router.get(TEI_OPENAPI)
async def tei_openapi(request: Request) -> JSONResponse:
    """The OpenAPI document at TEI's path, for tools pointed at a TEI server's."""
    return JSONResponse(request.app.openapi())


@router.get(DOCS)
async def swagger_ui(request: Request) -> HTMLResponse:
    app = request.app
    return get_swagger_ui_html(openapi_url=_url(request, app.openapi_url), title=f"{app.title} - Swagger UI",
                               swagger_js_url=_url(request, f"{DOCS}/swagger-ui-bundle.js"),
                               swagger_css_url=_url(request, f"{DOCS}/swagger-ui.css"),
                               swagger_favicon_url=_url(request, f"{DOCS}/favicon.png"),
                               oauth2_redirect_url=_url(request, OAUTH2_REDIRECT),
                               swagger_ui_parameters=app.swagger_ui_parameters)


@router.get(OAUTH2_REDIRECT)
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get(REDOC)
async def redoc(request: Request) -> HTMLResponse:
    app = request.app
    return get_redoc_html(openapi_url=_url(request, app.openapi_url), title=f"{app.title} - ReDoc",
                          redoc_js_url=_url(request, f"{DOCS}/redoc.standalone.js"),
                          redoc_favicon_url=_url(request, f"{DOCS}/favicon.png"), with_google_fonts=False)
