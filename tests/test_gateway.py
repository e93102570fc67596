"""The gateway against a recording upstream (tests/helpers/gateway_servers.py) and on its own: policies and salts,
limits, the admin API, bad input and upstream faults. The real engine behind it: tests/test_gateway_engine.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kvops.gateway.errors import GatewayError
from kvops.gateway.limits import TenantLimits, estimate_tokens
from kvops.gateway.policy import PolicyStore, TenantPolicy, TenantPolicyUpdate, load_policy_file
from kvops.gateway.streaming import event_usage, split_events
from kvops.processes import free_port, start_in_own_session
from kvops.schema.errors import ConfigError
from tests.helpers.gateway_metrics import sample, tenant_stats
from tests.helpers.gateway_servers import ADMIN, ADMIN_TOKEN, KEYS, Recorder, auth, gateway_in_front_of, serving
from tests.helpers.waiting import wait_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


# ------------------------------------------------------------------------------ policies


def test_each_cache_policy_gives_its_salt() -> None:
    assert TenantPolicy(cache="shared").salt_for("team-a") is None
    assert TenantPolicy(cache="isolated").salt_for("team-a") == "tenant:team-a"
    assert TenantPolicy(cache="group:research").salt_for("team-a") == "group:research"
    assert TenantPolicy().cache == "isolated"  # the default keeps tenants apart
    for bad in ("private", "group:", "group: x", "tenant:x"):
        with pytest.raises(ValueError, match=r"cache|name"):
            TenantPolicy(cache=bad)


def test_policy_file_gives_defaults_and_tenants(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text('[default]\ncache = "shared"\nmax_concurrency = 8\n\n'
                    '[tenants."team-a"]\ncache = "group:research"\nnormalize = true\n\n'
                    '[tenants.batch]\ntokens_per_minute = 6000\n')
    store = load_policy_file(str(path))
    assert store.policy("someone") == TenantPolicy(cache="shared", max_concurrency=8)
    assert store.policy("team-a") == TenantPolicy(cache="group:research", normalize=True, max_concurrency=8)
    assert store.policy("batch") == TenantPolicy(cache="shared", max_concurrency=8, tokens_per_minute=6000)
    path.write_text('[tenants.batch]\nmax_concurency = 3\n')
    with pytest.raises(ConfigError, match=r"tenants\.batch\.max_concurency: unknown key"):
        load_policy_file(str(path))
    path.write_text('[default]\ncache = "privat"\n')
    with pytest.raises(ConfigError, match=r"default\.cache: cache must be"):
        load_policy_file(str(path))


def test_update_changes_only_the_fields_sent_and_null_lifts_a_limit() -> None:
    store = PolicyStore(TenantPolicy(max_concurrency=2))
    before, after = store.update("t", TenantPolicyUpdate(normalize=True))
    assert (before.normalize, after.normalize, after.max_concurrency) == (False, True, 2)
    _, after = store.update("t", TenantPolicyUpdate.model_validate({"max_concurrency": None}))
    assert after.max_concurrency is None and after.normalize
    assert store.reset("t")[1] == store.default == store.policy("t")


# ------------------------------------------------------------------------------ limits


def test_token_bucket_admits_until_empty_then_says_when_to_retry() -> None:
    now = [0.0]
    limits = TenantLimits(clock=lambda: now[0])
    policy = TenantPolicy(tokens_per_minute=600)  # 10 tokens per second
    limits.admit("t", policy, 400)
    limits.admit("t", policy, 400)  # the bucket had 200 left: admitted, and it goes to -200
    with pytest.raises(Exception) as refused:
        limits.admit("t", policy, 1)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "21"  # (200 + 1) / 10 per s
    now[0] = 21.0
    limits.admit("t", policy, 1)
    assert limits.in_flight["t"] == 3
    limits.admit("other", policy, 1)  # buckets are per tenant


def test_a_limit_set_on_a_busy_tenant_counts_its_last_minute() -> None:
    """A limit put on a flooding tenant holds at once: its bucket starts at the limit less the last minute's charges."""
    now = [0.0]
    limits = TenantLimits(clock=lambda: now[0])
    unlimited, limited = TenantPolicy(), TenantPolicy(tokens_per_minute=600)
    for second in range(0, 50, 10):  # 5 x 200 tokens in the last minute, no limit yet
        now[0] = float(second)
        limits.admit("flood", unlimited, 200)
    now[0] = 55.0
    with pytest.raises(GatewayError) as refused:
        limits.admit("flood", limited, 200)  # 1000 charged in the minute before: the bucket starts empty
    assert refused.value.status == 429 and refused.value.reason == "token_rate_limit"
    limits.admit("quiet", limited, 200)  # a tenant with no recent charges starts full
    limits.admit("quiet", limited, 200)
    now[0] = 56.0  # refilled 10 tokens a second from empty
    limits.admit("flood", limited, 200)
    limits.reset("flood")  # a changed limit: 1200 charged in (-4 s, 56 s], the new 1200 leaves 0: refused again
    with pytest.raises(GatewayError, match="over its limit of 1200 tokens per minute"):
        limits.admit("flood", TenantPolicy(tokens_per_minute=1200), 1)


