"""A client's request body read (bounded in size and time) and shaped for the upstream by its tenant's policy:
the cache salt, prompt normalization, and usage asked for on streams."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from kvops.gateway.errors import GatewayError, bad_request
from kvops.gateway.policy import TenantPolicy
from kvops.gateway.volatile import mask_text
from kvops.prompt_normalization import normalize_prompt


async def read_json_object(request: Request, max_bytes: int, timeout_s: float) -> dict[str, Any]:
    """The body as a JSON object: 413 over `max_bytes` (by Content-Length before reading, else while reading),
    408 when it has not all arrived within `timeout_s` (a slow client cannot hold its connection forever), 400 for
    anything that is not a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise GatewayError(408, f"the request body did not arrive within {timeout_s:g} s", "invalid_request_error",
                           "body_timeout") from None
    except ClientDisconnect:
        raise bad_request("the client went away before the end of its request body", "body_incomplete") from None
    try:
        body = json.loads(b"".join(chunks), parse_constant=_not_json)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError and NaN / Infinity
        raise bad_request(f"the body is not valid JSON: {exc}", "bad_json") from None
    except RecursionError:
        raise bad_request("the body is not valid JSON: nested too deeply", "bad_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, not {type(body).__name__}", "bad_json")
    return body


def _not_json(name: str) -> None:
    """NaN and Infinity are not JSON (RFC 8259), though Python reads them; the upstream's body could not carry them."""
    raise ValueError(f"{name} is not a JSON value")


def _too_large(max_bytes: int) -> GatewayError:
    return GatewayError(413, f"the request body is over the gateway's limit of {max_bytes} bytes",
                        "invalid_request_error", "body_too_large")


@dataclass(frozen=True)
class Shaped:
    """The body to send upstream and what the gateway must remember about the client's own request."""

    body: dict[str, Any]
    stream: bool
    client_wants_usage: bool


def shape(body: dict[str, Any], tenant: str, policy: TenantPolicy, inject_salt: bool) -> Shaped:
    """The upstream's body for `tenant`: a copy of the client's with the policy applied."""
    out = dict(body)
    stream = wants_stream(out.get("stream"))
    # A client-supplied cache_salt is always replaced (or removed): a client that could choose its salt could join
    # another tenant's cache (and read its prompts' timing) just by sending that tenant's salt.
    out.pop("cache_salt", None)
    salt = policy.salt_for(tenant)
    if inject_salt and salt is not None:
        out["cache_salt"] = salt
    if policy.normalize or policy.mask:
        _rewrite_prompts(out, policy)
    options = out.get("stream_options")
    client_wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    if stream:
        # Asked for on every stream so that its tokens are counted; the usage-only last chunk is dropped again for a
        # client that did not ask for it (kvops/gateway/streaming.py).
        out["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return Shaped(out, stream, client_wants_usage)


def wants_stream(value: object) -> bool:
    """Whether `stream` asks for a stream as the upstream reads it: vLLM's pydantic models take a bool leniently
    (`1`, `"true"`, `"yes"`, `"on"`... are true), so the gateway does too, or it would not ask that stream for usage."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value == 1
    return isinstance(value, str) and value.strip().lower() in ("1", "true", "t", "yes", "y", "on")


def _rewrite_prompts(body: dict[str, Any], policy: TenantPolicy) -> None:
    """The policy's prompt rewriting (whitespace normalization, kvops.prompt_normalization, then the masks of
    kvops.gateway.volatile) on a completion's string prompt(s) and each chat message's string content; token ids
    and content parts are left as they are."""

    def rewrite(text: str) -> str:
        if policy.normalize:
            text = normalize_prompt(text)
        return mask_text(text, policy.mask) if policy.mask else text

    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = rewrite(prompt)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        body["prompt"] = [rewrite(p) for p in prompt]
    messages = body.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        body["messages"] = [{**m, "content": rewrite(m["content"])} if isinstance(m.get("content"), str) else dict(m)
                            for m in messages]
