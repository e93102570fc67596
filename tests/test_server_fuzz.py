"""Property-based fuzzing of the engine's HTTP API: whatever arrives — JSON bodies, streaming or not,
admin calls with odd tenant names, query strings, junk headers and tokens — the server answers with a
2xx or a 4xx that carries an OpenAI-style error body, never a 5xx; and once the fuzzing is over, no KV
block is left held: every block is free or cached, nothing runs or waits.

One real engine (the session's `llm`) behind the app, in process. max_tokens stays at 3 or below and
the profile endpoints get small sizes, so the whole file takes well under a minute on 2 cores.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import pytest
import torch
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvops.engine.block import BlockState
from kvops.engine.invariants import check_invariants
from kvops.engine.sampling import SamplingParams, sample
from kvops.engine.serving.app import build_app

MODEL = "SmolLM2-135M-Instruct"

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4)), max_leaves=8)


def mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` about four times in five (one_of would lean on whichever branch it finds more interesting):
    bodies that get past their first check reach the code behind it."""
    return st.sampled_from([True, True, True, True, False]).flatmap(lambda ok: valid if ok else other)


# Never absent or null (the default is 16 tokens): each generated token is a forward pass of the real model.
small_max_tokens = mostly(st.integers(1, 3), st.one_of(st.integers(-5, 0), st.text(max_size=5), st.floats(-2, 3)))
prompts = mostly(st.text(min_size=1, max_size=60),
                 st.one_of(st.lists(st.integers(-5, 60000), max_size=12), st.lists(st.text(max_size=10), max_size=3),
                           json_values))
completion_bodies = st.fixed_dictionaries(
    {"model": mostly(st.just(MODEL), json_values), "prompt": prompts, "max_tokens": small_max_tokens},
    optional={"temperature": mostly(st.floats(0, 2), json_scalars),
              "top_p": mostly(st.floats(0, 1), json_scalars), "top_k": mostly(st.integers(-1, 60), json_scalars),
              "stop": mostly(st.lists(st.text(max_size=4), max_size=3), json_values),
              "seed": mostly(st.integers(0, 2**63), json_scalars),
              "user": mostly(st.sampled_from(["a", "b"]), json_scalars),
              "stream": st.booleans(), "n": json_scalars,
              "stop_token_ids": mostly(st.lists(st.integers(0, 49151), max_size=3), json_values)},
)
roles = mostly(st.sampled_from(["user", "system", "assistant"]), json_values)
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": mostly(st.text(max_size=40), json_values)}),
                    min_size=1, max_size=3)
chat_bodies = st.fixed_dictionaries(
    {"model": mostly(st.just(MODEL), json_values), "messages": mostly(messages, json_values),
     "max_tokens": small_max_tokens},
    optional={"max_completion_tokens": small_max_tokens,
              "temperature": mostly(st.floats(0, 2), json_scalars), "stream": st.booleans(),
              "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
              "user": mostly(st.sampled_from(["a", "b"]), json_scalars)},
)

TOKEN = "fuzz"
# Header values as bytes: HTTP carries bytes, and the client refuses non-ASCII str values.
header_values = st.one_of(st.text(max_size=80).map(lambda t: t.encode("utf-8", "surrogatepass")),
                          st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b and b"\0" not in b))
GOOD_AUTH = f"Bearer {TOKEN}".encode()
wrong_authorizations = st.one_of(st.none(), st.just(b"Bearer wrong"), st.just(b"Bearer "),
                                 st.just(f"bearer {TOKEN}".encode()), st.just(TOKEN.encode()),
                                 st.just(f"Bearer {TOKEN} ".encode()), header_values,
                                 header_values.map(lambda v: b"Bearer " + v))
