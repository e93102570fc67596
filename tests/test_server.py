"""The engine as a service, driven by real clients over loopback: the official `openai` client,
raw HTTP for malformed input, concurrent streams, disconnects, admin knobs and SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvops.adapters.engine_client import EngineClient, EngineUnreachable, merge_steps
from kvops.loadgen import Lengths, LoadError, LoadSpec, Stream, run_load
from kvops.schema.snapshot import Snapshot, StepSample

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "test-admin-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvops", "engine", "serve", "--port", str(port), "--kv-cache-memory", "64MiB",
         "--max-model-len", "1024", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become healthy in 180 s")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start_server("--admin-token", TOKEN)
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def stats(url: str) -> Snapshot:
    return Snapshot.model_validate_json(httpx.get(f"{url}/stats", timeout=30).text)


def admin(url: str, path: str, body: dict[str, object], token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.put(f"{url}/admin/{path}", json=body, headers=headers, timeout=30)


def wait_idle(url: str) -> Snapshot:
    for _ in range(100):
        snap = stats(url)
        if snap.requests.running == snap.requests.waiting == 0 and snap.blocks.counts["pending_free"] == 0:
            return snap
        time.sleep(0.1)
    raise AssertionError("engine did not become idle")


def test_completions_and_cached_tokens(client):
    prompt = "Colour theory for painters. " * 6 + "The primary colours are red, yellow and blue. The secondary are"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert first.choices[0].text == second.choices[0].text and first.choices[0].text
    assert first.usage.completion_tokens == 8 and first.choices[0].finish_reason == "length"
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_streaming_gives_the_same_text(client):
    messages = [{"role": "user", "content": "Name three fruits."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert finish == whole.choices[0].finish_reason


def test_tenants_do_not_share_prefix_blocks_unless_allowed(client, server):
    prompt = "Tenant isolation check: " + "alpha beta gamma delta " * 12
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, user="tenant-a")
    other = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, user="tenant-b")
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert admin(server, "tenants/tenant-b", {"cache_salt": "tenant-a"}).status_code == 200
    shared = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, user="tenant-b")
    assert shared.usage.prompt_tokens_details.cached_tokens > 0
    header = httpx.post(f"{server}/v1/completions", headers={"X-Tenant": "tenant-c"},
                        json={"model": MODEL, "prompt": "hello", "max_tokens": 1}, timeout=60)
    assert header.status_code == 200
    tenants = stats(server).tenants
    assert {"tenant-a", "tenant-b", "tenant-c"} <= set(tenants)
    assert tenants["tenant-b"].hit_tokens_total > 0 and tenants["tenant-a"].requests_total >= 1


@pytest.mark.parametrize(
    ("body", "status", "field", "words"),
    [
        ("{not json", 400, None, "not valid JSON"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens", "at least 1"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "integer"),
        ({"model": "gpt-9", "prompt": "hi"}, 400, "model", "not served here"),
        ({"model": MODEL, "prompt": "word " * 1100, "max_tokens": 1}, 400, "prompt", "max_model_len 1024"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt", "empty"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature", "greater than or equal"),
        ({"prompt": "hi"}, 400, "model", "Field required"),
    ],
)
def test_bad_requests_get_400_naming_the_field(server, body, status, field, words):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{server}/v1/completions", content=content,
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert words in error["message"]
    assert error["param"] == field


def test_health_stats_metrics_models(server):
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
    snap = stats(server)
    assert snap.engine.model == MODEL and sum(snap.blocks.counts.values()) == snap.engine.num_blocks
    metrics = httpx.get(f"{server}/metrics").text
    assert "kvops_kv_blocks{state=\"free\"}" in metrics and "kvops_prefix_cache_queries_total" in metrics
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == MODEL


def test_polled_stats_come_from_the_step_loop_and_still_count_what_a_client_just_saw(server):
    # A poller at 10 Hz while requests run: most answers are the snapshot the step loop keeps (no wait for
    # the step in progress), yet a client that saw its request finish reads it counted in the next /stats.
    answers: list[tuple[str, float]] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                response = http.get(f"{server}/stats")
                answers.append((response.headers["X-Kvops-Snapshot"], Snapshot.model_validate_json(response.text).time))
                time.sleep(0.1)

    before = stats(server).requests.finished_total
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.3)  # the step loop refreshes only for an engine someone polls
        for i in range(4):
            body = {"model": MODEL, "prompt": f"Polling check {i}: count slowly", "max_tokens": 24, "ignore_eos": True}
            assert httpx.post(f"{server}/v1/completions", json=body, timeout=120).status_code == 200
            assert stats(server).requests.finished_total == before + i + 1
    finally:
        stop.set()
        poller.join()
    sources = [source for source, _ in answers]
    assert set(sources) <= {"cached", "built"} and sources.count("cached") >= len(sources) // 2, sources
    times = [when for _, when in answers]
    assert times == sorted(times)


def test_the_supervisors_client_reads_only_new_steps_and_keeps_the_whole_series(server, client):
    engine = EngineClient(server, timeout_s=30)
    try:
        client.completions.create(model=MODEL, prompt="Step series, part one", max_tokens=6, temperature=0)
        wait_idle(server)
        first = engine.snapshot()  # the whole snapshot
        assert first.steps
        after = httpx.get(f"{server}/stats", params={"steps_after": repr(first.steps[-1].t)}, timeout=30)
        assert after.headers["X-Kvops-Steps-Kept"] == "512"
        assert Snapshot.model_validate_json(after.text).steps == []  # nothing stepped since
        client.completions.create(model=MODEL, prompt="Step series, part two", max_tokens=6, temperature=0)
        wait_idle(server)
        merged = engine.snapshot()  # only the newer steps crossed the wire
        whole = stats(server)
        assert merged.steps == whole.steps and merged.steps[-1].t > first.steps[-1].t
        assert any(step is first.steps[-1] for step in merged.steps)  # held steps are shared, not copies
        bad = httpx.get(f"{server}/stats", params={"steps_after": "yesterday"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.steps_after"
        assert "number" in bad.json()["error"]["message"]
    finally:
        engine.close()


def test_merged_steps_keep_the_engines_window():
    held = [StepSample(t=t, duration_s=0.01, num_seqs=1, num_tokens=1, decode_only=True, max_context_len=8)
            for t in range(1, 6)]
    newer = [held[0].model_copy(update={"t": t}) for t in (6, 7)]
    assert [s.t for s in merge_steps(held, newer, 5)] == [3, 4, 5, 6, 7]
    assert [s.t for s in merge_steps(held, newer, 512)] == [1, 2, 3, 4, 5, 6, 7]
    assert [s.t for s in merge_steps(held, newer, 1)] == [7]


def test_admin_requires_the_token_and_changes_are_reflected(server):
    assert admin(server, "eviction-policy", {"policy": "lfu"}, token=None).status_code == 401
    assert admin(server, "eviction-policy", {"policy": "lfu"}, token="wrong").status_code == 403
    assert admin(server, "eviction-policy", {"policy": "fifo"}).status_code == 400
    changed = admin(server, "eviction-policy", {"policy": "lfu"})
    assert changed.status_code == 200 and changed.json()["eviction_policy"] == "lfu"
    assert stats(server).engine.eviction_policy == "lfu"
    assert admin(server, "prefix-caching", {"enabled": False}).json()["enable_prefix_caching"] is False
    assert stats(server).engine.enable_prefix_caching is False
    admin(server, "prefix-caching", {"enabled": True})
    admin(server, "eviction-policy", {"policy": "lru"})


def test_admin_actions_through_the_client_quote_tenant_names(server):
    # Over a real uvicorn: the client quotes the name into one path segment ('/' as %2F), uvicorn decodes
    # it before routing, and the engine's tenant route still takes the whole name.
    client = EngineClient(server, TOKEN, timeout_s=30)
    for tenant in ("team/a b", "ops tenant", "a/b c", "?#%", "100%/x?y=1&z#f", "../admin/config"):
        knobs = client.admin("set_tenant_quota", {"tenant": tenant, "quota_blocks": 64, "cache_salt": "shared"})
        assert knobs["tenant_quotas"][tenant] == 64 and knobs["tenant_salts"][tenant] == "shared"
        knobs = client.admin("set_tenant_quota", {"tenant": tenant})  # lifts the quota, restores its own salt
        assert tenant not in knobs["tenant_quotas"] and tenant not in knobs["tenant_salts"]
    assert client.admin("set_normalization", {"mode": "off"})["normalize_prompts"] == "off"
    assert admin(server, "tenants/", {"quota_blocks": None}).status_code == 404  # an empty name names nothing
    with pytest.raises(EngineUnreachable, match="HTTP 400: tenant: tenant name ' a/b' is not valid"):
        client.admin("set_tenant_quota", {"tenant": " a/b", "quota_blocks": 64})  # decoded, then refused
    assert client.knobs()["tenant_quotas"] == {}
    client.close()


def test_api_keys_with_the_openai_client(tmp_path):
    # `kvops engine serve --api-keys-env` end to end: the openai client sends its key as a Bearer token.
    import os

    keys = {"team-a": "team-a-key-0123456789", "team-b": "team-b-key-0123456789"}
    os.environ["KVOPS_TEST_SERVER_KEYS"] = ",".join(f"{t}={k}" for t, k in keys.items())
    try:
        proc, url = start_server("--api-keys-env", "KVOPS_TEST_SERVER_KEYS", "--admin-token", TOKEN)
    finally:
        del os.environ["KVOPS_TEST_SERVER_KEYS"]
    try:
        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)

        with pytest.raises(openai.AuthenticationError, match="the API key is not valid"):
            client("wrong-key-0123456789").completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        out = client(keys["team-b"]).completions.create(model=MODEL, prompt="Hi", max_tokens=2, user="team-a",
                                                        extra_headers={"X-Tenant": "team-a"})
        assert out.usage.prompt_tokens > 0
        chat = client(keys["team-a"]).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert chat.choices[0].message.content is not None
        tenants = stats(url).tenants
        assert tenants["team-b"].requests_total == 1 and tenants["team-a"].requests_total == 1
        # the admin API keeps its own token, and the tenant route takes a key's tenant like any other
        assert EngineClient(url, TOKEN).admin("set_tenant_quota", {"tenant": "team-b", "quota_blocks": 64})[
            "tenant_quotas"] == {"team-b": 64}
        assert admin(url, "tenants/team-b", {"quota_blocks": None}, token=keys["team-b"]).status_code == 403
        # kvops loadgen sends a stream's key from the variable its api_key_env names: the key, not `user`, decides
        os.environ["KVOPS_TEST_TEAM_A_KEY"] = keys["team-a"]
        try:
            report = run_load(url, LoadSpec(seed=1, duration_s=30, streams=[Stream(
                tenant="loadgen", api_key_env="KVOPS_TEST_TEAM_A_KEY", concurrency=1, max_requests=2,
                prompt=Lengths.fixed(8), output=Lengths.fixed(2))]))
        finally:
            del os.environ["KVOPS_TEST_TEAM_A_KEY"]
        assert report.total.requests_finished == 2 and report.total.requests_failed == 0
        after = stats(url).tenants
        assert after["team-a"].requests_total == 3 and "loadgen" not in after
        with pytest.raises(LoadError, match="KVOPS_TEST_UNSET_KEY"):
            run_load(url, LoadSpec(seed=1, duration_s=5, streams=[Stream(
                api_key_env="KVOPS_TEST_UNSET_KEY", concurrency=1, max_requests=1)]))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_disconnected_stream_aborts_and_frees_blocks(server):
    before = stats(server).requests.aborted_total
    body = {"model": MODEL, "prompt": "Tell me a very long story about a lighthouse.", "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break
    snap = wait_idle(server)
    assert snap.requests.aborted_total == before + 1
    assert snap.blocks.counts["filling"] == snap.blocks.counts["full"] == 0


def test_64_concurrent_streams_finish_without_leaking_blocks(server):
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, int]:
        body = {"model": MODEL, "prompt": f"Client {i} says hello and asks for a number:", "max_tokens": 6,
                "stream": True, "temperature": 0.7, "seed": i, "ignore_eos": True}
        chunks = 0
        async with http.stream("POST", f"{server}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                chunks += line.startswith("data: {")
            return response.status_code, chunks

    async def main() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(64))), timeout=300)

    results = asyncio.run(main())
    assert all(status == 200 for status, _ in results)
    assert all(chunks >= 1 for _, chunks in results)
    snap = wait_idle(server)
    assert snap.blocks.counts["filling"] == snap.blocks.counts["full"] == 0


def test_sigterm_drains_in_flight_requests_then_exits_0():
    proc, url = start_server()
    result: dict[str, object] = {}

    async def request_then_signal() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            pending = asyncio.create_task(http.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": "Count from one to twenty:", "max_tokens": 40, "ignore_eos": True}))
            await asyncio.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            response = await pending
            result["status"] = response.status_code
            result["tokens"] = response.json()["usage"]["completion_tokens"]

    asyncio.run(request_then_signal())
    assert proc.wait(timeout=60) == 0
    assert result == {"status": 200, "tokens": 40}
