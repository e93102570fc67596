"""Property-based fuzzing of the supervisor's HTTP API (kvops/supervisor/api.py): every route, with
generated path parameters, query strings, JSON bodies, methods and admin tokens, never answers a 5xx
(but the 503 a revert documents while its engine is unreachable), and every error carries a JSON body
that says what went wrong.

The API and the Supervisor behind it are real; its engines are cheap: two watched engines nobody
listens for (one down and diagnosed `engine_down`, one with a synthetic snapshot history, so the
snapshot, history and profile routes have data) and a managed engine that is never started (its
process check says "exited", so it is down with a log and can be resumed). No model is loaded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.schema.engines import LogLine
from kvops.supervisor.api import build_supervisor_app
from kvops.supervisor.config import parse_config
from kvops.supervisor.supervisor import Supervisor
from tests.helpers.synthetic import snapshot

TOKEN = "sup-fuzz-token"
ENGINES = ["gone", "fed", "worker"]
ENGINE_TOKEN_ENV = "KVOPS_FUZZ_ENGINE_TOKEN"
NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens there

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=30))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4)), max_leaves=8)


def mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` about four times in five, so requests get past their first check to the code behind it."""
    return st.sampled_from([True, True, True, True, False]).flatmap(lambda ok: valid if ok else other)


# Path segments: engine names that exist, and names with '/', '%', unicode, controls, or very long.
odd_names = st.one_of(st.text(max_size=20), st.text(alphabet="/%.?#& \\", max_size=8),
                      st.text(min_size=60, max_size=400),
                      st.sampled_from(["", ".", "..", "%2F", "a/b", "%", "\u00e9", "\U0001f600", "gone/", "GONE"]))
names = mostly(st.sampled_from(ENGINES), odd_names)
entry_ids = mostly(st.integers(-2, 12).map(str), st.one_of(st.integers().map(str), odd_names))
header_values = st.one_of(st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")),
                          st.binary(max_size=40).filter(lambda b: not set(b) & {0, 10, 13}))
GOOD_AUTH = f"Bearer {TOKEN}".encode()
authorizations = st.one_of(st.just(GOOD_AUTH), st.none(), st.just(b"Bearer wrong"), st.just(b"Bearer "),
                           st.just(TOKEN.encode()), st.just(f"bearer {TOKEN}".encode()), header_values,
                           header_values.map(lambda v: b"Bearer " + v))
numbers = st.one_of(st.integers(-10**6, 10**6).map(str), st.floats().map(repr),
                    st.sampled_from(["", "0", "-1", "1e309", "-1e309", "nan", "inf", "-inf", "99999999999999999999999",
                                     "1_000", " 5", "0x10"]), st.text(max_size=8))
queries = st.fixed_dictionaries({}, optional={"seconds": numbers, "lines": numbers, "limit": numbers}).flatmap(
    lambda known: st.dictionaries(st.text(max_size=8), st.text(max_size=12), max_size=2).map(
        lambda extra: {**extra, **known}))
apply_bodies = st.fixed_dictionaries(
    {"engine": names, "rule": mostly(st.sampled_from(["engine_down", "crash_loop", "prompt_variance"]), json_values)},
    optional={"subject": mostly(st.sampled_from(["", "x"]), json_values)})


@pytest.fixture(scope="module")
def sup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    state = tmp_path_factory.mktemp("sup-fuzz")
    config = parse_config({
        "supervisor": {"state_dir": str(state), "alert_warmup_s": 0, "fix_cooldown_s": 0},
        "engines": [{"name": "gone", "url": NOWHERE},
                    {"name": "fed", "url": NOWHERE, "kind": "kvops", "admin_token_env": ENGINE_TOKEN_ENV},
                    {"name": "worker", "args": {"kv_cache_memory": "48MiB"}}],
    }, "test_supervisor_fuzz")
    with pytest.MonkeyPatch.context() as env:  # read once, when the engine's client is made
        env.setenv(ENGINE_TOKEN_ENV, "engine-token")
        supervisor = Supervisor(config, admin_token=TOKEN)
    worker = supervisor.engines["worker"].managed
    assert worker is not None
    worker.check = lambda: False  # type: ignore[method-assign]  # never started: polls see it exited
    lines = [("stdout", "info"), ("stderr", "error"), ("kvops", "warning")]
    worker.log_tail.extend(LogLine(time=time.time(), stream=stream, level=level, text=f"line {i} \u00e9")
                           for i, (stream, level) in enumerate(lines))
    for _ in range(3):
        supervisor.poll_once()
    now = time.time()
    for i in range(5):
        supervisor.engines["fed"].history.add(snapshot(now - 4 + i))
    supervisor.engines["worker"].history.crash_loop = True
    # A diagnosis with a fix kvops applies, so /api/fixes/apply gets past its lookup into the fix manager (which
    # reads the unreachable engine's knobs and refuses with a 409).
    fix = Fix(kind=FixKind.ADMIN, action="set_normalization", params={"mode": "on"}, description="normalize")
    supervisor.engines["fed"].diagnoses.append(Diagnosis(rule="prompt_variance", engine="fed", title="t", summary="s",
                                                         severity=Severity.WARNING, evidence={}, fix=fix))
    try:
        yield supervisor
    finally:
        supervisor.stop()


