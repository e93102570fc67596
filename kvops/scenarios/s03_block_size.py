"""Scenario 3: a poorly chosen block size. The block-size profile (decode steps timed at candidate
sizes for this model and the recent lengths) shows the configured size measurably slower; kvops
restarts the engine at the measured best size, and inter-token latency falls.

The profile pauses serving, so by default it runs only when the engine is idle. Here the load
never stops (the fix's judge needs traffic on both sides of it), so the scenario asks for the
profile on demand once 50 requests have finished, as an operator would
(`POST /api/engines/{name}/profiles/block-size`)."""

from __future__ import annotations

from kvops.loadgen import Lengths, LoadSpec, Stream, start_load
from kvops.scenarios.runner import ScenarioContext, ScenarioResult

NAME = "block_size"
TITLE = "A poorly chosen block size: measured, retuned by a managed restart, decode latency falls"
CONFIGURED = 1


def _load(seed: int, duration_s: float) -> LoadSpec:
    return LoadSpec(seed=seed, duration_s=duration_s, streams=[Stream(
        tenant="chat", concurrency=6, unique=True, prompt=Lengths(dist="lognormal", median=120, sigma=0.4, max=400),
        output=Lengths(dist="fixed", value=24))])


def run() -> ScenarioResult:
    result = ScenarioResult(name=NAME, title=TITLE, metric="inter-token latency p50 (ms)",
                            command="kvops scenario run block_size")
    args = {"kv_cache_memory": "128MiB", "max_model_len": 1024, "block_size": CONFIGURED, "max_num_seqs": 8}
    rules = {"block_size_mismatch": {"policy": "auto"}}
    supervisor = {"verify_after_s": 15, "block_size_profile": {"schedule": "on_demand"}}
    with ScenarioContext(args, rules=rules, supervisor=supervisor) as ctx:
        before_load = start_load(ctx.url, _load(seed=3, duration_s=240))
        try:
            ctx.wait_until("50 finished requests",
                           lambda: ctx.latest is not None and ctx.latest.requests.finished_total >= 50, 120)
            ctx.sup.profile_block_size(ctx.state.name)
            profile = ctx.wait_until("the block-size profile", lambda: ctx.history.block_size_profile, 120)
            result.signal_at_s = round(ctx.elapsed(), 2)
            diagnosis, result.diagnosed_at_s = ctx.wait_diagnosis(
                "block_size_mismatch", 60, where=lambda d: d.fix is not None and d.fix.kind.value == "restart")
            result.detection_s = round(result.diagnosed_at_s - result.signal_at_s, 2)
            result.evidence = dict(diagnosis.evidence)
        finally:
            before_load.stop()
            before = before_load.join()
        applied, result.fix_applied_at_s = ctx.wait_audit("block_size_mismatch", ("applied", "failed"), 120)
        after = start_load(ctx.url, _load(seed=4, duration_s=30)).join()
        verdict, result.verified_at_s = ctx.wait_audit("block_size_mismatch", ("verified", "rolled_back", "failed"),
                                                       120)
        result.time_to_verified_fix_s = round(result.verified_at_s - result.signal_at_s, 2)
        result.before, result.after = before.total.itl.p50_ms, after.total.itl.p50_ms
        result.audit = [e.model_dump(mode="json") for e in ctx.audit("block_size_mismatch")]
        timings = {t.block_size: round(t.decode_step_ms, 1) for t in profile.candidates}
        result.check("the profile measured the configured size and the candidates", CONFIGURED in timings,
                     str(timings))
        result.check("restarted at the measured best size", applied.action == "applied" and
                     applied.after.get("block_size") not in (None, CONFIGURED), str(applied.after))
        result.check("the fix was verified", verdict.action == "verified", verdict.message)
        result.check("inter-token latency fell", result.after < result.before,
                     f"p50 {result.before:.1f} -> {result.after:.1f} ms")
    result.passed = all(c.passed for c in result.checks)
    return result
