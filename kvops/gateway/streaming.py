"""A streamed answer relayed chunk by chunk: server-sent events passed on as the upstream sends them, with the usage
read from the last one, and the upstream stream closed when the client hangs up.

Nothing is buffered beyond one event: the bytes of each complete event (up to its blank line) are sent as soon as
they arrive, unchanged. The gateway asks every stream for usage (`stream_options.include_usage`, so that its tokens
are counted); for a client that did not ask, the usage-only event (`"choices": []` with a `usage` object, which the
upstream sends just before `data: [DONE]`) is read and dropped, so the client sees the stream it asked for. Upstreams
that set `"usage": null` on every other chunk when usage is asked for (vLLM does) show that null to such a client too:
OpenAI's own streams look like that with usage on, and clients ignore it.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvops.gateway.accounting import Accounting, Usage
from kvops.gateway.upstream_http import RawResponse

_SEPARATORS = (b"\r\n\r\n", b"\n\n")


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete events (each with its blank line) from the front of `buffer`, and the incomplete rest."""
    if buffer.endswith(b"\n\n") and buffer.find(b"\n\n") == len(buffer) - 2 and b"\r" not in buffer:
        return [buffer], b""  # one whole event, as vLLM sends each chunk: the common case, in one pass
    events = []
    while True:
        ends = [(at, len(sep)) for sep in _SEPARATORS if (at := buffer.find(sep)) >= 0]
        if not ends:
            return events, buffer
        at, size = min(ends)
        events.append(buffer[: at + size])
        buffer = buffer[at + size:]


_NO_USAGE = (b'"usage":null', b'"usage": null')


def event_usage(event: bytes) -> tuple[Usage | None, bool]:
    """(the usage an event carries, whether the event is usage only: no choices). Most events carry none: vLLM
    writes `"usage":null` into every chunk of a stream that asked for usage, and those are not parsed (a quote inside
    a JSON string is escaped, so the bytes can only be the field itself)."""
    if b'"usage"' not in event or any(none in event for none in _NO_USAGE):
        return None, False
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    try:
        payload = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, False
    if not isinstance(payload, dict):
        return None, False
    usage = Usage.from_body(payload.get("usage"))
    return usage, usage is not None and not payload.get("choices")


class Relay:
    """One upstream stream being relayed to one client: iterate `chunks()`, then `close()` in every case."""

    def __init__(self, response: RawResponse, tenant: str, accounting: Accounting, started: float,
                 client_wants_usage: bool, on_close: Callable[[], Awaitable[None]]) -> None:
        self.response = response
        self.tenant = tenant
        self.accounting = accounting
        self.started = started
        self.client_wants_usage = client_wants_usage
        self.completed = False  # the upstream's stream ended and every byte of it went to the client
        self.failed_reason: str | None = None
        self._on_close = on_close
        self._closed = False
        self._usage: Usage | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        buffer = b""
        first = True
        try:
            async for raw in self.response.aiter_raw():
                if first:
                    self.accounting.first_token(self.tenant, time.monotonic() - self.started)
                    first = False
                events, buffer = split_events(buffer + raw)
                out = self._relayed(events)
                if out:
                    yield out
        except httpx.HTTPError:
            # The upstream broke off (or went silent past the read timeout) mid-stream: the status line has gone,
            # so the client sees the stream end early; it is counted, never raised into the server.
            self.failed_reason = "upstream_stream"
            return
        if buffer:
            yield buffer  # a last event without its blank line: passed on as it came
        self.completed = True

    def _relayed(self, events: list[bytes]) -> bytes:
        kept = []
        for event in events:
            usage, usage_only = event_usage(event)
            if usage is not None:
                self._usage = usage
            if usage_only and not self.client_wants_usage:
                continue
            kept.append(event)
        return b"".join(kept)

    async def close(self) -> None:
        """Close the upstream stream (a vLLM or kvops engine aborts the request when its client goes), account the
        request, and run `on_close` (the tenant's in-flight slot); once."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.response.aclose()
        finally:
            if self._usage is not None:
                self.accounting.usage(self.tenant, self._usage)
            if self.failed_reason is not None:
                self.accounting.error(self.tenant, self.failed_reason)
            elif not self.completed:
                self.accounting.disconnect(self.tenant)
            # 499 (nginx's "client closed request"): the client left before the end of the stream.
            gone = not self.completed and self.failed_reason is None
            self.accounting.request_done(self.tenant, 499 if gone else self.response.status_code)
            await self._on_close()


class RelayResponse(StreamingResponse):
    """Starlette's streaming response, closing its relay however the response ends: finished, the client gone
    (Starlette cancels the stream when it hears `http.disconnect`, or a send fails), or cancelled."""

    def __init__(self, relay: Relay, headers: dict[str, str]) -> None:
        super().__init__(relay.chunks(), status_code=relay.response.status_code, headers=headers,
                         media_type=relay.response.headers.get("content-type", "text/event-stream"))
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with contextlib.suppress(ClientDisconnect, OSError):
                await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.relay.close()
