"""The trivial upstream of `kvops bench gateway` (kvops/bench/gateway.py): raw ASGI, no framework, answering at once,
so that what the gateway adds shows apart from a real engine's noise. `python -m kvops.bench.gateway_stub PORT
[DELAY_S]` serves it on 127.0.0.1; the benchmark and its test start it so, in a process of its own.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any


def stub_app(delay_s: float = 0.0) -> Any:
    """A trivial upstream (raw ASGI, no framework): /health, /v1/models (owned by "vllm", so the gateway salts as it
    does for vLLM) and streamed /v1/completions of `max_tokens` one-token events, at once after `delay_s`."""

    async def send_json(send: Any, status: int, payload: Any) -> None:
        raw = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/health":
            return await send_json(send, 200, {"status": "ok"})
        if path == "/v1/models":
            return await send_json(send, 200, {"object": "list", "data": [{"id": "stub", "object": "model",
                                                                          "owned_by": "vllm"}]})
        if path != "/v1/completions":
            return await send_json(send, 404, {"error": {"message": "not found", "type": "not_found_error"}})
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(raw)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        if delay_s:
            await asyncio.sleep(delay_s)
        count = int(request.get("max_tokens") or 16)
        for i in range(count):
            chunk = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
                     "choices": [{"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}]}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})
        if (request.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(request.get("prompt") or []), "completion_tokens": count,
                     "total_tokens": len(request.get("prompt") or []) + count}
            chunk = {"id": "cmpl-stub", "object": "text_completion", "model": "stub", "choices": [], "usage": usage}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def serve_stub(port: int, delay_s: float = 0.0) -> None:
    import uvicorn

    uvicorn.run(stub_app(delay_s), host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    serve_stub(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
