"""The tenants of an engine with a `kvops gateway` in front of it: read from the gateway's /stats/tenants at each
poll into the engine's snapshot, where the engine reports none of its own (vLLM has no tenants: the gateway owns
them). The rules, the supervisor's /metrics and `kvops top`'s tenants panel then read them as they read a kvops
engine's.

A gateway that does not answer, or answers something that is not its tenant list, leaves the snapshot as it came:
the engine's numbers do not depend on it, and `errors` / `last_error` say what happened (GET /api/engines shows
it). Nothing here raises into the poll.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
import structlog
from pydantic import ValidationError

from kvops.gateway.accounting import UNAUTHENTICATED, TenantStatsList
from kvops.gateway.accounting import TenantStats as GatewayTenantStats
from kvops.schema.engines import GatewayLink
from kvops.schema.gateway import GatewayTenant, GatewayView
from kvops.schema.metrics import EACH
from kvops.schema.snapshot import Snapshot, TenantStats

log = structlog.get_logger("kvops.supervisor")

TIMEOUT_S = 2.0  # a poll waits no longer for the gateway: the engine's snapshot is not held up by it
TENANTS = "tenants"  # the snapshot field a source without tenants marks unknown
# What a gateway cannot see of its tenants: their blocks and evictions are the engine's (for vLLM, its KV events).
UNSEEN = tuple(f"{TENANTS}.{EACH}.{name}" for name in
               ("blocks_held", "blocks_owned", "evictions_caused", "evictions_suffered"))


@dataclass
class _Gateway:
    url: str
    client: httpx.Client
    errors: int = 0
    last_error: str = ""
    tenants: int = 0


@dataclass
class GatewayTenants:
    """One gateway per engine that names one (`gateway = URL` in its [[engines]] entry)."""

    urls: Mapping[str, str]
    _gateways: dict[str, _Gateway] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._gateways = {name: _Gateway(url, httpx.Client(base_url=url, timeout=TIMEOUT_S))
                          for name, url in self.urls.items()}

    def __contains__(self, name: object) -> bool:
        return name in self._gateways

    def status(self, name: str) -> GatewayLink | None:
        """For GET /api/engines: the gateway's URL, the tenants last read, failed reads and the last error."""
        gateway = self._gateways.get(name)
        if gateway is None:
            return None
        return GatewayLink(url=gateway.url, tenants=gateway.tenants, errors_total=gateway.errors,
                           error=gateway.last_error)

    def enrich(self, name: str, snap: Snapshot) -> Snapshot:
        """The snapshot with the gateway's view (each tenant's policy and counters), and with its tenants where the
        engine reports none itself."""
        gateway = self._gateways.get(name)
        if gateway is None:
            return snap
        try:
            listed = TenantStatsList.model_validate(gateway.client.get("/stats/tenants").raise_for_status().json())
        except (httpx.HTTPError, ValueError, ValidationError) as exc:
            gateway.errors += 1
            error = f"{gateway.url}/stats/tenants: {type(exc).__name__}: {exc}".splitlines()[0]
            if error != gateway.last_error:  # logged once while it keeps failing the same way
                log.warning("gateway tenants not read", engine=name, error=error)
            gateway.last_error = error
            return snap
        gateway.last_error = ""
        known = [t for t in listed.tenants if t.tenant != UNAUTHENTICATED]  # refused before a tenant was known
        gateway.tenants = len(known)
        view = GatewayView(url=gateway.url, tenants={t.tenant: gateway_tenant(t) for t in known})
        if snap.knows(TENANTS):  # a kvops engine: its own tenants are the cache's
            return snap.model_copy(update={"gateway": view})
        tenants = {t.tenant: tenant_stats(t.requests, t.prompt_tokens, t.cached_prompt_tokens) for t in known}
        unknown = [*(f for f in snap.unknown if f != TENANTS), *UNSEEN]
        return snap.model_copy(update={"tenants": tenants, "unknown": unknown, "gateway": view})

    def close(self) -> None:
        for gateway in self._gateways.values():
            gateway.client.close()


def tenant_stats(requests: Mapping[str, int], prompt_tokens: int, cached_tokens: int) -> TenantStats:
    """A gateway tenant as the snapshot's: requests answered (any status), prompt tokens, and the cached ones as
    its hits. What the gateway cannot see (blocks held, evictions) stays at the schema's zero, marked UNSEEN."""
    return TenantStats(requests_total=sum(requests.values()), prompt_tokens_total=prompt_tokens,
                       hit_tokens_total=cached_tokens,
                       hit_rate=round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0)


RATE_LIMITED = ("concurrency_limit", "token_rate_limit")  # the gateway's 429 reasons


def gateway_tenant(stats: GatewayTenantStats) -> GatewayTenant:
    """A gateway tenant's policy and counters as the snapshot's gateway view carries them."""
    policy = stats.policy.model_dump() if stats.policy is not None else {}
    return GatewayTenant(**policy, estimated_tokens_total=stats.estimated_tokens,
                         prompt_chars_total=stats.prompt_chars, reusable_chars_total=stats.reusable_prompt_chars,
                         normalized_reusable_chars_total=stats.normalized_reusable_prompt_chars,
                         masked_reusable_chars_total=stats.masked_reusable_prompt_chars,
                         volatile_chars_total=stats.volatile_prompt_chars,
                         shareable_chars_total=stats.shareable_prompt_chars,
                         rate_limited_total=sum(stats.errors.get(reason, 0) for reason in RATE_LIMITED),
                         client_disconnects_total=stats.client_disconnects)
