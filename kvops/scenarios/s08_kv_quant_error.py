"""Scenario 8: a KV dtype that damages a layer. With fp8 at the fixed scale 1.0 (`--kv-cache-scale 1.0`,
what vLLM uses when a checkpoint carries no scales), a layer whose keys are 1000× larger than usual
saturates (the engine's `--debug-scale-k 3:1000` reproduces such a model; kvops's default calibrated
scale would absorb it).
The error profile names the layer, kvops restarts the engine keeping that layer in full
precision, and the next profile is clean."""

from __future__ import annotations

from kvops.scenarios.runner import ScenarioContext, ScenarioResult

NAME = "kv_quant_error"
TITLE = "A KV dtype that damages a layer: the profile names it, the override removes the error"


def run() -> ScenarioResult:
    result = ScenarioResult(name=NAME, title=TITLE, metric="worst layer cosine (KV profile)",
                            command="kvops scenario run kv_quant_error")
    args = {"kv_cache_memory": "64MiB", "max_model_len": 512, "kv_cache_dtype": "fp8", "kv_cache_scale": "1.0",
            "debug_scale_k": "3:1000"}
    # Its effect shows in the KV error profile, not in snapshots: the judge finds no measurable objective
    # (inconclusive), and `inconclusive = "keep"` keeps the fix with a note; the profile after it is the proof.
    with ScenarioContext(args, rules={"kv_quant_error": {"policy": "auto"}},
                         supervisor={"inconclusive": "keep"}) as ctx:
        first = ctx.wait_until("the first KV profile", lambda: ctx.history.kv_profile, 120)
        result.signal_at_s = round(ctx.elapsed(), 2)
        result.before = min(layer.min_cosine for layer in first.layers)
        diagnosis, result.diagnosed_at_s = ctx.wait_diagnosis("kv_quant_error", 60)
        result.detection_s = round(result.diagnosed_at_s - result.signal_at_s, 2)
        result.evidence = dict(diagnosis.evidence)
        applied, result.fix_applied_at_s = ctx.wait_audit("kv_quant_error", ("verifying", "failed"), 120)
        verdict, result.verified_at_s = ctx.wait_audit("kv_quant_error", ("verified", "rolled_back", "failed"), 180)
        result.time_to_verified_fix_s = round(result.verified_at_s - result.signal_at_s, 2)
        after = ctx.wait_until("the profile after the restart", lambda: ctx.history.kv_profile, 120)
        result.after = min(layer.min_cosine for layer in after.layers)
        result.audit = [e.model_dump(mode="json") for e in ctx.audit("kv_quant_error")]
        result.check("the profile flags exactly layer 3", first.flagged == [3], f"flagged {first.flagged}")
        result.check("the diagnosis proposes keeping layer 3 in full precision",
                     diagnosis.fix is not None and diagnosis.fix.params.get("kv_cache_dtype_skip_layers") == [3],
                     str(diagnosis.fix.params if diagnosis.fix else None))
        result.check("the fix was applied by a managed restart", applied.action == "verifying",
                     applied.message or str(applied.after))
        result.check("the fix was kept (inconclusive by snapshots, kept by policy)",
                     verdict.action == "verified" and verdict.verdict is not None
                     and verdict.verdict.kind == "inconclusive", verdict.message)
        result.check("the profile after the fix is clean", after.flagged == [] and result.after > 0.99,
                     f"flagged {after.flagged}, worst {result.after:.4f}")
    result.passed = all(c.passed for c in result.checks)
    return result
