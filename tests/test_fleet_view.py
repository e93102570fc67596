"""The fleet reader's parts that need no Prometheus: selectors, what each way of failing to read Prometheus says,
where a supervisor is reached, and which engine comes first. The fleet read from a real Prometheus is
tests/test_fleet_prometheus.py."""

from __future__ import annotations

import httpx
import pytest

from kvops.fleet.prometheus_api import PrometheusApi, PrometheusError, Sample, parse_selector
from kvops.fleet.view import FleetDiagnosis, FleetEngine, Supervisor, supervisor_url
from kvops.top import run_top


@pytest.mark.parametrize(("text", "inner"), [
    (None, ""), ("", ""), ("{}", ""), ('{cluster="a"}', 'cluster="a"'), ('cluster="a"', 'cluster="a"'),
    ('{cluster="a", namespace=~"prod-.*"}', 'cluster="a", namespace=~"prod-.*"'),
    ('{a!="x\\"y"}', 'a!="x\\"y"'),
])
def test_selectors_people_write(text: str | None, inner: str):
    assert parse_selector(text) == inner


@pytest.mark.parametrize(("text", "says"), [
    ("{cluster=a}", "not a list of label matchers"), ('{cluster="a"', "unbalanced braces"),
    ('{a="1" b="2"}', "separated by commas"), ('{a="1",}', "not a list of label matchers"),
])
def test_a_broken_selector_says_what_to_write(text: str, says: str):
    with pytest.raises(PrometheusError, match=says):
        parse_selector(text)


def _api(status: int, body: bytes | str | dict[str, object]) -> PrometheusApi:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body) if isinstance(body, dict) else httpx.Response(status, content=body)
    return PrometheusApi("http://prometheus:9090", transport=httpx.MockTransport(answer))


@pytest.mark.parametrize(("status", "body", "says"), [
    (503, b"Service Unavailable", "not ready yet"),
    (404, b"<html>Grafana</html>", "is that Prometheus's address"),
    (400, {"status": "error", "errorType": "bad_data", "error": "parse error"}, "refused .*parse error"),
    (200, {"status": "success", "data": {"resultType": "matrix", "result": []}}, "no instant vector"),
])
def test_what_prometheus_answered_is_said(status: int, body: bytes | dict[str, object], says: str):
    with _api(status, body) as api, pytest.raises(PrometheusError, match=says):
        api.query("up")


def test_nothing_listening_names_the_address():
    with PrometheusApi("http://127.0.0.1:1", timeout_s=2) as api, \
            pytest.raises(PrometheusError, match=r"nothing answers at http://127\.0\.0\.1:1"):
        api.query("up")


def test_nan_samples_are_left_out():
    body = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"engine": "a"}, "value": [1, "NaN"]}, {"metric": {"engine": "b"}, "value": [1, "0.5"]}]}}
    with _api(200, body) as api:
        assert api.query("x") == [Sample({"engine": "b"}, 0.5)]


@pytest.mark.parametrize(("info", "up", "url"), [
    ({"supervisor_url": "http://kvops.example:9400/"}, {}, "http://kvops.example:9400"),
    ({"supervisor_url": "http://0.0.0.0:9400"}, {}, "http://10.1.2.3:9400"),  # listening everywhere
    (None, {"supervisor_url": "http://pod:9400"}, "http://pod:9400"),  # set by the scrape config
    (None, {}, "http://10.1.2.3:9400"),  # only the scraped address is known
])
def test_where_a_supervisor_is_reached(info: dict[str, str] | None, up: dict[str, str], url: str):
    target = Sample({"job": "kvops-supervisor", "instance": "10.1.2.3:9400", **up}, 1)
    assert supervisor_url(Sample(info, 1) if info is not None else None, target) == url


def _engine(name: str, up: bool | None = True, supervisor_up: bool = True, severity: str | None = None,
            kv: float = 0.0) -> FleetEngine:
    engine = FleetEngine(name, "vllm", Supervisor("j", name, supervisor_up, f"http://{name}"), up, kv_usage=kv)
    if severity:
        engine.diagnoses.append(FleetDiagnosis("rule", severity, 1))
    return engine


def test_worst_first():
    engines = [_engine("ok", kv=0.9), _engine("warn", severity="warning"), _engine("crit", severity="critical"),
               _engine("down", up=False), _engine("gone", up=None, supervisor_up=False)]
    ordered = sorted(engines, key=lambda e: e.rank)
    assert [e.engine for e in ordered] == ["gone", "down", "crit", "warn", "ok"]
    assert [e.status for e in ordered] == ["supervisor down", "engine down", "critical", "warning", "ok"]


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"prometheus": "http://p:9090", "attach": "http://s:9400"}, "drop --attach"),
    ({"prometheus": "http://p:9090", "demo": True}, "drop --demo"),
    ({"selector": '{a="b"}'}, "give --prometheus"),
    ({"prometheus": "ftp://p"}, "not an http"),
])
def test_top_flags_that_do_not_go_together(kwargs: dict[str, object], says: str,
                                           capsys: pytest.CaptureFixture[str]):
    assert run_top(**kwargs) == 2  # type: ignore[arg-type]
    assert says in capsys.readouterr().err
