"""Prefix caching off on a shared-prefix workload.

With caching disabled the engine still looks every prompt up in a shadow cache of the same size
(`potential_*` counters): the hit rate caching would have had. Over the window (counter deltas,
only while caching has been off), a high potential hit rate is prefill work thrown away.
"""

from __future__ import annotations

from pydantic import Field

from kvops.rules.common import PrefixCacheRuleSettings, cache_lookups, covered_steady_span, diagnosis, fresh_latest
from kvops.schema.admin import SET_PREFIX_CACHING
from kvops.schema.diagnosis import Diagnosis, Severity, Verification
from kvops.supervisor.history import EngineHistory

RULE_ID = "prefix_caching_off"
TITLE = "Prefix caching is off on a shared-prefix workload"
DESCRIPTION = "prefix caching is disabled while a shadow cache measures a high hit rate it would have had"


class Settings(PrefixCacheRuleSettings):
    min_potential_hit_rate: float = Field(0.3, gt=0, le=1, description="fire when caching would have served at least "
                                                                       "this share of prompt tokens")


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None or latest.engine.enable_prefix_caching:
        return []
    span = covered_steady_span(history, latest, settings, lambda s: s.engine.enable_prefix_caching)
    if span is None:
        return []
    potential_queries, potential_hits = cache_lookups(history, span, "potential_")
    if potential_queries < settings.min_queried_tokens:
        return []
    potential_hit_rate = potential_hits / potential_queries
    if potential_hit_rate < settings.min_potential_hit_rate:
        return []
    queries, hits = cache_lookups(history, span)
    hit_rate = hits / queries if queries > 0 else 0.0
    summary = (f"prefix caching is off; it would have served {potential_hit_rate:.0%} of {potential_queries:.0f} "
               f"prompt tokens in the last {span:.0f} s")
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.WARNING, summary,
        {
            "enable_prefix_caching": False,
            "potential_hit_rate": round(potential_hit_rate, 4),
            "potential_queried_tokens": int(potential_queries),
            "potential_hit_tokens": int(potential_hits),
            "potential_hit_rate_total": round(latest.prefix_cache.potential_hit_rate, 4),
            "hit_rate": round(hit_rate, 4),
            "window_s": round(span, 1),
        },
        fix=SET_PREFIX_CACHING.fix({"enabled": True}, f"enable prefix caching: the shadow cache measured a "
                                                      f"{potential_hit_rate:.0%} hit rate"),
        # From 0 any rise counts (the verifier takes the absolute change when the value before is 0).
        verification=Verification(evidence_key="hit_rate", better="higher", min_change=0.0),
    )]
