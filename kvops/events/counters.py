"""The resident-block index's cumulative counts: the residency histograms and the per-tenant counters.

Both only go up (a publisher restart or an AllBlocksCleared empties the resident set, not these), so rules can
read them over a window as they read every other counter. The tenant table is bounded: a deployment that salts
every request with its own value would otherwise grow it without end, so past MAX_TENANTS the tenants with no
resident block are folded into one OTHER_TENANTS entry, which keeps their counts.
"""

from __future__ import annotations

from array import array

import numpy as np

from kvops.schema.histogram import Histogram, bucket_quantile, percentile_fields
from kvops.schema.kv_events import NO_TENANT, TenantBlocks

# Tenants the index keeps apart; past it, the ones with nothing resident are folded into OTHER_TENANTS.
MAX_TENANTS = 4096
# Tenants the view names, most stores first; the rest are summed under OTHER_TENANTS.
REPORTED_TENANTS = 32
OTHER_TENANTS = "(other tenants)"
FLUSH_AT = 1 << 16  # residency observations held before they are bucketed (8 bytes each)


class ResidencyHistogram:
    """Observations in seconds into fixed buckets (upper bounds inclusive, as Prometheus's `le`). The hot path
    appends to `pending` (a C double each); they are bucketed in one numpy pass when read or when
    FLUSH_AT have piled up, which costs a fifth of bucketing each one as it comes."""

    __slots__ = ("bounds", "counts", "pending", "total")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.pending = array("d")

    def observe(self, value: float) -> None:
        self.pending.append(value)
        if len(self.pending) >= FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        values = np.frombuffer(self.pending, dtype=np.float64)
        # side="left": a value equal to a bound falls in that bound's bucket (bisect_left)
        added = np.bincount(np.searchsorted(self.bounds, values, side="left"), minlength=len(self.counts))
        self.counts = [a + int(b) for a, b in zip(self.counts, added, strict=True)]
        self.total += float(values.sum())
        del values  # the view must go before the array can shrink
        self.pending = array("d")

    def model(self) -> Histogram:
        self.flush()
        counts = list(self.counts)
        return Histogram(buckets=list(self.bounds), counts=counts, sum=self.total, count=sum(counts),
                         **percentile_fields(lambda q: bucket_quantile(self.bounds, counts, q / 100)))


class TenantTable:
    """Tenant names to small ids (the index keeps one per block) and each tenant's counters, by id."""

    __slots__ = ("_free", "_other", "evicted", "ids", "names", "removed", "resident", "stores")

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.names: list[str | None] = []
        self.resident: list[int] = []
        self.stores: list[int] = []
        self.removed: list[int] = []
        self.evicted: list[int] = []  # removals of other tenants' blocks in the batches where this one stored
        self._free: list[int] = []
        self._other = TenantBlocks()
        self.id_of(NO_TENANT)

    def __len__(self) -> int:
        return len(self.ids)

    def id_of(self, name: str) -> int:
        found = self.ids.get(name)
        if found is not None:
            return found
        if len(self.ids) >= MAX_TENANTS:
            self._fold_idle()
        if self._free:
            tenant = self._free.pop()
            self.names[tenant] = name
        else:
            tenant = len(self.names)
            self.names.append(name)
            for column in (self.resident, self.stores, self.removed, self.evicted):
                column.append(0)
        self.ids[name] = tenant
        return tenant

    def _fold_idle(self) -> None:
        """Fold every tenant with nothing resident into OTHER_TENANTS and free its id. Such a tenant has no
        block left that names its id (a removed block that still parents resident ones has the same tenant
        as they do), so the id can be given to the next new tenant."""
        for name, tenant in list(self.ids.items()):
            if self.resident[tenant] == 0 and name != NO_TENANT:
                self._other.stores_total += self.stores[tenant]
                self._other.removed_total += self.removed[tenant]
                self._other.evicted_others_total += self.evicted[tenant]
                self.stores[tenant] = self.removed[tenant] = self.evicted[tenant] = 0
                self.names[tenant] = None
                del self.ids[name]
                self._free.append(tenant)

    def clear_resident(self) -> None:
        self.resident = [0] * len(self.resident)

    def view(self) -> dict[str, TenantBlocks]:
        """The REPORTED_TENANTS with the most stores, by name, and the rest summed under OTHER_TENANTS."""
        seen = sorted(((tenant, name) for name, tenant in self.ids.items()
                       if self.stores[tenant] or self.resident[tenant] or self.removed[tenant]),
                      key=lambda item: (-self.stores[item[0]], item[1]))
        out: dict[str, TenantBlocks] = {}
        other = self._other.model_copy()
        for rank, (tenant, name) in enumerate(seen):
            blocks = TenantBlocks(resident=self.resident[tenant], stores_total=self.stores[tenant],
                                  removed_total=self.removed[tenant], evicted_others_total=self.evicted[tenant])
            if rank < REPORTED_TENANTS:
                out[name] = blocks
            else:
                other.resident += blocks.resident
                other.stores_total += blocks.stores_total
                other.removed_total += blocks.removed_total
                other.evicted_others_total += blocks.evicted_others_total
        if other.stores_total or other.resident or other.removed_total:
            out[OTHER_TENANTS] = other
        return out
