"""The engine as an HTTP service: OpenAI-compatible API, /health, /stats, /metrics, /admin.

FastAPI on uvicorn. `build_app` composes three groups of routes — OpenAI (openai_routes), stats (stats_routes)
and admin (admin_routes) — around one engine, and maps errors to OpenAI's error body with the offending field.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvops.engine.engine import LLMEngine
from kvops.engine.errors import InvalidRequestError
from kvops.engine.serving.admin_routes import add_admin_routes
from kvops.engine.serving.async_engine import AsyncEngine
from kvops.engine.serving.auth import AuthenticationError, TenantResolver
from kvops.engine.serving.error_responses import error_response
from kvops.engine.serving.metrics import EngineMetrics
from kvops.engine.serving.openai_routes import add_openai_routes
from kvops.engine.serving.stats_routes import add_stats_routes
from kvops.schema.errors import ConfigError

log = structlog.get_logger("kvops.engine.server")


def build_app(engine: LLMEngine | AsyncEngine, admin_token: str | None = None, drain_timeout_s: float = 30.0,
              tenants: TenantResolver | None = None) -> FastAPI:
    """The ASGI app around an engine, or a runner that built it (`AsyncEngine.built_on_loop_thread`); its step loop
    runs with the app's lifespan. `tenants`: the engine config's API keys unless given (ConfigError if bad)."""
    runner = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    engine = runner.engine
    tenants = tenants or TenantResolver.from_config(engine.config)
    metrics = EngineMetrics(lambda: engine.snapshot(), engine.config.max_tenant_labels)
    runner.metrics = metrics

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runner.start()
        log.info("engine ready", model=engine.model_name)
        yield
        drained = await runner.drain(drain_timeout_s)
        log.info("engine stopping", drained=drained)
        runner.stop()

    app = FastAPI(title="kvops engine", version="1", lifespan=lifespan)
    app.state.runner = runner
    app.state.metrics = metrics
    app.state.tenants = tenants
    _answer_errors_as_openai(app)
    # Added straight onto the app, not as APIRouters: FastAPI's include_router nests the router, so app.routes
    # would list the router instead of its routes, and the fuzz tests read every route from app.routes.
    add_openai_routes(app, runner, tenants)
    add_stats_routes(app, runner, metrics)
    add_admin_routes(app, runner, admin_token)
    return app


def _answer_errors_as_openai(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        field = ".".join(location) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {message}")
        given = first.get("input")
        shown = f" (got {json.dumps(given)[:80]})" if given is not None and not isinstance(given, dict) else ""
        return error_response(400, f"{field or 'body'}: {message}{shown}", field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), None, kind)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.field)

    @app.exception_handler(ConfigError)
    async def invalid_setting(_: Request, exc: ConfigError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(AuthenticationError)
    async def unauthenticated(_: Request, exc: AuthenticationError) -> JSONResponse:
        return error_response(401, str(exc), None, "authentication_error")
