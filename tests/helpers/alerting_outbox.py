"""Shared by the alerting tests: what the alerter wrote to its outbox, read back the way a restarted
daemon would, and a real HTTP receiver on 127.0.0.1 (stdlib `http.server` in a thread)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvops.alerting import SIGNATURE_HEADER
from kvops.alerting.alerter import STATE_FILE
from kvops.alerting.outbox import Outbox, OutboxRow


def outbox_rows(state_dir: Path) -> list[OutboxRow]:
    outbox = Outbox(state_dir / STATE_FILE)
    try:
        return outbox.rows()
    finally:
        outbox.close()


@dataclass(frozen=True)
class Request:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered
    at: float = field(default_factory=time.monotonic)  # when it arrived, to measure the backoff between tries

    def json(self) -> Any:
        return json.loads(self.body)


class Receiver:
    """An HTTP endpoint that records every POST and answers the next scripted status (then `status`, 200 by
    default); `hang_s` scripts how long it sits on a request before answering, to make the client time out."""

    def __init__(self, port: int = 0, status: int = 200) -> None:
        self.port = port
        self.status = status
        self.requests: list[Request] = []
        self.script: list[int] = []
        self.hang_s: list[float] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def accepted(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if 200 <= r.status < 300]

    def alertnames(self) -> list[str]:
        """Alert names of the accepted webhook notifications, in arrival order."""
        return [a["labels"]["alertname"] for r in self.accepted for a in r.json()["alerts"]]

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    hang = receiver.hang_s.pop(0) if receiver.hang_s else 0.0
                if hang:
                    time.sleep(hang)  # the client has given up by now: this answer goes nowhere
                    return
                with receiver._lock:
                    status = receiver.script.pop(0) if receiver.script else receiver.status
                    receiver.requests.append(Request(self.path, dict(self.headers.items()), body, status))
                # a careless receiver echoing the request headers in its error page
                echo = {k: v for k, v in self.headers.items() if k in ("Authorization", SIGNATURE_HEADER)}
                reply = b"ok" if status < 300 else f"refused; you sent {echo}".encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