def test_concurrency_limit_counts_in_flight_requests() -> None:
    limits, policy = TenantLimits(), TenantPolicy(max_concurrency=1)
    limits.admit("t", policy, 0)
    with pytest.raises(Exception) as refused:
        limits.admit("t", policy, 0)
    assert refused.value.status == 429 and refused.value.reason == "concurrency_limit"
    limits.release("t")
    limits.admit("t", policy, 0)


def test_token_estimate_is_a_quarter_of_the_characters_plus_max_tokens() -> None:
    assert estimate_tokens({"prompt": "x" * 10, "max_tokens": 5}) == 3 + 5
    assert estimate_tokens({"messages": [{"content": "x" * 8}, {"content": [{"text": "y" * 4}]}],
                            "max_completion_tokens": 2}) == 3 + 2
    assert estimate_tokens({"prompt": [1, 2, 3]}) == 3


# ------------------------------------------------------------------------------ streams


def test_events_are_split_at_blank_lines_and_usage_is_read() -> None:
    events, rest = split_events(b"data: 1\n\ndata: 2\r\n\r\ndata: 3")
    assert events == [b"data: 1\n\n", b"data: 2\r\n\r\n"] and rest == b"data: 3"
    usage, only = event_usage(b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, '
                              b'"prompt_tokens_details": {"cached_tokens": 1}}}\n\n')
    assert only and (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (3, 2, 1)
    assert event_usage(b'data: {"choices": [{"delta": {}}], "usage": null}\n\n') == (None, False)
    assert event_usage(b"data: [DONE]\n\n") == (None, False)


def _stream(url: str, body: dict, headers: dict[str, str]) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line]


def test_stream_usage_is_counted_and_shown_only_to_a_client_that_asked(tmp_path: Path) -> None:
    recorder = Recorder(chunks=3)
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path) as (url, _):
        lines = _stream(url, {**CHAT, "stream": True}, auth("team-a"))
        assert recorder.bodies[-1]["stream_options"] == {"include_usage": True}  # asked upstream anyway
        assert lines[-1] == "data: [DONE]" and len(lines) == 3 + 1  # the usage-only event dropped
        assert not any('"usage"' in line for line in lines)
        asked = _stream(url, {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, auth("team-a"))
        assert len(asked) == 3 + 2 and '"usage"' in asked[-2]
        assert sample(url, "kvops_gateway_prompt_tokens_total", tenant="team-a") == 20
        assert sample(url, "kvops_gateway_cached_prompt_tokens_total", tenant="team-a") == 8
        assert sample(url, "kvops_gateway_completion_tokens_total", tenant="team-a") == 6
        assert sample(url, "kvops_gateway_time_to_first_token_seconds_count", tenant="team-a") == 2
        assert sample(url, "kvops_gateway_requests_total", tenant="team-a", status="200") == 2
        stats = tenant_stats(url, "team-a")
        assert (stats["prompt_tokens"], stats["cached_prompt_tokens"], stats["requests"]) == (20, 8, {"200": 2})


def test_client_hanging_up_mid_stream_closes_the_upstream_stream_and_is_counted(tmp_path: Path) -> None:
    recorder = Recorder(chunks=200, chunk_delay_s=0.05)  # 10 s of stream
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path) as (url, gateway):
        started = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True},
                          headers=auth("team-b"), timeout=30) as response:
            chunks = response.iter_raw()
            next(chunks)
        # leaving the block closes the connection: the client hangs up after its first chunk
        wait_for("the upstream stream closed", lambda: recorder.streams_closed_early == 1, 5)
        assert time.monotonic() - started < 5 and recorder.streams_finished == 0
        wait_for("the disconnect counted", lambda: sample(url, "kvops_gateway_client_disconnects_total",
                                                          tenant="team-b") == 1, 5)
        assert sample(url, "kvops_gateway_requests_total", tenant="team-b", status="499") == 1
        assert gateway.limits.in_flight["team-b"] == 0
        assert sample(url, "kvops_gateway_in_flight_requests", tenant="team-b") == 0


