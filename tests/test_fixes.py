"""Fixes against a real engine's admin API, run as jobs: queued, applied with before/after values, kept when
the judge says improved, rolled back when it does not, and refused with a reason when kvops cannot apply them.
The judge is a stand-in here (tests/test_fix_jobs.py runs the real one on real windows)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvops.adapters.engine_client import EngineClient
from kvops.engine.serving.app import build_app
from kvops.history import EngineHistory
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.verdict import Verdict, VerdictKind
from kvops.supervisor.fixes.audit import AuditLog
from kvops.supervisor.fixes.manager import FixError, FixManager, Target
from tests.helpers.waiting import wait_for


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


HIT_RATE = [Objective(measure="hit_rate", better="higher")]


def _diagnosis(evidence: float, fix: Fix, rule: str = "prompt_variance") -> Diagnosis:
    fix = fix.model_copy(update={"objectives": fix.objectives or HIT_RATE})
    return Diagnosis(rule=rule, engine="default", severity=Severity.WARNING, title="t", summary="s",
                     evidence={"hit_rate": evidence}, fix=fix)


NORMALIZE = Fix(kind=FixKind.ADMIN, action="set_normalization", params={"mode": "on"}, description="normalize")
AUTO = lambda rule: "auto"  # noqa: E731


def _manager(tmp_path: Path, client: EngineClient, verdict: VerdictKind = VerdictKind.IMPROVED,
             **kwargs: object) -> FixManager:
    def judge(objectives, before, after) -> Verdict:
        return Verdict(kind=verdict, message=f"hit_rate {verdict.value}")

    history = EngineHistory("default")
    fixes = FixManager(AuditLog(tmp_path / "audit.jsonl"), lambda engine: Target(client, None, history),
                       verify_after_s=0.3, state_path=tmp_path / "fix_jobs.json", cooldown_s=0, judge=judge,
                       **kwargs)  # type: ignore[arg-type]
    fixes.start()
    return fixes


def _actions(fixes: FixManager) -> list[str]:
    return [e.action for e in fixes.audit.entries]


def _settled(fixes: FixManager) -> str:
    return wait_for("the job's end", lambda: next((a for a in reversed(_actions(fixes)) if a in (
        "verified", "rolled_back", "failed", "reverted")), None), 10, every_s=0.05)


def test_auto_fix_that_helps_is_kept(tmp_path: Path, client: EngineClient):
    fixes = _manager(tmp_path, client)
    fixes.consider([_diagnosis(0.2, NORMALIZE)], AUTO)  # only queues: the job runs on its worker
    assert _settled(fixes) == "verified"
    assert client.knobs()["normalize_prompts"] == "on"
    assert _actions(fixes) == ["queued", "applying", "verifying", "verified"]
    verifying, verified = fixes.audit.entries[2], fixes.audit.entries[3]
    assert verifying.before == {"normalize_prompts": "off"} and verifying.after == {"normalize_prompts": "on"}
    assert verified.verdict is not None and verified.verdict.kind is VerdictKind.IMPROVED
    # Still diagnosed (above threshold): the kept fix is not applied again.
    fixes.consider([_diagnosis(0.5, NORMALIZE)], AUTO)
    assert len(fixes.audit.entries) == 4
    assert (tmp_path / "audit.jsonl").read_text().count("\n") == 4  # durable
    assert fixes.job_views()[0]["state"] == "verified"


def test_fix_that_does_not_help_is_rolled_back(tmp_path: Path, client: EngineClient):
    fixes = _manager(tmp_path, client, VerdictKind.NO_EFFECT)
    fixes.consider([_diagnosis(0.2, NORMALIZE)], AUTO)
    assert _settled(fixes) == "rolled_back"
    rolled = fixes.audit.entries[-1]
    assert rolled.after == {"normalize_prompts": "off"} and rolled.message.startswith("no_effect")
    assert client.knobs()["normalize_prompts"] == "off"
    assert fixes.counts[("default", "prompt_variance", "rolled_back")] == 1


def test_an_audit_entry_is_counted_before_anyone_can_see_it(tmp_path: Path, client: EngineClient):
    # A reader of the audit log (the API, the test above) may look at the counts the moment an entry appears:
    # CI once saw `rolled_back` in the log and no count for it yet.
    fixes = _manager(tmp_path, client, VerdictKind.NO_EFFECT)
    write = fixes.audit.record
    counted_when_written: list[int] = []

    def record(**fields: Any) -> Any:
        counted_when_written.append(fixes.counts.get((fields["engine"], fields["rule"], fields["action"]), 0))
        return write(**fields)

    fixes.audit.record = record  # type: ignore[method-assign]
    fixes.consider([_diagnosis(0.2, NORMALIZE)], AUTO)
    assert _settled(fixes) == "rolled_back"
    assert len(counted_when_written) == 4 and min(counted_when_written) == 1, counted_when_written


def test_inconclusive_is_extended_once_then_the_policy_decides(tmp_path: Path, client: EngineClient):
    calls: list[int] = []
    fixes = _manager(tmp_path, client, VerdictKind.INCONCLUSIVE, inconclusive="keep")
    judge = fixes.judge
    fixes.judge = lambda *args: calls.append(1) or judge(*args)  # type: ignore[method-assign]
    fixes.consider([_diagnosis(0.2, NORMALIZE)], AUTO)
    assert _settled(fixes) == "verified"
    kept = fixes.audit.entries[-1]
    assert len(calls) == 2 and kept.verdict is not None and kept.verdict.extended
    assert 'kept by the inconclusive = "keep" policy' in kept.message
    assert client.knobs()["normalize_prompts"] == "on"


def test_a_fix_without_objectives_follows_the_inconclusive_policy(tmp_path: Path, client: EngineClient):
    fixes = _manager(tmp_path, client)  # the judge would say improved: it is never asked
    diagnosis = _diagnosis(0.2, NORMALIZE)
    diagnosis.fix.objectives = []  # type: ignore[union-attr]
    fixes.consider([diagnosis], AUTO)
    assert _settled(fixes) == "rolled_back"
    assert "no measurable objective" in fixes.audit.entries[-1].message
    assert client.knobs()["normalize_prompts"] == "off"


def test_suggest_records_once_and_a_person_applies_and_reverts_it(tmp_path: Path, client: EngineClient):
    fixes = _manager(tmp_path, client)
    fixes.verify_after_s = 30  # stays verifying: a person reverts it
    diagnosis = _diagnosis(0.2, NORMALIZE)
    for _ in range(3):
        fixes.consider([diagnosis], lambda rule: "suggest")
    assert _actions(fixes) == ["proposed"]
    assert client.knobs()["normalize_prompts"] == "off"
    queued = fixes.apply(diagnosis)
    assert queued.action == "queued"
    wait_for("verifying", lambda: _actions(fixes)[-1] == "verifying", 10, every_s=0.05)
    assert client.knobs()["normalize_prompts"] == "on"
    with pytest.raises(FixError, match="has a fix job running"):
        fixes.apply(diagnosis)
    reverted = fixes.revert(queued.id)  # any of the job's audit ids
    assert reverted.action == "reverted" and client.knobs()["normalize_prompts"] == "off"
    assert fixes.job_views()[-1]["state"] == "reverted"


def test_tenant_quota_fix_keeps_the_tenants_cache_salt(tmp_path: Path, client: EngineClient, llm):
    llm.engine.tenant_salts["batch"] = "shared"
    fixes = _manager(tmp_path, client, VerdictKind.WORSE)
    quota = Fix(kind=FixKind.ADMIN, action="set_tenant_quota", params={"tenant": "batch", "quota_blocks": 96},
                description="cap batch", objectives=[Objective(measure="victims_hit_rate", better="higher",
                                                               subject="batch")])
    diagnosis = Diagnosis(rule="tenant_pollution", engine="default", subject="batch", severity=Severity.WARNING,
                          title="t", summary="s", evidence={"victim_evictions_suffered_per_s": 5.0}, fix=quota)
    fixes.verify_after_s = 1.0
    fixes.consider([diagnosis], AUTO)
    wait_for("verifying", lambda: _actions(fixes)[-1] == "verifying", 10, every_s=0.05)
    knobs = client.knobs()
    assert knobs["tenant_quotas"] == {"batch": 96} and knobs["tenant_salts"] == {"batch": "shared"}
    assert _settled(fixes) == "rolled_back"  # worse: rolled back
    knobs = client.knobs()
    assert knobs["tenant_quotas"] == {} and knobs["tenant_salts"] == {"batch": "shared"}


def test_tenant_names_with_a_slash_or_a_space_reach_the_engine_whole(tmp_path: Path, client: EngineClient):
    tenant = "team/a b"  # quoted by the client into one path segment, decoded by the engine
    fixes = _manager(tmp_path, client, VerdictKind.NO_EFFECT)
    quota = Fix(kind=FixKind.ADMIN, action="set_tenant_quota", params={"tenant": tenant, "quota_blocks": 96},
                description="cap")
    diagnosis = Diagnosis(rule="tenant_pollution", engine="default", subject=tenant, severity=Severity.WARNING,
                          title="t", summary="s", evidence={"victim_evictions_suffered_per_s": 5.0},
                          fix=quota.model_copy(update={"objectives": HIT_RATE}))
    fixes.verify_after_s = 1.0
    fixes.consider([diagnosis], AUTO)
    wait_for("verifying", lambda: _actions(fixes)[-1] == "verifying", 10, every_s=0.05)
    assert client.knobs()["tenant_quotas"] == {tenant: 96}
    assert _settled(fixes) == "rolled_back"
    assert client.knobs()["tenant_quotas"] == {}


def test_bad_params_fail_in_the_job_before_anything_is_sent(tmp_path: Path, client: EngineClient):
    fixes = _manager(tmp_path, client)
    unknown = Fix(kind=FixKind.ADMIN, action="set_everything", params={}, description="?")
    with pytest.raises(FixError, match="unknown admin action 'set_everything'"):
        fixes.apply(_diagnosis(0.2, unknown))
    bad = Fix(kind=FixKind.ADMIN, action="set_normalization", params={"mode": "loud"}, description="?")
    fixes.apply(_diagnosis(0.2, bad))
    wait_for("the job's end", lambda: len(fixes.audit.entries) == 4, 10, every_s=0.05)
    assert "mode" in fixes.audit.entries[-1].message
    assert client.knobs()["normalize_prompts"] == "off"
    assert _actions(fixes) == ["failed", "queued", "applying", "failed"]


def test_fixes_kvops_cannot_apply_are_refused_with_the_reason(tmp_path: Path, client: EngineClient):
    fixes = _manager(tmp_path, client)
    restart = Fix(kind=FixKind.RESTART, action="restart_engine", params={"block_size": 32}, description="bs 32")
    with pytest.raises(FixError, match="kvops does not manage this engine"):
        fixes.apply(_diagnosis(0.2, restart, rule="block_size_mismatch"))
    assert fixes.audit.entries[-1].action == "failed"
    anonymous = EngineClient(client.url, None)
    anonymous._http = client._http
    fixes.targets = lambda engine: Target(anonymous, None, EngineHistory("default"))
    with pytest.raises(FixError, match="needs the engine's admin token"):
        fixes.apply(_diagnosis(0.2, NORMALIZE))
    report = Fix(kind=FixKind.REPORT, action="advice", description="read the runbook")
    with pytest.raises(FixError, match="proposes no fix kvops can apply"):
        fixes.apply(_diagnosis(0.2, report, rule="host_bound"))


def test_audit_log_survives_a_restart(tmp_path: Path, client: EngineClient):
    fixes = _manager(tmp_path, client)
    fixes.consider([_diagnosis(0.2, NORMALIZE)], lambda rule: "suggest")
    reloaded = AuditLog(tmp_path / "audit.jsonl")
    assert [e.action for e in reloaded.entries] == ["proposed"]
    assert reloaded.record(engine="default", rule="x", action="proposed").id == 2


def test_after_a_rollback_only_a_different_fix_is_tried_after_the_cooldown(tmp_path: Path, client: EngineClient):
    fixes = _manager(tmp_path, client, VerdictKind.NO_EFFECT)
    fixes.consider([_diagnosis(0.2, NORMALIZE)], AUTO)
    assert _settled(fixes) == "rolled_back"
    for _ in range(3):  # the same change is not retried while the diagnosis lasts
        fixes.consider([_diagnosis(0.2, NORMALIZE)], AUTO)
    assert len(fixes.audit.entries) == 4
    shadow = Fix(kind=FixKind.ADMIN, action="set_normalization", params={"mode": "shadow"}, description="measure")
    fixes.cooldown_until[("prompt_variance", "default", "")] = fixes.clock() + 600  # in the cool-down: not yet
    fixes.consider([_diagnosis(0.2, shadow)], AUTO)
    assert len(fixes.audit.entries) == 4
    fixes.cooldown_until.clear()
    fixes.consider([_diagnosis(0.2, shadow)], AUTO)  # the rule now proposes something else: tried
    assert _actions(fixes)[4] == "queued"
    wait_for("shadow mode", lambda: client.knobs()["normalize_prompts"] == "shadow", 10, every_s=0.05)
