"""The supervisor's `/metrics`: its own health, the engines it watches, diagnoses, fixes, alerts.

Everything is read from the supervisor's state at scrape time (a custom collector), so the
exposition can never disagree with the supervisor API.

Per engine it also republishes the numbers that mean the same on every kind of engine (KV usage,
prefix cache, queue, preemptions, block size), read from the snapshot it holds for the engine: the
kvops engine's own `/stats`, or vLLM's and SGLang's `/metrics` read by `kvops.adapters`. They carry
the labels `engine` and `kind`, so one alert or dashboard query works on every kind. A field the
engine does not report (`Snapshot.unknown`) has no series, rather than a made-up 0. Those series, names, help
and snapshot fields, are declared once in `kvops.schema.metrics`, with the engine's own.

For an engine whose KV cache events it reads (kvops.supervisor.event_feeds), the supervisor also exports what
they show and the stream's own health (`_event_families`): these are the supervisor's reading of a stream, not a
snapshot field every engine reports, so they are declared here rather than in that table.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvops import __version__
from kvops.kinds import managed_profile
from kvops.rules import RULES
from kvops.schema.diagnosis import Severity
from kvops.schema.kv_events import EVENT_TYPES
from kvops.schema.metrics import (
    GPU_LABELS,
    SUPERVISOR_LABELS,
    MetricType,
    SnapshotMetric,
    by_stem,
    field_value,
    split_each,
    supervisor_metrics,
)
from kvops.schema.snapshot import Snapshot
from kvops.tenancy.labels import TenantLabels

if TYPE_CHECKING:
    from kvops.supervisor.supervisor import EngineState, Supervisor

FIX_OUTCOMES = ("proposed", "queued", "applying", "verifying", "verified", "rolled_back", "reverted", "failed")
ENGINE_LABELS = list(SUPERVISOR_LABELS)


def engine_kind(state: EngineState) -> str:
    """The engine's kind: its latest snapshot's source, else the configured kind (a managed `auto` is a kvops
    engine; a watched one stays `auto` until it first answers)."""
    latest = state.history.latest
    if latest is not None:
        return latest.source
    kind = str(state.spec.kind)
    return managed_profile(kind).kind if state.spec.managed else kind


def _number(holder: object, row: SnapshotMetric, path: str) -> float | None:
    """The row's value below `holder` (a snapshot, or one GPU) as the exposition's float; None when not read."""
    if row.known and not getattr(holder, row.known):
        return None
    value = field_value(holder, path)
    if value is None:
        return None
    return float(value / row.divisor if row.divisor != 1.0 else value)


def _family(row: SnapshotMetric, labels: list[str]) -> Metric:
    kind = GaugeMetricFamily if row.type is MetricType.GAUGE else CounterMetricFamily
    return kind(row.supervisor_name, row.supervisor_help, labels=labels)


# The series kvops.schema.metrics declares for the supervisor: per engine, then per GPU of the engine, then the
# status of its GPU read.
SNAPSHOT_SERIES = tuple(row for row in supervisor_metrics() if not row.labels)
GPU_SERIES = tuple(row for row in supervisor_metrics() if row.labels == GPU_LABELS)
TENANT_SERIES = tuple(row for row in supervisor_metrics() if row.labels == ("tenant",))
GPU_STATUS = by_stem("gpu_status_info")


def snapshot_families(states: Iterable[EngineState],
                      tenant_labels: Mapping[str, TenantLabels] | None = None) -> Iterator[Metric]:
    """SNAPSHOT_SERIES for every engine that answered its last poll, labelled engine and kind; then its GPUs and
    its tenants (labels given out by `tenant_labels[engine]`, which keeps them from one scrape to the next)."""
    families = {row.stem: _family(row, ENGINE_LABELS) for row in SNAPSHOT_SERIES}
    up: list[tuple[str, Snapshot]] = []
    for state in states:
        snap = state.history.latest
        if snap is None or state.history.is_up is not True:
            continue  # no stale numbers for an engine that is down
        up.append((state.name, snap))
        labels = [state.name, snap.source]
        for row in SNAPSHOT_SERIES:
            value = _number(snap, row, row.field)
            if snap.knows(row.field) and value is not None:
                families[row.stem].add_metric(labels, value)
    yield from families.values()
    yield from _gpu_families(up)
    yield from _tenant_families(up, tenant_labels if tenant_labels is not None else defaultdict(TenantLabels))


def _gpu_families(engines: list[tuple[str, Snapshot]]) -> Iterator[Metric]:
    """The engines' GPU facts where read, labelled gpu and name too, and each engine's gpu_status (the reason
    when there are none: a CPU engine, NVML unavailable, a kind that does not report its GPU). Only the engine's
    own GPU(s): the other GPUs of its host would repeat under every engine there."""
    status = _family(GPU_STATUS, [*ENGINE_LABELS, *GPU_STATUS.labels])
    families = {row.stem: _family(row, [*ENGINE_LABELS, *row.labels]) for row in GPU_SERIES}
    for engine, snap in engines:
        status.add_metric([engine, snap.source, str(field_value(snap, GPU_STATUS.field))], 1)
        if not snap.knows("process.gpus"):
            continue
        for gpu in snap.process.engine_gpus():
            for row in GPU_SERIES:
                number = _number(gpu, row, split_each(row.field)[1])
                if number is not None:
                    families[row.stem].add_metric([engine, snap.source, str(gpu.index), gpu.name], number)
    yield status
    yield from families.values()


def _tenant_families(engines: list[tuple[str, Snapshot]],
                     labels: Mapping[str, TenantLabels]) -> Iterator[Metric]:
    """Each engine's tenants where it reports them: a tenant label per tenant up to the engine's limit, heaviest
    first by prompt tokens when first seen, the rest summed as tenant="other" (kvops.tenancy.labels' TenantLabels:
    tenant names come from clients, and a series must never move between a tenant and "other")."""
    families = {row.stem: _family(row, [*ENGINE_LABELS, "tenant"]) for row in TENANT_SERIES}
    for engine, snap in engines:
        if not snap.knows("tenants") or not snap.tenants:
            continue
        given = labels[engine]
        given.admit(sorted(snap.tenants, key=lambda t: -snap.tenants[t].prompt_tokens_total))
        for row in TENANT_SERIES:
            path = split_each(row.field)[1]
            summed: dict[str, float] = defaultdict(float)
            for tenant, stats in snap.tenants.items():
                summed[given.label(tenant)] += float(field_value(stats, path))
            for tenant, value in summed.items():
                families[row.stem].add_metric([engine, snap.source, tenant], value)
    yield from families.values()


class SupervisorCollector(Collector):
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterable[Metric]:
        sup = self.supervisor
        kinds = {name: engine_kind(state) for name, state in sup.engines.items()}
        yield from _supervisor_families(sup)
        yield from _engine_families(sup, kinds)
        yield from snapshot_families(sup.engines.values(), sup.tenant_labels)
        yield from _event_families(sup, kinds)
        yield from _diagnosis_families(sup, kinds)
        yield from _self_monitoring(sup, kinds)
        yield from _fix_families(sup)
        yield from _alert_families(sup)


def _supervisor_families(sup: Supervisor) -> Iterator[Metric]:
    # supervisor_url: where people and `kvops top --prometheus` reach this supervisor (its external_url), so a
    # fleet view read from Prometheus can drill down from any of its engines.
    info = GaugeMetricFamily("kvops_supervisor_info", "Supervisor version and address; always 1.",
                             labels=["version", "supervisor_url"])
    info.add_metric([__version__, sup.external_url], 1)
    yield info
    yield GaugeMetricFamily("kvops_supervisor_start_time_seconds", "Supervisor start time, unix seconds.",
                            value=sup.started_at)
    yield CounterMetricFamily("kvops_supervisor_polls", "Poll cycles completed.", value=sup.polls_total)
    yield GaugeMetricFamily("kvops_supervisor_last_poll_duration_seconds",
                            "Duration of the last poll cycle (all engines, rules, alerts, fixes).",
                            value=sup.last_poll_s)
    timing = sup.timing
    for name, doc, histogram in (
            ("kvops_supervisor_poll_duration_seconds", "Poll cycles by duration (all engines, rules, alerts, fixes).",
             timing.duration),
            ("kvops_supervisor_poll_lateness_seconds", "Poll cycles by how long after their due time they started.",
             timing.lateness),
            ("kvops_supervisor_rule_evaluation_seconds", "Rule evaluations (every rule on every engine) by duration.",
             timing.evaluation)):
        yield HistogramMetricFamily(name, doc, buckets=histogram.cumulative(), sum_value=histogram.total)
    if sup.fix_lease is not None:  # without a lease there is nothing to hold: no series rather than a constant
        yield GaugeMetricFamily("kvops_supervisor_fix_lease_held", "1 while this supervisor holds the fix lease and "
                                "applies fixes, 0 while it is the standby.", value=1 if sup.fix_lease.held() else 0)
    yield CounterMetricFamily("kvops_supervisor_polls_late", "Poll cycles that took longer than the poll interval, "
                              "so that every engine's next poll started late.", value=timing.late_total)


def _engine_families(sup: Supervisor, kinds: dict[str, str]) -> Iterator[Metric]:
    """Each engine's liveness as the supervisor sees it: up, restarts, crash loop, poll errors, bad data."""
    up = GaugeMetricFamily("kvops_engine_up", "1 when the engine answered its last poll.",
                           labels=[*ENGINE_LABELS, "managed"])
    restarts = CounterMetricFamily("kvops_engine_restarts", "Restarts of a managed engine by the supervisor.",
                                   labels=ENGINE_LABELS)
    crash_loop = GaugeMetricFamily("kvops_engine_crash_loop", "1 when a managed engine is in a crash loop "
                                   "and no longer restarted.", labels=ENGINE_LABELS)
    errors = CounterMetricFamily("kvops_engine_poll_errors", "Polls that got no snapshot from the engine.",
                                 labels=ENGINE_LABELS)
    implausible = GaugeMetricFamily("kvops_engine_data_problems", "Values in the engine's metrics that cannot "
                                    "be right over the last minute (GET /api/engines lists them).",
                                    labels=ENGINE_LABELS)
    for name, state in sup.engines.items():
        up.add_metric([name, kinds[name], str(state.spec.managed).lower()], 1 if state.history.is_up else 0)
        restarts.add_metric([name, kinds[name]], state.history.restarts_total)
        crash_loop.add_metric([name, kinds[name]], 1 if state.history.crash_loop else 0)
        errors.add_metric([name, kinds[name]], sup.poll_errors.get(name, 0))
        implausible.add_metric([name, kinds[name]], len(state.data_problems))
    yield up
    yield restarts
    yield crash_loop
    yield errors
    yield implausible


