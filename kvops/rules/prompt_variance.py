"""Low hit rate from prompt variance: prompts that differ only in whitespace or control characters
miss the prefix cache.

In `shadow` normalization mode the engine looks every prompt up a second time, normalized, in a
shadow cache and counts what would have hit. Over the window (counter deltas, the current mode
only), a shadow hit rate far above the real one is the measured gain of turning normalization on.

With normalization `off` there is nothing to compare; when the hit rate is low on many prompts the
rule may propose `shadow` mode as a measurement (an `info` diagnosis, setting `suggest_shadow`). A vLLM
or SGLang server has no normalization and no shadow cache: there the same low hit rate is an `info`
diagnosis whose advice is to make shared prefixes byte-identical, down to a near-zero hit rate: that
one no_prefix_hits reports (its causes are rarely prompt variance alone; one problem, one diagnosis).
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.kinds import Capability, profile_of
from kvops.rules.common import PrefixCacheRuleSettings, cache_lookups, covered_steady_span, diagnosis, fresh_latest
from kvops.rules.no_prefix_hits import NEAR_ZERO_HIT_RATE
from kvops.schema.admin import SET_NORMALIZATION
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.snapshot import Snapshot

RULE_ID = "prompt_variance"
TITLE = "Low hit rate from prompt variance: normalized prompts would hit the cache"
DESCRIPTION = "with normalization in shadow mode, the normalized hit rate is far above the real one"


class Settings(PrefixCacheRuleSettings):
    min_gap: float = Field(0.15, gt=0, le=1, description="fire when the shadow hit rate exceeds the real one by this "
                                                         "much (absolute)")
    verify_min_change: float = Field(0.1, ge=0, description="relative rise of the hit rate that counts")
    suggest_shadow: bool = Field(True, description="with normalization off, propose shadow mode (info) when the hit "
                                                   "rate is low on many prompts")
    shadow_probe_max_hit_rate: float = Field(0.2, ge=0, le=1, description="... 'low': at most this hit rate")
    shadow_probe_min_requests: int = Field(50, ge=1, description="... 'many': at least this many requests finished "
                                                                 "in the window")


EXTERNAL_ADVICE = ("make shared prompt prefixes byte-identical (no timestamps, request ids or stray whitespace "
                   "before the shared part); kvops's prompt normalization needs a kvops engine")


def _normalization(snap: Snapshot) -> tuple[str, bool]:
    # Switching the mode or prefix caching live changes what the counters mean.
    return snap.prefix_cache.normalization, snap.engine.enable_prefix_caching


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None or not latest.engine.enable_prefix_caching:
        return []  # no real hit rate to compare: prefix_caching_off's case
    mode = latest.prefix_cache.normalization
    span = covered_steady_span(history, latest, settings, _normalization)
    if span is None:
        return []
    queries, hits = cache_lookups(history, span)
    hit_rate = hits / queries if queries > 0 else None

    if mode == "shadow":
        shadow_queries, shadow_hits = cache_lookups(history, span, "shadow_")
        if shadow_queries < settings.min_queried_tokens or hit_rate is None:
            return []
        shadow_hit_rate = shadow_hits / shadow_queries
        gap = shadow_hit_rate - hit_rate
        if gap < settings.min_gap:
            return []
        summary = (f"normalized prompts would hit {shadow_hit_rate:.0%} of {shadow_queries:.0f} prompt tokens, "
                   f"the cache hits {hit_rate:.0%} (+{gap:.0%} with normalization on)")
        return [diagnosis(
            history, RULE_ID, TITLE, Severity.WARNING, summary,
            {
                "normalization": mode,
                "hit_rate": round(hit_rate, 4),
                "shadow_hit_rate": round(shadow_hit_rate, 4),
                "gap": round(gap, 4),
                "queried_tokens": int(queries),
                "shadow_queried_tokens": int(shadow_queries),
                "window_s": round(span, 1),
            },
            fix=SET_NORMALIZATION.fix({"mode": "on"}, f"turn prompt normalization on: the shadow cache measured a "
                                                      f"{shadow_hit_rate:.0%} hit rate against {hit_rate:.0%}",
                                  [Objective(measure="hit_rate", better="higher",
                                             min_effect=settings.verify_min_change)]),
        )]

    if mode != "off" or not settings.suggest_shadow or hit_rate is None:
        return []
    requests = history.delta(lambda s: s.requests.finished_total, span) or 0.0
    if (queries < settings.min_queried_tokens or requests < settings.shadow_probe_min_requests
            or hit_rate > settings.shadow_probe_max_hit_rate):
        return []
    normalizes = profile_of(latest).can(Capability.LIVE_NORMALIZATION)
    if not normalizes and hit_rate <= NEAR_ZERO_HIT_RATE:
        return []  # no normalization to offer: no_prefix_hits reports (almost) no hits with their likely causes
    summary = f"the prefix cache hits {hit_rate:.0%} of {queries:.0f} prompt tokens over {requests:.0f} requests"
    if normalizes:
        summary += ": measure whether normalization would help"
        # Shadow mode changes nothing served; it only measures. No objective: it is not a fix.
        measure = SET_NORMALIZATION.fix({"mode": "shadow"}, "switch prompt normalization to shadow mode to measure "
                                                            "the hit rate it would give")
    else:
        measure = Fix(kind=FixKind.REPORT, action="advice", description=EXTERNAL_ADVICE)
    return [diagnosis(history, RULE_ID, TITLE, Severity.INFO, summary, {
        "normalization": mode, "hit_rate": round(hit_rate, 4), "queried_tokens": int(queries),
        "requests": int(requests), "window_s": round(span, 1)}, fix=measure)]