# ------------------------------------------------------------------------------ salts


def test_each_tenant_gets_its_salt_and_a_client_salt_is_replaced(tmp_path: Path) -> None:
    """The recording upstream stands in for vLLM's request parsing: it says `owned_by: vllm`, so `auto` detects a
    vLLM and the gateway sends `cache_salt`."""
    recorder = Recorder(owned_by="vllm")
    policies = PolicyStore(TenantPolicy(), {"team-b": TenantPolicy(cache="group:research")})
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path, policies=policies) as (url, _):
        forged = {**CHAT, "cache_salt": "group:research"}  # team-a tries to join team-b's cache
        assert httpx.post(f"{url}/v1/chat/completions", json=forged, headers=auth("team-a")).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "p"},
                          headers=auth("team-b")).status_code == 200
        assert [body.get("cache_salt") for body in recorder.bodies] == ["tenant:team-a", "group:research"]
        assert recorder.bodies[0]["messages"] == CHAT["messages"]  # the rest as the client sent it
        # a whole answer: its usage counted, its time to first token the whole answer's
        assert sample(url, "kvops_gateway_prompt_tokens_total", tenant="team-b") == 10
        assert sample(url, "kvops_gateway_cached_prompt_tokens_total", tenant="team-b") == 4
        assert sample(url, "kvops_gateway_time_to_first_token_seconds_count", tenant="team-b") == 1
        put = httpx.put(f"{url}/admin/tenants/team-a", json={"cache": "shared"}, headers=ADMIN)
        assert put.status_code == 200 and put.json()["before"]["cache"] == "isolated"
        httpx.post(f"{url}/v1/chat/completions", json=forged, headers=auth("team-a"))
        assert "cache_salt" not in recorder.bodies[-1]  # shared: no salt, and not the client's either


def test_no_salt_for_an_upstream_that_is_not_vllm(tmp_path: Path) -> None:
    recorder = Recorder(owned_by="kvops")
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path) as (url, gateway):
        httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "cache_salt": "x"}, headers=auth("team-a"))
        assert "cache_salt" not in recorder.bodies[-1] and str(gateway.upstream.kind) == "kvops"


def test_live_normalization_changes_what_reaches_the_upstream(tmp_path: Path) -> None:
    recorder = Recorder()
    noisy = {"model": "m", "messages": [{"role": "user", "content": "  What\u00a0is   a\r\nKV cache?  "}]}
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path) as (url, _):
        httpx.post(f"{url}/v1/chat/completions", json=noisy, headers=auth("team-a"))
        assert recorder.bodies[-1]["messages"][0]["content"] == noisy["messages"][0]["content"]
        assert httpx.put(f"{url}/admin/tenants/team-a", json={"normalize": True}, headers=ADMIN).status_code == 200
        httpx.post(f"{url}/v1/chat/completions", json=noisy, headers=auth("team-a"))
        assert recorder.bodies[-1]["messages"][0]["content"] == "What is a\nKV cache?"
        httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "a  b "}, headers=auth("team-a"))
        assert recorder.bodies[-1]["prompt"] == "a b"
        httpx.post(f"{url}/v1/chat/completions", json=noisy, headers=auth("team-b"))  # another tenant: untouched
        assert recorder.bodies[-1]["messages"][0]["content"] == noisy["messages"][0]["content"]
        assert httpx.delete(f"{url}/admin/tenants/team-a", headers=ADMIN).json()["after"]["normalize"] is False
        httpx.post(f"{url}/v1/chat/completions", json=noisy, headers=auth("team-a"))
        assert recorder.bodies[-1]["messages"][0]["content"] == noisy["messages"][0]["content"]


