"""Scenario 5 on the real vLLM: whitespace-noisy prompts that are otherwise identical miss vLLM's prefix cache. vLLM
cannot normalize prompts; the `kvops gateway` in front of it can. The gateway measures what normalization would
reuse (its two simulated prefix caches of the prompt text, as sent and normalized), prompt_variance names the tenant,
kvops turns normalization on for it on the gateway, live, and the verdict reads the tenant's hit rate from vLLM's
own cached tokens."""

from __future__ import annotations

import time

from kvops.loadgen import Lengths, LoadSpec, Stream, start_load
from kvops.scenarios.on_vllm import BLOCK_SIZE, VLLM_MODEL, TenantKeys, VllmSession
from kvops.scenarios.runner import ScenarioResult, tenant_hit_rate

NAME = "prompt_variance"
ENGINE = "vllm"
TITLE = "Whitespace-noisy prompts on vLLM: the gateway predicts the gain, its normalization delivers 90% of it"
TENANT = "support"
SESSION = VllmSession  # on the one vLLM of the scenarios named with it (its args and this rule's settings there)


def _load(keys: TenantKeys, seed: int, duration_s: float) -> LoadSpec:
    # Fixed arrivals, as in the kvops engine's scenario: the judge's windows then carry the same traffic. One a
    # second: vLLM-CPU computes prompts at about 130 tokens a second here (one core, fp32), and a noisy prompt is
    # computed whole.
    return LoadSpec(seed=seed, model=VLLM_MODEL, duration_s=duration_s, streams=[Stream(
        tenant=TENANT, api_key_env=keys.env(TENANT), rate=1.0, arrival="fixed", shared_prefix_tokens=3 * BLOCK_SIZE,
        prefix_groups=1, noise=0.8, prompt=Lengths(dist="fixed", value=16), output=Lengths(dist="fixed", value=2))])


def run(session: VllmSession | None = None) -> ScenarioResult:
    if session is None:
        with VllmSession() as own:
            return run(own)
    result = ScenarioResult(name=NAME, title=TITLE, metric="the tenant's prefix-cache hit rate (vLLM's cached tokens)",
                            command="kvops scenario run prompt_variance --engine vllm")
    # The rule decides after about 22 s of this tenant's load (on_vllm.RULES), so the fix's 15 s before-window
    # holds only its requests (~15), whatever ran on this vLLM before.
    ctx, keys = session.begin(verify_after_s=15, min_traffic=10), session.keys
    noisy = start_load(ctx.gateway_url, _load(keys, seed=1, duration_s=120))
    try:
        result.signal_at_s = ctx.wait_signal(
            "normalized prompts sharing more text than the prompts as sent, at the gateway",
            lambda s: s.gateway is not None and TENANT in s.gateway.tenants and (
                s.gateway.tenants[TENANT].normalized_reusable_chars_total
                > s.gateway.tenants[TENANT].reusable_chars_total + 2048), 60)
        diagnosis, result.diagnosed_at_s = ctx.wait_diagnosis(
            NAME, 60, where=lambda d: d.evidence.get("normalization") == "gateway")
        result.detection_s = round(result.diagnosed_at_s - result.signal_at_s, 2)
        result.evidence = dict(diagnosis.evidence)
        applied, result.fix_applied_at_s = ctx.wait_audit(NAME, ("verifying", "failed"), 30)
        # The same traffic goes on through the fix's window (stopping it would abort requests in flight).
        verdict, result.verified_at_s = ctx.wait_audit(NAME, ("verified", "rolled_back", "failed"), 60)
    finally:
        noisy.stop()
        noisy.join()
    measured_from = time.time()
    # 12 requests after the fix (the first stores the normalized prefix, the rest hit it): enough for the hit rate.
    start_load(ctx.gateway_url, _load(keys, seed=2, duration_s=12)).join()
    time.sleep(1.5)  # the last requests' usage into a snapshot
    after = tenant_hit_rate(ctx.history, (TENANT,), measured_from, time.time())
    result.audit = [e.model_dump(mode="json") for e in ctx.audit(NAME)]
    result.time_to_verified_fix_s = round(result.verified_at_s - result.signal_at_s, 2)
    before, predicted = diagnosis.evidence.get("hit_rate"), diagnosis.evidence.get("predicted_hit_rate")
    result.before, result.after = (float(before) if before is not None else None), after
    result.evidence["verdict"] = verdict.message
    result.check("the gateway predicts a much higher hit rate", float(diagnosis.evidence["gap"]) >= 0.15,
                 f"as sent {diagnosis.evidence['reusable_share']}, normalized "
                 f"{diagnosis.evidence['normalized_reusable_share']}")
    result.check("normalization switched on for the tenant on the gateway",
                 applied.action == "verifying" and applied.fix is not None and applied.fix.kind == "gateway"
                 and applied.after == {"tenant": TENANT, "normalize": True}, str(applied.after))
    result.check("the fix was verified as improved", verdict.action == "verified", verdict.message)
    result.check("measured hit rate reaches 90% of the prediction",
                 after is not None and predicted is not None and after >= 0.9 * float(predicted),
                 f"measured {after}, predicted {predicted}")
    result.passed = all(c.passed for c in result.checks)
    return result
