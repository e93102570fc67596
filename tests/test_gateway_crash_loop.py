"""A managed `kvops gateway` that exits: a configuration error (exit code 2) is not started again, other exits get
the engine's crash-loop handling, and why it is down shows in GET /api/engines, in the `gateway_down` diagnosis and
its alert, and in `kvops top`'s engines panel; `POST /api/engines/<engine>/resume` starts it again once fixed.

Real gateway processes (about half a second each to start, no model: their upstream is a dead address), the
supervisor's own poll loop, no shared engine."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvops.history import EngineHistory
from kvops.supervisor.api import build_supervisor_app
from kvops.supervisor.config import parse_config
from kvops.supervisor.engine_spec import GatewaySpec
from kvops.supervisor.managed_gateway import GatewayHandle
from kvops.supervisor.supervisor import Supervisor
from tests.helpers.waiting import wait_for

SHORT_KEY = "team-a 0123456789\n"  # 10 characters: the gateway wants 16
GOOD_KEY = "team-a 0123456789abcdef\n"
DEAD_UPSTREAM = "http://127.0.0.1:9"
ADMIN = {"Authorization": "Bearer admin-token"}


def _poll(handle: GatewayHandle, seconds: float) -> None:
    """The supervisor's poll loop, by hand, for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        handle.check()
        time.sleep(0.05)


@pytest.fixture
def handles() -> Iterator[list[GatewayHandle]]:
    started: list[GatewayHandle] = []
    yield started
    for handle in started:
        handle.stop()


def _handle(tmp_path: Path, started: list[GatewayHandle], history: EngineHistory, **spec: Any) -> GatewayHandle:
    handle = GatewayHandle("e", GatewaySpec.model_validate(spec), tmp_path, history=history)
    started.append(handle)
    return handle


def test_a_gateway_that_refuses_its_key_file_is_started_once_and_says_why(
        tmp_path: Path, handles: list[GatewayHandle]) -> None:
    keys = tmp_path / "keys"
    keys.write_text(SHORT_KEY)
    history = EngineHistory("e")
    handle = _handle(tmp_path, handles, history, api_keys_file=str(keys),
                     restart={"initial_backoff_s": 0.1, "crash_loop_exits": 5})
    handle.start(DEAD_UPSTREAM)
    wait_for("the gateway to exit", lambda: (handle.check(), handle.exits)[1], 60, every_s=0.05)
    _poll(handle, 1.5)  # fifteen backoffs of 0.1 s: a blind restart would have started it again by now
    assert handle.starts == 1 and handle.pid is None
    view = handle.view()
    assert view["last_exit"] == "exit code 2" and "refused its configuration" in str(view["stopped"]), view
    assert view["restart_at"] is None and view["log"] == str(tmp_path / "gateway-e.log")
    last_lines = str(view["last_lines"])  # the gateway's own one-line refusal, from its log
    assert f"{keys} line 1" in last_lines and "at least 16" in last_lines, view
    # The engine's history carries it for the rules, as it carries the engine's own exits.
    assert history.gateway is handle.record and history.gateway.exits[-1].exit_code == 2


def test_a_gateway_that_keeps_exiting_stops_in_a_crash_loop(tmp_path: Path, handles: list[GatewayHandle]) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        history = EngineHistory("e")
        # Its port is taken: it exits (not with 2), and is started again until the crash loop stops it.
        handle = _handle(tmp_path, handles, history, listen=f"127.0.0.1:{taken.getsockname()[1]}",
                         restart={"initial_backoff_s": 0.1, "crash_loop_exits": 2, "crash_loop_window_s": 120})
        handle.start(DEAD_UPSTREAM)
        wait_for("the crash loop", lambda: (handle.check(), history.gateway and history.gateway.stopped)[1], 60,
                 every_s=0.05)
        _poll(handle, 1.0)
        assert handle.starts == 2 and handle.exits == 2 and handle.pid is None
        record = handle.record
        assert history.gateway is record and "crash loop: 2 exits in 120 s" in record.stopped
        assert record.exits[-1].exit_code not in (0, 2)
        assert "address already in use" in str(handle.view()["last_lines"])
    finally:
        taken.close()


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[tuple[Supervisor, Path]]:
    keys = tmp_path / "keys"
    keys.write_text(SHORT_KEY)
    config = parse_config({
        "supervisor": {"state_dir": str(tmp_path / "state"), "poll_interval_s": 0.2, "evaluation_interval_s": 0.2,
                       "alert_warmup_s": 0},
        "engines": [{"name": "e", "url": DEAD_UPSTREAM,
                     "gateway": {"api_keys_file": str(keys), "restart": {"initial_backoff_s": 0.2}}}],
    }, "test")
    sup = Supervisor(config, admin_token="admin-token")
    sup.start()
    try:
        yield sup, keys
    finally:
        sup.stop()


def _gateway_entry(api: TestClient) -> dict[str, Any]:
    return api.get("/api/engines").json()[0]["gateway"]


def _gateway_down(api: TestClient) -> dict[str, Any] | None:
    return next((d for d in api.get("/api/diagnoses").json() if d["rule"] == "gateway_down"), None)


def test_the_supervisor_shows_why_its_gateway_is_down_alerts_and_resumes_it(
        supervised: tuple[Supervisor, Path]) -> None:
    sup, keys = supervised
    api = TestClient(build_supervisor_app(sup))
    diagnosis = wait_for("gateway_down", lambda: _gateway_down(api), 60, every_s=0.1)
    entry = _gateway_entry(api)
    assert entry["managed"] and entry["pid"] is None and entry["starts"] == 1 and entry["exits"] == 1, entry
    assert entry["last_exit"] == "exit code 2" and "refused its configuration" in entry["stopped"], entry
    assert any(f"{keys} line 1" in line for line in entry["last_lines"]) and entry["log"].endswith("gateway-e.log")
    assert diagnosis["severity"] == "critical" and "exit code 2" in diagnosis["summary"], diagnosis
    assert f"{keys} line 1" in diagnosis["summary"] and "--check-config" in diagnosis["fix"]["description"]
    assert f"{keys} line 1" in diagnosis["evidence"]["last_lines"]
    # Critical: its alert fires at once, as crash_loop's and engine_down's do.
    wait_for("its alert", lambda: [a for a in sup.alerter.active_alerts()
                                   if a.labels.get("alertname") == "gateway_down"], 10, every_s=0.1)
    time.sleep(1.0)  # five backoffs of 0.2 s
    assert _gateway_entry(api)["starts"] == 1
    # Fixed, then resumed: it starts again, and the diagnosis clears.
    keys.write_text(GOOD_KEY)
    assert api.post("/api/engines/e/resume").status_code == 401  # the admin token is needed
    assert api.post("/api/engines/e/resume", headers=ADMIN).json() == {"resumed": "e", "gateway": True}
    handle = sup.engines["e"].gateway
    assert handle is not None
    # 503: it answers, for an upstream that does not
    wait_for("the gateway answering", lambda: httpx.get(f"{handle.url}/health", timeout=2).status_code == 503, 60,
             every_s=0.2)
    wait_for("gateway_down to clear", lambda: _gateway_down(api) is None, 30, every_s=0.1)
    entry = _gateway_entry(api)
    assert entry["starts"] == 2 and entry["pid"] == handle.pid and entry["stopped"] == "", entry
