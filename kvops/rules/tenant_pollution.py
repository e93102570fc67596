"""Tenant pollution: one tenant's allocations evict the cached blocks other tenants reuse.

The engine counts cross-tenant evictions per tenant (`evictions_caused` by the allocating tenant,
`evictions_suffered` by the block's owner). A polluter causes many of them over the window while
reusing almost nothing itself (its own hit rate near zero: what it fills the cache with is never
read again), and the harm shows as its victims' hit rate falling: the second half of the window
against the first, or the window against the victims' hit rate before it, whichever fell more.
One diagnosis per polluter (subject = the tenant).

A server without kvops's tenants but with KV cache events (vLLM: a tenant is a cache salt, else a LoRA;
`Snapshot.kv_events`) shows the same thing from the events: the removals of other tenants' blocks in the
batches where a tenant stored (`TenantBlocks.evicted_others_total`). A tenant whose stores account for at
least `min_events_pollution_share` of the removals of the others' blocks over the window, and at least
`min_evictions_caused` of them, is named; the server has no per-tenant quota or hit counters, so the fix is
advice and the victims' hit rate is not checked. Behind a `kvops gateway` (`Snapshot.gateway`) whose isolated
tenant the polluter is (salt `tenant:<name>`), the fix is a token-rate limit on that tenant, set live on the
gateway, judged by the other tenants' hit rate (the engine's cached tokens in the usage the gateway counts) and by
the removals its stores cause.
"""

from __future__ import annotations

import math

from pydantic import Field

from kvops.history import EngineHistory, Getter
from kvops.rules.common import (
    WindowRuleSettings,
    blocks_for,
    covered_window,
    diagnosis,
    earlier_and_recent,
    events_delta,
    events_span,
    fresh_latest,
    ratio,
    rounded,
    run_span,
)
from kvops.schema.admin import SET_TENANT_QUOTA
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.gateway import gateway_fix
from kvops.schema.metrics import EACH
from kvops.schema.snapshot import Snapshot

RULE_ID = "tenant_pollution"
TITLE = "Tenant pollution: one tenant evicts the others' cached blocks"
DESCRIPTION = "a tenant with no reuse of its own evicts other tenants' cached blocks and their hit rate falls"


class Settings(WindowRuleSettings):
    min_evictions_caused: int = Field(64, ge=1, description="cross-tenant evictions the polluter must cause in "
                                                            "the window")
    max_polluter_hit_rate: float = Field(0.05, ge=0, le=1, description="the polluter's own hit rate over the window "
                                                                      "must be at most this (its reuse near zero)")
    min_polluter_prompt_tokens: int = Field(256, ge=1, description="prompt tokens the polluter must send in the window "
                                                                  "for its hit rate to count")
    min_victim_evictions: int = Field(16, ge=1, description="evictions the other tenants must suffer in the window")
    min_victim_hit_rate_drop: float = Field(
        0.05, ge=0, le=1, description="the victims' hit rate must have fallen by this much (absolute); 0 disables "
                                      "the check")
    min_victim_prompt_tokens: int = Field(256, ge=1, description="victims' prompt tokens needed in each compared "
                                                                "period for its hit rate to count")
    quota_pool_share: float = Field(0.25, gt=0, le=1, description="the proposed quota is at most this share of the "
                                                                  "pool (and at least one max_model_len request)")
    verify_min_change: float = Field(0.5, ge=0, description="relative fall of the tenant's eviction rate that counts")
    min_events_pollution_share: float = Field(
        0.5, gt=0, le=1, description="KV events: the tenant's stores account for at least this share of the removals "
                                     "of other tenants' blocks in the window")
    gateway_rate_share: float = Field(
        0.25, gt=0, lt=1, description="behind a kvops gateway: the polluter's token-rate limit is this share of its "
                                      "estimated token rate over the window")
    min_tokens_per_minute: int = Field(600, ge=1, description="... and never below this many tokens a minute")


def _tenant(field: str, tenants: tuple[str, ...]) -> Getter:
    """A counter summed over some tenants (a tenant not yet seen counts 0)."""

    def get(snap: Snapshot) -> float:
        return sum(getattr(snap.tenants[t], field) for t in tenants if t in snap.tenants)

    return get


def _victims_hit_rate_drop(history: EngineHistory, snaps: list[Snapshot], span: float, victims: tuple[str, ...],
                           min_tokens: int) -> dict[str, float | None]:
    hits = earlier_and_recent(history, _tenant("hit_tokens_total", victims), span)
    prompts = earlier_and_recent(history, _tenant("prompt_tokens_total", victims), span)
    earlier = recent = window = before = None
    if hits is not None and prompts is not None:
        earlier = ratio(hits[0], prompts[0]) if prompts[0] >= min_tokens else None
        recent = ratio(hits[1], prompts[1]) if prompts[1] >= min_tokens else None
        whole = prompts[0] + prompts[1]
        window = ratio(hits[0] + hits[1], whole) if whole >= min_tokens else None
    # Before the window: the victims' cumulative hit rate up to its start.
    first = snaps[0]
    prompted = _tenant("prompt_tokens_total", victims)(first)
    if prompted >= min_tokens:
        before = _tenant("hit_tokens_total", victims)(first) / prompted
    drops = [a - b for a, b in ((earlier, recent), (before, window)) if a is not None and b is not None]
    return {"earlier": earlier, "recent": recent, "window": window, "before": before,
            "drop": max(drops) if drops else None}


