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

Where such a server publishes its KV cache events (`Snapshot.kv_events`), kvops sees the root blocks
themselves: groups of roots that differ in only a few token positions (`root_variants`) are the same prompt
with a timestamp, a request id or whitespace changed. With a low hit rate, the largest group is named, with
the differing positions and token ids, and normalization of those tokens is proposed (advice: the server
cannot normalize). Without such a group the events say the variance is not the cause, and the low-hit note
is not given (low_hit_cause names the cause). A kvops engine, which normalizes live, is unchanged.

Behind a `kvops gateway` (`Snapshot.gateway`), the gateway measures what normalization and masks would do: it keeps
simulated prefix caches of the prompt text, as sent, normalized, and normalized with every volatile value masked
(kvops/gateway/shadow.py). A tenant whose prompts would share at least `min_gap` more of their text is named, and the
fix turns normalization on for it on the gateway, live; or, where normalization is on or not enough and its
prompts carry timestamps or ids, masks those patterns (kvops/gateway/volatile.py). The verdict reads the hit rate
the engine reports (the tenant's cached tokens).
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field

from kvops.history import EngineHistory
from kvops.kinds import Capability, profile_of
from kvops.rules.common import (
    PrefixCacheRuleSettings,
    cache_lookups,
    covered_steady_span,
    diagnosis,
    fresh_latest,
    usable_events,
)
from kvops.rules.gateway_reads import gateway_delta, hit_rate_objective, tenant_hit_rate
from kvops.rules.no_prefix_hits import NEAR_ZERO_HIT_RATE
from kvops.schema.admin import SET_NORMALIZATION
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.gateway import GatewayTenant, gateway_fix
from kvops.schema.kv_events import KvEventStats, RootVariant
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
    min_variant_roots: int = Field(4, ge=2, description="KV events: root blocks a group of variants needs")
    max_variant_positions: int = Field(8, ge=1, description="KV events: a group differing in more token positions "
                                                            "is not one prompt varied")
    min_gateway_prompt_chars: int = Field(8192, ge=1, description="behind a kvops gateway: prompt characters a "
                                                                  "tenant must send in the window to be judged")


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

    normalizes = profile_of(latest).can(Capability.LIVE_NORMALIZATION)
    if not normalizes and latest.gateway is not None:
        found = _through_gateway(history, settings, latest)
        if found:
            return found
    events = None if normalizes else usable_events(latest)
    if events is not None:  # a server without normalization whose root blocks kvops sees
        if hit_rate is None or queries < settings.min_queried_tokens or hit_rate > settings.shadow_probe_max_hit_rate:
            return []
        return _root_variants(history, settings, events, span, hit_rate, queries)
    if mode != "off" or not settings.suggest_shadow or hit_rate is None:
        return []
    requests = history.delta(lambda s: s.requests.finished_total, span) or 0.0
    if (queries < settings.min_queried_tokens or requests < settings.shadow_probe_min_requests
            or hit_rate > settings.shadow_probe_max_hit_rate):
        return []
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


def from_events(found: Diagnosis) -> bool:
    """Whether a prompt_variance diagnosis names root variants seen in the KV events (not the low-hit note)."""
    return "variant_positions" in found.evidence


def _variants(variant: RootVariant, shown: int = 4) -> str:
    """The differing token ids of the first `shown` roots, one bracketed list per root."""
    text = " ".join("[" + ",".join(map(str, ids)) + "]" for ids in variant.variants[:shown])
    return text + (f" (+{variant.roots - shown} more)" if variant.roots > shown else "")


def _root_variants(history: EngineHistory, settings: Settings, events: KvEventStats, span: float, hit_rate: float,
                   queries: float) -> list[Diagnosis]:
    """The largest group of resident root blocks that differ in a few token positions, on a low hit rate."""
    groups = [v for v in events.root_variants
              if v.roots >= settings.min_variant_roots and 0 < len(v.positions) <= settings.max_variant_positions]
    if not groups:
        return []  # the roots do not vary by a few tokens: not this rule's cause (low_hit_cause names it)
    top = max(groups, key=lambda v: v.roots)
    positions = ",".join(map(str, top.positions))
    summary = (f"{top.roots} root blocks of {top.block_tokens} tokens differ only at token position(s) {positions} "
               f"(ids {_variants(top)}), and the prefix cache hit {hit_rate:.0%} of {queries:.0f} prompt tokens: "
               f"the same prompt with a few tokens changed before its shared part")
    advice = (f"normalize the prompts before the shared part: the tokens at position(s) {positions} of the first "
              f"block (a timestamp, a request id, whitespace) differ between otherwise identical prompts; move them "
              f"after the shared part or strip them, and the {top.roots} roots become one")
    return [diagnosis(history, RULE_ID, TITLE, Severity.WARNING, summary, {
        "normalization": "unavailable",
        "hit_rate": round(hit_rate, 4),
        "queried_tokens": int(queries),
        "variant_roots": top.roots,
        "variant_positions": positions,
        "variant_tokens": _variants(top),
        "variant_block_tokens": top.block_tokens,
        "variant_tenant": top.tenant,
        "variant_groups": len(groups),
        "window_s": round(span, 1),
    }, fix=Fix(kind=FixKind.REPORT, action="advice", description=advice))]


def _gateway_shaping(snap: Snapshot) -> object:
    # A tenant's normalization or mask changed changes what its shadow counters mean.
    if snap.gateway is None:
        return None
    return frozenset((name, tenant.normalize, tuple(tenant.mask)) for name, tenant in snap.gateway.tenants.items())


def _through_gateway(history: EngineHistory, settings: Settings, latest: Snapshot) -> list[Diagnosis]:
    """Behind a kvops gateway: each tenant whose prompts, whitespace-normalized or with their volatile values masked,
    would share far more of their prefixes than as the upstream gets them (the gateway's simulated prefix caches,
    kvops/gateway/shadow.py). Normalization first (it changes nothing the model reads); masks once it is on, or
    when it alone is not enough. The fix changes that tenant's policy on the gateway, judged by the hit rate the
    engine itself reports."""
    gateway = latest.gateway
    span = covered_steady_span(history, latest, settings, _gateway_shaping)
    if gateway is None or span is None:
        return []
    found: list[Diagnosis] = []
    for name, policy in sorted(gateway.tenants.items()):

        def counter(read: Callable[[GatewayTenant], float], tenant: str = name) -> float:
            return gateway_delta(history, tenant, read, span)

        chars = counter(lambda t: t.prompt_chars_total)
        if chars < settings.min_gateway_prompt_chars:
            continue
        as_sent = counter(lambda t: t.reusable_chars_total) / chars
        normalized = counter(lambda t: t.normalized_reusable_chars_total) / chars
        masked = counter(lambda t: t.masked_reusable_chars_total) / chars
        # the patterns (kvops/gateway/volatile.py) the gateway found in this tenant's prompts in the window
        seen = [p for p in policy.volatile_chars_total if counter(lambda t, p=p: t.volatile_chars_total.get(p, 0))]
        unmasked = [p for p in seen if p not in policy.mask]
        now = normalized if policy.normalize else as_sent
        if not policy.normalize and normalized - now >= settings.min_gap:
            gain, change = normalized - now, {"normalize": True}
            what = (f"its prompts, whitespace-normalized, would share {normalized:.0%} of their text with earlier "
                    f"prompts, as sent {as_sent:.0%}")
            action = "turn whitespace normalization on"
        elif unmasked and masked - now >= settings.min_gap:
            mask = [*policy.mask, *unmasked]  # the gateway puts them in its catalog's order
            gain, change = masked - now, {"normalize": True, "mask": mask}
            what = (f"its prompts carry volatile values ({', '.join(unmasked)}); masked, they would share "
                    f"{masked:.0%} of their text with earlier prompts, now {now:.0%}")
            action = f"mask {', '.join(unmasked)} (and normalize whitespace)"
        else:
            continue
        hit_rate = tenant_hit_rate(history, latest, name, span)
        predicted = min(1.0, hit_rate + gain) if hit_rate is not None else None
        measured = (f"the engine hit {hit_rate:.0%} of its prompt tokens, about {predicted:.0%} expected after" if
                    hit_rate is not None and predicted is not None else
                    "the engine does not report its cached tokens per request")
        summary = f"tenant {name!r}: {what} (+{gain:.0%}); {measured}"
        objective = hit_rate_objective(latest, name, settings.verify_min_change)
        found.append(diagnosis(history, RULE_ID, TITLE, Severity.WARNING, summary, {
            "normalization": "gateway",
            "tenant": name,
            "prompt_chars": int(chars),
            "reusable_share": round(as_sent, 4),
            "normalized_reusable_share": round(normalized, 4),
            "masked_reusable_share": round(masked, 4),
            "volatile_patterns": ",".join(seen),
            "gap": round(gain, 4),
            "hit_rate": None if hit_rate is None else round(hit_rate, 4),
            "predicted_hit_rate": None if predicted is None else round(predicted, 4),
            "window_s": round(span, 1),
        }, fix=gateway_fix(name, change, f"{action} for tenant {name!r} on the gateway: its prompts would share "
                           f"{gain:.0%} more of their text", [objective]), subject=name))
    return found