authorizations = st.one_of(st.just(GOOD_AUTH), wrong_authorizations)  # the right token half the time
# Tenant names as they may reach a path: '/', '%', spaces, unicode, control characters, very long.
tenant_names = st.one_of(
    st.sampled_from(["a", "b", "tenant-1", "x", "..", "%2F", "a/b", "%", "\u00e9", "\U0001f600", " lead", "trail ",
                     "t" * 64, "t" * 65]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=70),  # what the rule allows
    st.text(st.sampled_from("/%.?#& \\a"), min_size=1, max_size=8),
    st.text(max_size=20), st.text(min_size=60, max_size=600))


@pytest.fixture(scope="module")
def http(llm) -> Iterator[TestClient]:
    engine = llm.engine
    with TestClient(build_app(engine, admin_token="fuzz")) as client:
        yield client
    # leave the shared engine as other tests expect it, whatever the fuzzed admin calls changed
    engine.block_manager.set_prefix_caching(True)
    engine.block_manager.set_eviction_policy("lru")
    engine.set_normalization("off")
    engine.tenant_salts.clear()
    engine.block_manager.quotas.clear()


def _check(response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400 and response.status_code != 499:
        error = response.json()["error"]
        assert error["message"] and error["code"] == response.status_code


def _headers(authorization: bytes | None = None, tenant: bytes | None = None) -> dict[str, bytes]:
    headers = {}
    if authorization is not None:
        headers["Authorization"] = authorization
    if tenant is not None:
        headers["X-Tenant"] = tenant
    return headers


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=completion_bodies, authorization=authorizations, tenant=st.one_of(st.none(), header_values))
def test_completions_never_5xx(http, body, authorization, tenant):
    _check(http.post("/v1/completions", json=body, headers=_headers(authorization, tenant)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies, authorization=authorizations, tenant=st.one_of(st.none(), header_values))
def test_chat_never_5xx(http, body, authorization, tenant):
    _check(http.post("/v1/chat/completions", json=body, headers=_headers(authorization, tenant)))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=st.booleans(), usage=st.booleans(), chat=st.booleans(), tenant=st.sampled_from(["a", "b", "c"]),
       max_tokens=st.integers(1, 3), prompt=st.text(st.characters(categories=["L", "N", "P"]), min_size=1,
                                                    max_size=30))
def test_valid_requests_streaming_or_not_complete(http, stream, usage, chat, tenant, max_tokens, prompt):
    """Well-formed requests, so the engine really runs them: both paths (SSE and whole) end cleanly."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "user": tenant}
    if stream:
        body["stream_options"] = {"include_usage": usage}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    response = http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    _check(response)
    assert response.status_code == 200, response.text
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]"), response.text
        # An error is an event with an "error" key (kvops/engine/serving/openai_routes.py); the word in generated text
        # is not one: the model once wrote "http error:" here.
        events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert events and not any("error" in event for event in events), response.text


def test_a_tiny_temperature_is_sampled_greedily():
    """Found by test_completions_never_5xx (temperature=5.4e-165): logits / temperature overflowed, torch.multinomial
    raised, and the step loop died."""
    logits = torch.tensor([[1.0, 2.0, 30.0]])
    assert sample(logits, [SamplingParams(temperature=1e-300)], [None]) == [2]


def test_a_refused_streaming_request_answers_400(http):
    """Found by the fuzz: a prompt that encodes to no tokens answered 200 and an SSE error event when streamed."""
    body = {"model": MODEL, "prompt": "\x16", "max_tokens": 1}
    assert http.post("/v1/completions", json=body).status_code == 400
    response = http.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 400, response.text


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=60))
def test_garbage_bodies_get_400(http, raw):
    response = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    _check(response)


ADMIN_BODIES = {
    "/admin/eviction-policy": st.fixed_dictionaries({"policy": st.one_of(st.sampled_from(["lru", "lfu"]),
                                                                         json_values)}),
    "/admin/prefix-caching": st.fixed_dictionaries({"enabled": st.one_of(st.booleans(), json_values)}),
    "/admin/normalization": st.fixed_dictionaries({"mode": st.one_of(st.sampled_from(["off", "shadow", "on"]),
                                                                     json_values)}),
    "/admin/tenants/": st.fixed_dictionaries({}, optional={
        "quota_blocks": mostly(st.one_of(st.none(), st.sampled_from([64, 100, 182]), st.integers(-2, 300)),
                               st.one_of(st.integers(), json_scalars)),
        "cache_salt": mostly(st.one_of(st.none(), st.text(max_size=300)), json_values)}),
}


def _tenant_path(data: st.DataObject) -> str:
    """A tenant's admin path, the name quoted as a client would, or partly raw ('/' and '%' as they are)."""
    name = data.draw(tenant_names, "tenant")
    return "/admin/tenants/" + quote(name, safe=data.draw(st.sampled_from(["", "/", "%", "/%"]), "unquoted"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), path=st.sampled_from(sorted(ADMIN_BODIES)), authorization=authorizations,
       method=st.sampled_from(["PUT"] * 6 + ["GET", "POST", "DELETE"]))
