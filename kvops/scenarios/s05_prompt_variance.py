"""Scenario 5: whitespace-noisy prompts that are otherwise identical. Shadow normalization
predicts the hit rate normalization would give; kvops switches it on, and the measured hit rate
reaches at least 90% of the prediction."""

from __future__ import annotations

from kvops.loadgen import Lengths, LoadSpec, Stream, start_load
from kvops.scenarios.runner import ScenarioContext, ScenarioResult

NAME = "prompt_variance"
TITLE = "Whitespace-noisy prompts: shadow predicts the gain, normalization delivers at least 90% of it"


def _load(seed: int, duration_s: float) -> LoadSpec:
    # Arrivals at a fixed rate: with Poisson ones the 10-15 s windows the judge compares carried ±16% more or
    # fewer requests by chance, which its throughput guard read as the fix slowing the engine (7.6 -> 6.5 tok/s
    # with this seed; the guard broke in one CI run of three).
    return LoadSpec(seed=seed, duration_s=duration_s, streams=[Stream(
        tenant="support", rate=3.0, arrival="fixed", shared_prefix_tokens=96, prefix_groups=1, noise=0.8,
        prompt=Lengths(dist="fixed", value=16), output=Lengths(dist="fixed", value=2))])


def run() -> ScenarioResult:
    result = ScenarioResult(name=NAME, title=TITLE, metric="prefix-cache hit rate",
                            command="kvops scenario run prompt_variance")
    args = {"kv_cache_memory": "128MiB", "max_model_len": 1024, "normalize_prompts": "shadow"}
    # A 30 s window: the rule decides on 15 s or more of traffic, so the fix (applied at once, policy auto) has
    # a before-window with requests in it to be judged against.
    rules = {"prompt_variance": {"policy": "auto",
                                 "settings": {"window_s": 30, "min_queried_tokens": 1000, "min_samples": 3}}}
    with ScenarioContext(args, rules=rules) as ctx:
        noisy = start_load(ctx.url, _load(seed=1, duration_s=90))
        result.signal_at_s = ctx.wait_signal(
            "shadow normalization predicting more hits than the cache gets",
            lambda s: s.prefix_cache.shadow_hits_total > s.prefix_cache.hits_total + 320, 60)
        diagnosis, result.diagnosed_at_s = ctx.wait_diagnosis("prompt_variance", 60,
                                                              where=lambda d: d.severity.value == "warning")
        result.detection_s = round(result.diagnosed_at_s - result.signal_at_s, 2)
        result.evidence = dict(diagnosis.evidence)
        predicted = float(diagnosis.evidence["shadow_hit_rate"])
        applied, result.fix_applied_at_s = ctx.wait_audit(NAME, ("verifying", "failed"), 30)
        # The same traffic goes on through the fix's window: stopping it now would abort requests in flight,
        # which the judge's error guard rightly counts against the fix.
        verdict, result.verified_at_s = ctx.wait_audit(NAME, ("verified", "rolled_back", "failed"), 60)
        noisy.stop()
        noisy.join()
        # 10 s of fresh load is 30 requests: each either finds the normalized prefix or not, and the first stores it.
        after = start_load(ctx.url, _load(seed=2, duration_s=10)).join()
        result.time_to_verified_fix_s = round(result.verified_at_s - result.signal_at_s, 2)
        result.before = float(diagnosis.evidence["hit_rate"])
        result.after = after.tenants["support"].hit_rate
        result.audit = [e.model_dump(mode="json") for e in ctx.audit(NAME)]
        result.check("shadow predicts a much higher hit rate", predicted - result.before >= 0.15,
                     f"real {result.before:.2f}, predicted {predicted:.2f}")
        result.check("normalization switched on automatically", applied.action == "verifying" and
                     applied.after == {"normalize_prompts": "on"}, str(applied.after))
        result.check("the fix was verified", verdict.action == "verified", verdict.message)
        result.check("measured hit rate reaches 90% of the prediction", result.after >= 0.9 * predicted,
                     f"measured {result.after:.3f}, predicted {predicted:.3f}")
    result.passed = all(c.passed for c in result.checks)
    return result
