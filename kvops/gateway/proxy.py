"""The OpenAI routes: authenticate, admit, shape, relay, account. `POST /v1/completions`,
`POST /v1/chat/completions` and `GET /v1/models`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvops.gateway.accounting import UNAUTHENTICATED, Usage
from kvops.gateway.errors import GatewayError, error_response
from kvops.gateway.limits import estimate_tokens
from kvops.gateway.shadow import prompt_texts
from kvops.gateway.shaping import Shaped, read_json_object, shape
from kvops.gateway.state import Gateway
from kvops.gateway.streaming import Relay, RelayResponse
from kvops.gateway.upstream import upstream_failure
from kvops.gateway.upstream_http import RawResponse

log = structlog.get_logger("kvops.gateway")

# Of the upstream's response headers, the ones the client gets (hop-by-hop and length headers are the gateway's).
T = TypeVar("T")
PASSED_HEADERS = ("x-request-id", "x-kvops-request-id")


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class FastRelay:
    """The generation routes as a plain ASGI app in front of the framework's. Every chunk of a stream answered
    through FastAPI passed its middleware stack (error and exception wrappers, body limits), a tenth of the
    gateway's CPU on a stream; here the response is sent straight to the server. Everything else, and a request
    that is not a POST to those paths, goes to `app`."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await relay_generation(self.gateway, request, scope["path"])
        except Exception as exc:  # as the framework's last handler: a 500 in OpenAI's shape, never a traceback
            log.error("gateway error", path=scope["path"], error=repr(exc)[:300])
            response = error_response(500, "the gateway failed on this request; its log says why", "internal_error")
        await response(scope, receive, send)


def refused(gateway: Gateway, tenant: str, exc: GatewayError) -> Response:
    gateway.accounting.error(tenant, exc.reason)
    gateway.accounting.request_done(tenant, exc.status)
    return exc.response()


def build_proxy_router(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    async def completions(request: Request) -> Response:
        return await relay_generation(gateway, request, "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await relay_generation(gateway, request, "/v1/chat/completions")

    async def models(request: Request) -> Response:
        tenant = UNAUTHENTICATED
        try:
            tenant = gateway.tenant_of(request)
            response = await gateway.upstream.send(gateway.upstream.build("GET", "/v1/models"), stream=False)
        except GatewayError as exc:
            return refused(gateway, tenant, exc)
        return upstream_answer(gateway, tenant, response, response.content)

    router.add_api_route("/v1/completions", completions, methods=["POST"])
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/v1/models", models, methods=["GET"])
    return router


async def relay_generation(gateway: Gateway, request: Request, path: str) -> Response:
    started = time.monotonic()
    tenant = UNAUTHENTICATED
    try:
        tenant = gateway.tenant_of(request)
        body = await read_json_object(request, gateway.settings.max_body_bytes, gateway.settings.body_timeout_s)
        policy = gateway.policies.policy(tenant)
        estimate = estimate_tokens(body)
        gateway.limits.admit(tenant, policy, estimate)
    except GatewayError as exc:
        return refused(gateway, tenant, exc)
    gateway.accounting.admitted(tenant, estimate, gateway.shadow.observe(policy.salt_for(tenant), prompt_texts(body)))
    gateway.accounting.started(tenant)
    release = _release_once(gateway, tenant)
    try:
        shaped = shape(body, tenant, policy, await gateway.upstream.injects_salt())
        response = await until_gone(request, gateway.upstream.send(gateway.upstream.build("POST", path, shaped.body),
                                                                   stream=True))
    except GatewayError as exc:
        await release()
        return refused(gateway, tenant, exc)
    except BaseException:
        await release()
        raise
    if response is None:
        await release()
        return client_gone(gateway, tenant)
    # Relayed as a stream when the upstream streams, whatever the gateway made of the request's `stream`.
    if response.status_code == 200 and "text/event-stream" in response.headers.get("content-type", ""):
        relay = Relay(response, tenant, gateway.accounting, started, shaped.client_wants_usage, release)
        return RelayResponse(relay, _passed(response))
    return await _whole_answer(gateway, request, tenant, response, shaped, started, release)


async def until_gone(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client hung up first: then `work` is cancelled, which closes the upstream
    connection (vLLM and the kvops engine abort a request whose client has gone). A whole answer is waited for
    like this; a stream's hang-up is Starlette's to hear (kvops/gateway/streaming.py)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_hung_up(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself cancelled: nothing may be left running
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # until the upstream connection is closed; the task's CancelledError stays in it
    return None


async def _hung_up(request: Request) -> None:
    """Returns when the client disconnects (its body has been read: the next message can only be that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def client_gone(gateway: Gateway, tenant: str) -> Response:
    gateway.accounting.disconnect(tenant)
    gateway.accounting.request_done(tenant, 499)
    return Response(status_code=499)  # nobody reads it


async def _whole_answer(gateway: Gateway, request: Request, tenant: str, response: RawResponse, shaped: Shaped,
                        started: float, release: Callable[[], Awaitable[None]]) -> Response:
    try:
        content = await until_gone(request, response.aread())
    except httpx.HTTPError as exc:
        return refused(gateway, tenant, upstream_failure(exc, gateway.upstream.url))
    finally:
        await response.aclose()
        await release()
    if content is None:
        return client_gone(gateway, tenant)
    if response.status_code < 400:
        gateway.accounting.first_token(tenant, time.monotonic() - started)
        if not shaped.stream:
            try:
                usage = Usage.from_body(json.loads(content).get("usage"))
            except (ValueError, AttributeError):
                usage = None
            if usage is not None:
                gateway.accounting.usage(tenant, usage)
    return upstream_answer(gateway, tenant, response, content)


def upstream_answer(gateway: Gateway, tenant: str, response: RawResponse, content: bytes) -> Response:
    """The upstream's answer as the client gets it: as it came when it succeeded or is an OpenAI error body, else an
    OpenAI error of the same status (503: the upstream is unavailable); 502 when it refused the gateway's key."""
    status = response.status_code
    gateway.accounting.request_done(tenant, 502 if status in (401, 403) else status)
    if status < 400:
        return Response(content, status_code=status, headers=_passed(response),
                        media_type=response.headers.get("content-type", "application/json"))
    if status in (401, 403):
        # The client's key was good (it got this far): the upstream refused the gateway's own credentials.
        gateway.accounting.error(tenant, "upstream_auth")
        return error_response(502, f"the upstream {gateway.upstream.url} refused the gateway ({status}): give it the "
                              "upstream's key with --upstream-api-key-env", "upstream_error")
    gateway.accounting.error(tenant, "upstream_unavailable" if status == 503 else "upstream_status")
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return JSONResponse(body, status_code=status, headers=_passed(response))
    if status == 503:
        return error_response(503, f"the upstream {gateway.upstream.url} is unavailable (503); try again later",
                              "upstream_error")
    return error_response(status, f"the upstream {gateway.upstream.url} answered {status}", "upstream_error")


def _passed(response: RawResponse) -> dict[str, str]:
    return {name: response.headers[name] for name in PASSED_HEADERS if name in response.headers}


def _release_once(gateway: Gateway, tenant: str) -> Callable[[], Awaitable[None]]:
    """Give the tenant's in-flight slot back, once, whichever path ends the request."""
    done = False

    async def release() -> None:
        nonlocal done
        if not done:
            done = True
            gateway.limits.release(tenant)
            gateway.accounting.finished(tenant)

    return release
