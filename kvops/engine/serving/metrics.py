"""The engine's Prometheus exposition (`/metrics`), with the official `prometheus-client`.

Two kinds of metrics share one private `CollectorRegistry`:

- event metrics (histograms and a counter) that the engine updates as requests finish and tokens
  come out, through the `observe_*` methods;
- everything else, read from the latest `Snapshot` at scrape time by a custom collector, so that
  `/metrics` and `/stats` always agree.

Both are declared, names, types, help and snapshot fields, in `kvops.schema.metrics`; this module only walks them.

A scrape never fails because of one bad read: when `snapshot_fn` raises, the snapshot families are
left out (and `kvops_metrics_snapshot_errors_total` counts it) while the event metrics still go out.
Every metric is listed in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvops.engine.stats import LATENCY_BUCKETS
from kvops.schema.metrics import (
    ENGINE_INFO,
    ENGINE_INFO_HELP,
    ENGINE_INFO_LABELS,
    SNAPSHOT_METRICS,
    MetricType,
    SnapshotMetric,
    event,
    field_value,
    split_each,
)
from kvops.schema.snapshot import BLOCK_STATE_CODES, Snapshot, TenantStats
from kvops.tenancy.labels import DEFAULT_MAX_TENANT_LABELS, TenantLabels

log = structlog.get_logger("kvops.engine.metrics")  # the logger name operators already filter on

TOKEN_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class _WithoutCreated(Collector):
    """The event metrics of an inner registry, without the `*_created` series the client adds.

    `prometheus_client.disable_created_metrics()` would do this for every registry in the process;
    this keeps the choice local to the engine's registry.
    """

    def __init__(self, inner: CollectorRegistry) -> None:
        self._inner = inner

    def collect(self) -> Iterable[Metric]:
        for family in self._inner.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [sample for sample in family.samples if not sample.name.endswith("_created")]
            yield kept


class _SnapshotCollector(Collector):
    """Reads one snapshot per scrape and turns it into metric families."""

    def __init__(self, snapshot_fn: Callable[[], Snapshot], errors: Counter, labels: TenantLabels) -> None:
        self._snapshot_fn = snapshot_fn
        self._errors = errors
        self._labels = labels

    def collect(self) -> Iterable[Metric]:
        try:
            # Build and check every family before yielding any, so a bad snapshot leaves out all of them,
            # not half, and nothing fails later while the exposition is written.
            families = [_checked(family) for family in snapshot_families(self._snapshot_fn(), self._labels)]
        except Exception as exc:  # a scrape must never fail because of one bad read
            self._errors.inc()
            log.warning("metrics snapshot failed; serving event metrics only", error=repr(exc))
            return []
        return families


def _checked(family: Metric) -> Metric:
    """The family with every sample value a float (raises on a value the exposition could not write)."""
    family.samples = [sample._replace(value=float(sample.value)) for sample in family.samples]
    return family


def _tenants_by_label(snap: Snapshot, labels: TenantLabels | None) -> dict[str, list[TenantStats]]:
    """The snapshot's tenants grouped by their `tenant` label, labels in name order."""
    if labels is not None:
        # Tenants first seen in this snapshot take the free labels heaviest first.
        labels.admit(name for name, _ in sorted(snap.tenants.items(),
                                                key=lambda item: (-item[1].prompt_tokens_total, item[0])))
    groups: dict[str, list[TenantStats]] = {}
    for name, stats in snap.tenants.items():
        groups.setdefault(name if labels is None else labels.label(name), []).append(stats)
    return dict(sorted(groups.items()))


def _value(holder: Any, row: SnapshotMetric, path: str) -> float | None:
    """The row's number read at `path` below `holder` (the snapshot, or the item an EACH stands for); None when the
    field was not read."""
    if row.known and not getattr(holder, row.known):
        return None
    value = field_value(holder, path)
    if value is None:
        return None
    return value / row.divisor if row.divisor != 1.0 else value


def _series(row: SnapshotMetric, snap: Snapshot,
            tenants: Callable[[], dict[str, list[TenantStats]]]) -> Iterator[tuple[list[str], float | None]]:
    """The row's (label values, value) pairs; the labels say how the field's collection is walked."""
    collection, within = split_each(row.field)
    match row.labels:
        case ():
            yield [], _value(snap, row, row.field)
        case ("status",):  # an info family: always 1, the field's value as its label
            yield [str(field_value(snap, row.field))], 1
        case ("state",):  # every state always present, so a state's series never disappears
            counts = field_value(snap, collection)
            for state in BLOCK_STATE_CODES:
                yield [state], counts.get(state, 0)
        case ("tenant",):
            for label, members in tenants().items():
                yield [label], sum(_value(stats, row, within) or 0 for stats in members)
        case ("gpu", "name"):
            for gpu in field_value(snap, collection):
                yield [str(gpu.index), gpu.name], _value(gpu, row, within)
        case _:
            raise ValueError(f"{row.engine_name}: no way to walk labels {row.labels}")


