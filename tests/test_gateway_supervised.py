"""`kvops run` with a `kvops gateway` in front of an engine ([engines.gateway]): the table and its errors, and a
gateway the supervisor starts, reads, restarts when it exits and stops, in front of the session's real kvops engine
(watched by URL), with two tenants' keys.

Named test_gateway_* so that it runs before test_scenarios, which stops every child process of the session (the
shared engine among them) before each scenario."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from kvops.schema.errors import ConfigError
from kvops.supervisor.api import build_supervisor_app
from kvops.supervisor.config import parse_config
from kvops.supervisor.supervisor import Supervisor
from tests.helpers.waiting import wait_for

KEYS = {"team-a": "team-a-key-0123456789", "team-b": "team-b-key-0123456789"}


def _engine(gateway: Any, **more: Any) -> dict[str, Any]:
    return {"name": "e", "url": "http://127.0.0.1:8000", "gateway": gateway, **more}


def _config(tmp_path: Path, gateway: Any) -> Any:
    return parse_config({"supervisor": {"state_dir": str(tmp_path / "state")}, "engines": [_engine(gateway)]}, "t")


def test_a_gateway_is_a_url_or_a_table(tmp_path: Path) -> None:
    external = _config(tmp_path, "http://127.0.0.1:9500/").engines[0].gateway
    assert external.url == "http://127.0.0.1:9500" and not external.managed
    keys = tmp_path / "keys"
    keys.write_text("team-a k\n")
    managed = _config(tmp_path, {"api_keys_file": str(keys), "args": {"max_body_size": 1024}}).engines[0].gateway
    assert managed.managed and managed.listen == "127.0.0.1:0" and managed.api_keys_file == str(keys)


@pytest.mark.parametrize(("gateway", "expected"), [
    ({"listen": "9500"}, "is not host:port"),
    ({"api_keys_file": "/nonexistent/keys"}, "is not a file"),
    ({"url": "http://127.0.0.1:9500", "policy_file": None, "listen": "127.0.0.1:9501"}, "with url kvops starts none"),
    ({"args": {"max_bodysize": 1}}, "args.max_bodysize is not a `kvops gateway` flag"),
    ({"args": {"upstream": "http://x"}}, "args.upstream is set by its own key here"),
    ({"admin_tokn_env": "X"}, "admin_tokn_env"),
    ("ftp://host", "is not an http(s) URL"),
])
def test_a_bad_gateway_table_names_the_key_and_what_to_write(tmp_path: Path, gateway: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        _config(tmp_path, gateway)
    assert "engines" in str(error.value) and "gateway" in str(error.value) and expected in str(error.value)


def test_check_config_reports_a_bad_gateway_table(tmp_path: Path) -> None:
    path = tmp_path / "kvops.toml"
    path.write_text('[[engines]]\nname = "e"\nurl = "http://127.0.0.1:8000"\n[engines.gateway]\nlistenn = "x"\n')
    done = subprocess.run([sys.executable, "-m", "kvops", "run", "--config", str(path), "--check-config"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "listenn" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.fixture
def supervised(shared_engine: str, tmp_path: Path) -> Iterator[Supervisor]:
    keys = tmp_path / "api-keys"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    config = parse_config({"supervisor": {"state_dir": str(tmp_path / "state"), "poll_interval_s": 0.5,
                                          "alert_warmup_s": 0},
                           "engines": [_engine({"api_keys_file": str(keys)}, url=shared_engine)]}, "test")
    sup = Supervisor(config)
    sup.start()
    try:
        yield sup
    finally:
        sup.stop()


def _complete(url: str, tenant: str) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The KV cache holds", "max_tokens": 2}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    assert response.status_code == 200, response.text


def test_the_supervisor_runs_the_gateway_reads_its_tenants_restarts_and_stops_it(supervised: Supervisor) -> None:
    state = supervised.engines["e"]
    handle = state.gateway
    assert handle is not None and handle.managed and handle.admin_token
    wait_for("the gateway", lambda: httpx.get(f"{handle.url}/health", timeout=2).status_code == 200, 60, every_s=0.2)
    for tenant in ("team-a", "team-a", "team-b"):
        _complete(handle.url, tenant)
    assert httpx.post(f"{handle.url}/v1/completions", json={}).status_code == 401  # keys are the gateway's
    # A kvops engine reports tenants of its own (the gateway's requests are its `default`): the gateway's are in
    # the snapshot's gateway view, with what each was charged.
    def charged() -> dict[str, int]:
        latest = state.history.latest
        gateway = latest.gateway if latest is not None else None
        return {} if gateway is None else {name: t.estimated_tokens_total for name, t in gateway.tenants.items()}

    wait_for("both tenants in the snapshot", lambda: set(charged()) == set(KEYS), 20, every_s=0.2)
    assert charged()["team-a"] == 2 * charged()["team-b"] > 0
    # The supervisor holds the admin token: a tenant's policy changes through it.
    assert state.gateway_admin is not None and state.gateway_admin.set_policy("team-b", {"normalize": True})[
        "normalize"] is True
    entry = TestClient(build_supervisor_app(supervised)).get("/api/engines").json()[0]["gateway"]
    assert entry["managed"] and entry["pid"] == handle.pid and entry["admin"] and entry["tenants"] == 2, entry
    first = handle.pid
    assert first is not None
    os.kill(first, 9)
    wait_for("the gateway started again", lambda: handle.pid not in (None, first), 30, every_s=0.2)
    wait_for("it answers again", lambda: httpx.get(f"{handle.url}/health", timeout=2).status_code == 200, 60,
             every_s=0.2)
    assert handle.starts == 2 and handle.exits == 1 and "exit code -9" in handle.last_exit
    _complete(handle.url, "team-a")
    second = handle.pid
    assert second is not None
    supervised.stop()
    assert handle.pid is None and not psutil.pid_exists(second)  # the running one is stopped, not only forgotten
    assert "gateway listening" in handle.log_path.read_text()
