"""The supervisor's /metrics: what it exports after real poll cycles, in valid exposition format."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvops.adapters import Scrape
from kvops.kinds import snapshot_from_scrape
from kvops.schema.snapshot import Snapshot
from kvops.supervisor import exporter
from kvops.supervisor.config import parse_config
from kvops.supervisor.supervisor import Supervisor
from tests.helpers.synthetic import snapshot

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "docs" / "supervisor.md", ROOT / "docs" / "metrics.md")
VLLM_CAPTURES = ROOT / "tests" / "fixtures" / "vllm-cpu"


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
    assert 'kvops_engine_up{engine="gone",kind="auto",managed="false"} 0.0' in text
    assert 'kvops_engine_poll_errors_total{engine="gone",kind="auto"} 4.0' in text
    assert 'kvops_diagnosis_active{engine="gone",id="engine_down",kind="auto",severity="critical"} 1.0' in text
    assert "kvops_engine_kv_cache_usage_ratio{" not in text  # nothing read from an engine never seen
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
    documented = {m.group(1) for doc in DOCS for m in re.finditer(r"^\|\s*`(kvops_[a-z0-9_]+)`", doc.read_text(), re.M)}
    assert exported <= documented, exported - documented


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not on PATH")
def test_promtool_check_metrics(supervisor: Supervisor):
    text = exporter.render(supervisor)[0].decode()
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


# ------------------------------------------------------------------ the same series for every kind of engine


class SnapshotClient:
    """An engine client that answers every poll with a fresh copy of one snapshot (the time moved to now)."""

    admin_token = None

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def snapshot(self) -> Snapshot:
        return self.snap.model_copy(update={"time": time.time()})

    def close(self) -> None:
        pass


def _vllm_snapshot(state: str) -> Snapshot:
    scrape = Scrape.parse((VLLM_CAPTURES / f"{state}.txt").read_text())
    models = json.loads((VLLM_CAPTURES / "v1-models.json").read_text())
    return snapshot_from_scrape("vllm", scrape, time.time(), models)


@pytest.fixture
def mixed(tmp_path: Path) -> Supervisor:
    """A supervisor watching a kvops engine and a vLLM server (its snapshot from a capture of the real one)."""
    config = parse_config({
        "supervisor": {"state_dir": str(tmp_path), "alert_warmup_s": 0},
        "engines": [{"name": "ours", "url": "http://127.0.0.1:9", "kind": "kvops"},
                    {"name": "theirs", "url": "http://127.0.0.1:9", "kind": "vllm"}],
    }, "test")
    sup = Supervisor(config)
    kvops_snap = snapshot(time.time(), engine={"block_size": 16, "num_blocks": 1000},
                          blocks={"usage": 0.25},
                          prefix_cache={"queries_total": 2000, "hits_total": 500, "hit_rate": 0.25},
                          requests={"waiting": 3, "running": 5, "preemptions_total": 7})
    sup.engines["ours"].client = SnapshotClient(kvops_snap)  # type: ignore[assignment]
    sup.engines["theirs"].client = SnapshotClient(_vllm_snapshot("pressure"))  # type: ignore[assignment]
    for _ in range(3):
        sup.poll_once()
    return sup


def _samples(text: str) -> dict[str, dict[tuple[str, str], float]]:
    """name -> (engine, kind) -> value, for the per-engine series."""
    out: dict[str, dict[tuple[str, str], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "engine" in sample.labels and "kind" in sample.labels:
                out.setdefault(sample.name, {})[(sample.labels["engine"], sample.labels["kind"])] = sample.value
    return out


def test_kvops_and_vllm_engines_get_the_same_series_labelled_by_kind(mixed: Supervisor):
    samples = _samples(exporter.render(mixed)[0].decode())
    ours, theirs = ("ours", "kvops"), ("theirs", "vllm")
    same = ["kvops_engine_kv_cache_usage_ratio", "kvops_engine_kv_pool_blocks", "kvops_engine_kv_block_size_tokens",
            "kvops_engine_prefix_caching_enabled", "kvops_engine_prefix_cache_query_tokens_total",
            "kvops_engine_prefix_cache_hit_tokens_total", "kvops_engine_prefix_cache_hit_ratio",
            "kvops_engine_requests_running", "kvops_engine_requests_waiting", "kvops_engine_preemptions_total",
            "kvops_engine_prompt_tokens_total", "kvops_engine_generation_tokens_total", "kvops_engine_up"]
    for name in same:
        assert set(samples[name]) == {ours, theirs}, name
    # the kvops engine's snapshot ...
    assert samples["kvops_engine_kv_cache_usage_ratio"][ours] == 0.25
    assert samples["kvops_engine_kv_block_size_tokens"][ours] == 16
    assert samples["kvops_engine_prefix_cache_hit_ratio"][ours] == 0.25
    assert samples["kvops_engine_requests_waiting"][ours] == 3
    assert samples["kvops_engine_preemptions_total"][ours] == 7
    # ... and the real vLLM's /metrics under KV pressure (tests/fixtures/vllm-cpu/pressure.txt)
    assert samples["kvops_engine_kv_cache_usage_ratio"][theirs] == 1.0
    assert samples["kvops_engine_kv_pool_blocks"][theirs] == 11
    assert samples["kvops_engine_kv_block_size_tokens"][theirs] == 128
    assert samples["kvops_engine_prefix_cache_query_tokens_total"][theirs] == 1005
    assert samples["kvops_engine_prefix_cache_hit_ratio"][theirs] == 0.0
    assert samples["kvops_engine_requests_waiting"][theirs] == 9
    assert samples["kvops_engine_preemptions_total"][theirs] == 4
    assert samples["kvops_engine_up"][theirs] == 1
    # diagnoses carry the kind too; every one the supervisor holds is exported
    diagnosed = {(d.rule, d.engine) for d in mixed.diagnoses}
    exported = {(labels_id, engine) for labels_id, engine in _diagnosis_labels(exporter.render(mixed)[0].decode())}
    assert diagnosed == exported


def _diagnosis_labels(text: str) -> set[tuple[str, str]]:
    found = set()
    for family in text_string_to_metric_families(text):
        if family.name == "kvops_diagnosis_active":
            for sample in family.samples:
                assert sample.labels["kind"] == {"ours": "kvops", "theirs": "vllm"}[sample.labels["engine"]]
                found.add((sample.labels["id"], sample.labels["engine"]))
    return found


def test_fields_an_engine_does_not_report_have_no_series(mixed: Supervisor):
    snap = _vllm_snapshot("idle").model_copy(update={"unknown": ["requests.preemptions_total", "engine.num_blocks"]})
    mixed.engines["theirs"].client = SnapshotClient(snap)  # type: ignore[assignment]
    mixed.poll_once()
    samples = _samples(exporter.render(mixed)[0].decode())
    assert ("theirs", "vllm") not in samples["kvops_engine_preemptions_total"]
    assert ("theirs", "vllm") not in samples["kvops_engine_kv_pool_blocks"]
    assert ("theirs", "vllm") in samples["kvops_engine_kv_cache_usage_ratio"]
