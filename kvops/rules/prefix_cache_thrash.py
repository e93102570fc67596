"""Prefix-cache thrash: blocks evicted and then stored again with the same hash, i.e. work recomputed.

From the engine's KV cache events (`Snapshot.kv_events`, kvops.events): over the window (counter deltas), the
share of stored blocks that were re-stores (`restores_total`: a hash stored again less than the index's
`restore_window_s` after it was removed) and the prompt tokens those re-stores recomputed. A pool too small
for the reuse distance evicts a block after it sat idle for `idle` seconds and the next request needing it
comes `gap` seconds after that, so the pool must hold about `pool × (idle + gap) / idle` blocks for it to
survive (the medians of the window's idle-before-eviction and reuse-gap histograms). The fix restarts with
that KV budget, else with fewer concurrent sequences (common.reuse_capacity_fix), judged by the re-store
share (measure `kv_restore_share`).

This is also "eviction before reuse", one of low_hit_cause's causes: where this rule fires, low_hit_cause's
diagnosis with that cause is dropped (kvops.rules.SUPERSEDED), one problem, one diagnosis.
"""

from __future__ import annotations

import math

from pydantic import Field

from kvops.history import EngineHistory
from kvops.rules.common import (
    Evidence,
    WindowRuleSettings,
    covered_window,
    diagnosis,
    events_delta,
    events_span,
    fresh_latest,
    reuse_capacity_fix,
    rounded,
    usable_events,
    window_histogram,
)
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.snapshot import Snapshot

RULE_ID = "prefix_cache_thrash"
TITLE = "Prefix-cache thrash: evicted blocks are computed and stored again"
DESCRIPTION = "a large share of the blocks stored in the window were re-stores of blocks evicted shortly before"


class Settings(WindowRuleSettings):
    min_stores: int = Field(100, ge=1, description="blocks stored in the window")
    min_restore_share: float = Field(0.2, gt=0, le=1, description="fire when at least this share of the stored "
                                                                  "blocks were re-stores")
    min_histogram_samples: int = Field(10, ge=1, description="removed and re-stored blocks the idle and reuse-gap "
                                                             "histograms need in the window to size the pool")
    headroom: float = Field(1.1, ge=1, description="the proposed pool is the estimated working set times this")
    verify_min_change: float = Field(0.5, ge=0, description="relative fall of the re-store share that counts")


def needed_blocks(pool: int, idle_s: float | None, gap_s: float | None, headroom: float) -> int | None:
    """Blocks the pool must hold for a block reused `idle_s + gap_s` after its last use to survive until then:
    the pool turns over in about `idle_s` (blocks are evicted after sitting idle that long)."""
    if pool <= 0 or idle_s is None or gap_s is None or idle_s <= 0:
        return None
    return math.ceil(pool * (idle_s + gap_s) / idle_s * headroom)


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    events = usable_events(latest) if latest is not None else None
    span = events_span(history, latest, settings) if latest is not None and events is not None else None
    if latest is None or events is None or span is None:
        return []
    stores = events_delta(history, span, lambda e: e.stores_total)
    restores = events_delta(history, span, lambda e: e.restores_total)
    if stores < settings.min_stores or restores / stores < settings.min_restore_share:
        return []
    share = restores / stores
    tokens = events_delta(history, span, lambda e: e.restored_tokens_total)
    snaps = covered_window(history, span, settings)
    idle = window_histogram(snaps, lambda s: s.kv_events.idle_before_evict_s if s.kv_events else None)
    gap = window_histogram(snaps, lambda s: s.kv_events.reuse_gap_s if s.kv_events else None)
    idle_p50 = idle.p50 if idle is not None and idle.count >= settings.min_histogram_samples else None
    gap_p50 = gap.p50 if gap is not None and gap.count >= settings.min_histogram_samples else None
    pool = events.pool_blocks or (latest.engine.num_blocks if latest.knows("engine.num_blocks") else 0)
    needed = needed_blocks(pool, idle_p50, gap_p50, settings.headroom)
    fix, numbers = _fix(latest, snaps, needed, share, settings)
    preemptions = history.delta(lambda s: s.requests.preemptions_total, span) or 0.0
    summary = (f"{restores:.0f} of {stores:.0f} blocks stored in the last {span:.0f} s ({share:.0%}) were "
               f"evicted and stored again: {tokens:.0f} prompt tokens recomputed")
    if idle_p50 is not None and gap_p50 is not None:
        summary += f"; blocks sit idle ~{idle_p50:.1f} s before eviction and come back ~{gap_p50:.1f} s later"
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.WARNING, summary,
        {
            "stores": int(stores),
            "restores": int(restores),
            "restore_share": round(share, 4),
            "restored_tokens": int(tokens),
            "restored_tokens_per_s": round(tokens / span, 2) if span > 0 else None,
            "root_restores": int(events_delta(history, span, lambda e: e.root_restores_total)),
            "removes": int(events_delta(history, span, lambda e: e.removes_total)),
            "idle_before_evict_p50_s": rounded(idle_p50, 3),
            "reuse_gap_p50_s": rounded(gap_p50, 3),
            "restore_window_s": events.restore_window_s,
            "pool_blocks": pool or None,
            "resident_blocks": sum(events.resident.values()),
            "block_size": events.block_size,
            "preemptions": int(preemptions),
            "dropped_batches": int(events_delta(history, span, lambda e: e.stream.dropped_batches_total)),
            **numbers,
            "window_s": round(span, 1),
        },
        fix=fix,
    )]


def _fix(latest: Snapshot, snaps: list[Snapshot], needed: int | None, share: float,
         settings: Settings) -> tuple[Fix, Evidence]:
    """A restart that keeps the working set resident, judged by the re-store share; advice when the numbers do
    not size one (the histograms too thin, or neither the budget nor the concurrency can be sized)."""
    reason = f"{share:.0%} of stored blocks were re-stores of evicted ones"
    fix, numbers = reuse_capacity_fix(latest, snaps, needed, reason) if needed is not None else (None, {})
    if fix is None:
        return Fix(kind=FixKind.REPORT, action="advice",
                   description=f"{reason}: give the engine more KV memory or run fewer sequences at once, so a "
                               f"block survives until the next request that needs it"), numbers
    # kvops.supervisor.fixes.measures' re-stored blocks over stored blocks, from the events.
    objective = Objective(measure="kv_restore_share", better="lower", min_effect=settings.verify_min_change)
    return fix.model_copy(update={"objectives": [objective]}), numbers
