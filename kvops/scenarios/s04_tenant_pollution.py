"""Scenario 4: a flooding tenant (long unique prompts, the audit-log incident) evicts the cached
prefixes two other tenants reuse. Tenant pollution names the polluter and its victims, kvops caps
the polluter with a quota, and the victims' hit rate comes back to at least 90% of its baseline."""

from __future__ import annotations

import time

from kvops.loadgen import Lengths, LoadSpec, Stream, start_load
from kvops.scenarios.runner import ScenarioContext, ScenarioResult, tenant_hit_rate

NAME = "tenant_pollution"
TITLE = "A flooding tenant: named, capped by a quota, the victims' hit rate recovers"
VICTIMS = ("team-a", "team-b")
BASELINE_S = 25.0


def _load() -> LoadSpec:
    def victim(name: str) -> Stream:
        return Stream(tenant=name, rate=0.5, arrival="poisson", shared_prefix_tokens=192, prefix_key=name,
                      prompt=Lengths(dist="fixed", value=16), output=Lengths(dist="fixed", value=8))
    flood = Stream(tenant="audit-log", rate=1.5, arrival="fixed", unique=True, start_s=BASELINE_S,
                   prompt=Lengths(dist="fixed", value=400), output=Lengths(dist="fixed", value=4))
    return LoadSpec(seed=4, duration_s=240, streams=[victim(VICTIMS[0]), victim(VICTIMS[1]), flood])


def run() -> ScenarioResult:
    result = ScenarioResult(name=NAME, title=TITLE, metric="victims' prefix-cache hit rate",
                            command="kvops scenario run tenant_pollution")
    args = {"kv_cache_memory": "64MiB", "max_model_len": 512, "max_num_seqs": 8}
    rules = {"tenant_pollution": {"policy": "auto", "settings": {
        "window_s": 15, "min_evictions_caused": 16, "min_victim_evictions": 8, "min_victim_prompt_tokens": 128}}}
    with ScenarioContext(args, rules=rules, supervisor={"verify_after_s": 15}) as ctx:
        load = start_load(ctx.url, _load())
        started = time.time()
        try:
            result.signal_at_s = ctx.wait_signal(
                "the flood evicting another tenant's cached blocks",
                lambda s: s.tenants.get("audit-log") is not None and s.tenants["audit-log"].evictions_caused > 0,
                BASELINE_S + 60)
            baseline = tenant_hit_rate(ctx.history, VICTIMS, started + 5, started + BASELINE_S)
            diagnosis, result.diagnosed_at_s = ctx.wait_diagnosis(NAME, 90)
            result.detection_s = round(result.diagnosed_at_s - result.signal_at_s, 2)
            result.evidence = dict(diagnosis.evidence)
            applied, result.fix_applied_at_s = ctx.wait_audit(NAME, ("verifying", "failed"), 30)
            verdict, result.verified_at_s = ctx.wait_audit(NAME, ("verified", "rolled_back", "failed"), 90)
            result.time_to_verified_fix_s = round(result.verified_at_s - result.signal_at_s, 2)
            fixed_at = time.time()
            time.sleep(25)
            after = tenant_hit_rate(ctx.history, VICTIMS, fixed_at + 5, time.time())
        finally:
            load.stop()
            load.join()
        result.before, result.after = baseline, after
        result.audit = [e.model_dump(mode="json") for e in ctx.audit(NAME)]
        result.check("the polluter is named", diagnosis.subject == "audit-log", diagnosis.subject)
        result.check("the victims are named", all(v in str(diagnosis.evidence) for v in VICTIMS),
                     str(diagnosis.evidence)[:300])
        result.check("a quota was applied to the polluter", applied.action == "verifying" and
                     applied.fix is not None and applied.fix.params.get("tenant") == "audit-log",
                     str(applied.after))
        result.check("the fix was verified", verdict.action == "verified", verdict.message)
        result.check("the victims' hit rate is back to 90% of its baseline",
                     baseline is not None and after is not None and after >= 0.9 * baseline,
                     f"baseline {baseline}, after {after}")
    result.passed = all(c.passed for c in result.checks)
    return result
