"""alerts/ and dashboards/ without servers: `promtool check rules` and `promtool test rules`, one alert per
diagnosis with its runbook, every metric the rules and the dashboard read is one kvops exports, and every
dashboard expression parses (through promtool, as a recording rule)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvops.engine.serving.metrics import snapshot_families
from kvops.rules import RULES
from tests.helpers.synthetic import snapshot

ROOT = Path(__file__).resolve().parent.parent
RULES_FILE = ROOT / "alerts" / "kvops.rules.yml"
TESTS_DIR = ROOT / "alerts" / "tests"
DASHBOARD = ROOT / "dashboards" / "kvops.json"
RUNBOOKS = ROOT / "docs" / "runbooks"
METRIC_DOCS = (ROOT / "docs" / "metrics.md", ROOT / "docs" / "supervisor.md")
RUNBOOK_BASE = "https://github.com/kvops/kvops/blob/main/docs/runbooks/"
# Series Prometheus makes itself: scrape health and the alert state of rules.
PROMETHEUS_SERIES = {"up", "ALERTS"}

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool is not on PATH (Debian package `prometheus`; .ci/run installs it)")


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def _records() -> set[str]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _dashboard_exprs() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in _dashboard()["panels"] for target in panel.get("targets", [])]


def _grafana_to_promql(expr: str) -> str:
    """Grafana's variables as Grafana substitutes them with "All" selected and a 1 h range."""
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "1h")
            .replace("$engine", ".*").replace("$tenant", ".*"))


def _exported_names() -> set[str]:
    """Every metric name kvops documents (engine and supervisor), with a histogram's series suffixes."""
    names: set[str] = set()
    for doc in METRIC_DOCS:
        for match in re.finditer(r"^\|\s*`(kvops_[a-z0-9_]+)`\s*\|\s*(\w+)", doc.read_text(), re.M):
            name, kind = match.groups()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