def test_the_default_policy_changes_live_for_every_tenant_without_its_own(tmp_path: Path) -> None:
    recorder = Recorder()
    noisy = {"model": "m", "prompt": "a  b " + "x" * 100}  # charged 27 tokens against a limit of 10 a minute
    policies = PolicyStore(TenantPolicy(), {"team-b": TenantPolicy()})  # team-b has a policy of its own
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path, policies=policies) as (url, _):
        put = httpx.put(f"{url}/admin/default", json={"normalize": True, "tokens_per_minute": 10}, headers=ADMIN)
        assert put.status_code == 200, put.text
        assert put.json()["before"]["normalize"] is False and put.json()["after"]["normalize"] is True
        assert put.json()["overridden"] == ["team-b"]
        assert httpx.post(f"{url}/v1/completions", json=noisy, headers=auth("team-a")).status_code == 200
        assert recorder.bodies[-1]["prompt"] == "a b " + "x" * 100  # the new default
        limited = httpx.post(f"{url}/v1/completions", json=noisy, headers=auth("team-a"))
        assert limited.status_code == 429 and "Retry-After" in limited.headers  # 10 tokens a minute: spent
        assert httpx.post(f"{url}/v1/completions", json=noisy, headers=auth("team-b")).status_code == 200
        assert recorder.bodies[-1]["prompt"] == noisy["prompt"]  # its own policy: untouched
        listed = httpx.get(f"{url}/admin/tenants", headers=ADMIN).json()
        assert listed["default"]["normalize"] is True and listed["tenants"]["team-a"]["normalize"] is True
        back = httpx.put(f"{url}/admin/default", json={"normalize": False, "tokens_per_minute": None}, headers=ADMIN)
        assert back.json()["after"] == TenantPolicy().model_dump()
        assert httpx.post(f"{url}/v1/completions", json=noisy, headers=auth("team-a")).status_code == 200
        assert recorder.bodies[-1]["prompt"] == noisy["prompt"]
        assert httpx.put(f"{url}/admin/default", json={"cache": "everyone"}, headers=ADMIN).status_code == 400
        assert httpx.put(f"{url}/admin/default", json={"normalize": True}, headers=auth("team-a")).status_code == 403


# ------------------------------------------------------------------------------ the admin API


