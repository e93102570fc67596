"""The gateway in front of a real kvops engine (conftest's `shared_engine`): passthrough, streaming chunk by chunk,
tenants from keys, a client hanging up, the concurrency limit, live normalization. The salt injection needs a
server that keeps the bodies it gets: tests/test_gateway.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvops.gateway.state import Gateway
from tests.helpers.gateway_metrics import sample, tenant_stats
from tests.helpers.gateway_servers import ADMIN, auth, gateway_in_front_of
from tests.helpers.waiting import wait_for


@pytest.fixture(scope="module")
def through(shared_engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Gateway, str]]:
    """(the gateway's URL, the gateway, the model name), the gateway in front of the shared engine."""
    model = httpx.get(f"{shared_engine}/v1/models", timeout=30).json()["data"][0]["id"]
    with gateway_in_front_of(shared_engine, tmp_path_factory.mktemp("gateway")) as (url, gateway):
        yield url, gateway, model


def chat(model: str, content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def engine_aborted(engine: str) -> float:
    text = httpx.get(f"{engine}/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("kvops_requests_aborted_total"))


def test_answers_pass_through_and_tenants_are_counted_apart(shared_engine: str, through) -> None:
    url, gateway, model = through
    body = chat(model, "What is a KV cache?", 12)
    direct = httpx.post(f"{shared_engine}/v1/chat/completions", json=body, timeout=60).json()
    relayed = [httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth(tenant), timeout=60)
               for tenant in ("team-a", "team-a", "team-b")]
    assert all(r.status_code == 200 for r in relayed), relayed[0].text
    texts = {r.json()["choices"][0]["message"]["content"] for r in relayed}
    assert texts == {direct["choices"][0]["message"]["content"]}
    assert str(gateway.upstream.kind) == "kvops"  # detected from /v1/models: no cache_salt is sent to it
    prompt = direct["usage"]["prompt_tokens"]
    assert sample(url, "kvops_gateway_requests_total", tenant="team-a", status="200") == 2
    assert sample(url, "kvops_gateway_requests_total", tenant="team-b", status="200") == 1
    assert sample(url, "kvops_gateway_prompt_tokens_total", tenant="team-a") == 2 * prompt
    assert sample(url, "kvops_gateway_prompt_tokens_total", tenant="team-b") == prompt
    assert sample(url, "kvops_gateway_completion_tokens_total", tenant="team-b") == direct["usage"][
        "completion_tokens"]
    # the second and third ask for the same prompt: the engine's prefix cache serves part of it
    assert sample(url, "kvops_gateway_cached_prompt_tokens_total", tenant="team-a") > 0
    assert tenant_stats(url, "team-b")["requests"] == {"200": 1}
    completion = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "The sky is", "max_tokens": 4,
                                                           "temperature": 0}, headers=auth("team-b"), timeout=60)
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"]
    models = httpx.get(f"{url}/v1/models", headers=auth("team-a"), timeout=30)
    assert models.json()["data"][0]["id"] == model


def test_a_stream_arrives_chunk_by_chunk_with_the_engine_s_text(shared_engine: str, through) -> None:
    url, _, model = through
    body = chat(model, "Describe a cat in detail.", 48, ignore_eos=True)
    direct = httpx.post(f"{shared_engine}/v1/chat/completions", json=body, timeout=120).json()
    started = time.monotonic()
    arrivals: list[float] = []
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      headers=auth("team-a"), timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic() - started)
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    done = time.monotonic() - started
    assert text == direct["choices"][0]["message"]["content"]
    assert len(arrivals) >= 40, len(arrivals)  # not one buffered lump: about one event per token
    assert arrivals[0] < done / 2, (arrivals[0], done)  # the first chunk came long before the upstream finished