@pytest.fixture(scope="module")
def api(sup: Supervisor) -> Iterator[TestClient]:
    with TestClient(build_supervisor_app(sup)) as client:
        yield client


def _routes(client: TestClient) -> list[tuple[str, str]]:
    return sorted((method, route.path) for route in client.app.routes if isinstance(route, APIRoute)
                  for method in route.methods)


def _check(response: Any, method: str, template: str) -> None:
    status = response.status_code
    documented_503 = status == 503 and method == "POST" and template == "/api/fixes/{entry_id}/revert"
    assert status < 500 or documented_503, f"{status}: {response.text[:500]}"
    if status >= 400:
        body = response.json()  # never HTML or plain text
        # the supervisor's refusals and FastAPI's own (unknown route, wrong method, a parameter of the wrong type)
        assert body["error"]["message"] and body["error"]["code"] == status, body


def _path(template: str, data: st.DataObject) -> str:
    """The route's path with each parameter drawn, quoted as a client would or partly left raw."""
    path = template
    for param in ("name", "entry_id"):
        if f"{{{param}}}" in path:
            value = data.draw(names if param == "name" else entry_ids, param)
            path = path.replace(f"{{{param}}}", quote(value, safe=data.draw(st.sampled_from(["", "/", "%", "/%"]))))
    return path


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_route_never_5xx(api: TestClient, data: st.DataObject) -> None:
    method, template = data.draw(st.sampled_from(_routes(api)), "route")
    method = data.draw(mostly(st.just(method), st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"])), "method")
    path = _path(template, data)
    query = data.draw(queries, "query")
    url = f"{path}?{urlencode(query)}" if query else path
    headers = {}
    authorization = data.draw(authorizations, "authorization")
    if authorization is not None:
        headers["Authorization"] = authorization
    body = data.draw(apply_bodies if template == "/api/fixes/apply" else st.one_of(st.none(), json_values), "body")
    kind = data.draw(st.sampled_from(["json", "json", "raw", "none"]), "body kind")
    if kind == "json":
        response = api.request(method, url, json=body, headers=headers)
    elif kind == "raw":
        raw = data.draw(st.binary(max_size=40), "raw body")
        response = api.request(method, url, content=raw, headers={**headers, "Content-Type": "application/json"})
    else:
        response = api.request(method, url, headers=headers)
    _check(response, method, template)


def test_the_fuzz_reaches_every_route_and_the_happy_paths(api: TestClient, sup: Supervisor) -> None:
    """Not fuzzing: that the fixture gives the routes something to answer with, so the fuzz above runs
    their code past the first refusal."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert {e["name"]: e["up"] for e in api.get("/api/engines").json()} == {"gone": False, "fed": False,
                                                                            "worker": False}
    assert api.get("/api/engines/fed/snapshot").status_code == 200
    assert len(api.get("/api/engines/fed/history?seconds=60").json()) == 5
    assert api.get("/api/engines/worker/logs?lines=2").json()[-1]["text"] == "line 2 \u00e9"
    assert any(d["rule"] == "engine_down" for d in api.get("/api/diagnoses").json())
    refused = api.post("/api/fixes/apply", json={"engine": "gone", "rule": "engine_down"}, headers=auth)
    assert refused.status_code == 409, refused.text  # a report, not a fix kvops applies
    applied = api.post("/api/fixes/apply", json={"engine": "fed", "rule": "prompt_variance"}, headers=auth)
    assert applied.status_code in (200, 409), applied.text  # 409: the fuzz queued it already
    assert api.post("/api/engines/worker/resume", headers=auth).json() == {"resumed": "worker"}
    for method, template in _routes(api):
        path = template.replace("{name}", "fed").replace("{entry_id}", "1")
        response = api.request(method, path, headers=auth)
        _check(response, method, template)


def test_float_query_edges(api: TestClient) -> None:
    """The one float parameter, at its edges: a window of nan, inf or -inf seconds is no 500."""
    for seconds in ("nan", "inf", "-inf", "1e309", "-0"):
        response = api.get(f"/api/engines/fed/history?seconds={seconds}")
        _check(response, "GET", "/api/engines/{name}/history")
        if response.status_code == 200:
            assert isinstance(response.json(), list)


def test_framework_errors_use_the_supervisor_error_body(api: TestClient) -> None:
    for response in (api.get("/api/engines/fed/logs?lines=x"), api.get("/api/nothing"), api.delete("/api/engines")):
        body = response.json()
        assert body["error"]["code"] == response.status_code and body["error"]["message"], body
