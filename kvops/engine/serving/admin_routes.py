"""The engine's admin routes: the admin actions (kvops.schema.admin's table, each bound here to the handler that
changes the engine), /admin/config, and the on-demand profiles. Each needs the admin token when one is set."""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvops.engine.block_size_profile import DEFAULT_CANDIDATES, profile_block_size
from kvops.engine.config import parse_layers
from kvops.engine.engine import LLMEngine
from kvops.engine.errors import InvalidRequestError
from kvops.engine.kv_error_profile import DEFAULT_STEPS, DEFAULT_THRESHOLD, profile_kv_error
from kvops.engine.serving.async_engine import AsyncEngine
from kvops.engine.serving.auth import admin_refusal, check_client_tenant
from kvops.engine.serving.error_responses import error_response
from kvops.schema.admin import (
    ADMIN_ACTIONS,
    AdminAction,
    EvictionPolicyBody,
    NormalizationBody,
    PrefixCachingBody,
    TenantBody,
)

log = structlog.get_logger("kvops.engine.server")  # the logger name operators already filter on

# The actions themselves (name, endpoint, body, undo) are kvops.schema.admin's table; each is bound here to
# the handler that changes the engine. A handler runs on the step-loop thread and returns what to log.

AdminHandler = Callable[..., dict[str, Any]]  # (engine, body, **path params) -> the fields logged


def _set_normalization(engine: LLMEngine, body: NormalizationBody) -> dict[str, Any]:
    engine.set_normalization(body.mode)
    return {"knob": "normalize_prompts", "mode": body.mode}


def _set_prefix_caching(engine: LLMEngine, body: PrefixCachingBody) -> dict[str, Any]:
    engine.block_manager.set_prefix_caching(body.enabled)
    return {"knob": "prefix_caching", "enabled": body.enabled}


def _set_eviction_policy(engine: LLMEngine, body: EvictionPolicyBody) -> dict[str, Any]:
    engine.block_manager.set_eviction_policy(body.policy)
    return {"knob": "eviction_policy", "policy": body.policy}


def _set_tenant(engine: LLMEngine, body: TenantBody, tenant: str) -> dict[str, Any]:
    check_client_tenant(tenant, "tenant")
    engine.set_tenant_quota(tenant, body.quota_blocks)
    if body.cache_salt is None:
        engine.tenant_salts.pop(tenant, None)
    else:
        engine.tenant_salts[tenant] = body.cache_salt
    return {"knob": "tenant", "tenant": tenant, "cache_salt": body.cache_salt, "quota_blocks": body.quota_blocks}


ADMIN_HANDLERS: dict[str, AdminHandler] = {
    "set_normalization": _set_normalization,
    "set_prefix_caching": _set_prefix_caching,
    "set_eviction_policy": _set_eviction_policy,
    "set_tenant_quota": _set_tenant,
}


def _int_list(text: str, field: str, example: str) -> list[int]:
    """A comma-separated query parameter of integers; a 400 naming the field when it is not one."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise InvalidRequestError(f"{field} {text!r} is not a comma-separated list of integers, e.g. {example}",
                                  field) from None


def _route_path(action: AdminAction) -> str:
    """The action's path with each field as a `path` converter: the server decodes %2F before routing,
    so a quoted tenant name holding '/' would not match a plain `{tenant}` segment."""
    return re.sub(r"\{(\w+)\}", r"{\1:path}", action.path)


def add_admin_routes(app: FastAPI, runner: AsyncEngine, admin_token: str | None) -> None:
    engine = runner.engine

    def authorize(authorization: str | None) -> JSONResponse | None:
        refused = admin_refusal(admin_token, authorization)
        return None if refused is None else error_response(refused[0], refused[1], None, refused[2])

    async def admin_change(authorization: str | None, change: Callable[[], dict[str, Any]]) -> JSONResponse:
        denied = authorize(authorization)
        if denied is not None:
            return denied
        logged = await runner.run(change)
        log.info("admin change", **logged)
        return JSONResponse(await runner.run(engine.knobs))

    @app.get("/admin/config")
    async def admin_config(authorization: str | None = Header(default=None)) -> JSONResponse:
        denied = authorize(authorization)
        return denied or JSONResponse(await runner.run(engine.knobs))

    def admin_endpoint(action: AdminAction) -> Callable[..., Awaitable[JSONResponse]]:
        handler = ADMIN_HANDLERS[action.name]

        async def endpoint(**kwargs: Any) -> JSONResponse:
            body, authorization = kwargs.pop("body"), kwargs.pop("authorization")
            if not all(kwargs.values()):  # `{x:path}` also matches an empty segment, which names nothing
                raise StarletteHTTPException(404, "Not Found")
            return await admin_change(authorization, lambda: handler(engine, body, **kwargs))

        # FastAPI reads the parameters (path fields, the body model, the header) from the signature.
        keyword = inspect.Parameter.KEYWORD_ONLY
        endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(name, keyword, annotation=str) for name in action.path_params]
            + [inspect.Parameter("body", keyword, annotation=action.body),
               inspect.Parameter("authorization", keyword, annotation=str | None, default=Header(default=None))],
            return_annotation=JSONResponse)
        endpoint.__name__ = f"admin_{action.name}"
        return endpoint

    for action in ADMIN_ACTIONS.values():
        app.add_api_route(_route_path(action), admin_endpoint(action), methods=[action.method])

    @app.get("/admin/profile/kv-quant")
    async def admin_profile_kv_quant(
        kv_cache_dtype: str | None = None, group_size: int | None = None, skip_layers: str | None = None,
        steps: str | None = None, threshold: float = DEFAULT_THRESHOLD,
        authorization: str | None = Header(default=None),
    ) -> Response:
        """Per-layer KV quantization error of the engine's KV dtype (or `kv_cache_dtype`). It decodes a
        fixed prompt set (a few seconds on CPU) on the step-loop thread, so serving pauses meanwhile."""
        denied = authorize(authorization)
        if denied is not None:
            return denied
        step_list = _int_list(steps, "steps", "10,50,100") if steps else list(DEFAULT_STEPS)
        layers = parse_layers(skip_layers) if skip_layers is not None else None
        profile = await runner.run(lambda: profile_kv_error(engine, kv_cache_dtype, group_size, layers, step_list,
                                                            threshold))
        log.info("kv quantization profile", kv_cache_dtype=profile.kv_cache_dtype, flagged=profile.flagged,
                 duration_s=profile.duration_s)
        return Response(profile.model_dump_json(), media_type="application/json")

    @app.get("/admin/profile/block-size")
    async def admin_profile_block_size(
        candidates: str | None = None, batch_size: int | None = None, repeats: int = 5,
        max_context: int | None = None, authorization: str | None = Header(default=None),
    ) -> Response:
        """Decode-step time of each candidate block size at the engine's recent batch size and prompt lengths
        (see docs/block-size.md). It runs on the step-loop thread, so serving pauses for the seconds it takes."""
        denied = authorize(authorization)
        if denied is not None:
            return denied
        sizes = _int_list(candidates, "candidates", "8,16,32,64") if candidates else list(DEFAULT_CANDIDATES)
        profile = await runner.run(lambda: profile_block_size(engine, sizes, batch_size, repeats, max_context))
        log.info("block size profile", best=profile.best, configured=profile.configured,
                 batch_size=profile.batch_size, duration_s=profile.duration_s)
        return Response(profile.model_dump_json(), media_type="application/json")

