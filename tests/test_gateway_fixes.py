"""Fixes through a `kvops gateway`: the gateway's shadow prefix caches of the prompt text, the rules that propose a
tenant's policy change on the gateway (tenant_pollution, prompt_variance behind a gateway in front of a vLLM), the
measures that judge them, and a fix job changing a real gateway's policy live and undoing it.

The rules' inputs are synthetic snapshots (as in test_rules_kv_events); the gateway is the real app on a loopback
port, in front of the recording upstream of gateway_servers (a stand-in for vLLM's request parsing, which the real
vLLM tests replace: test_vllm_scenarios)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvops.adapters.engine_client import EngineUnreachable
from kvops.gateway.shadow import CHUNK_CHARS, ShadowReuse, prompt_texts
from kvops.history import EngineHistory
from kvops.loadgen.prompts import add_noise
from kvops.schema.diagnosis import Diagnosis, FixKind, Objective, Severity
from kvops.schema.gateway import gateway_fix
from kvops.schema.verdict import Verdict, VerdictKind
from kvops.supervisor.fixes.audit import AuditLog
from kvops.supervisor.fixes.gateway import GatewayAdmin
from kvops.supervisor.fixes.jobs import Target
from kvops.supervisor.fixes.manager import FixManager
from kvops.supervisor.fixes.measures import measure
from tests.helpers.gateway_servers import ADMIN_TOKEN, Recorder, auth, gateway_in_front_of, serving
from tests.helpers.synthetic import snapshot
from tests.helpers.waiting import wait_for
from tests.test_rules_kv_events import events, fired, history, vllm

SHARED = "You are a support assistant for ACME. Answer briefly and politely, and cite the manual. " * 6

# ------------------------------------------------------------------ the shadow caches


def test_whitespace_noise_is_reused_only_by_the_normalized_cache():
    shadow, rng = ShadowReuse(), random.Random(3)
    clean = [shadow.observe("tenant:a", prompt_texts({"prompt": SHARED + f"question {i}"})) for i in range(5)]
    assert clean[0].reused == 0 and all(r.reused == r.normalized_reused > 300 for r in clean[1:])
    noisy = [shadow.observe("tenant:a", prompt_texts({"prompt": add_noise(SHARED, rng) + f"q {i}"}))
             for i in range(20)]
    as_sent = sum(r.reused for r in noisy) / sum(r.chars for r in noisy)
    normalized = sum(r.normalized_reused for r in noisy) / sum(r.chars for r in noisy)
    assert as_sent < 0.1 and normalized > 0.8, (as_sent, normalized)


def test_salts_keep_the_shadow_caches_apart_and_chats_are_read_by_message():
    shadow = ShadowReuse()
    shadow.observe("tenant:a", prompt_texts({"prompt": SHARED}))
    assert shadow.observe("tenant:b", prompt_texts({"prompt": SHARED})).reused == 0
    whole_chunks = len(SHARED) // CHUNK_CHARS * CHUNK_CHARS
    assert shadow.observe("tenant:a", prompt_texts({"prompt": SHARED})).reused == whole_chunks
    chat = {"messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": "hi   there"}]}
    [text] = prompt_texts(chat)
    assert text.sent.startswith("system\n") and "hi   there" in text.sent and "hi there" in text.normalized
    assert prompt_texts({"prompt": [1, 2, 3]}) == [] and prompt_texts({"messages": "x"}) == []


def test_a_bounded_shadow_cache_forgets_the_oldest_prefixes():
    shadow = ShadowReuse(capacity=8)
    shadow.observe(None, prompt_texts({"prompt": SHARED}))
    for i in range(4):
        shadow.observe(None, prompt_texts({"prompt": f"{i} " * 400}))
    assert shadow.observe(None, prompt_texts({"prompt": SHARED})).reused == 0


# ------------------------------------------------------------------ the rules behind a gateway


def gateway_view(tenants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"url": "http://127.0.0.1:9500", "tenants": tenants}


def pollution_scene(limit: int | None = None, cache: str = "isolated", charged: int = 600):
    """A vLLM whose KV events show salt tenant:batch evicting tenant:chat, behind a gateway that charged batch
    `charged` estimated tokens a poll (every 25 s: 600 is 1440 a minute)."""
    salts = {"tenant:batch": {"stores_total": 30, "evicted_others_total": 10, "removed_total": 1},
             "tenant:chat": {"stores_total": 10, "removed_total": 12}}

    def scene(i: int, t: float) -> dict[str, Any]:
        return {**vllm(i, hits=1500, kv=events(i, tenants=salts)), "gateway": gateway_view({
            "batch": {"cache": cache, "estimated_tokens_total": charged * i, "tokens_per_minute": limit},
            "chat": {"estimated_tokens_total": 100 * i}})}

    return scene


def test_a_polluting_gateway_tenant_gets_a_token_rate_limit_judged_on_the_others_hits_and_its_evictions():
    [d] = fired(history(pollution_scene()), "tenant_pollution")
    fix = d.fix
    assert d.subject == "tenant:batch" and fix is not None and fix.kind is FixKind.GATEWAY
    assert fix.params == {"tenant": "batch", "tokens_per_minute": 600}  # 1440 a minute, a quarter: 360, floor 600
    assert d.evidence["gateway_tokens_per_minute"] == pytest.approx(1440, rel=0.01)
    assert [(o.measure, o.better, o.subject) for o in fix.objectives] == [
        ("victims_hit_rate", "higher", "batch"), ("events_evictions_caused_per_s", "lower", "tenant:batch")]


def test_a_limit_that_did_not_stop_it_is_tightened_and_a_group_or_a_floor_gives_advice():
    # 60000 a poll is 144000 a minute: a quarter, 36000, is below a limit of 40000, but not below one of 20000,
    # which did not stop it: halved.
    [d] = fired(history(pollution_scene(limit=40000, charged=60000)), "tenant_pollution")
    assert d.fix is not None and d.fix.params["tokens_per_minute"] == 36000
    [d] = fired(history(pollution_scene(limit=20000, charged=60000)), "tenant_pollution")
    assert d.fix is not None and d.fix.params["tokens_per_minute"] == 10000
    [floor] = fired(history(pollution_scene(limit=600)), "tenant_pollution")
    assert floor.fix is not None and floor.fix.kind is FixKind.REPORT  # nothing tighter is left above the floor
    [group] = fired(history(pollution_scene(cache="group:ops")), "tenant_pollution")
    assert group.fix is not None and group.fix.kind is FixKind.REPORT  # tenant:batch is no longer its salt


def variance_scene(normalize: bool = False, gain: float = 0.6, cached: int = 200):
    def scene(i: int, t: float) -> dict[str, Any]:
        snap = vllm(i, hits=300)
        return {**snap, "unknown": [f for f in snap["unknown"] if f != "tenants"],
                "tenants": {"support": {"prompt_tokens_total": 1000 * i, "hit_tokens_total": cached * i}},
                "gateway": gateway_view({"support": {
                    "normalize": normalize, "prompt_chars_total": 4000 * i, "reusable_chars_total": 800 * i,
                    "normalized_reusable_chars_total": int((0.2 + gain) * 4000) * i}})}

    return scene


def test_prompt_variance_behind_a_gateway_turns_normalization_on_for_the_tenant():
    [d] = fired(history(variance_scene()), "prompt_variance")
    ev = d.evidence
    assert d.severity is Severity.WARNING and d.subject == "support" and ev["normalization"] == "gateway"
    assert ev["reusable_share"] == pytest.approx(0.2) and ev["normalized_reusable_share"] == pytest.approx(0.8)
    assert ev["hit_rate"] == pytest.approx(0.2) and ev["predicted_hit_rate"] == pytest.approx(0.8)
    assert d.fix is not None and d.fix.kind is FixKind.GATEWAY
    assert d.fix.params == {"tenant": "support", "normalize": True}
    assert [(o.measure, o.subject) for o in d.fix.objectives] == [("tenant_hit_rate", "support")]


def test_no_gateway_normalization_fix_when_it_is_on_or_would_gain_little():
    assert not [d for d in fired(history(variance_scene(normalize=True)), "prompt_variance")
                if d.evidence.get("normalization") == "gateway"]
    assert not [d for d in fired(history(variance_scene(gain=0.05)), "prompt_variance")
                if d.evidence.get("normalization") == "gateway"]
    # An engine that reports no cached tokens: judged on its own hit rate instead.
    [d] = fired(history(variance_scene(cached=0)), "prompt_variance")
    assert d.evidence["hit_rate"] is None and [o.measure for o in d.fix.objectives] == ["hit_rate"]


# ------------------------------------------------------------------ the measures that judge them


def test_the_tenant_hit_rate_and_the_events_evictions_measures():
    snaps = [snapshot(100.0 + 10 * i, tenants={
        "a": {"prompt_tokens_total": 100 * i, "hit_tokens_total": 60 * i},
        "b": {"prompt_tokens_total": 100 * i, "hit_tokens_total": 10 * i}},
        kv_events=events(i, tenants={"tenant:a": {"evicted_others_total": 3}})) for i in range(1, 6)]
    assert measure("tenant_hit_rate", snaps, "a").value == pytest.approx(0.6)
    assert measure("tenant_hit_rate", snaps, "b").value == pytest.approx(0.1)
    assert measure("events_evictions_caused_per_s", snaps, "tenant:a").value == pytest.approx(0.3)
    assert measure("events_evictions_caused_per_s", snaps, "tenant:b").value == pytest.approx(0.0)
    assert measure("events_evictions_caused_per_s", [snapshot(1.0), snapshot(2.0)], "tenant:a").value is None


# ------------------------------------------------------------------ a fix job on a real gateway


def _diagnosis(change: dict[str, Any]) -> Diagnosis:
    fix = gateway_fix("team-a", change, "limit team-a", [Objective(measure="hit_rate", better="higher")])
    return Diagnosis(rule="tenant_pollution", engine="default", subject="tenant:team-a", severity=Severity.WARNING,
                     title="t", summary="s", evidence={"x": 1}, fix=fix)


def _ended(fixes: FixManager, job_id: int) -> Any:
    return next((e for e in fixes.audit.entries if e.id > job_id
                 and e.action in ("verified", "rolled_back", "failed", "reverted")), None)


def _limit(url: str) -> int | None:
    listed = httpx.get(f"{url}/admin/tenants", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
    return listed["tenants"]["team-a"]["tokens_per_minute"]


@pytest.mark.parametrize("verdict", [VerdictKind.IMPROVED, VerdictKind.NO_EFFECT])
def test_a_gateway_fix_changes_the_tenants_policy_live_and_is_undone_unless_it_helped(
        tmp_path: Path, verdict: VerdictKind):
    """The verdict is given (the judge has its own tests): what is checked is the change on the gateway, its audit,
    the 429 it makes, and the undo."""
    recorder = Recorder()
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path) as (url, _):
        admin = GatewayAdmin(url, ADMIN_TOKEN)
        fixes = FixManager(AuditLog(tmp_path / "audit.jsonl"),
                           lambda e: Target(None, None, EngineHistory("default"), admin),  # type: ignore[arg-type]
                           verify_after_s=1.0, state_path=tmp_path / "fix_jobs.json", cooldown_s=0,
                           judge=lambda *a: Verdict(kind=verdict, message="given"))
        fixes.start()
        queued = fixes.apply(_diagnosis({"tokens_per_minute": 1}))
        wait_for("the change", lambda: _limit(url) == 1, 10, every_s=0.05)
        body = {"model": "m", "prompt": "x" * 400, "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth("team-a")).status_code == 200
        limited = httpx.post(f"{url}/v1/completions", json=body, headers=auth("team-a"))
        assert limited.status_code == 429 and "Retry-After" in limited.headers
        ended = wait_for("the verdict", lambda: _ended(fixes, queued.id), 15, every_s=0.1)
        verifying = next(e for e in fixes.audit.entries if e.action == "verifying")
        assert verifying.before == {"tenant": "team-a", "tokens_per_minute": None}
        assert verifying.after == {"tenant": "team-a", "tokens_per_minute": 1}
        if verdict is VerdictKind.IMPROVED:
            assert ended.action == "verified" and _limit(url) == 1
        else:
            assert ended.action == "rolled_back" and _limit(url) is None
        fixes.stop()


def test_a_gateway_fix_without_a_gateway_or_its_token_is_refused_with_the_way_to_give_it(tmp_path: Path):
    history = EngineHistory("default")
    for admin, expected in ((None, "put `kvops gateway` in front of it"), (GatewayAdmin("http://127.0.0.1:9", None),
                                                                            "admin_token_env")):
        fixes = FixManager(AuditLog(tmp_path / f"audit-{expected[:3]}.jsonl"),
                           lambda e, a=admin: Target(None, None, history, a),  # type: ignore[arg-type]
                           verify_after_s=1.0)
        with pytest.raises(Exception, match="gateway") as info:
            fixes.apply(_diagnosis({"normalize": True}))
        assert expected in str(info.value)


def test_a_gateway_that_does_not_answer_fails_the_fix_and_names_it(tmp_path: Path):
    admin = GatewayAdmin("http://127.0.0.1:9", "token", timeout_s=0.5)  # nothing listens there
    with pytest.raises(EngineUnreachable, match=r"127\.0\.0\.1:9/admin/tenants"):
        admin.policy("team-a")
    fixes = FixManager(AuditLog(tmp_path / "audit.jsonl"),
                       lambda e: Target(None, None, EngineHistory("default"), admin),  # type: ignore[arg-type]
                       verify_after_s=1.0, state_path=tmp_path / "fix_jobs.json")
    fixes.start()
    queued = fixes.apply(_diagnosis({"normalize": True}))
    ended = wait_for("the failure", lambda: _ended(fixes, queued.id), 10, every_s=0.1)
    assert ended.action == "failed" and "the change was not made" in ended.message
    fixes.stop()