def test_a_client_hanging_up_aborts_the_engine_s_request(shared_engine: str, through) -> None:
    url, gateway, model = through

    before = engine_aborted(shared_engine)
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=auth("team-b"), timeout=60,
                      json=chat(model, "Count to a thousand.", 900, ignore_eos=True, stream=True)) as response:
        chunks = response.iter_raw()
        next(chunks)
    # leaving the block closes the connection: the client hangs up after its first chunk
    wait_for("the engine aborted the request", lambda: engine_aborted(shared_engine) == before + 1, 15)
    wait_for("the disconnect counted", lambda: sample(url, "kvops_gateway_client_disconnects_total",
                                                      tenant="team-b") == 1, 5)
    assert gateway.limits.in_flight["team-b"] == 0


def test_a_client_hanging_up_before_a_whole_answer_aborts_the_engine_s_request(shared_engine: str, through) -> None:
    url, gateway, model = through
    before, hung_up = engine_aborted(shared_engine), sample(url, "kvops_gateway_client_disconnects_total",
                                                            tenant="team-b")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s of a 900-token answer and hangs up
        httpx.post(f"{url}/v1/chat/completions", headers=auth("team-b"), timeout=httpx.Timeout(10, read=1),
                   json=chat(model, "Count to a thousand.", 900, ignore_eos=True))
    wait_for("the engine aborted the request", lambda: engine_aborted(shared_engine) == before + 1, 15)
    wait_for("the hang-up counted", lambda: sample(url, "kvops_gateway_client_disconnects_total",
                                                   tenant="team-b") == hung_up + 1, 5)
    assert gateway.limits.in_flight["team-b"] == 0


def test_a_tenant_over_its_concurrency_limit_gets_429_and_others_do_not(through) -> None:
    url, gateway, model = through
    assert httpx.put(f"{url}/admin/tenants/team-a", json={"max_concurrency": 1}, headers=ADMIN).status_code == 200
    holding = threading.Event()
    release = threading.Event()
    statuses: list[int] = []

    def hold() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", headers=auth("team-a"), timeout=60,
                          json=chat(model, "Tell a long story.", 600, ignore_eos=True, stream=True)) as response:
            statuses.append(response.status_code)
            chunks = response.iter_raw()  # kept: a dropped iterator closes the response, and so the connection
            next(chunks)
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert holding.wait(60)
        assert statuses == [200] and gateway.limits.in_flight["team-a"] == 1
        refused = httpx.post(f"{url}/v1/chat/completions", json=chat(model, "Hi", 2), headers=auth("team-a"),
                             timeout=30)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        other = httpx.post(f"{url}/v1/chat/completions", json=chat(model, "Hi", 2), headers=auth("team-b"),
                           timeout=60)
        assert other.status_code == 200
        assert sample(url, "kvops_gateway_errors_total", tenant="team-a", reason="concurrency_limit") == 1
    finally:
        release.set()
        thread.join(30)
        httpx.delete(f"{url}/admin/tenants/team-a", headers=ADMIN)
    wait_for("team-a admitted again", lambda: httpx.post(
        f"{url}/v1/chat/completions", json=chat(model, "Hi", 2), headers=auth("team-a"), timeout=60).status_code == 200,
        10)


def test_live_normalization_reaches_the_engine(through, tmp_path: Path) -> None:
    url, _, model = through
    noisy, clean = "  What\u00a0is   a\r\n\r\n\r\nKV   cache?  ", "What is a\n\nKV cache?"

    def prompt_tokens(content: str) -> int:
        response = httpx.post(f"{url}/v1/chat/completions", json=chat(model, content, 1), headers=auth("team-b"),
                              timeout=60)
        return int(response.json()["usage"]["prompt_tokens"])

    raw, wanted = prompt_tokens(noisy), prompt_tokens(clean)
    assert raw != wanted  # the engine sees the noise
    put = httpx.put(f"{url}/admin/tenants/team-b", json={"normalize": True}, headers=ADMIN)
    assert put.status_code == 200 and put.json()["after"]["normalize"] is True
    try:
        assert prompt_tokens(noisy) == wanted
    finally:
        httpx.delete(f"{url}/admin/tenants/team-b", headers=ADMIN)
    assert prompt_tokens(noisy) == raw
