"""The upstream server: one pooled httpx client, what kind of server it is, and its failures as OpenAI errors.

Which kind decides whether `cache_salt` is sent: vLLM (V1) takes it and keys its prefix cache with it; the kvops
engine ignores unknown fields (its own per-tenant salts come from its tenant, docs/server.md) and an unknown
OpenAI-compatible server may refuse a field it does not know, so only a `vllm` upstream gets one. `auto` asks
`GET /v1/models` (`owned_by`: `vllm`, `kvops`) on the first request that needs to know, and again until it gets an
answer, so a gateway may start before its upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import httpx
import structlog

from kvops.gateway.errors import GatewayError
from kvops.gateway.upstream_http import RawResponse, UpstreamConnections

log = structlog.get_logger("kvops.gateway")


class UpstreamKind(StrEnum):
    AUTO = "auto"
    VLLM = "vllm"
    KVOPS = "kvops"
    OPENAI = "openai"  # any other OpenAI-compatible server: no cache_salt


@dataclass(frozen=True)
class UpstreamTimeouts:
    """Seconds. `read` bounds the wait for each part of an answer (the whole body when not streamed, the next chunk
    of a stream)."""

    connect: float = 3.0
    read: float = 600.0
    write: float = 30.0
    pool: float = 10.0


@dataclass(frozen=True)
class UpstreamRequest:
    method: str
    path: str
    body: bytes | None  # JSON


def upstream_failure(exc: httpx.HTTPError, url: str) -> GatewayError:
    """What the client is told when the upstream could not be reached or did not answer in time."""
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return GatewayError(502, f"the upstream {url} did not accept a connection in time", "upstream_error",
                            "upstream_connect")
    if isinstance(exc, httpx.ConnectError):
        return GatewayError(502, f"the upstream {url} refused the connection or cannot be reached", "upstream_error",
                            "upstream_connect")
    if isinstance(exc, httpx.TimeoutException):
        return GatewayError(504, f"the upstream {url} did not answer in time", "upstream_error", "upstream_timeout")
    return GatewayError(502, f"the upstream {url} failed: {type(exc).__name__}", "upstream_error", "upstream_protocol")


class Upstream:
    """The server requests are relayed to."""

    def __init__(self, url: str, kind: UpstreamKind = UpstreamKind.AUTO, timeouts: UpstreamTimeouts | None = None,
                 api_key: str | None = None, max_connections: int = 256) -> None:
        self.url = url.rstrip("/")
        self.kind = kind
        timeouts = timeouts or UpstreamTimeouts()
        # identity: streams are relayed as raw bytes, which must be the events themselves, not a compressed body
        headers = {"Accept-Encoding": "identity"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        parts = urlsplit(self.url)
        self._prefix = parts.path.rstrip("/")
        # The relayed requests (kvops/gateway/upstream_http.py); the client below for the rare others.
        self.connections = UpstreamConnections(
            parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80),
            connect_timeout=timeouts.connect, read_timeout=timeouts.read, pool_timeout=timeouts.pool,
            limit=max_connections, headers=headers, tls=parts.scheme == "https")
        self.client = httpx.AsyncClient(
            base_url=self.url, headers=headers, trust_env=False,  # never a proxy from the environment
            timeout=httpx.Timeout(connect=timeouts.connect, read=timeouts.read, write=timeouts.write,
                                  pool=timeouts.pool),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))
        self._detect_lock = asyncio.Lock()

    async def close(self) -> None:
        await self.connections.close()
        await self.client.aclose()

    async def resolved_kind(self) -> UpstreamKind:
        """The kind, asking `/v1/models` when it is `auto` (AUTO again while the upstream does not answer)."""
        if self.kind is not UpstreamKind.AUTO:
            return self.kind
        async with self._detect_lock:
            if self.kind is UpstreamKind.AUTO:
                detected = await self._detect()
                if detected is not None:
                    log.info("gateway upstream kind detected", upstream=self.url, kind=str(detected))
                    self.kind = detected
            return self.kind

    async def _detect(self) -> UpstreamKind | None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = await self.client.get("/v1/models")
            if response.status_code == 200:
                data = response.json().get("data") or []
                owners = {str(card.get("owned_by", "")).lower() for card in data if isinstance(card, dict)}
                if "vllm" in owners:
                    return UpstreamKind.VLLM
                if "kvops" in owners:
                    return UpstreamKind.KVOPS
                return UpstreamKind.OPENAI
        return None

    async def injects_salt(self) -> bool:
        return await self.resolved_kind() is UpstreamKind.VLLM

    def build(self, method: str, path: str, body: dict[str, Any] | None = None) -> UpstreamRequest:
        raw = None if body is None else json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        return UpstreamRequest(method, self._prefix + path, raw)

    async def send(self, request: UpstreamRequest, stream: bool) -> RawResponse:
        """The upstream's response (headers only when `stream`, then its body read from it; else the whole body in
        `content`); GatewayError when it cannot be had."""
        headers = {"Content-Type": "application/json"} if request.body is not None else {}
        try:
            response = await self.connections.send(request.method, request.path, request.body, headers)
            if not stream:
                try:
                    response.content = await response.aread()
                finally:
                    await response.aclose()
            return response
        except httpx.HTTPError as exc:
            raise upstream_failure(exc, self.url) from None
