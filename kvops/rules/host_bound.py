"""Host-bound engine: the CPU is saturated while the GPU idles.

Saturation is measured against the cores the engine's host loop can use (`cpu_cores`), not the
machine's: a Python scheduler loop is bound by one core (the GIL) long before the process shows
"all cores busy", so the default is 1 core and `cpu_percent` near 100 is saturated. The snapshot
carries no core count, hence the setting. An engine on the CPU, or without GPU data
(`gpu_status != "ok"`), never fires: there is no accelerator to be starved.
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.rules.common import Evidence, WindowRuleSettings, covered, diagnosis, engine_gpus, fresh_latest, run_span
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity

RULE_ID = "host_bound"
TITLE = "Host-bound engine: the CPU is saturated while the GPU idles"
DESCRIPTION = "process CPU near the usable cores while the engine's GPU utilization is low"


class Settings(WindowRuleSettings):
    window_s: float = Field(120.0, gt=0, description="CPU and GPU utilization are averaged over this window")
    min_samples: int = Field(3, ge=2, description="snapshots with GPU data needed in the window (covering half of it)")
    cpu_cores: float = Field(1.0, gt=0, description="cores the engine's host loop can use (1: a Python loop)")
    cpu_saturation: float = Field(0.9, gt=0, le=1, description="saturated at this share of cpu_cores × 100%")
    max_gpu_utilization_percent: float = Field(50.0, ge=0, le=100, description="the GPU idles below this utilization")
    min_running: float = Field(1.0, ge=0, description="mean running sequences needed: an idle GPU with no work is "
                                                      "not starved")


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None or not engine_gpus(latest):
        return []
    span = run_span(latest, settings.window_s)
    # A GPU whose utilization NVML does not sample (a MIG slice) reads 0: that is not an idle GPU.
    snaps = [s for s in history.window(span) if engine_gpus(s) and all(g.utilization_known for g in engine_gpus(s))]
    if not covered(snaps, settings.window_s, settings.min_samples):
        return []
    cpu = sum(s.process.cpu_percent for s in snaps) / len(snaps)
    gpu_samples = [sum(g.utilization_percent for g in engine_gpus(s)) / len(engine_gpus(s)) for s in snaps]
    gpu = sum(gpu_samples) / len(gpu_samples)
    running = sum(s.requests.running for s in snaps) / len(snaps)
    saturated_at = settings.cpu_saturation * settings.cpu_cores * 100
    if cpu < saturated_at or gpu > settings.max_gpu_utilization_percent or running < settings.min_running:
        return []
    summary = (f"CPU {cpu:.0f}% (saturated at {saturated_at:.0f}%) while the GPU is {gpu:.0f}% busy, "
               f"{running:.1f} sequences running on average over {span:.0f} s")
    evidence: Evidence = {
        "cpu_percent": round(cpu, 1),
        "cpu_saturated_percent": round(saturated_at, 1),
        "cpu_cores": settings.cpu_cores,
        "gpu_utilization_percent": round(gpu, 1),
        "gpus": ",".join(g.name for g in engine_gpus(latest)),
        "running_mean": round(running, 2),
        "num_threads": latest.process.num_threads,
        "device": latest.engine.device,
        "window_s": round(span, 1),
    }
    return [diagnosis(history, RULE_ID, TITLE, Severity.WARNING, summary, evidence, fix=Fix(
        kind=FixKind.REPORT, action="advice",
        description="the GPU waits on the host loop: enable graph capture (CUDA graphs) for decode, or reduce "
                    "per-step host work (scheduling, sampling, detokenization)"))]