def test_admin_never_5xx(http, data, path, authorization, method):
    """Every admin change: junk bodies, methods and tokens."""
    body = data.draw(mostly(ADMIN_BODIES[path], json_values), "body")
    path = _tenant_path(data) if path == "/admin/tenants/" else path
    _check(http.request(method, path, json=body, headers=_headers(authorization)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_admin_tenant_names_never_5xx(http, data):
    """Tenant names in the path ('/', '%', unicode, controls, very long) with the right token and a body the
    endpoint takes, so each name reaches the engine's handler."""
    body = data.draw(ADMIN_BODIES["/admin/tenants/"], "body")
    response = http.put(_tenant_path(data), json=body, headers=_headers(GOOD_AUTH))
    _check(response)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/health", "/stats", "/metrics", "/v1/models", "/admin/config"]),
       query=st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3), authorization=authorizations,
       tenant=st.one_of(st.none(), header_values))
def test_read_endpoints_never_5xx(http, path, query, authorization, tenant):
    response = http.get(f"{path}?{urlencode(query)}", headers=_headers(authorization, tenant))
    _check(response)
    if path == "/admin/config" and authorization == GOOD_AUTH:
        assert response.status_code == 200, response.text


# The profiles run for seconds with their defaults: with the right token the sizes that cost time (steps,
# max_context, repeats) are small or invalid, so a run that does happen takes a fraction of a second.
junk = st.one_of(st.text(max_size=12), st.sampled_from(["", "-1", "0", "nan", "inf", "1e309", "1,,2",
                                                        "99999999999999999999"]))
# For the sizes: text that cannot be a number (no digit in any script) and is not empty (the default).
not_a_size = st.text(min_size=1, max_size=12).filter(lambda t: t.strip() != "" and not any(c.isdigit() for c in t))
KV_QUANT_QUERY = st.fixed_dictionaries(
    {"steps": st.one_of(st.sampled_from(["1", "1,2", "0", "-3", "2000", "1,5000", "1,,2", "nan"]), not_a_size)},
    optional={"kv_cache_dtype": st.one_of(st.sampled_from(["auto", "int8", "fp8", "int4", "int2", "float32"]), junk),
              "group_size": st.one_of(st.sampled_from(["32", "64", "0", "7", "-1"]), junk),
              "skip_layers": st.one_of(st.sampled_from(["0", "0,1", "29", "99", "model.layers.1", "-1", ""]), junk),
              "threshold": st.one_of(st.sampled_from(["0.5", "1", "0", "2", "-0.1"]), junk)})
