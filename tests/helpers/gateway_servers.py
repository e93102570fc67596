"""Servers the gateway tests run on 127.0.0.1 in this process: a gateway in front of an upstream, and a recording
upstream that stands in for vLLM's request parsing (it keeps every body it gets and answers like an OpenAI server).

The recording upstream exists because the kvops engine ignores `cache_salt` (its request models drop unknown fields),
so what the gateway injects can only be seen by a server that keeps the body. Its answers follow vLLM's shapes; the
test against a real vLLM belongs to a later step (docs/gateway.md, "Not built yet").
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvops.gateway.app import build_gateway_app
from kvops.gateway.policy import PolicyStore
from kvops.gateway.shaping import wants_stream
from kvops.gateway.state import Gateway, GatewaySettings
from kvops.gateway.upstream import Upstream, UpstreamKind, UpstreamTimeouts
from kvops.processes import free_port
from kvops.tenancy.api_keys import load_api_keys

KEYS = {"team-a": "a" * 8 + "0123456789abcdef", "team-b": "b" * 8 + "0123456789abcdef"}
ADMIN_TOKEN = "admin-token-0123456789"


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` on a free 127.0.0.1 port, in a thread, for the block; its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys"
    path.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    return path


def make_gateway(upstream_url: str, tmp_path: Path | None = None, kind: UpstreamKind = UpstreamKind.AUTO,
                 policies: PolicyStore | None = None, admin: bool = True, **settings: Any) -> Gateway:
    """A gateway to `upstream_url`; with the two tenants of KEYS when `tmp_path` is given, else without keys."""
    keys = load_api_keys(str(key_file(tmp_path)), None) if tmp_path is not None else None
    return Gateway(Upstream(upstream_url, kind, UpstreamTimeouts(connect=2.0, read=60.0)), keys,
                   policies or PolicyStore(),
                   GatewaySettings(admin_token=ADMIN_TOKEN if admin else None, **settings))


@contextmanager
def gateway_in_front_of(upstream_url: str, tmp_path: Path | None = None,
                        **kwargs: Any) -> Iterator[tuple[str, Gateway]]:
    gateway = make_gateway(upstream_url, tmp_path, **kwargs)
    with serving(build_gateway_app(gateway)) as url:
        yield url, gateway


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Recorder:
    """The recording upstream: every body it got, and whether each stream it served ended or was closed."""

    def __init__(self, owned_by: str = "vllm", chunks: int = 5, chunk_delay_s: float = 0.0) -> None:
        self.owned_by = owned_by
        self.chunks = chunks
        self.chunk_delay_s = chunk_delay_s
        self.bodies: list[dict[str, Any]] = []
        self.streams_closed_early = 0
        self.streams_finished = 0
        self.status = 200  # what the completion routes answer (503: unavailable)
        self.app = self._build()

    def _usage(self) -> dict[str, Any]:
        return {"prompt_tokens": 10, "completion_tokens": self.chunks, "total_tokens": 10 + self.chunks,
                "prompt_tokens_details": {"cached_tokens": 4}}

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": self.owned_by}]}

        async def completion(request: Request) -> Any:
            body = await request.json()
            self.bodies.append(body)
            if not isinstance(body, dict):
                return JSONResponse({"error": {"message": "not an object", "type": "x", "param": None, "code": 400}},
                                    status_code=400)
            if self.status != 200:
                return JSONResponse({"detail": "busy"}, status_code=self.status)
            if wants_stream(body.get("stream")):
                return StreamingResponse(self._stream(body), media_type="text/event-stream")
            return {"id": "x", "object": "chat.completion", "model": "m", "usage": self._usage(),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                 "finish_reason": "stop"}]}

        app.add_api_route("/v1/chat/completions", completion, methods=["POST"])
        app.add_api_route("/v1/completions", completion, methods=["POST"])
        return app

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        finished = False
        try:
            for i in range(self.chunks):
                chunk = {"id": "x", "object": "chat.completion.chunk", "model": "m",
                         "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                await asyncio.sleep(self.chunk_delay_s)
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage") is True:
                usage = {"id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [],
                         "usage": self._usage()}
                yield f"data: {json.dumps(usage)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if finished:
                self.streams_finished += 1
            else:
                self.streams_closed_early += 1
