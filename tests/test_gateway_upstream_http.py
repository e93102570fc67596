"""The gateway's HTTP/1.1 client to its upstream (kvops/gateway/upstream_http.py), against raw asyncio servers on
loopback that answer byte by byte as a test needs: chunks split across reads, sized and unsized bodies, connections
kept alive and reused, one closed by the server while idle, an answer that breaks off, and one that never comes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from kvops.gateway.upstream_http import UpstreamConnections

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length")), 0)
    return head + (await reader.readexactly(length) if length else b"")


def _pool(port: int, read_timeout: float = 5.0) -> UpstreamConnections:
    return UpstreamConnections("127.0.0.1", port, connect_timeout=2, read_timeout=read_timeout, pool_timeout=2,
                               limit=4, headers={"Accept-Encoding": "identity"})


def test_a_chunked_stream_is_read_chunk_by_chunk_and_its_connection_kept():
    requests: list[bytes] = []
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while not reader.at_eof():
            try:
                requests.append(await _read_request(reader))
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for event in (b"data: 1\n\n", b"data: 22\n\n"):
                frame = b"%x\r\n%s\r\n" % (len(event), event)
                writer.write(frame[:3])  # a chunk split across two reads
                await writer.drain()
                await asyncio.sleep(0.01)
                writer.write(frame[3:])
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def run() -> list[list[bytes]]:
        server, port = await _serve(handler)
        pool = _pool(port)
        got = []
        for _ in range(2):
            response = await pool.send("POST", "/v1/completions", b'{"a":1}', {"Content-Type": "application/json"})
            assert response.status_code == 200 and response.headers.get("Content-Type") == "text/event-stream"
            got.append([chunk async for chunk in response.aiter_raw()])
            await response.aclose()
        await pool.close()
        server.close()
        return got

    assert asyncio.run(run()) == [[b"data: 1\n\n", b"data: 22\n\n"]] * 2
    assert connections == 1  # kept alive and reused
    assert requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Content-Length: 7\r\n" in requests[0] and requests[0].endswith(b'\r\n\r\n{"a":1}')


def test_sized_and_unsized_bodies_and_a_connection_closed_while_idle():
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await _read_request(reader)
        served += 1
        if served == 1:  # sized, then the server closes the idle connection (its keep-alive timeout)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
            await writer.drain()
            await asyncio.sleep(0.05)
        else:  # no length: the body runs to the connection's end
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n\r\nbusy")
            await writer.drain()
        writer.close()

    async def run() -> list[tuple[int, bytes]]:
        server, port = await _serve(handler)
        pool, out = _pool(port), []
        for _ in range(2):
            response = await pool.send("GET", "/v1/models", None, {})
            out.append((response.status_code, await response.aread()))
            await response.aclose()
            await asyncio.sleep(0.2)  # the first connection is closed by now: the second request opens another
        server.close()
        return out

    assert asyncio.run(run()) == [(200, b"hello"), (503, b"busy")]


def test_an_answer_that_breaks_off_or_never_comes_is_an_httpx_error():
    async def breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nda")
        await writer.drain()
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    async def run(handler: Handler, read_timeout: float) -> None:
        server, port = await _serve(handler)
        try:
            response = await _pool(port, read_timeout).send("POST", "/x", b"{}", {})
            [chunk async for chunk in response.aiter_raw()]
        finally:
            server.close()

    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(run(breaks, 5))
    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(run(silent, 0.3))


def test_nothing_listening_is_a_connect_error():
    async def run() -> None:
        await _pool(9).send("GET", "/health", None, {})

    with pytest.raises(httpx.ConnectError):
        asyncio.run(run())
