"""Swap storm: preemption keeps pushing sequences' K/V to the host pool and back.

The engine's swap window (the last 60 s) gives the swap rate (blocks swapped out per block
allocated) and swap-outs per second. A high rate alone can be a short burst on a tiny engine, so
the rule also wants real volume (swap-outs per second above a floor) and the cost showing in the
latency: the p95 of recent decode-only step durations against the p95 of the decode steps
before them (the baseline), both from the step samples of the current run.
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.rules.common import (
    SnapshotRuleSettings,
    capacity_fix,
    diagnosis,
    fresh_latest,
    percentile,
    recent_steps,
    run_span,
    with_objectives,
)
from kvops.schema.diagnosis import Diagnosis, Objective, Severity

RULE_ID = "swap_storm"
TITLE = "Swap storm: preempted sequences thrash between device and host"
DESCRIPTION = "the swap rate and swap-outs per second are high and decode steps got slower"


class Settings(SnapshotRuleSettings):
    min_swap_rate: float = Field(0.2, gt=0, description="fire at this swap rate (swap-outs per block allocated)")
    critical_swap_rate: float = Field(1.0, gt=0, description="critical at this swap rate: every allocation "
                                                             "displaces another sequence's K/V")
    min_swap_out_per_s: float = Field(1.0, ge=0, description="... with at least this many blocks swapped out per "
                                                             "second")
    min_allocations: int = Field(20, ge=1, description="block allocations in the swap window for its rate to count")
    require_latency_jump: bool = Field(True, description="fire only when decode steps also got slower")
    recent_s: float = Field(60.0, gt=0, description="decode steps this recent are compared ...")
    baseline_s: float = Field(600.0, gt=0, description="... against the decode steps before them, up to this old")
    min_latency_increase: float = Field(0.25, ge=0, description="recent p95 over baseline p95, minus 1, that counts as "
                                                                "a jump")
    min_steps: int = Field(20, ge=2, description="decode steps needed in each of the two periods")
    target_usage: float = Field(0.9, gt=0, le=1, description="the fix sizes the pool for this usage at max_num_seqs")
    verify_min_change: float = Field(0.25, ge=0, description="relative fall of swap-outs per second that counts")


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None:
        return []
    window = latest.swap.window
    if (window.allocations < settings.min_allocations or window.swap_rate < settings.min_swap_rate
            or window.swap_out_per_s < settings.min_swap_out_per_s):
        return []

    span = run_span(latest, settings.baseline_s)
    steps = [s for s in recent_steps(history.window(span), latest.time - span) if s.decode_only]
    split = latest.time - settings.recent_s
    recent = [s.duration_s for s in steps if s.t >= split]
    baseline = [s.duration_s for s in steps if s.t < split]
    recent_p95 = percentile(recent, 95) if len(recent) >= settings.min_steps else None
    baseline_p95 = percentile(baseline, 95) if len(baseline) >= settings.min_steps else None
    increase = recent_p95 / baseline_p95 - 1 if recent_p95 is not None and baseline_p95 else None
    if settings.require_latency_jump and (increase is None or increase < settings.min_latency_increase):
        return []  # no baseline is no evidence of a jump: never guess

    fix, fix_numbers = capacity_fix(latest, history.window(run_span(latest, settings.recent_s)),
                                    settings.target_usage, "sequences swap each other out")
    latency = f"; decode p95 {baseline_p95 * 1000:.1f} -> {recent_p95 * 1000:.1f} ms" \
        if recent_p95 is not None and baseline_p95 is not None else ""
    return [diagnosis(
        history, RULE_ID, TITLE,
        Severity.CRITICAL if window.swap_rate >= settings.critical_swap_rate else Severity.WARNING,
        f"swap rate {window.swap_rate:.2f} ({window.swap_out_per_s:.1f} blocks/s out, "
        f"{window.swap_in_per_s:.1f}/s in over {window.window_s:.0f} s){latency}",
        {
            "swap_rate": round(window.swap_rate, 4),
            "swap_out_per_s": round(window.swap_out_per_s, 4),
            "swap_in_per_s": round(window.swap_in_per_s, 4),
            "allocations": window.allocations,
            "swapped_blocks": latest.swap.swapped_blocks,
            "swapped_seqs": latest.swap.swapped_seqs,
            "host_blocks": latest.swap.host_blocks,
            "swap_fallbacks_total": latest.swap.swap_fallbacks_total,
            "decode_p95_ms_recent": None if recent_p95 is None else round(recent_p95 * 1000, 3),
            "decode_p95_ms_baseline": None if baseline_p95 is None else round(baseline_p95 * 1000, 3),
            "latency_increase": None if increase is None else round(increase, 4),
            "running": latest.requests.running,
            "max_num_seqs": latest.engine.max_num_seqs,
            **fix_numbers,
        },
        # Fewer swap-outs per second; the judge's throughput guard checks that it costs no throughput.
        fix=with_objectives(fix, Objective(measure="swap_out_per_s", better="lower",
                                           min_effect=settings.verify_min_change)),
    )]