@needs_promtool
def test_promtool_check_rules():
    result = subprocess.run(["promtool", "check", "rules", str(RULES_FILE)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_unit_tests_pass():
    files = sorted(TESTS_DIR.glob("*.yml"))
    assert files
    result = subprocess.run(["promtool", "test", "rules", *map(str, files)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]


@needs_promtool
def test_example_prometheus_config_is_valid_and_loads_the_rules():
    config = ROOT / "alerts" / "prometheus.example.yml"
    result = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {job["job_name"]: job for job in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert set(jobs) == {"kvops-supervisor", "kvops-engine"}  # the job names the rules match on
    # the engines come from the supervisor's service discovery, which labels each with `engine`
    # (tests/test_supervisor.py checks the endpoint, test_prometheus_e2e.py scrapes through it)
    assert [sd["url"] for sd in jobs["kvops-engine"]["http_sd_configs"]] == [
        "http://127.0.0.1:9400/api/prometheus/targets"]


@pytest.mark.skipif(shutil.which("amtool") is None,
                    reason="amtool is not on PATH (Debian package `prometheus-alertmanager`; .ci/run installs it)")
def test_example_alertmanager_config_is_valid():
    config = ROOT / "alerts" / "alertmanager.example.yml"
    result = subprocess.run(["amtool", "check-config", str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_one_alert_per_diagnosis_with_severity_and_runbook():
    alerts = _alerts()
    by_diagnosis: dict[str, set[str]] = {}
    for alert in alerts:
        labels, annotations = alert["labels"], alert["annotations"]
        diagnosis = labels["diagnosis"]
        by_diagnosis.setdefault(diagnosis, set()).add(alert["alert"])
        assert labels["severity"] in ("info", "warning", "critical"), alert["alert"]
        assert annotations["summary"] and annotations["description"], alert["alert"]
        assert annotations["runbook_url"] == f"{RUNBOOK_BASE}{diagnosis}.md", alert["alert"]
        assert (RUNBOOKS / f"{diagnosis}.md").is_file(), f"no runbook for {diagnosis}"
    assert set(RULES) <= set(by_diagnosis), f"diagnoses without an alert: {set(RULES) - set(by_diagnosis)}"
    # One alert name per diagnosis (several severities share the name, as kvops's own alerts do).
    assert all(len(names) == 1 for names in by_diagnosis.values()), by_diagnosis
    # Two rules under one name must differ by severity, or Alertmanager could not tell them apart.
    seen = [(a["alert"], a["labels"]["severity"]) for a in alerts]
    assert len(seen) == len(set(seen))


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    fires: set[str] = set()
    silent: set[str] = set()
    for path in TESTS_DIR.glob("*.yml"):
        spec = yaml.safe_load(path.read_text())
        assert spec["rule_files"] == ["../kvops.rules.yml"], path.name
        for test in spec["tests"]:
            for check in test.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - fires == set(), f"alerts never shown firing: {names - fires}"
    assert names - silent == set(), f"alerts never shown silent: {names - silent}"


def test_runbooks_say_what_it_means_how_to_confirm_and_fix():
    for diagnosis in {a["labels"]["diagnosis"] for a in _alerts()}:
        text = (RUNBOOKS / f"{diagnosis}.md").read_text()
        for heading in ("## What it means", "## How to confirm", "## How to fix", "## How the alert is computed"):
            assert heading in text, f"{diagnosis}.md lacks {heading!r}"
        assert f"# `{diagnosis}`" in text.splitlines()[0]
    index = (RUNBOOKS / "README.md").read_text()
    assert all(f"({d}.md)" in index for d in RULES)


def test_rules_and_dashboard_read_only_exported_metrics():
    exported = _exported_names() | _records() | PROMETHEUS_SERIES
    exprs = [(a["alert"], a["expr"]) for a in _alerts()] + _dashboard_exprs()
    for var in _dashboard()["templating"]["list"]:
        if var["type"] == "query":
            exprs.append((var["name"], var["query"]["query"]))
    for where, expr in exprs:
        without_strings = re.sub(r'"[^"]*"', '""', expr)
        for name in re.findall(r"\b(kvops[:_][a-z0-9_:]+)", without_strings):
            assert name in exported, f"{where}: {name} is not a metric kvops exports"


@needs_promtool
def test_dashboard_expressions_parse(tmp_path: Path):
    # promtool has no "parse this query" command; as recording rules they go through the same parser.
    rules = [{"record": f"dashboard:expr_{i}", "expr": _grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(_dashboard_exprs())]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_shows_what_the_issue_lists_templated_by_engine_and_tenant():
    dashboard = _dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("engine", "tenant"):
        assert variables[name]["includeAll"] and variables[name]["multi"] and variables[name]["allValue"] == ".*"
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"KV usage", "Blocks by state", "Prefix hit rate", "Prefix hit rate per tenant", "Swap rate",
            "Prompt length", "Preemptions", "Time to first token", "Inter-token latency", "Active diagnoses",
            "Fixes applied, verified and rolled back"} <= titles
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    heatmap = next(p for p in dashboard["panels"] if p["title"] == "Prompt length")
    assert heatmap["type"] == "heatmap" and heatmap["targets"][0]["format"] == "heatmap"
    # Every engine metric is filtered by the engine variable, every per-tenant one by the tenant variable too.
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            expr = target["expr"]
            # (and the scrape's own `up` of the supervisors: a supervisor that is down has no engines to filter)
            global_only = re.fullmatch(r"[^{]*\b(kvops_diagnoses_active|kvops_alerts|kvops_alert_\w+|up)\b.*", expr)
            if not global_only:
                assert 'engine=~"$engine"' in expr, (panel["title"], expr)
            if "tenant" in expr and "kvops_tenant_" in expr:
                assert 'tenant=~"$tenant"' in expr, (panel["title"], expr)


def test_engine_exports_the_numbers_the_rules_compute_with():
    snap = snapshot(engine={"block_size": 32, "enable_prefix_caching": False},
                    prefix_cache={"shadow_queries_total": 900, "shadow_hits_total": 700,
                                  "potential_queries_total": 5000, "potential_hits_total": 2100})

    class SnapshotOnly(Collector):
        def collect(self) -> Iterable[Metric]:
            return snapshot_families(snap)

    registry = CollectorRegistry()
    registry.register(SnapshotOnly())
    lines = generate_latest(registry).decode().splitlines()
    for line in ("kvops_engine_block_size 32.0", "kvops_prefix_caching_enabled 0.0",
                 "kvops_prefix_cache_shadow_queries_total 900.0", "kvops_prefix_cache_shadow_hits_total 700.0",
                 "kvops_prefix_cache_potential_queries_total 5000.0", "kvops_prefix_cache_potential_hits_total 2100.0"):
        assert line in lines, line