def snapshot_families(snap: Snapshot, labels: TenantLabels | None = None) -> Iterator[Metric]:
    """Every snapshot-derived metric family of kvops.schema.metrics, values exactly those of the snapshot (`/stats`);
    per-tenant values summed by `labels` (None: every tenant its own label)."""
    info = GaugeMetricFamily(ENGINE_INFO, ENGINE_INFO_HELP, labels=list(ENGINE_INFO_LABELS))
    info.add_metric([str(field_value(snap, path)) for path in ENGINE_INFO_LABELS.values()], 1)
    yield info
    grouped: dict[str, list[TenantStats]] = {}

    def tenants() -> dict[str, list[TenantStats]]:
        # at most `labels.limit` tenants by name, the rest summed as tenant="other" (TenantLabels)
        if not grouped:
            grouped.update(_tenants_by_label(snap, labels))
        return grouped

    for row in SNAPSHOT_METRICS:
        if row.engine is None:
            continue
        kind = GaugeMetricFamily if row.type is MetricType.GAUGE else CounterMetricFamily
        # `engine_name` carries no `_total`: the client appends it to a counter's sample.
        family = kind(row.engine_name, row.engine.help, labels=list(row.labels))
        for label_values, value in _series(row, snap, tenants):
            if value is not None:
                family.add_metric(label_values, value)
        if family.samples or not row.optional:
            yield family


class EngineMetrics:
    """The engine's `/metrics`: event metrics updated by the engine plus the latest snapshot at scrape time."""

    def __init__(self, snapshot_fn: Callable[[], Snapshot],
                 max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        self.tenant_labels = TenantLabels(max_tenant_labels)
        self.registry = CollectorRegistry()
        events = CollectorRegistry()
        self._events = events

        def histogram(name: str) -> Histogram:
            row = event(name)
            buckets = LATENCY_BUCKETS if row.unit == "seconds" else TOKEN_BUCKETS
            return Histogram(row.name, row.help, row.labels, buckets=buckets, registry=events)

        def counter(name: str) -> Counter:
            row = event(name)
            return Counter(row.name, row.help, row.labels, registry=events)

        self.request_prompt_tokens = histogram("kvops_request_prompt_tokens")
        self.request_generation_tokens = histogram("kvops_request_generation_tokens")
        self.time_to_first_token = histogram("kvops_time_to_first_token_seconds")
        self.inter_token_latency = histogram("kvops_inter_token_latency_seconds")
        self.e2e_latency = histogram("kvops_e2e_request_latency_seconds")
        self.requests_finished = counter("kvops_requests_finished")
        self.snapshot_errors = counter("kvops_metrics_snapshot_errors")
        # The snapshot first: a failed read then shows in the same scrape's snapshot_errors counter.
        self.registry.register(_SnapshotCollector(snapshot_fn, self.snapshot_errors, self.tenant_labels))
        self.registry.register(_WithoutCreated(events))

    def observe_request_finished(self, tenant: str, prompt_tokens: int, generation_tokens: int,
                                 finish_reason: str) -> None:
        tenant = self.tenant_labels.label(tenant)
        self.request_prompt_tokens.labels(tenant).observe(prompt_tokens)
        self.request_generation_tokens.labels(tenant).observe(generation_tokens)
        self.requests_finished.labels(tenant, finish_reason).inc()

    def observe_time_to_first_token(self, tenant: str, seconds: float) -> None:
        self.time_to_first_token.labels(self.tenant_labels.label(tenant)).observe(seconds)

    def observe_inter_token_latency(self, tenant: str, seconds: float) -> None:
        self.inter_token_latency.labels(self.tenant_labels.label(tenant)).observe(seconds)

    def observe_e2e_latency(self, tenant: str, seconds: float) -> None:
        self.e2e_latency.labels(self.tenant_labels.label(tenant)).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for the HTTP handler."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["LATENCY_BUCKETS", "TOKEN_BUCKETS", "EngineMetrics", "snapshot_families"]
