"""Prefix caching off on a shared-prefix workload.

With caching disabled the engine still looks every prompt up in a shadow cache of the same size
(`potential_*` counters): the hit rate caching would have had. Over the window (counter deltas,
only while caching has been off), a high potential hit rate is prefill work thrown away.

vLLM and SGLang have no such shadow cache: with caching off on a server that prefilled at least
`min_queried_tokens` prompt tokens in the window, the rule says so as `info` (what caching would
have saved is not measured), with the server's own flag as the fix.
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.kinds import profile_of
from kvops.rules.common import PrefixCacheRuleSettings, cache_lookups, covered_steady_span, diagnosis, fresh_latest
from kvops.schema.admin import SET_PREFIX_CACHING
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.snapshot import Snapshot

RULE_ID = "prefix_caching_off"
# The hit rate before is 0 (caching off), so the objective's effect is absolute: 5 points of prompt tokens
# served from cache. A relative one from 0 means nothing.
OBJECTIVES = [Objective(measure="hit_rate", better="higher", min_effect=0.05)]
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
    if not latest.knows("prefix_cache.potential_hit_rate"):
        return _unmeasured(history, settings, latest, span)
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
                                                      f"{potential_hit_rate:.0%} hit rate", OBJECTIVES),
    )]


def _unmeasured(history: EngineHistory, settings: Settings, latest: Snapshot, span: float) -> list[Diagnosis]:
    """A server without a shadow cache (vLLM, SGLang): caching is off while it prefills many prompt tokens."""
    prompt_tokens = history.delta(lambda s: s.requests.prompt_tokens_total, span) or 0.0
    if prompt_tokens < settings.min_queried_tokens or not latest.knows("requests.prompt_tokens_total"):
        return []
    summary = (f"prefix caching is off: {prompt_tokens:.0f} prompt tokens prefilled in the last {span:.0f} s, none "
               f"looked up ({latest.source} does not measure what caching would have served)")
    flag = profile_of(latest).flag("enable_prefix_caching")
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.INFO, summary,
        {"enable_prefix_caching": False, "prompt_tokens": int(prompt_tokens), "potential_hit_rate": None,
         "hit_rate": 0.0, "window_s": round(span, 1)},
        fix=Fix(kind=FixKind.RESTART, action="restart_engine", params={"enable_prefix_caching": True},
                description=f"restart with {flag}: shared prompt prefixes are then prefilled once",
                objectives=OBJECTIVES),
    )]