# The stream's health counters: (family stem, EventStreamHealth field, help).
STREAM_COUNTERS = (
    ("kv_event_batches", "batches_total", "KV event batches received and applied to the index."),
    ("kv_event_gaps", "gaps_total", "Jumps in the KV event batches' sequence numbers (batches missed in between)."),
    ("kv_event_replayed_batches", "replayed_batches_total", "Missed KV event batches got back from the publisher's "
     "replay socket."),
    ("kv_event_dropped_batches", "dropped_batches_total", "Missed KV event batches the replay could not give: the "
     "index may be off until the next reset."),
    ("kv_event_malformed", "malformed_total", "KV event messages that were not an event batch (skipped)."),
    ("kv_event_publisher_restarts", "publisher_restarts_total", "Times the publisher's sequence started again (a "
     "new engine process): the index was emptied."),
)
# What the index saw, from the snapshot's view: (family stem, KvEventStats field, help).
INDEX_COUNTERS = (
    ("kv_blocks_stored", "stores_total", "Blocks the engine stored in its prefix cache (KV events)."),
    ("kv_blocks_removed", "removes_total", "Blocks the engine evicted from its prefix cache (KV events)."),
    ("kv_block_restores", "restores_total", "Stores of a block removed within the restore window: work computed "
     "again (prefix-cache thrash)."),
)


