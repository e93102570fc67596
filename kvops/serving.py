"""Running an ASGI app until SIGTERM/SIGINT, then draining: shared by the engine and the supervisor."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, except that a signal-initiated graceful shutdown exits 0: uvicorn
    re-raises the signal afterwards, which would make a clean drain look like a kill."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def serve(app: ASGIApp, host: str, port: int, drain_timeout_s: float, timeout_keep_alive_s: int = 5,
          limit_concurrency: int | None = None) -> int:
    """Run the app until SIGTERM/SIGINT: stop accepting, finish in-flight requests, drain, exit 0.
    `timeout_keep_alive_s` closes an idle keep-alive connection (uvicorn's default, 5 s); `limit_concurrency`
    answers 503 to connections beyond that many (None: no limit)."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=max(1, int(drain_timeout_s)),
                            timeout_keep_alive=timeout_keep_alive_s, limit_concurrency=limit_concurrency)
    server = _DrainingServer(config)
    server.run()
    return 0 if server.started else 1