def test_admin_routes_need_the_admin_token(tmp_path: Path) -> None:
    recorder = Recorder()
    with serving(recorder.app) as upstream:
        with gateway_in_front_of(upstream, tmp_path, admin=False) as (url, _):
            off = httpx.get(f"{url}/admin/tenants", headers=ADMIN)
            assert off.status_code == 403 and "--admin-token-env" in off.json()["error"]["message"]
        with gateway_in_front_of(upstream, tmp_path) as (url, _):
            assert httpx.get(f"{url}/admin/tenants").status_code == 401
            assert httpx.get(f"{url}/admin/tenants", headers=auth("team-a")).status_code == 403  # a key is not it
            listed = httpx.get(f"{url}/admin/tenants", headers=ADMIN).json()
            assert sorted(listed["tenants"]) == ["team-a", "team-b"] and listed["default"]["cache"] == "isolated"
            bad = httpx.put(f"{url}/admin/tenants/team-a", json={"cache": "everyone"}, headers=ADMIN)
            assert bad.status_code == 400 and "cache must be" in bad.json()["error"]["message"]
            bad = httpx.put(f"{url}/admin/tenants/team-a", json={"max_concurrency": 0}, headers=ADMIN)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_concurrency"
            assert httpx.put(f"{url}/admin/tenants/%20x", json={}, headers=ADMIN).status_code == 400
            quoted = httpx.put(f"{url}/admin/tenants/team%2Fa%20b", json={"max_concurrency": 3}, headers=ADMIN)
            assert quoted.status_code == 200 and quoted.json()["tenant"] == "team/a b"
            with capture_logs() as logs:
                httpx.put(f"{url}/admin/tenants/team-a", json={"tokens_per_minute": 600}, headers=auth("team-a"))
                httpx.put(f"{url}/admin/tenants/team-a", json={"tokens_per_minute": 600}, headers=ADMIN)
            changes = [e for e in logs if e["event"] == "gateway policy change"]
            assert len(changes) == 1 and changes[0]["tenant"] == "team-a"
            assert changes[0]["after"]["tokens_per_minute"] == 600 and changes[0]["before"]["tokens_per_minute"] is None
            assert not any(secret in repr(logs) for secret in (*KEYS.values(), ADMIN_TOKEN))
            percent = httpx.put(f"{url}/admin/tenants/100%2541", json={}, headers=ADMIN)  # decoded once: 100%41
            assert percent.status_code == 200 and percent.json()["tenant"] == "100%41"


# ------------------------------------------------------------------------------ bad input and faults


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_keys_decide_the_tenant_and_bad_input_is_refused_in_openai_shape(tmp_path: Path) -> None:
    recorder = Recorder()
    with serving(recorder.app) as upstream, \
            gateway_in_front_of(upstream, tmp_path, max_body_bytes=1000) as (url, _):
        assert _error(httpx.post(f"{url}/v1/chat/completions", json=CHAT), 401)["type"] == "authentication_error"
        wrong = {"Authorization": "Bearer " + "z" * 24}
        assert "not valid" in _error(httpx.post(f"{url}/v1/completions", json=CHAT, headers=wrong), 401)["message"]
        assert _error(httpx.get(f"{url}/v1/models"), 401)
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
        assert "1000 bytes" in _error(httpx.post(f"{url}/v1/chat/completions", json=big, headers=auth("team-a")),
                                      413)["message"]
        _error(httpx.post(f"{url}/v1/chat/completions", content=b"{nope", headers=auth("team-a")), 400)
        _error(httpx.post(f"{url}/v1/chat/completions", json=[1, 2], headers=auth("team-a")), 400)
        for raw in (b'{"model": NaN}', b'{"max_tokens": -Infinity}', b'\xff'):
            _error(httpx.post(f"{url}/v1/chat/completions", content=raw, headers=auth("team-a")), 400)
        assert recorder.bodies == []  # nothing of it reached the upstream
        assert httpx.get(f"{url}/v1/models", headers=auth("team-b")).json()["data"][0]["owned_by"] == "vllm"
        assert sample(url, "kvops_gateway_errors_total", tenant="unauthenticated", reason="no_api_key") == 2
        assert sample(url, "kvops_gateway_errors_total", tenant="team-a", reason="body_too_large") == 1
        assert sample(url, "kvops_gateway_errors_total", tenant="team-a", reason="bad_json") == 5


def test_a_body_that_does_not_arrive_in_time_gets_408(tmp_path: Path) -> None:
    recorder = Recorder()
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, body_timeout_s=0.5) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\"")
            started = time.monotonic()
            answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 5
        assert b"did not arrive within 0.5 s" in answer


def test_an_upstream_nobody_listens_on_is_a_502_within_seconds() -> None:
    with gateway_in_front_of(f"http://127.0.0.1:{free_port()}") as (url, _):
        started = time.monotonic()
        error = _error(httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30), 502)
        assert time.monotonic() - started < 5 and "refused" in error["message"]
        assert httpx.get(f"{url}/health").status_code == 503
        _error(httpx.post(f"{url}/v1/completions", json={**CHAT, "stream": True}, timeout=30), 502)
        assert sample(url, "kvops_gateway_errors_total", tenant="default", reason="upstream_connect") == 2


