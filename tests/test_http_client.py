"""The supervisor's HTTP client (kvops/adapters/http_client.py) against a real stdlib HTTP server: kept-alive
connections reused from any thread, as many as requests ran at once, a request resent once when the server dropped
the idle connection, and failures as HttpError naming what happened."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvops.adapters.engine_client import EngineClient, EngineUnreachable
from kvops.adapters.http_client import HttpClient, HttpError
from kvops.processes import free_port


class Server:
    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[str, str, bytes]] = []
        self.close_after_reply = False
        self.delay_s = 0.0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive

            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def _reply(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.requests.append((self.command, self.path, body))
                time.sleep(outer.delay_s)
                payload = json.dumps({"path": self.path}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("X-Kvops-Test", "yes")
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except BrokenPipeError:  # the timed-out client left
                    return
                if outer.close_after_reply:  # like a server's idle timeout, without saying Connection: close
                    self.close_connection = True

            do_GET = do_PUT = do_POST = _reply

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def test_requests_reuse_idle_connections_from_any_thread(server: Server):
    client = HttpClient(server.url + "/engine-a/", timeout_s=5)  # a path prefix is kept
    for _ in range(5):
        reply = client.request("GET", "/stats", params={"steps_after": "12.5"})
        assert reply.status_code == 200 and reply.headers.get("x-kvops-test") == "yes"
    assert reply.json() == {"path": "/engine-a/stats?steps_after=12.5"}
    assert server.connections == 1
    # Another thread, one after the other: the idle connection serves it (a supervisor reads each engine from
    # whichever of its 16 reader threads is free: one connection per thread made 16 per engine).
    for _ in range(3):
        other = threading.Thread(target=lambda: client.request("GET", "/health"))
        other.start()
        other.join()
    assert server.connections == 1 and client.connections == 1
    # Two at once: http.client carries one request at a time, so the second opens a connection of its own; both
    # are kept for later.
    server.delay_s = 0.3
    both = [threading.Thread(target=lambda: client.request("GET", "/health")) for _ in range(2)]
    for thread in both:
        thread.start()
    for thread in both:
        thread.join()
    server.delay_s = 0.0
    assert server.connections == 2 and client.connections == 2
    client.request("PUT", "/admin/eviction-policy", json={"policy": "lfu"}, headers={"Authorization": "Bearer t"})
    assert server.requests[-1] == ("PUT", "/engine-a/admin/eviction-policy", b'{"policy": "lfu"}')
    assert server.connections == 2
    client.close()
    assert client.connections == 0


def test_a_connection_the_server_closed_is_replaced_and_the_request_sent_once_more(server: Server):
    client = HttpClient(server.url, timeout_s=5)
    server.close_after_reply = True
    for _ in range(3):
        assert client.request("GET", "/stats").status_code == 200
    assert len(server.requests) == 3  # each answered once, over a new connection each time
    client.close()


def test_failures_say_what_happened():
    client = HttpClient(f"http://127.0.0.1:{free_port()}", timeout_s=1)
    with pytest.raises(HttpError, match="ConnectionRefusedError"):
        client.request("GET", "/health")
    with pytest.raises(ValueError, match="is not an http:// or https:// URL"):
        HttpClient("localhost:8000", timeout_s=1)


def test_a_slow_server_times_out(server: Server):
    server.delay_s = 1.0
    client = HttpClient(server.url, timeout_s=5)
    with pytest.raises(HttpError, match="timed out"):
        client.request("GET", "/admin/profile/kv-quant", timeout=0.2)
    client.close()


def test_an_admin_call_waits_out_the_step_in_flight_where_a_read_times_out(server: Server):
    """The engine answers an admin call between two steps; one step can outlast the client's read timeout. A
    timed-out admin call still lands after the step, so the fix job must wait for its answer, not give up."""
    server.delay_s = 0.6  # a step in flight
    client = EngineClient(server.url, "admin-token", timeout_s=0.2)
    assert client.admin("set_normalization", {"mode": "on"}) == {"path": "/admin/normalization"}
    assert client.knobs() == {"path": "/admin/config"}
    with pytest.raises(EngineUnreachable, match="timed out"):
        client.health()
    client.close()
