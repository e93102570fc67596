"""Prefixes split by cache salts: a tenant kept apart by its salt sends text another namespace has cached.

A kvops gateway gives each tenant a cache salt (kvops/gateway/policy.py): `isolated` tenants one of their own, a
group one per group, `shared` tenants none. vLLM reuses a cached block only under the salt it was stored with, so
two isolated tenants that send the same system prompt each compute and hold it. The gateway measures the cost: a
simulated prefix cache with no salt remembers which namespace last sent each chunk of text, and counts, per
tenant and per other namespace, the characters its prompts would have reused only by sharing that namespace's salt
(`GatewayTenant.shareable_chars_total`, kvops/gateway/shadow.py).

An isolated tenant that would reuse at least `min_share` of its prompt text from one namespace is named. Where
that namespace is `shared` or a group, the fix moves the tenant into it on the gateway, live, judged by the
tenant's hit rate as the engine reports it. Where it is another isolated tenant, both would have to move into a
new group: the fix is advice naming both. Sharing a salt lets tenants infer from timings what the others sent, so
isolation is a choice kvops never reverses on its own: the rule's policy is `suggest` unless set otherwise, and no
rule ever proposes isolating (it can only lower hit rates; it is a privacy decision, made in the policy file or
`PUT /admin/tenants/{tenant}`).
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.rules.common import WindowRuleSettings, covered_steady_span, diagnosis, fresh_latest
from kvops.rules.gateway_reads import gateway_delta, hit_rate_objective, tenant_hit_rate
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.schema.gateway import GROUP_PREFIX, ISOLATED, SHARED, TENANT_SALT_PREFIX, GatewayView, gateway_fix
from kvops.schema.snapshot import Snapshot

RULE_ID = "salt_split"
TITLE = "Prefixes split by cache salts: an isolated tenant sends text another namespace has cached"
DESCRIPTION = "behind a kvops gateway, an isolated tenant's prompts would reuse far more by sharing a cache salt"


class Settings(WindowRuleSettings):
    min_share: float = Field(0.25, gt=0, le=1, description="fire when sharing one namespace's salt would reuse this "
                                                           "share of the tenant's prompt text")
    min_prompt_chars: int = Field(8192, ge=1, description="prompt characters the tenant must send in the window")
    verify_min_change: float = Field(0.1, ge=0, description="relative rise of the tenant's hit rate that counts")


def _caches(snap: Snapshot) -> object:
    # A tenant moved between namespaces changes what its counters mean.
    if snap.gateway is None:
        return None
    return frozenset((name, tenant.cache) for name, tenant in snap.gateway.tenants.items())


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None or latest.gateway is None or not latest.engine.enable_prefix_caching:
        return []
    gateway = latest.gateway
    span = covered_steady_span(history, latest, settings, _caches)
    if span is None:
        return []
    found: list[Diagnosis] = []
    for name, policy in sorted(gateway.tenants.items()):
        if policy.cache != ISOLATED:
            continue  # a shared or grouped tenant already shares: moving it would split another namespace
        chars = gateway_delta(history, name, lambda t: t.prompt_chars_total, span)
        if chars < settings.min_prompt_chars:
            continue
        shares = {ns: gateway_delta(history, name, lambda t, ns=ns: t.shareable_chars_total.get(ns, 0), span) / chars
                  for ns in policy.shareable_chars_total}
        if not shares:
            continue
        namespace, share = max(shares.items(), key=lambda item: item[1])
        if share < settings.min_share:
            continue
        found.append(_diagnosis(history, settings, latest, gateway, name, namespace, share, chars, span))
    return found


def _diagnosis(history: EngineHistory, settings: Settings, latest: Snapshot, gateway: GatewayView, tenant: str,
               namespace: str, share: float, chars: float, span: float) -> Diagnosis:
    hit_rate = tenant_hit_rate(history, latest, tenant, span)
    other = gateway.tenant_of_salt(namespace) if namespace.startswith(TENANT_SALT_PREFIX) else None
    sharers = sorted(n for n, t in gateway.tenants.items() if n != tenant and t.cache == namespace)
    who = (f"isolated tenant {other!r}" if other is not None else
           f"the {namespace!r} namespace" + (f" ({', '.join(map(repr, sharers))})" if sharers else ""))
    measured = f"; the engine hit {hit_rate:.0%} of its prompt tokens" if hit_rate is not None else ""
    summary = (f"tenant {tenant!r} is isolated, yet {share:.0%} of its prompt text was cached just before by {who}: "
               f"sharing that salt would reuse it{measured}")
    evidence: dict[str, float | int | str | bool | None] = {
        "tenant": tenant, "namespace": namespace, "shareable_share": round(share, 4), "prompt_chars": int(chars),
        "hit_rate": None if hit_rate is None else round(hit_rate, 4), "window_s": round(span, 1)}
    if namespace == SHARED or namespace.startswith(GROUP_PREFIX):
        fix = gateway_fix(tenant, {"cache": namespace}, f"move tenant {tenant!r} into the {namespace!r} cache "
                          f"namespace on the gateway: {share:.0%} of its prompt text is cached there (tenants of one "
                          f"namespace can infer from timings what the others sent)",
                          [hit_rate_objective(latest, tenant, settings.verify_min_change)])
    else:
        pair = f"'{tenant}' and '{other}'" if other is not None else f"{tenant!r} and the tenant of salt {namespace!r}"
        fix = Fix(kind=FixKind.REPORT, action="advice", description=(
            f"if tenants {pair} may share cached prefixes, put both in one group: PUT /admin/tenants/<name> "
            f"{{\"cache\": \"group:<group>\"}} for each (or cache = \"group:<group>\" in the policy file); tenants "
            f"of one group can infer from timings what the others sent"))
    return diagnosis(history, RULE_ID, TITLE, Severity.INFO, summary, evidence, fix=fix, subject=tenant)
