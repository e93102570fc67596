"""Fixes against a real engine's admin API: applied with before/after values, kept when the
evidence improves, rolled back when it does not, and refused with a reason when kvops cannot
apply them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvops.engine.server import build_app
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity, Verification
from kvops.supervisor.audit import AuditLog
from kvops.supervisor.engine_client import EngineClient
from kvops.supervisor.fixes import FixError, FixManager


@pytest.fixture
def client(llm) -> Iterator[EngineClient]:
    engine = llm.engine
    with TestClient(build_app(engine, admin_token="fix-token")) as http:
        client = EngineClient("http://testserver", "fix-token")
        client._http = http  # the real app, in process
        yield client
    engine.set_normalization("off")
    engine.block_manager.quotas.clear()
    engine.tenant_salts.clear()


def _diagnosis(evidence: float, fix: Fix, rule: str = "prompt_variance") -> Diagnosis:
    return Diagnosis(rule=rule, engine="default", severity=Severity.WARNING, title="t", summary="s",
                     evidence={"hit_rate": evidence}, fix=fix,
                     verification=Verification(evidence_key="hit_rate", better="higher", min_change=0.1))


NORMALIZE = Fix(kind=FixKind.ADMIN, action="set_normalization", params={"mode": "on"}, description="normalize")


def _manager(tmp_path: Path) -> tuple[FixManager, list[float]]:
    now = [1000.0]
    return FixManager(AuditLog(tmp_path / "audit.jsonl"), verify_after_s=60, clock=lambda: now[0]), now


def test_auto_fix_that_helps_is_kept(tmp_path: Path, client: EngineClient):
    fixes, now = _manager(tmp_path)
    before = _diagnosis(0.2, NORMALIZE)
    fixes.consider([before], lambda rule: "auto", lambda engine: (client, None))
    assert client.knobs()["normalize_prompts"] == "on"
    applied = fixes.audit.entries[-1]
    assert applied.action == "applied" and applied.before == {"normalize_prompts": "off"}
    assert applied.after == {"normalize_prompts": "on"}
    now[0] += 30
    fixes.consider([_diagnosis(0.5, NORMALIZE)], lambda rule: "auto", lambda engine: (client, None))
    assert fixes.audit.entries[-1].action == "applied"  # not judged before verify_after_s
    now[0] += 31
    fixes.consider([_diagnosis(0.5, NORMALIZE)], lambda rule: "auto", lambda engine: (client, None))
    verified = fixes.audit.entries[-1]
    assert verified.action == "verified" and "rose from 0.2 to 0.5" in verified.message
    assert client.knobs()["normalize_prompts"] == "on"
    # Still diagnosed (above threshold): the kept fix is not applied again.
    fixes.consider([_diagnosis(0.5, NORMALIZE)], lambda rule: "auto", lambda engine: (client, None))
    assert [e.action for e in fixes.audit.entries] == ["applied", "verified"]
    assert (tmp_path / "audit.jsonl").read_text().count("\n") == 2  # durable


def test_fix_that_does_not_help_is_rolled_back(tmp_path: Path, client: EngineClient):
    fixes, now = _manager(tmp_path)
    fixes.consider([_diagnosis(0.2, NORMALIZE)], lambda rule: "auto", lambda engine: (client, None))
    now[0] += 61
    fixes.consider([_diagnosis(0.21, NORMALIZE)], lambda rule: "auto", lambda engine: (client, None))
    rolled = fixes.audit.entries[-1]
    assert rolled.action == "rolled_back" and "needed 10%" in rolled.message
    assert rolled.after == {"normalize_prompts": "off"}
    assert client.knobs()["normalize_prompts"] == "off"
    assert fixes.counts[("default", "prompt_variance", "rolled_back")] == 1


def test_suggest_records_once_and_a_person_applies_it(tmp_path: Path, client: EngineClient):
    fixes, _ = _manager(tmp_path)
    diagnosis = _diagnosis(0.2, NORMALIZE)
    for _ in range(3):
        fixes.consider([diagnosis], lambda rule: "suggest", lambda engine: (client, None))
    assert [e.action for e in fixes.audit.entries] == ["proposed"]
    assert client.knobs()["normalize_prompts"] == "off"
    entry = fixes.apply(diagnosis, client, None)
    assert entry.action == "applied" and client.knobs()["normalize_prompts"] == "on"
    reverted = fixes.revert(entry.id)
    assert reverted.action == "reverted" and client.knobs()["normalize_prompts"] == "off"


def test_tenant_quota_fix_keeps_the_tenants_cache_salt(tmp_path: Path, client: EngineClient, llm):
    llm.engine.tenant_salts["batch"] = "shared"
    fixes, now = _manager(tmp_path)
    quota = Fix(kind=FixKind.ADMIN, action="set_tenant_quota", params={"tenant": "batch", "quota_blocks": 96},
                description="cap batch")
    diagnosis = Diagnosis(rule="tenant_pollution", engine="default", subject="batch", severity=Severity.WARNING,
                          title="t", summary="s", evidence={"victim_evictions_suffered_per_s": 5.0}, fix=quota,
                          verification=Verification(evidence_key="victim_evictions_suffered_per_s", better="lower"))
    fixes.consider([diagnosis], lambda rule: "auto", lambda engine: (client, None))
    knobs = client.knobs()
    assert knobs["tenant_quotas"] == {"batch": 96} and knobs["tenant_salts"] == {"batch": "shared"}
    now[0] += 61
    fixes.consider([diagnosis], lambda rule: "auto", lambda engine: (client, None))  # no better: roll back
    knobs = client.knobs()
    assert knobs["tenant_quotas"] == {} and knobs["tenant_salts"] == {"batch": "shared"}


def test_tenant_names_with_a_slash_or_a_space_reach_the_engine_whole(tmp_path: Path, client: EngineClient):
    tenant = "team/a b"  # quoted by the client into one path segment, decoded by the engine
    fixes, now = _manager(tmp_path)
    quota = Fix(kind=FixKind.ADMIN, action="set_tenant_quota", params={"tenant": tenant, "quota_blocks": 96},
                description="cap")
    diagnosis = Diagnosis(rule="tenant_pollution", engine="default", subject=tenant, severity=Severity.WARNING,
                          title="t", summary="s", evidence={"victim_evictions_suffered_per_s": 5.0}, fix=quota,
                          verification=Verification(evidence_key="victim_evictions_suffered_per_s", better="lower"))
    fixes.consider([diagnosis], lambda rule: "auto", lambda engine: (client, None))
    assert client.knobs()["tenant_quotas"] == {tenant: 96}
    now[0] += 61
    fixes.consider([diagnosis], lambda rule: "auto", lambda engine: (client, None))  # no better: roll back
    assert client.knobs()["tenant_quotas"] == {}
    assert [e.action for e in fixes.audit.entries] == ["applied", "rolled_back"]


def test_unknown_admin_actions_and_bad_params_fail_before_anything_is_sent(tmp_path: Path, client: EngineClient):
    fixes, _ = _manager(tmp_path)
    unknown = Fix(kind=FixKind.ADMIN, action="set_everything", params={}, description="?")
    with pytest.raises(FixError, match="unknown admin action 'set_everything'"):
        fixes.apply(_diagnosis(0.2, unknown), client, None)
    bad = Fix(kind=FixKind.ADMIN, action="set_normalization", params={"mode": "loud"}, description="?")
    with pytest.raises(FixError, match="mode"):
        fixes.apply(_diagnosis(0.2, bad), client, None)
    assert client.knobs()["normalize_prompts"] == "off"
    assert [e.action for e in fixes.audit.entries] == ["failed", "failed"]


def test_fixes_kvops_cannot_apply_are_refused_with_the_reason(tmp_path: Path, client: EngineClient):
    fixes, _ = _manager(tmp_path)
    restart = Fix(kind=FixKind.RESTART, action="restart_engine", params={"block_size": 32}, description="bs 32")
    with pytest.raises(FixError, match="kvops does not manage this engine"):
        fixes.apply(_diagnosis(0.2, restart, rule="block_size_mismatch"), client, None)
    assert fixes.audit.entries[-1].action == "failed"
    anonymous = EngineClient(client.url, None)
    anonymous._http = client._http
    with pytest.raises(FixError, match="needs the engine's admin token"):
        fixes.apply(_diagnosis(0.2, NORMALIZE), anonymous, None)
    report = Fix(kind=FixKind.REPORT, action="advice", description="read the runbook")
    with pytest.raises(FixError, match="proposes no fix kvops can apply"):
        fixes.apply(_diagnosis(0.2, report, rule="host_bound"), client, None)


def test_audit_log_survives_a_restart(tmp_path: Path, client: EngineClient):
    fixes, _ = _manager(tmp_path)
    fixes.consider([_diagnosis(0.2, NORMALIZE)], lambda rule: "suggest", lambda engine: (client, None))
    reloaded = AuditLog(tmp_path / "audit.jsonl")
    assert [e.action for e in reloaded.entries] == ["proposed"]
    assert reloaded.record(engine="default", rule="x", action="proposed").id == 2


def test_after_a_rollback_only_a_different_fix_is_tried(tmp_path: Path, client: EngineClient):
    fixes, now = _manager(tmp_path)
    auto = (lambda rule: "auto", lambda engine: (client, None))
    fixes.consider([_diagnosis(0.2, NORMALIZE)], *auto)
    now[0] += 61
    fixes.consider([_diagnosis(0.2, NORMALIZE)], *auto)  # no better: rolled back
    assert [e.action for e in fixes.audit.entries] == ["applied", "rolled_back"]
    for _ in range(3):  # the same change is not retried while the diagnosis lasts
        fixes.consider([_diagnosis(0.2, NORMALIZE)], *auto)
    assert len(fixes.audit.entries) == 2
    shadow = Fix(kind=FixKind.ADMIN, action="set_normalization", params={"mode": "shadow"}, description="measure")
    fixes.consider([_diagnosis(0.2, shadow)], *auto)  # the rule now proposes something else: tried
    assert [e.action for e in fixes.audit.entries] == ["applied", "rolled_back", "applied"]
    assert client.knobs()["normalize_prompts"] == "shadow"