def _event_families(sup: Supervisor, kinds: dict[str, str]) -> Iterator[Metric]:
    """The KV event streams: events by type and the stream's health, from the feed at scrape time; the index's
    counters, from the latest snapshot of an engine that is up (as the other snapshot series), and its resident
    blocks by medium unless the stream is stale. An engine without events has none of these."""
    feeds = sup.event_feeds
    now = sup.clock()
    events = CounterMetricFamily("kvops_engine_kv_events", "KV cache events received, by type (BlockStored, "
                                 "BlockRemoved, AllBlocksCleared; unknown: types kvops skips).",
                                 labels=[*ENGINE_LABELS, "type"])
    counters = {stem: CounterMetricFamily(f"kvops_engine_{stem}", text, labels=ENGINE_LABELS)
                for stem, _, text in (*STREAM_COUNTERS, *INDEX_COUNTERS)}
    age = GaugeMetricFamily("kvops_engine_kv_event_last_age_seconds", "Seconds since the last KV event batch "
                            "arrived (absent before the first).", labels=ENGINE_LABELS)
    stale = GaugeMetricFamily("kvops_engine_kv_event_stream_stale", "1 when the KV event stream no longer "
                              "describes the cache: no batch since the engine went down or restarted, or none while "
                              "it computed prompts.", labels=ENGINE_LABELS)
    broken = GaugeMetricFamily("kvops_engine_kv_event_stream_error", "1 while the KV event stream cannot be read "
                               "(GET /api/engines says why).", labels=ENGINE_LABELS)
    feed_errors = CounterMetricFamily("kvops_engine_kv_event_feed_errors", "Faults of kvops's KV event feed that the "
                                      "supervisor survived (the log has each).", labels=ENGINE_LABELS)
    resident = GaugeMetricFamily("kvops_engine_resident_blocks", "Blocks resident in the engine's prefix cache, by "
                                 "medium (KV events).", labels=[*ENGINE_LABELS, "medium"])
    for name, state in sup.engines.items():
        health = feeds.health(name, now)
        if health is None:
            continue
        labels = [name, kinds[name]]
        for kind in (*EVENT_TYPES, *(t for t in sorted(health.events_total) if t not in EVENT_TYPES)):
            events.add_metric([*labels, kind], health.events_total.get(kind, 0))
        for stem, field, _ in STREAM_COUNTERS:
            counters[stem].add_metric(labels, getattr(health, field))
        if health.last_event_age_s is not None:
            age.add_metric(labels, health.last_event_age_s)
        stale.add_metric(labels, 1 if health.stale else 0)
        broken.add_metric(labels, 1 if health.error else 0)
        feed_errors.add_metric(labels, feeds.errors.get(name, 0))
        snap = state.history.latest
        view = snap.kv_events if snap is not None and state.history.is_up is True else None
        if view is None:
            continue
        for stem, field, _ in INDEX_COUNTERS:
            counters[stem].add_metric(labels, getattr(view, field))
        if view.stream.stale:
            continue  # the resident set of a process that died, or that the stream no longer follows
        for medium, blocks in sorted(view.resident.items()):
            resident.add_metric([*labels, medium], blocks)
    yield events
    yield from counters.values()
    yield from (age, stale, broken, feed_errors, resident)


