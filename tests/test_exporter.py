"""The supervisor's /metrics: what it exports after real poll cycles, in valid exposition format."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvops.supervisor import exporter
from kvops.supervisor.config import parse_config
from kvops.supervisor.supervisor import Supervisor

DOCS = Path(__file__).resolve().parent.parent / "docs" / "supervisor.md"


@pytest.fixture
def supervisor(tmp_path: Path) -> Supervisor:
    config = parse_config({
        "supervisor": {"state_dir": str(tmp_path), "alert_warmup_s": 0},
        "engines": [{"name": "gone", "url": "http://127.0.0.1:9"}],  # nothing listens on the discard port
    }, "test")
    sup = Supervisor(config)
    for _ in range(4):
        sup.poll_once()
    return sup


def test_an_unreachable_engine_is_down_and_diagnosed(supervisor: Supervisor):
    body, content_type = exporter.render(supervisor)
    text = body.decode()
    assert content_type.startswith("text/plain")
    assert 'kvops_engine_up{engine="gone",managed="false"} 0.0' in text
    assert 'kvops_engine_poll_errors_total{engine="gone"} 4.0' in text
    assert 'kvops_diagnosis_active{engine="gone",id="engine_down",severity="critical"} 1.0' in text
    assert "kvops_supervisor_polls_total 4.0" in text
    assert 'kvops_alerts{state="firing"} 1.0' in text  # critical alerts fire at once


def test_metric_names_follow_prometheus_conventions(supervisor: Supervisor):
    text = exporter.render(supervisor)[0].decode()
    for family in text_string_to_metric_families(text):
        assert re.fullmatch(r"kvops_[a-z0-9_]+", family.name), family.name
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family.name


def test_docs_list_every_supervisor_metric(supervisor: Supervisor):
    text = exporter.render(supervisor)[0].decode()
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(text)}
    documented = {m.group(1) for m in re.finditer(r"^\|\s*`(kvops_[a-z0-9_]+)`", DOCS.read_text(), re.M)}
    assert exported <= documented, exported - documented


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not on PATH")
def test_promtool_check_metrics(supervisor: Supervisor):
    text = exporter.render(supervisor)[0].decode()
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr
