"""The engine's OpenAI-compatible routes: /v1/completions, /v1/chat/completions (streamed as SSE or whole) and
/v1/models. Requests become engine sequences through `AsyncEngine`; a client that disconnects aborts its
sequence."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvops.engine.engine import RequestOutput
from kvops.engine.errors import InvalidRequestError
from kvops.engine.sampling import SamplingParams
from kvops.engine.serving.async_engine import AsyncEngine
from kvops.engine.serving.auth import TenantResolver
from kvops.engine.serving.protocol import (
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
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)
from kvops.schema.errors import EngineError

Decode = Callable[[list[int]], str]  # token ids to text: the engine's tokenizer


def add_openai_routes(app: FastAPI, runner: AsyncEngine, tenants: TenantResolver) -> None:
    engine = runner.engine

    def key_tenant(authorization: str | None = Header(default=None)) -> str | None:
        # A dependency, so a request without a valid key is refused before its body is checked.
        return tenants.authenticate(authorization)

    def check_model(name: str) -> None:
        if name != engine.model_name:
            raise InvalidRequestError(f"model {name!r} is not served here: this engine serves {engine.model_name!r}",
                                      "model")

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
            request, body, runner.generate(prompt, params, tenant=tenant), decode=engine.decode,
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
            request, body, runner.generate(prompt, params, tenant=tenant), decode=engine.decode,
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

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name, created=int(engine.started_at),
                                         max_model_len=engine.max_model_len)])


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        max_tokens=16 if max_tokens is None else max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, seed=body.seed, stop=stop, stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
    )


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


async def respond(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    outputs: AsyncIterator[RequestOutput],
    chunk: Callable[[RequestOutput, str, bool], BaseModel],
    usage_chunk: Callable[[RequestOutput], BaseModel],
    whole: Callable[[RequestOutput], BaseModel],
    decode: Decode,
) -> Response:
    """Stream SSE chunks, or wait for the whole completion (aborting it if the client leaves)."""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # Wait for the first output before answering 200: a request the engine refuses (an empty prompt, one
        # too long) raises here and is answered 400, as it is unstreamed, not 200 with an error event.
        first = await anext(outputs, None)
        return StreamingResponse(stream_events(_prepend(first, outputs), chunk,
                                               usage_chunk if include_usage else None, decode),
                                 media_type="text/event-stream")
    out = await run_to_end(request, outputs)
    if out is None:
        return Response(status_code=499)
    return JSONResponse(whole(out).model_dump())


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n"


async def text_deltas(outputs: AsyncIterator[RequestOutput],
                      decode: Decode) -> AsyncIterator[tuple[str, RequestOutput]]:
    """Incremental detokenization: emit text once it is stable (no half of a multi-byte char)."""
    sent = ""
    async for out in outputs:
        text = out.text if out.finished else decode(out.token_ids)
        if not out.finished and text.endswith("\ufffd"):
            continue
        delta, sent = text[len(sent):] if text.startswith(sent) else text, text
        yield delta, out


async def stream_events(
    outputs: AsyncIterator[RequestOutput],
    chunk: Callable[[RequestOutput, str, bool], BaseModel],
    usage_chunk: Callable[[RequestOutput], BaseModel] | None,
    decode: Decode,
) -> AsyncIterator[str]:
    first = True
    try:
        async for delta, out in text_deltas(outputs, decode):
            yield sse(chunk(out, delta, first))
            first = False
            if out.finished and usage_chunk is not None:
                yield sse(usage_chunk(out))
        yield sse("[DONE]")
    except EngineError as exc:
        yield sse(json.dumps({"error": {"message": str(exc), "type": "engine_error"}}))
    finally:
        await outputs.aclose()


async def _prepend(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
    async for out in rest:
        yield out
