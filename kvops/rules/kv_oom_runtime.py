"""OOM risk at run time: the blocks an allocation can take are running out.

Reclaimable blocks (free + cached + pending-free: cached ones are evictable) are fitted with a
least-squares line over the window; when the line reaches zero soon, the engine is about to
preempt. Preemptions already rising (the second half of the window at least as busy as the
first, above a floor) say the same thing after the fact, including when the pool sits exhausted
and the trend is flat. So does a pool exhausted through the whole window while requests wait: they
queue for KV blocks (KV-bound queueing; the queueing rule owns queues with KV room to spare).
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.rules.common import (
    WindowRuleSettings,
    capacity_fix,
    covered_window,
    diagnosis,
    earlier_and_recent,
    fresh_latest,
    halves_duration,
    ratio,
    reclaimable_blocks,
    run_span,
    with_objectives,
)
from kvops.schema.diagnosis import Diagnosis, Objective, Severity
from kvops.schema.snapshot import Snapshot

RULE_ID = "kv_oom_runtime"
TITLE = "OOM risk at run time: free KV blocks trending to zero"
DESCRIPTION = "reclaimable blocks run out within minutes at the current trend, or preemptions are rising"


class Settings(WindowRuleSettings):
    window_s: float = Field(60.0, gt=0, description="the trend and the preemption rate are read over this window")
    min_samples: int = Field(5, ge=3, description="snapshots needed in the window (covering half of it)")
    warning_s: float = Field(120.0, gt=0, description="warning when reclaimable blocks run out within this time")
    critical_s: float = Field(30.0, gt=0, description="critical when they run out within this time")
    min_preemptions_per_s: float = Field(
        0.1, ge=0, description="fire when preemptions in the second half of the window reach this rate and are not "
                               "falling")
    exhausted_fraction: float = Field(
        0.02, ge=0, lt=1, description="reclaimable share of the pool at or below which the pool counts as exhausted "
                                      "(time to exhaustion 0) while preemptions happen")
    target_usage: float = Field(0.9, gt=0, le=1, description="the fix sizes the pool for this usage at max_num_seqs")
    verify_min_change: float = Field(0.25, ge=0, description="relative fall of the preemption rate that counts")


def _preemptions(snap: Snapshot) -> float:
    return snap.requests.preemptions_total


def _reclaimable(snap: Snapshot) -> float:
    return reclaimable_blocks(snap)


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None or latest.engine.num_blocks <= 0:
        return []
    span = run_span(latest, settings.window_s)
    snaps = covered_window(history, span, settings)
    if not snaps:
        return []
    slope = history.trend(_reclaimable, span)
    halves = earlier_and_recent(history, _preemptions, span)
    durations = halves_duration(history, span)
    if slope is None or halves is None or durations is None:
        return []
    earlier_rate = ratio(halves[0], durations[0])
    recent_rate = ratio(halves[1], durations[1])
    window_rate = history.rate(_preemptions, span) or 0.0

    num_blocks = latest.engine.num_blocks
    available = reclaimable_blocks(latest)
    preempting = (recent_rate or 0.0) > 0 or window_rate > 0
    kv_bound = all(reclaimable_blocks(s) / num_blocks <= settings.exhausted_fraction and s.requests.waiting > 0
                   for s in snaps)
    exhausted = available / num_blocks <= settings.exhausted_fraction and (preempting or kv_bound)
    time_to_exhaustion = 0.0 if exhausted else (available / -slope if slope < 0 else None)
    preemptions_rising = (recent_rate is not None and recent_rate >= settings.min_preemptions_per_s
                          and recent_rate >= (earlier_rate or 0.0))
    running_out = time_to_exhaustion is not None and time_to_exhaustion <= settings.warning_s
    if not running_out and not preemptions_rising:
        return []
    # A full pool that queues requests without preempting works, slowly: a warning. Preemptions are critical.
    critical = (time_to_exhaustion is not None and time_to_exhaustion <= settings.critical_s
                and (preempting or not kv_bound))

    fix, fix_numbers = capacity_fix(latest, snaps, settings.target_usage, "the KV pool runs dry")

    if kv_bound and not preempting:
        headline = (f"the pool is full ({available} of {num_blocks} blocks reclaimable) and {latest.requests.waiting} "
                    f"request(s) wait for KV blocks: KV-bound queueing")
    elif time_to_exhaustion is not None:
        headline = f"reclaimable blocks run out in {time_to_exhaustion:.0f} s ({available} of {num_blocks} left, " \
                   f"{slope:+.2f}/s)"
    else:
        headline = f"{available} of {num_blocks} blocks reclaimable"
    # Preemptions are what a smaller concurrency or a larger pool must bring down; without any yet, the
    # pool's peak usage must: sized for target_usage, it falls from ~1 to about that, so half of that fall
    # counts (a relative 25% would ask a full pool to drop to 75%).
    objective = (Objective(measure="preemptions_per_s", better="lower", min_effect=settings.verify_min_change)
                 if window_rate > 0 else
                 Objective(measure="kv_usage_max", better="lower",
                           min_effect=round((1 - settings.target_usage) / 2, 4)))
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.CRITICAL if critical else Severity.WARNING,
        f"{headline}; preemptions {window_rate:.2f}/s over {span:.0f} s",
        {
            "num_blocks": num_blocks,
            "reclaimable_blocks": available,
            "free_blocks": latest.blocks.counts.get("free", 0),
            "cached_blocks": latest.blocks.counts.get("cached", 0),
            "reclaimable_fraction": round(available / num_blocks, 4),
            "reclaimable_trend_per_s": round(slope, 4),
            "time_to_exhaustion_s": None if time_to_exhaustion is None else round(time_to_exhaustion, 1),
            "preemptions_per_s": round(window_rate, 4),
            "preemptions_per_s_earlier": None if earlier_rate is None else round(earlier_rate, 4),
            "preemptions_per_s_recent": None if recent_rate is None else round(recent_rate, 4),
            "running": latest.requests.running,
            "waiting": latest.requests.waiting,
            "kv_bound_queueing": kv_bound,
            "max_num_seqs": latest.engine.max_num_seqs,
            "window_s": round(span, 1),
            **fix_numbers,
        },
        fix=with_objectives(fix, objective),
    )]