def _diagnosis_families(sup: Supervisor, kinds: dict[str, str]) -> Iterator[Metric]:
    active = GaugeMetricFamily("kvops_diagnosis_active", "Active diagnoses by rule, severity and engine "
                               "(the value counts subjects, e.g. tenants, when a rule fires for several).",
                               labels=["id", "severity", *ENGINE_LABELS])
    counted: dict[tuple[str, str, str, str], int] = {}
    for diagnosis in sup.diagnoses:
        kind = kinds.get(diagnosis.engine, "unknown")
        key = (diagnosis.rule, diagnosis.severity.value, diagnosis.engine, kind)
        counted[key] = counted.get(key, 0) + 1
    for key, count in sorted(counted.items()):
        active.add_metric(list(key), count)
    yield active
    severities = GaugeMetricFamily("kvops_diagnoses_active", "Active diagnoses per severity, all engines.",
                                   labels=["severity"])
    for severity in Severity:
        severities.add_metric([severity.value], sum(1 for d in sup.diagnoses if d.severity is severity))
    yield severities


def _fix_families(sup: Supervisor) -> Iterator[Metric]:
    fixes = CounterMetricFamily("kvops_fixes", "Fix steps by outcome: proposed, queued, applying, verifying, "
                                "verified, rolled_back, reverted, failed.", labels=["engine", "rule", "outcome"])
    for (engine, rule, outcome), count in sorted(sup.fixes.counts.items()):
        fixes.add_metric([engine, rule, outcome], count)
    yield fixes
    jobs = GaugeMetricFamily("kvops_fix_jobs", "Fix jobs by state (queued, applying, verifying, reverting; "
                             "the finished ones GET /api/fixes keeps count under their outcome).",
                             labels=["engine", "rule", "state"])
    by_state: dict[tuple[str, str, str], int] = {}
    for job in sup.fixes.job_views():
        key = (job["engine"], job["rule"], job["state"])
        by_state[key] = by_state.get(key, 0) + 1
    for key, count in sorted(by_state.items()):
        jobs.add_metric(list(key), count)
    yield jobs