def test_an_unavailable_upstream_is_a_503(tmp_path: Path) -> None:
    recorder = Recorder()
    recorder.status = 503
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream) as (url, gateway):
        error = _error(httpx.post(f"{url}/v1/chat/completions", json=CHAT), 503)
        assert "unavailable" in error["message"]
        assert gateway.limits.in_flight["default"] == 0
        recorder.status = 401  # the upstream wants a key the gateway was not given: not the client's fault
        error = _error(httpx.post(f"{url}/v1/chat/completions", json=CHAT), 502)
        assert "--upstream-api-key-env" in error["message"]
        assert sample(url, "kvops_gateway_errors_total", tenant="default", reason="upstream_auth") == 1


def test_the_gateway_does_not_import_torch() -> None:
    code = "import sys, kvops.gateway.app, kvops.gateway.run; print(json.dumps('torch' in sys.modules))"
    result = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert json.loads(result.stdout) is False


def test_kvops_gateway_command_serves_says_default_tenant_and_drains(tmp_path: Path) -> None:
    """The command as a user runs it: flags, start-up lines, 502 for a dead upstream, a clean SIGTERM."""
    port = free_port()
    proc = start_in_own_session([sys.executable, "-m", "kvops", "gateway", "--upstream",
                                 f"http://127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{port}",
                                 "--connect-timeout", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for("the gateway up", lambda: httpx.get(f"{url}/health").status_code == 503, 30, [proc])
        assert httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 502
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert b"every request is tenant 'default'" in err and b"127.0.0.1:" in err


def test_kvops_gateway_refuses_a_bad_key_file_in_one_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("team-a short\n")
    result = subprocess.run([sys.executable, "-m", "kvops", "gateway", "--upstream", "http://127.0.0.1:1",
                             "--api-keys-file", str(keys)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "line 1" in result.stderr and "Traceback" not in result.stderr


def test_a_tenant_over_its_token_rate_gets_429_with_retry_after(tmp_path: Path) -> None:
    recorder = Recorder()
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path) as (url, _):
        limited = httpx.put(f"{url}/admin/tenants/team-a", json={"tokens_per_minute": 60}, headers=ADMIN)
        assert limited.status_code == 200
        body = {**CHAT, "max_tokens": 100}  # 2 + 100 estimated tokens: the bucket of 60 goes to -42
        assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth("team-a")).status_code == 200
        refused = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth("team-a"))
        error = _error(refused, 429)
        assert error["type"] == "rate_limit_error" and "60 tokens per minute" in error["message"]
        assert 40 <= int(refused.headers["Retry-After"]) <= 44  # (42 + 1) tokens at 1 per second
        assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth("team-b")).status_code == 200
        assert len(recorder.bodies) == 2
        assert sample(url, "kvops_gateway_errors_total", tenant="team-a", reason="token_rate_limit") == 1
        httpx.put(f"{url}/admin/tenants/team-a", json={"tokens_per_minute": None}, headers=ADMIN)
        assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth("team-a")).status_code == 200


SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=20))
JSON_VALUES = st.recursive(SCALARS,
                           lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=12)
BODY_FIELDS = st.sampled_from(["model", "prompt", "messages", "stream", "stream_options", "max_tokens",
                               "max_completion_tokens", "cache_salt", "user"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(BODY_FIELDS, JSON_VALUES, max_size=6) | JSON_VALUES)
def test_no_body_makes_the_gateway_fail(fuzz_gateway: str, body: object) -> None:
    """Whatever JSON a client sends, with normalization and both limits on, the gateway answers it without a 5xx of
    its own (the recording upstream answers 200 to anything that reaches it)."""
    response = httpx.post(f"{fuzz_gateway}/v1/chat/completions", json=body, headers=auth("team-a"), timeout=30)
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    recorder = Recorder(chunks=1)
    policies = PolicyStore(TenantPolicy(normalize=True, max_concurrency=4, tokens_per_minute=10**9))
    with serving(recorder.app) as upstream, \
            gateway_in_front_of(upstream, tmp_path_factory.mktemp("fuzz"), policies=policies) as (url, _):
        yield url