def _quota(latest: Snapshot, tenant: str, peak_held: int, settings: Settings) -> int | None:
    """Enough for what the tenant's live sequences held at their peak, at most a share of the pool,
    never less than one max_model_len request; None when no quota below the current one is left."""
    engine = latest.engine
    one_request = blocks_for(engine.max_model_len, engine.block_size)
    quota = max(one_request, min(peak_held, math.floor(settings.quota_pool_share * engine.num_blocks)))
    current = latest.tenants[tenant].quota_blocks
    if current is not None and quota >= current:
        quota = max(one_request, current // 2)  # the current quota did not stop it: tighten
        if quota >= current:
            return None
    return quota


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None:
        return []
    # No engine tenants (vLLM), or tenants that carry no evictions (a gateway's): the KV events' tenants, where
    # there are events.
    if len(latest.tenants) < 2 or not latest.knows(f"tenants.{EACH}.evictions_caused"):
        return _from_events(history, settings, latest)
    span = run_span(latest, settings.window_s)
    snaps = covered_window(history, span, settings)
    if not snaps:
        return []
    elapsed = snaps[-1].time - snaps[0].time
    names = tuple(sorted(latest.tenants))
    suffered = {t: history.delta(_tenant("evictions_suffered", (t,)), span) or 0.0 for t in names}

    diagnoses: list[Diagnosis] = []
    for tenant in names:
        caused = history.delta(_tenant("evictions_caused", (tenant,)), span) or 0.0
        if caused < settings.min_evictions_caused:
            continue
        prompt_tokens = history.delta(_tenant("prompt_tokens_total", (tenant,)), span) or 0.0
        hit_tokens = history.delta(_tenant("hit_tokens_total", (tenant,)), span) or 0.0
        if prompt_tokens < settings.min_polluter_prompt_tokens:
            continue  # its reuse is unknown: never guess
        own_hit_rate = hit_tokens / prompt_tokens
        if own_hit_rate > settings.max_polluter_hit_rate:
            continue
        victims = tuple(t for t in names if t != tenant and suffered[t] > 0)
        victim_evictions = sum(suffered[t] for t in victims)
        if victim_evictions < settings.min_victim_evictions:
            continue
        hit = _victims_hit_rate_drop(history, snaps, span, victims, settings.min_victim_prompt_tokens)
        drop = hit["drop"]
        if settings.min_victim_hit_rate_drop > 0 and (drop is None or drop < settings.min_victim_hit_rate_drop):
            continue

        peak_held = max(s.tenants[tenant].blocks_held for s in snaps if tenant in s.tenants)
        quota = _quota(latest, tenant, peak_held, settings)
        stats = latest.tenants[tenant]
        fix = None if quota is None else SET_TENANT_QUOTA.fix(
            {"tenant": tenant, "quota_blocks": quota},
            f"cap tenant {tenant!r} at {quota} blocks (it owns {stats.blocks_owned}, its live sequences held at most "
            f"{peak_held}): its allocations then evict its own unreused blocks first",
            # The others' hit rate must recover (by the default 10%) and the tenant evict less of theirs.
            [Objective(measure="victims_hit_rate", better="higher", subject=tenant),
             Objective(measure="evictions_caused_per_s", better="lower", min_effect=settings.verify_min_change,
                       subject=tenant)])
        summary = (f"tenant {tenant!r} caused {caused:.0f} evictions of other tenants' blocks in {elapsed:.0f} s "
                   f"with a {own_hit_rate:.0%} hit rate of its own; victims ({', '.join(victims)}) lost "
                   f"{drop or 0:.0%} hit rate")
        diagnoses.append(diagnosis(
            history, RULE_ID, TITLE, Severity.WARNING, summary,
            {
                "tenant": tenant,
                "evictions_caused": int(caused),
                "evictions_caused_per_s": round(caused / elapsed, 4),
                "polluter_prompt_tokens": int(prompt_tokens),
                "polluter_hit_rate": round(own_hit_rate, 4),
                "blocks_held": stats.blocks_held,
                "blocks_held_peak": peak_held,
                "blocks_owned": stats.blocks_owned,
                "current_quota_blocks": stats.quota_blocks,
                "quota_blocks": quota,
                "victims": ",".join(victims),
                "victim_evictions_suffered": int(victim_evictions),
                "victim_evictions_suffered_per_s": round(victim_evictions / elapsed, 4),
                "victim_hit_rate_earlier": rounded(hit["earlier"]),
                "victim_hit_rate_recent": rounded(hit["recent"]),
                "victim_hit_rate_before_window": rounded(hit["before"]),
                "victim_hit_rate_window": rounded(hit["window"]),
                "victim_hit_rate_drop": rounded(drop),
                "window_s": round(elapsed, 1),
            },
            fix=fix, subject=tenant,
        ))
    return diagnoses


def _from_events(history: EngineHistory, settings: Settings, latest: Snapshot) -> list[Diagnosis]:
    """Polluters seen in the KV events: a tenant whose stores caused most removals of the other tenants' blocks."""
    events = latest.kv_events
    span = events_span(history, latest, settings)
    if events is None or span is None or len(events.tenants) < 2:
        return []
    names = sorted(events.tenants)

    def counter(tenant: str, field: str) -> float:
        return events_delta(history, span, lambda e: getattr(e.tenants[tenant], field) if tenant in e.tenants else 0)

    removed = {t: counter(t, "removed_total") for t in names}
    diagnoses: list[Diagnosis] = []
    for tenant in names:
        caused = counter(tenant, "evicted_others_total")
        others_removed = sum(removed[t] for t in names if t != tenant)
        if caused < settings.min_evictions_caused or others_removed <= 0:
            continue
        share = min(1.0, caused / others_removed)
        if share < settings.min_events_pollution_share:
            continue
        stores = counter(tenant, "stores_total")
        victims = [t for t in names if t != tenant and removed[t] > 0]
        stats = events.tenants[tenant]
        limit = _gateway_limit(history, settings, latest, tenant, span)
        summary = (f"tenant {tenant!r}'s stores came with {caused:.0f} removals of other tenants' cached blocks in "
                   f"{span:.0f} s, {share:.0%} of all removals of theirs ({', '.join(victims)})")
        diagnoses.append(diagnosis(
            history, RULE_ID, TITLE, Severity.WARNING, summary,
            {
                "tenant": tenant,
                "evictions_caused": int(caused),
                "evictions_caused_per_s": round(caused / span, 4),
                "evictions_caused_share": round(share, 4),
                "victim_blocks_removed": int(others_removed),
                "victims": ",".join(victims),
                "tenant_stores": int(stores),
                "tenant_blocks_removed": int(removed[tenant]),
                "tenant_resident_blocks": stats.resident,
                "tenants": len(names),
                "window_s": round(span, 1),
                **(limit[1] if limit is not None else {}),
            },
            fix=limit[0] if limit is not None else Fix(
                kind=FixKind.REPORT, action="advice",
                description=f"serve tenant {tenant!r} from its own engine (or pool), or cap its traffic: the server "
                            f"has no per-tenant KV quota, and its {stores:.0f} blocks stored in the window push the "
                            f"other tenants' cached prefixes out"),
            subject=tenant,
        ))
    return diagnoses


def _gateway_limit(history: EngineHistory, settings: Settings, latest: Snapshot, events_tenant: str,
                   span: float) -> tuple[Fix, dict[str, int | float | str | None]] | None:
    """Behind a kvops gateway, where the polluter is one of its isolated tenants: a token-rate limit at a share of
    what it sent over the window (the gateway's own estimate, the unit its limiter counts in), tighter than any it
    has; its fix and evidence. None without a gateway tenant to limit."""
    gateway = latest.gateway
    tenant = gateway.tenant_of_salt(events_tenant) if gateway is not None else None
    if gateway is None or tenant is None:
        return None

    def charged(snap: Snapshot) -> float:
        found = snap.gateway.tenants.get(tenant) if snap.gateway is not None else None
        return found.estimated_tokens_total if found is not None else 0

    per_minute = (history.delta(charged, span) or 0.0) * 60 / span
    current = gateway.tenants[tenant].tokens_per_minute
    limit = max(settings.min_tokens_per_minute, math.floor(settings.gateway_rate_share * per_minute))
    if current is not None and limit >= current:
        limit = max(settings.min_tokens_per_minute, current // 2)  # the current limit did not stop it: tighten
        if limit >= current:
            return None
    fix = gateway_fix(
        tenant, {"tokens_per_minute": limit},
        f"limit gateway tenant {tenant!r} to {limit} tokens a minute (it sent about {per_minute:.0f} a minute in the "
        f"window): fewer of its blocks stored, fewer of the other tenants' cached prefixes pushed out",
        # The others' hit rate (the engine's cached tokens, per the gateway's tenants) must recover, and its stores
        # evict less of theirs, as the KV events count it.
        [Objective(measure="victims_hit_rate", better="higher", subject=tenant),
         Objective(measure="events_evictions_caused_per_s", better="lower", min_effect=settings.verify_min_change,
                   subject=events_tenant)])
    return fix, {"gateway_tenant": tenant, "gateway_tokens_per_minute": round(per_minute, 1),
                 "current_tokens_per_minute": current, "tokens_per_minute": limit}
