"""What the rules read of a tenant behind a kvops gateway: its gateway counters over a window, the hit rate the
engine reports for it, and the objective a fix through the gateway is judged by.

The gateway's counters (Snapshot.gateway, kvops/gateway/shadow.py) predict; the engine's own cached tokens, per
tenant from the usage blocks the gateway reads, judge. Where the engine reports no cached tokens at all, a fix is
judged on the engine's hit rate instead.
"""

from __future__ import annotations

from collections.abc import Callable

from kvops.history import EngineHistory
from kvops.schema.diagnosis import Objective
from kvops.schema.gateway import GatewayTenant
from kvops.schema.snapshot import Snapshot


def gateway_delta(history: EngineHistory, tenant: str, read: Callable[[GatewayTenant], float], span: float) -> float:
    """The rise of one of `tenant`'s gateway counters over the last `span` seconds (0 when it is not there)."""
    return history.delta(lambda s: read(s.gateway.tenants[tenant])
                         if s.gateway is not None and tenant in s.gateway.tenants else 0, span) or 0.0


def reports_cached_tokens(latest: Snapshot) -> bool:
    """Whether the engine reports cached prompt tokens in its answers' usage (vLLM with prompt token details)."""
    return any(t.hit_tokens_total for t in latest.tenants.values())


def tenant_hit_rate(history: EngineHistory, latest: Snapshot, tenant: str, span: float) -> float | None:
    """The share of `tenant`'s prompt tokens the engine served from its prefix cache over the window; None where
    the engine reports no cached tokens or the tenant sent none."""
    if not reports_cached_tokens(latest):
        return None
    prompts = history.delta(lambda s: s.tenants[tenant].prompt_tokens_total if tenant in s.tenants else 0, span)
    hits = history.delta(lambda s: s.tenants[tenant].hit_tokens_total if tenant in s.tenants else 0, span)
    return hits / prompts if prompts and hits is not None else None


def hit_rate_objective(latest: Snapshot, tenant: str, min_effect: float) -> Objective:
    """A fix for `tenant` must raise its own hit rate where the engine reports it, else the engine's."""
    if reports_cached_tokens(latest):
        return Objective(measure="tenant_hit_rate", better="higher", min_effect=min_effect, subject=tenant)
    return Objective(measure="hit_rate", better="higher", min_effect=min_effect)