BLOCK_SIZE_QUERY = st.fixed_dictionaries(
    {"max_context": st.one_of(st.sampled_from(["1", "16", "40", "0", "-1", "1e309", "nan"]), not_a_size),
     "repeats": st.one_of(st.sampled_from(["1", "2", "0", "51", "-1", "99999999999999999999"]), not_a_size),
     "candidates": st.one_of(st.sampled_from(["16", "8,16", "1", "0", "-8", "3", "4096", "8,8"]), junk)},
    optional={"batch_size": st.one_of(st.sampled_from(["1", "2", "0", "-1", "65", "100000"]), junk)})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), path=st.sampled_from(["/admin/profile/kv-quant", "/admin/profile/block-size"]),
       authorization=authorizations)
def test_profile_endpoints_never_5xx(http, data, path, authorization):
    query = data.draw(KV_QUANT_QUERY if path.endswith("kv-quant") else BLOCK_SIZE_QUERY, "query")
    _check(http.get(f"{path}?{urlencode(query)}", headers=_headers(authorization)))


FUZZED_ROUTES = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/health"),
                 ("GET", "/stats"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/admin/config"),
                 ("GET", "/admin/profile/kv-quant"), ("GET", "/admin/profile/block-size"),
                 *(("PUT", p.rstrip("/") + ("/{tenant:path}" if p.endswith("/") else "")) for p in ADMIN_BODIES)}


def test_every_route_is_fuzzed(http):
    """A route added to the server fails this until it is fuzzed here too."""
    routes = {(method, route.path) for route in http.app.routes if isinstance(route, APIRoute)
              for method in route.methods}
    assert routes - FUZZED_ROUTES == set(), "fuzz these routes too"


def test_kv_quant_profile_endpoint(http: TestClient):
    auth = {"Authorization": "Bearer fuzz"}
    assert http.get("/admin/profile/kv-quant").status_code == 401
    response = http.get("/admin/profile/kv-quant?kv_cache_dtype=int8&steps=3,6&skip_layers=2", headers=auth)
    assert response.status_code == 200, response.text
    profile = response.json()
    assert profile["kv_cache_dtype"] == "int8" and profile["steps"] == [3, 6] and profile["flagged"] == []
    assert profile["layers"][2]["kv_dtype"] == "float32" and profile["layers"][3]["kv_dtype"] == "int8"
    assert set(profile["layers"][3]["k_cosine"]) == {"3", "6"}
    for query, message in [("kv_cache_dtype=int2", "'int2' is not one of"), ("steps=ten", "comma-separated"),
                           ("steps=0", "positive"), ("threshold=2", "threshold must be in"),
                           ("skip_layers=99", "names layer 99"), ("steps=5000", "past max_model_len"),
                           ("group_size=48&kv_cache_dtype=int4", "group-size must be one of")]:
        bad = http.get(f"/admin/profile/kv-quant?{query}", headers=auth)
        assert bad.status_code == 400 and message in bad.json()["error"]["message"], (query, bad.text)


def test_no_block_is_left_held_after_the_fuzzing(http):
    """Runs last in this file: whatever the requests above did (errors mid-stream, refused prompts, admin
    changes), once nothing is in flight every KV block is free or cached, none referenced, nothing runs."""
    runner, engine = http.app.state.runner, http.app.state.runner.engine

    def settled() -> bool:
        return not engine.has_unfinished() and not engine.block_manager.pending_free

    deadline = time.monotonic() + 10
    while not runner.call(settled).result(timeout=10):  # asked on the step loop: no torn reads
        assert time.monotonic() < deadline, "requests still in flight 10 s after the last one answered"
        time.sleep(0.05)

    def held() -> list[str]:
        bm = engine.block_manager
        check_invariants(bm)
        problems = [f"block {b.block_id} is {b.state.name} with ref_count {b.ref_count}" for b in bm.blocks
                    if b.state not in (BlockState.FREE, BlockState.CACHED) or b.ref_count]
        if bm.seqs or bm.swapped:
            problems.append(f"sequences still hold blocks: {sorted(bm.seqs)} {sorted(bm.swapped)}")
        return problems

    assert runner.call(held).result(timeout=10) == []
