"""The `tenant` label of Prometheus series: which tenants have one of their own, the others summed as "other".

The engine's /metrics and the supervisor's exporter both cap it the same way, so that a tenant keeps one label
across both and neither grows without bound.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

OTHER_TENANT = "other"  # the label of the tenants summed together
DEFAULT_MAX_TENANT_LABELS = 20  # the engine's --max-tenant-labels, and the supervisor's cap per engine


class TenantLabels:
    """Which tenants have a `tenant` label of their own; the others are summed as tenant="other".

    Tenant names come from clients, so one label per tenant would let them grow /metrics without bound.
    A tenant keeps its label until restart once given one, and the first `limit` tenants seen get one
    (those first seen in the same scrape heaviest first, by prompt tokens): a tenant that moved between
    its own series and "other" would make both counters jump, down in one and up in the other, which
    Prometheus reads as a reset and a burst. So every series here only grows. `/stats` keeps every tenant.
    """

    def __init__(self, limit: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        self.limit = limit
        self._own: set[str] = set()
        self._lock = threading.Lock()  # the step loop observes while a scrape may be admitting

    def label(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._own:
                return tenant
            # A tenant really named "other" is counted in the aggregate: two series with one label set
            # would make the exposition invalid.
            if tenant != OTHER_TENANT and len(self._own) < self.limit:
                self._own.add(tenant)
                return tenant
            return OTHER_TENANT

    def admit(self, tenants: Iterable[str]) -> None:
        """Give free labels to these tenants, in this order."""
        for tenant in tenants:
            self.label(tenant)

    @property
    def labelled(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._own)
