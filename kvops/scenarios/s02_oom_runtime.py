"""Scenario 2: demand grows toward exhaustion (one more long conversation every few seconds).
The run-time OOM risk fires on the free-block trend, before preemptions pile up."""

from __future__ import annotations

from kvops.loadgen import Lengths, LoadSpec, Stream, start_load
from kvops.scenarios.runner import ScenarioContext, ScenarioResult

NAME = "oom_runtime"
TITLE = "Demand growing toward exhaustion: run-time OOM risk fires before preemptions pile up"


def _load() -> LoadSpec:
    # One more closed-loop conversation every 4 s, each generating long answers: KV use ramps up.
    streams = [Stream(tenant="app", concurrency=1, start_s=4.0 * i, unique=True,
                      prompt=Lengths(dist="fixed", value=64), output=Lengths(dist="fixed", value=400))
               for i in range(8)]
    return LoadSpec(seed=2, duration_s=120, streams=streams)


def run() -> ScenarioResult:
    result = ScenarioResult(name=NAME, title=TITLE, metric="preemptions when diagnosed",
                            command="kvops scenario run oom_runtime")
    args = {"kv_cache_memory": "48MiB", "max_model_len": 512, "max_num_seqs": 16}
    rules = {"kv_oom_runtime": {"policy": "suggest", "settings": {"window_s": 6, "min_samples": 5}}}
    with ScenarioContext(args, rules=rules) as ctx:
        load = start_load(ctx.url, _load())
        try:
            result.signal_at_s = ctx.wait_signal("KV usage starting to climb", lambda s: s.blocks.usage > 0.1, 60)
            diagnosis, result.diagnosed_at_s = ctx.wait_diagnosis("kv_oom_runtime", 90)
            at_diagnosis = ctx.latest
            result.detection_s = round(result.diagnosed_at_s - result.signal_at_s, 2)
            result.evidence = dict(diagnosis.evidence)
            first_preemption = ctx.wait_signal("the first preemption", lambda s: s.requests.preemptions_total > 0, 90)
        finally:
            load.stop()
            load.join()
        preempted = at_diagnosis.requests.preemptions_total if at_diagnosis else None
        result.before, result.after = float(preempted or 0), None
        result.audit = [e.model_dump(mode="json") for e in ctx.audit(NAME)]
        result.check("diagnosed with a time to exhaustion",
                     diagnosis.evidence.get("time_to_exhaustion_s") is not None, str(diagnosis.evidence)[:300])
        result.check("diagnosed before preemptions piled up", preempted is not None and preempted <= 2,
                     f"{preempted} preemptions when diagnosed")
        result.check("diagnosed before the first preemption", result.diagnosed_at_s <= first_preemption,
                     f"diagnosed at {result.diagnosed_at_s:.1f} s, first preemption at {first_preemption:.1f} s")
        result.check("a capacity fix is proposed", diagnosis.fix is not None and bool(diagnosis.fix.params),
                     str(diagnosis.fix.params if diagnosis.fix else None))
    result.passed = all(c.passed for c in result.checks)
    return result
