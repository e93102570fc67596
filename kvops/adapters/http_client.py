"""HTTP/1.1 with keep-alive on the standard library: what the supervisor polls engines with.

A poll at 10 Hz is one small request every 100 ms, for the life of the daemon, on the machine the engine
runs on. httpx spent 0.5 ms of CPU per request on an idle 2-vCPU machine and 1.7 ms with the engine busy,
`http.client` 0.1 ms and ~0.4 ms (docs/benchmarks.md, "Supervisor polling"). An `http.client` connection
carries one request at a time, and the supervisor reads engines from a pool of threads while fix jobs and profiles
call the same client from their own, so each request takes an idle kept-alive connection (a new one when none is
idle) and gives it back: a client holds as many connections as it ever had requests at once, usually one. (One
connection per thread, as before, came to one per reader thread per engine: 16 x 300 sockets for a 300-engine
fleet.)
"""

from __future__ import annotations

import http.client
import json as jsonlib
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

# A kept-alive connection the server closed while idle fails on its next request in one of these ways, before
# any response: such a request is sent once more on a new connection (only the idempotent methods).
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})


class HttpError(Exception):
    """No response: refused, timed out, reset, or not HTTP. The message names the exception."""


@dataclass(frozen=True, slots=True)
class Reply:
    status_code: int
    headers: http.client.HTTPMessage  # case-insensitive .get()
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return jsonlib.loads(self.content)


class HttpClient:
    def __init__(self, base_url: str, timeout_s: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r} is not an http:// or https:// URL")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self._idle: list[http.client.HTTPConnection] = []  # kept alive, not in use; the last returned first
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def request(self, method: str, path: str, *, headers: dict[str, str] | None = None,
                params: dict[str, str] | None = None, json: Any = None, timeout: float | None = None) -> Reply:
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        body = None if json is None else jsonlib.dumps(json).encode()
        sent_headers = {"Accept": "*/*", **(headers or {})}
        if body is not None:
            sent_headers["Content-Type"] = "application/json"
        for attempt in (1, 2):
            conn, reused = self._connection()
            conn.timeout = self.timeout_s if timeout is None else timeout
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            try:
                conn.request(method, target, body=body, headers=sent_headers)
                response = conn.getresponse()
                reply = Reply(response.status, response.headers, response.read())
            except _STALE as exc:
                self._drop(conn)
                if reused and attempt == 1 and method in _IDEMPOTENT:
                    continue
                raise HttpError(f"{type(exc).__name__}: {exc}") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                raise HttpError(f"{type(exc).__name__}: {exc or 'timed out'}") from None
            if response.will_close:
                self._drop(conn)
            else:
                with self._lock:
                    if conn in self._all:  # not closed meanwhile by close()
                        self._idle.append(conn)
            return reply
        raise AssertionError("unreachable")  # the loop returns or raises

    def close(self) -> None:
        with self._lock:
            connections, self._all, self._idle = self._all, [], []
        for conn in connections:
            conn.close()

    @property
    def connections(self) -> int:
        """Connections open or kept alive now."""
        with self._lock:
            return len(self._all)

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                conn = self._idle.pop()
                return conn, conn.sock is not None
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = kind(self._host, self._port, timeout=self.timeout_s)
            self._all.append(conn)
            return conn, False

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