def _alert_families(sup: Supervisor) -> Iterator[Metric]:
    stats = sup.alerter.stats()
    deliveries = CounterMetricFamily("kvops_alert_deliveries", "Alert notifications delivered (2xx).",
                                     labels=["receiver"])
    failures = CounterMetricFamily("kvops_alert_delivery_failures", "Failed delivery attempts (retried).",
                                   labels=["receiver"])
    for receiver, count in sorted(stats.delivered.items()):
        deliveries.add_metric([receiver], count)
    for receiver, count in sorted(stats.failed_attempts.items()):
        failures.add_metric([receiver], count)
    yield deliveries
    yield failures
    # alerting watching itself (docs/alerting.md, "When kvops itself fails"): per receiver, so one that
    # is down, refusing or disabled shows by name
    dead = CounterMetricFamily("kvops_alert_dead_letters", "Notifications a receiver refused for good "
                               "(4xx other than 408/429, twice): kept in the outbox, not retried.",
                               labels=["receiver"])
    yield GaugeMetricFamily("kvops_alert_outbox_pending", "Notifications waiting in the outbox.",
                            value=stats.pending)
    pending = GaugeMetricFamily("kvops_alert_receiver_pending", "Notifications waiting in the outbox for the "
                                "receiver.", labels=["receiver"])
    oldest = GaugeMetricFamily("kvops_alert_outbox_oldest_pending_age_seconds", "Age of the oldest "
                               "notification waiting in the outbox (0 when none).", labels=["receiver"])
    last = GaugeMetricFamily("kvops_alert_last_delivery_timestamp_seconds", "Last delivery (2xx) to the "
                             "receiver, unix seconds (0 before any).", labels=["receiver"])
    enabled = GaugeMetricFamily("kvops_alert_receiver_enabled", "1 when the receiver is in use, 0 when "
                                "disabled (its secret's environment variable is unset).", labels=["receiver"])
    for receiver, state in sorted(stats.receivers.items()):
        dead.add_metric([receiver], state.dead_letters)
        pending.add_metric([receiver], state.pending)
        oldest.add_metric([receiver], state.oldest_pending_age_s or 0.0)
        last.add_metric([receiver], state.last_delivered_at or 0.0)
        enabled.add_metric([receiver], 1 if state.enabled else 0)
    yield from (dead, pending, oldest, last, enabled)
    firing = GaugeMetricFamily("kvops_alerts", "Alerts by state.", labels=["state"])
    alerts = sup.alerter.active_alerts()
    for state in ("pending", "firing"):
        firing.add_metric([state], sum(1 for a in alerts if a.state == state))
    yield firing


def _self_monitoring(sup: Supervisor, kinds: dict[str, str]) -> Iterator[Metric]:
    """kvops's own faults: rules that raised, and diagnoses that cleared and came back (flaps). Every rule
    and engine has its series from the start, so the first error is an increase Prometheus can see."""
    rule_errors = CounterMetricFamily("kvops_rule_errors", "Rule evaluations that raised an exception (the rule "
                                      "was skipped that poll; the supervisor log has the traceback).",
                                      labels=["rule", *ENGINE_LABELS])
    flaps = CounterMetricFamily("kvops_diagnosis_flaps", "Diagnoses raised again within 10 minutes of clearing "
                                "(after their clear_for_s).", labels=["rule", *ENGINE_LABELS])
    for name, kind in kinds.items():
        for rule in RULES:
            rule_errors.add_metric([rule, name, kind], sup.rule_errors.get((rule, name), 0))
            flaps.add_metric([rule, name, kind], sup.hysteresis.flaps.get((rule, name), 0))
    yield rule_errors
    yield flaps
    profiling = GaugeMetricFamily("kvops_engine_profiling", "1 while kvops profiles the engine (serving pauses; "
                                  "failed polls then do not count as down).", labels=["profile", *ENGINE_LABELS])
    for name, state in sup.engines.items():
        for profile in ("kv", "block_size"):
            profiling.add_metric([profile, name, kinds[name]], 1 if state.probes.running == profile else 0)
    yield profiling


def render(supervisor: Supervisor) -> tuple[bytes, str]:
    registry = CollectorRegistry()
    registry.register(SupervisorCollector(supervisor))
    return generate_latest(registry), CONTENT_TYPE_LATEST
