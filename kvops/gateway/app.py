"""The gateway's ASGI app: the OpenAI routes, `/health`, `/metrics`, `/stats/tenants` and the admin API, with every
error answered in OpenAI's shape (never a traceback)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from kvops.config_files import location
from kvops.gateway.accounting import TenantStatsList
from kvops.gateway.admin import build_admin_router
from kvops.gateway.errors import error_response
from kvops.gateway.proxy import FastRelay, build_proxy_router
from kvops.gateway.state import Gateway

log = structlog.get_logger("kvops.gateway")


def build_gateway_app(gateway: Gateway) -> ASGIApp:
    """The gateway's app: the generation routes relayed by FastRelay, the rest by FastAPI."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await gateway.upstream.close()

    app = FastAPI(title="kvops gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.include_router(build_proxy_router(gateway))
    app.include_router(build_admin_router(gateway))

    @app.get("/health")
    async def health() -> Response:
        """200 while the upstream's /health answers 200; 503 with the reason otherwise (the gateway alone cannot
        answer a completion)."""
        try:
            response = await gateway.upstream.client.get("/health", timeout=gateway.upstream.client.timeout.connect)
        except httpx.HTTPError as exc:
            return JSONResponse({"status": "upstream_unreachable", "upstream": gateway.upstream.url,
                                 "reason": type(exc).__name__}, status_code=503)
        if response.status_code != 200:
            return JSONResponse({"status": "upstream_unhealthy", "upstream": gateway.upstream.url,
                                 "upstream_status": response.status_code}, status_code=503)
        return JSONResponse({"status": "ok", "upstream": gateway.upstream.url})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.accounting.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats/tenants")
    async def tenant_stats() -> TenantStatsList:
        return gateway.accounting.snapshot(gateway.policies.policy)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        error = exc.errors()[0] if exc.errors() else {}
        where = location(tuple(part for part in error.get("loc", ()) if part != "body"))
        message = str(error.get("msg", "invalid request")).removeprefix("Value error, ")
        return error_response(400, f"{where}: {message}" if where else message, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("gateway error", path=request.url.path, error=repr(exc)[:300])
        return error_response(500, "the gateway failed on this request; its log says why", "internal_error")

    return FastRelay(app, gateway)
