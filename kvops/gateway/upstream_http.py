"""HTTP/1.1 to the upstream on asyncio streams, for the requests the gateway relays: kept-alive connections, a
request written in one piece, the answer's body read as the upstream sends it (chunked or sized).

httpx spent most of the gateway's CPU on a stream: its layers (httpcore, h11, an anyio cancel scope per read) cost
about 0.2 ms a chunk, and every chunk of a vLLM stream is one event (docs/benchmarks.md, "Gateway overhead"). Here a
chunk is a line read and a read of its size. Failures are httpx's exception types, so the gateway maps them to its
answers in one place (kvops.gateway.upstream.upstream_failure).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import httpx

MAX_HEADER_BYTES = 64 * 1024


class Headers(dict[str, str]):
    """Response headers by lower-case name (a repeated header keeps its last value)."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())


class _Silence:
    """A timeout on the gap between chunks: the upstream silent for `limit` seconds (up to a second more) raises
    TimeoutError. Moving an asyncio timeout at every chunk cost a tenth of a stream's CPU; this one moves at most
    once a second."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.slack = min(1.0, limit / 10)
        self._loop = asyncio.get_running_loop()
        self._timeout = asyncio.timeout_at(self._loop.time() + limit + self.slack)

    async def __aenter__(self) -> _Silence:
        await self._timeout.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        return await self._timeout.__aexit__(*exc)  # type: ignore[arg-type]

    def heard(self) -> None:
        now = self._loop.time()
        when = self._timeout.when()
        if when is not None and when - now < self.limit:
            self._timeout.reschedule(now + self.limit + self.slack)


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


@dataclass
class RawResponse:
    """One answer: status and headers read; the body read by `aiter_raw` (as it comes) or `aread`, then `aclose`."""

    status_code: int
    headers: Headers
    _connection: _Connection
    _pool: UpstreamConnections
    _read_timeout: float
    content: bytes = b""  # the whole body, for an answer read at once (`send(..., stream=False)`)
    _done: bool = False
    _closed: bool = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        reader = self._connection.reader
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                async with _Silence(self._read_timeout) as silence:
                    while True:
                        size_line = await reader.readuntil(b"\r\n")
                        size = int(size_line.split(b";", 1)[0], 16)
                        if size == 0:
                            await reader.readuntil(b"\r\n")  # no trailers from the servers the gateway fronts
                            break
                        data = await reader.readexactly(size + 2)
                        silence.heard()
                        yield data[:-2]
            elif (length := self.headers.get("content-length")) is not None:
                left = int(length)
                while left > 0:
                    async with asyncio.timeout(self._read_timeout):
                        data = await reader.read(min(left, 65536))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
            else:  # the body runs to the connection's end
                while True:
                    async with asyncio.timeout(self._read_timeout):
                        data = await reader.read(65536)
                    if not data:
                        break
                    yield data
                self._connection.close()
        except TimeoutError:
            raise httpx.ReadTimeout("the upstream sent nothing within the read timeout") from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ConnectionError) as exc:
            raise httpx.RemoteProtocolError(f"the upstream's answer broke off: {type(exc).__name__}") from None
        self._done = True

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        """Back to the pool when the whole answer was read; otherwise the connection is closed, which tells the
        upstream its client has gone (vLLM aborts the request)."""
        if self._closed:
            return
        self._closed = True
        keep = self._done and self.headers.get("connection", "").lower() != "close"
        self._pool.release(self._connection, keep)


@dataclass
class UpstreamConnections:
    """Kept-alive connections to one host and port, at most `limit` at once."""

    host: str
    port: int
    connect_timeout: float
    read_timeout: float
    pool_timeout: float
    limit: int
    headers: Mapping[str, str] = field(default_factory=dict)
    tls: bool = False
    _idle: list[_Connection] = field(default_factory=list)
    _slots: asyncio.Semaphore | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        if self._slots is None:  # made on the loop that serves (a Semaphore binds to the running loop)
            self._slots = asyncio.Semaphore(self.limit)
        return self._slots

    async def send(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]) -> RawResponse:
        """The answer's status and headers (its body is read from the response); httpx errors when none came."""
        try:
            async with asyncio.timeout(self.pool_timeout):
                await self._semaphore().acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no connection to the upstream came free in time") from None
        try:
            return await self._exchange(method, path, body, headers)
        except BaseException:
            self._semaphore().release()
            raise

    async def _exchange(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]) -> RawResponse:
        head = self._head(method, path, body, headers)
        while self._idle:
            connection = self._idle.pop()
            if not connection.usable():
                connection.close()
                continue
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                # A kept-alive connection the upstream closed meanwhile fails before any answer: try a new one.
                return await self._request(connection, head, body)
            connection.close()
        connection = await self._connect()
        try:
            return await self._request(connection, head, body)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            connection.close()
            raise httpx.RemoteProtocolError(f"the upstream closed the connection without an answer: "
                                            f"{type(exc).__name__}") from None

    def _head(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += [f"{name}: {value}" for name, value in {**self.headers, **headers}.items()]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port, limit=MAX_HEADER_BYTES,
                                                               ssl=True if self.tls else None)
        except TimeoutError:
            raise httpx.ConnectTimeout("the upstream did not accept a connection in time") from None
        except OSError as exc:
            raise httpx.ConnectError(f"the upstream refused the connection: {exc}") from None
        return _Connection(reader, writer)

    async def _request(self, connection: _Connection, head: bytes, body: bytes | None) -> RawResponse:
        connection.writer.write(head + body if body else head)
        try:
            async with asyncio.timeout(self.read_timeout):
                await connection.writer.drain()
                raw = await connection.reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            connection.close()
            raise httpx.ReadTimeout("the upstream did not answer within the read timeout") from None
        except asyncio.LimitOverrunError:
            connection.close()
            raise httpx.RemoteProtocolError("the upstream's headers are too long") from None
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            connection.close()
            raise httpx.RemoteProtocolError(f"not an HTTP answer: {lines[0][:80]!r}") from None
        headers = Headers()
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return RawResponse(status, headers, connection, self, self.read_timeout)

    def release(self, connection: _Connection, keep: bool) -> None:
        if keep and connection.usable():
            self._idle.append(connection)
        else:
            connection.close()
        self._semaphore().release()

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
