"""The engine as an HTTP service: OpenAI-compatible API, /health, /stats, /metrics, /admin.

FastAPI on uvicorn. Requests become engine sequences through `AsyncEngine`; a client that
disconnects aborts its sequence. Errors use OpenAI's error body with the offending field.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import structlog
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvops.engine.api_keys import AuthenticationError, TenantResolver, admin_refusal, check_client_tenant
from kvops.engine.async_engine import AsyncEngine
from kvops.engine.block_size_profile import DEFAULT_CANDIDATES, profile_block_size
from kvops.engine.config import parse_layers
from kvops.engine.engine import LLMEngine, RequestOutput
from kvops.engine.errors import ConfigError, EngineError, InvalidRequestError
from kvops.engine.kv_error_profile import DEFAULT_STEPS, DEFAULT_THRESHOLD, profile_kv_error
from kvops.engine.metrics import EngineMetrics
from kvops.engine.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)
from kvops.engine.sampling import SamplingParams
from kvops.schema.admin import (
    ADMIN_ACTIONS,
    AdminAction,
    EvictionPolicyBody,
    NormalizationBody,
    PrefixCachingBody,
    TenantBody,
)
from kvops.schema.snapshot import SNAPSHOT_SOURCE_HEADER, STEPS_KEPT_HEADER

log = structlog.get_logger("kvops.engine.server")

HEALTH_STALL_S = 30.0  # a step loop silent for this long is stuck: /health says 503


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


# ------------------------------------------------------------ admin actions, engine side
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


def build_app(engine: LLMEngine | AsyncEngine, admin_token: str | None = None, drain_timeout_s: float = 30.0,
              tenants: TenantResolver | None = None) -> FastAPI:
    """The ASGI app around an engine, or a runner that built it (`AsyncEngine.built_on_loop_thread`); its step loop
    runs with the app's lifespan. `tenants`: the engine config's API keys unless given (ConfigError if bad)."""
    from contextlib import asynccontextmanager

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

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        field = ".".join(location) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {message}")
        given = first.get("input")
        shown = f" (got {json.dumps(given)[:80]})" if given is not None and not isinstance(given, dict) else ""
        return _error(400, f"{field or 'body'}: {message}{shown}", field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), None, kind)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(400, str(exc), exc.field)

    @app.exception_handler(ConfigError)
    async def invalid_setting(_: Request, exc: ConfigError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(AuthenticationError)
    async def unauthenticated(_: Request, exc: AuthenticationError) -> JSONResponse:
        return _error(401, str(exc), None, "authentication_error")

    def key_tenant(authorization: str | None = Header(default=None)) -> str | None:
        # A dependency, so a request without a valid key is refused before its body is checked.
        return tenants.authenticate(authorization)

    # ------------------------------------------------------------ serving

    def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> SamplingParams:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, seed=body.seed, stop=stop, stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
        )

    def check_model(name: str) -> None:
        if name != engine.model_name:
            raise InvalidRequestError(f"model {name!r} is not served here: this engine serves {engine.model_name!r}",
                                      "model")

    def usage(out: RequestOutput) -> Usage:
        prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))

    async def run_to_end(request: Request, outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        """Collect a non-streaming request, aborting it if the client goes away meanwhile."""
        async def collect() -> RequestOutput:
            last = None
            async for out in outputs:
                last = out
            assert last is not None
            return last

        task = asyncio.ensure_future(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await outputs.aclose()
                return None
        return task.result()

    def accepting() -> None:
        if not runner.accepting:
            raise InvalidRequestError("the engine is shutting down and takes no new requests", None)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request, x_tenant: str | None = Header(default=None),
                          keyed: str | None = Depends(key_tenant)) -> Response:
        check_model(body.model)
        accepting()
        prompt: str | Sequence[int]
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
            if len(body.prompt) != 1:
                raise InvalidRequestError(f"prompt: a list of {len(body.prompt)} prompts was given; send one per "
                                          "request", "prompt")
            prompt = str(body.prompt[0])
        else:
            prompt = body.prompt  # type: ignore[assignment]
        params = sampling_params(body, body.max_tokens)
        tenant = tenants.tenant(keyed, body.user, x_tenant)
        prompt = await runner.run(lambda: engine.prepare_prompt(prompt, tenant))
        return await respond(
            request, body, runner.generate(prompt, params, tenant=tenant),
            chunk=lambda out, delta, first: CompletionResponse(
                id=out.request_id, model=engine.model_name,
                choices=[CompletionChoice(text=delta, finish_reason=out.finish_reason)]),
            usage_chunk=lambda out: CompletionResponse(id=out.request_id, model=engine.model_name, choices=[],
                                                       usage=usage(out)),
            whole=lambda out: CompletionResponse(
                id=out.request_id, model=engine.model_name, usage=usage(out),
                choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)]),
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               x_tenant: str | None = Header(default=None),
                               keyed: str | None = Depends(key_tenant)) -> Response:
        check_model(body.model)
        accepting()
        params = sampling_params(body, body.max_completion_tokens or body.max_tokens)
        tenant = tenants.tenant(keyed, body.user, x_tenant)
        messages = [m.model_dump() for m in body.messages]
        prompt = await runner.run(lambda: engine.prepare_chat(messages, tenant))
        return await respond(
            request, body, runner.generate(prompt, params, tenant=tenant),
            chunk=lambda out, delta, first: ChatCompletionChunk(
                id=out.request_id, model=engine.model_name,
                choices=[ChatChunkChoice(delta=ChatDelta(role="assistant" if first else None, content=delta),
                                         finish_reason=out.finish_reason)]),
            usage_chunk=lambda out: ChatCompletionChunk(id=out.request_id, model=engine.model_name, choices=[],
                                                        usage=usage(out)),
            whole=lambda out: ChatCompletionResponse(
                id=out.request_id, model=engine.model_name, usage=usage(out),
                choices=[ChatChoice(message=ChatResponseMessage(content=out.text),
                                    finish_reason=out.finish_reason)]),
        )

    async def respond(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        outputs: AsyncIterator[RequestOutput],
        chunk: Callable[[RequestOutput, str, bool], BaseModel],
        usage_chunk: Callable[[RequestOutput], BaseModel],
        whole: Callable[[RequestOutput], BaseModel],
    ) -> Response:
        """Stream SSE chunks, or wait for the whole completion (aborting it if the client leaves)."""
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            # Wait for the first output before answering 200: a request the engine refuses (an empty prompt, one
            # too long) raises here and is answered 400, as it is unstreamed, not 200 with an error event.
            first = await anext(outputs, None)
            return StreamingResponse(stream_events(_prepend(first, outputs), chunk,
                                                   usage_chunk if include_usage else None),
                                     media_type="text/event-stream")
        out = await run_to_end(request, outputs)
        if out is None:
            return Response(status_code=499)
        return JSONResponse(whole(out).model_dump())

    def sse(payload: BaseModel | str) -> str:
        data = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=False)
        return f"data: {data}\n\n"

    async def text_deltas(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[str, RequestOutput]]:
        """Incremental detokenization: emit text once it is stable (no half of a multi-byte char)."""
        sent = ""
        async for out in outputs:
            text = out.text if out.finished else engine.decode(out.token_ids)
            if not out.finished and text.endswith("\ufffd"):
                continue
            delta, sent = text[len(sent):] if text.startswith(sent) else text, text
            yield delta, out

    async def stream_events(
        outputs: AsyncIterator[RequestOutput],
        chunk: Callable[[RequestOutput, str, bool], BaseModel],
        usage_chunk: Callable[[RequestOutput], BaseModel] | None,
    ) -> AsyncIterator[str]:
        first = True
        try:
            async for delta, out in text_deltas(outputs):
                yield sse(chunk(out, delta, first))
                first = False
                if out.finished and usage_chunk is not None:
                    yield sse(usage_chunk(out))
            yield sse("[DONE]")
        except EngineError as exc:
            yield sse(json.dumps({"error": {"message": str(exc), "type": "engine_error"}}))
        finally:
            await outputs.aclose()

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name, created=int(engine.started_at),
                                         max_model_len=engine.max_model_len)])

    # ------------------------------------------------------------ observability

    @app.get("/health")
    async def health() -> JSONResponse:
        stalled = time.monotonic() - runner.heartbeat
        if not runner.alive:
            return JSONResponse({"status": "down", "reason": f"step loop stopped: {runner.error}"}, status_code=503)
        if stalled > HEALTH_STALL_S:
            return JSONResponse({"status": "stuck", "reason": f"step loop silent for {stalled:.0f} s"},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": engine.model_name})

    @app.get("/stats")
    async def stats(steps_after: float | None = None) -> Response:
        entry = runner.snapshots.serve()
        source = "cached"
        if entry is None:
            entry, source = await runner.run(runner.snapshots.refresh), "built"
        headers = {SNAPSHOT_SOURCE_HEADER: source}
        if steps_after is None:
            return Response(entry.body, media_type="application/json", headers=headers)
        headers[STEPS_KEPT_HEADER] = str(engine.stats.steps.maxlen)  # for the poller to merge the steps it holds
        return Response(entry.steps_after(steps_after), media_type="application/json", headers=headers)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = await runner.run(metrics.render)
        return Response(body, media_type=content_type)

    # ------------------------------------------------------------ admin

    def authorize(authorization: str | None) -> JSONResponse | None:
        refused = admin_refusal(admin_token, authorization)
        return None if refused is None else _error(refused[0], refused[1], None, refused[2])

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

    return app


async def _prepend(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
    async for out in rest:
        yield out
