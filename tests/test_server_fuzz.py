"""Property-based fuzzing of the HTTP API: whatever JSON arrives, the server answers with a 2xx
or a 4xx that carries an OpenAI-style error body — never a 5xx."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvops.engine.server import build_app

MODEL = "SmolLM2-135M-Instruct"

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4)), max_leaves=8)
small_max_tokens = st.one_of(st.integers(-5, 3), st.none(), st.text(max_size=5), st.floats(-2, 3))
prompts = st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 60000), max_size=12),
                    st.lists(st.text(max_size=10), max_size=3), json_values)
completion_bodies = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), json_values), "prompt": prompts},
    optional={"max_tokens": small_max_tokens, "temperature": json_scalars, "top_p": json_scalars,
              "top_k": json_scalars, "stop": json_values, "seed": json_scalars, "user": json_scalars,
              "stream": st.booleans(), "n": json_scalars, "stop_token_ids": json_values},
)
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system"]), json_values),
                                           "content": st.one_of(st.text(max_size=40), json_values)}), max_size=3)
chat_bodies = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), json_values), "messages": st.one_of(messages, json_values)},
    optional={"max_tokens": small_max_tokens, "temperature": json_scalars, "stream": st.booleans()},
)


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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=completion_bodies)
def test_completions_never_5xx(http, body):
    _check(http.post("/v1/completions", json=body))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies)
def test_chat_never_5xx(http, body):
    _check(http.post("/v1/chat/completions", json=body))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=60))
def test_garbage_bodies_get_400(http, raw):
    response = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    _check(response)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["eviction-policy", "prefix-caching", "normalization", "tenants/x"]), body=json_values)
def test_admin_never_5xx(http, path, body):
    _check(http.put(f"/admin/{path}", json=body, headers={"Authorization": "Bearer fuzz"}))


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
