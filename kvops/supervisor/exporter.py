"""The supervisor's `/metrics`: its own health, the engines it watches, diagnoses, fixes, alerts.

Everything is read from the supervisor's state at scrape time (a custom collector), so the
exposition can never disagree with the supervisor API.

Per engine it also republishes the numbers that mean the same on every kind of engine (KV usage,
prefix cache, queue, preemptions, block size), read from the snapshot it holds for the engine: the
kvops engine's own `/stats`, or vLLM's and SGLang's `/metrics` read by `kvops.adapters`. They carry
the labels `engine` and `kind`, so one alert or dashboard query works on every kind. A field the
engine does not report (`Snapshot.unknown`) has no series, rather than a made-up 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvops import __version__
from kvops.rules import RULES
from kvops.schema.diagnosis import Severity
from kvops.schema.snapshot import GpuStats, Snapshot

if TYPE_CHECKING:
    from kvops.supervisor.supervisor import EngineState, Supervisor

FIX_OUTCOMES = ("proposed", "queued", "applying", "verifying", "verified", "rolled_back", "reverted", "failed")
ENGINE_LABELS = ["engine", "kind"]


def engine_kind(state: EngineState) -> str:
    """The engine's kind: its latest snapshot's source, else the configured kind (a managed `auto` is a kvops
    engine; a watched one stays `auto` until it first answers)."""
    latest = state.history.latest
    if latest is not None:
        return latest.source
    kind = str(state.spec.kind)
    return "kvops" if kind == "auto" and state.spec.managed else kind


# Per-engine series read from the latest snapshot: (name, type, help, the field it needs, value).
SnapshotGetter = Callable[[Snapshot], float]
SNAPSHOT_SERIES: tuple[tuple[str, str, str, str, SnapshotGetter], ...] = (
    ("kvops_engine_kv_cache_usage_ratio", "gauge",
     "Fraction (0-1) of the KV pool holding running sequences' K/V; the rest is free or cached (reclaimable).",
     "blocks.usage", lambda s: s.blocks.usage),
    ("kvops_engine_kv_pool_blocks", "gauge", "Blocks in the engine's KV pool.",
     "engine.num_blocks", lambda s: s.engine.num_blocks),
    ("kvops_engine_kv_block_size_tokens", "gauge", "Tokens per KV block.",
     "engine.block_size", lambda s: s.engine.block_size),
    ("kvops_engine_prefix_caching_enabled", "gauge", "1 when prefix caching is on, else 0.",
     "engine.enable_prefix_caching", lambda s: 1.0 if s.engine.enable_prefix_caching else 0.0),
    ("kvops_engine_prefix_cache_query_tokens", "counter", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache.queries_total", lambda s: s.prefix_cache.queries_total),
    ("kvops_engine_prefix_cache_hit_tokens", "counter", "Prompt tokens served from the prefix cache.",
     "prefix_cache.hits_total", lambda s: s.prefix_cache.hits_total),
    ("kvops_engine_prefix_cache_hit_ratio", "gauge",
     "Prefix cache hits over lookups (0-1) since the engine started; rate the token counters for a window.",
     "prefix_cache.hit_rate", lambda s: s.prefix_cache.hit_rate),
    ("kvops_engine_requests_running", "gauge", "Requests running.",
     "requests.running", lambda s: s.requests.running),
    ("kvops_engine_requests_waiting", "gauge", "Requests waiting for admission.",
     "requests.waiting", lambda s: s.requests.waiting),
    ("kvops_engine_preemptions", "counter", "Sequences preempted for lack of KV blocks.",
     "requests.preemptions_total", lambda s: s.requests.preemptions_total),
    ("kvops_engine_prompt_tokens", "counter", "Prompt tokens admitted.",
     "requests.prompt_tokens_total", lambda s: s.requests.prompt_tokens_total),
    ("kvops_engine_generation_tokens", "counter", "Tokens generated.",
     "requests.generation_tokens_total", lambda s: s.requests.generation_tokens_total),
)


def snapshot_families(states: Iterable[EngineState]) -> Iterator[Metric]:
    """SNAPSHOT_SERIES for every engine that answered its last poll, labelled engine and kind; then its GPUs."""
    families = {name: (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, text, labels=ENGINE_LABELS)
                for name, kind, text, _, _ in SNAPSHOT_SERIES}
    up: list[tuple[str, Snapshot]] = []
    for state in states:
        snap = state.history.latest
        if snap is None or state.history.is_up is not True:
            continue  # no stale numbers for an engine that is down
        up.append((state.name, snap))
        labels = [state.name, snap.source]
        for name, _, _, field, value in SNAPSHOT_SERIES:
            if snap.knows(field):
                families[name].add_metric(labels, float(value(snap)))
    yield from families.values()
    yield from _gpu_families(up)


# Per-engine GPU series: (name, help, value or None when not read). Only the engine's own GPU(s): the other GPUs
# of its host would repeat under every engine there.
GpuGetter = Callable[[GpuStats], float | None]
GPU_SERIES: tuple[tuple[str, str, GpuGetter], ...] = (
    ("kvops_engine_gpu_memory_total_bytes", "Memory of the engine's GPU (NVML).", lambda g: g.memory_total_bytes),
    ("kvops_engine_gpu_memory_used_bytes", "Memory in use on the engine's GPU, every process (NVML).",
     lambda g: g.memory_used_bytes),
    ("kvops_engine_gpu_memory_free_bytes", "Memory free on the engine's GPU (NVML).", lambda g: g.memory_free_bytes),
    ("kvops_engine_gpu_memory_used_by_kvops_bytes", "Memory the engine process holds on its GPU.",
     lambda g: g.memory_kvops_bytes),
    ("kvops_engine_gpu_memory_used_by_others_bytes", "Memory other processes (and the driver) use on the engine's "
     "GPU.", lambda g: g.memory_others_bytes),
    ("kvops_engine_gpu_utilization_ratio", "Busy fraction (0-1) of the engine's GPU over NVML's last sample period.",
     lambda g: g.utilization_percent / 100.0 if g.utilization_known else None),
)


def _gpu_families(engines: list[tuple[str, Snapshot]]) -> Iterator[Metric]:
    """The engines' GPU facts where read, labelled gpu and name too, and each engine's gpu_status (the reason
    when there are none: a CPU engine, NVML unavailable, a kind that does not report its GPU)."""
    status = GaugeMetricFamily("kvops_engine_gpu_status_info", "The engine's GPU read: status is \"ok\" or why "
                               "there are no GPU series (e.g. no GPU: the engine runs on cpu); always 1.",
                               labels=[*ENGINE_LABELS, "status"])
    families = {name: GaugeMetricFamily(name, text, labels=[*ENGINE_LABELS, "gpu", "name"])
                for name, text, _ in GPU_SERIES}
    for engine, snap in engines:
        status.add_metric([engine, snap.source, snap.process.gpu_status], 1)
        if not snap.knows("process.gpus"):
            continue
        for gpu in snap.process.engine_gpus():
            for name, _, value in GPU_SERIES:
                number = value(gpu)
                if number is not None:
                    families[name].add_metric([engine, snap.source, str(gpu.index), gpu.name], float(number))
    yield status
    yield from families.values()


class SupervisorCollector(Collector):
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterable[Metric]:
        sup = self.supervisor
        info = GaugeMetricFamily("kvops_supervisor_info", "Supervisor version; always 1.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield GaugeMetricFamily("kvops_supervisor_start_time_seconds", "Supervisor start time, unix seconds.",
                                value=sup.started_at)
        yield CounterMetricFamily("kvops_supervisor_polls", "Poll cycles completed.", value=sup.polls_total)
        yield GaugeMetricFamily("kvops_supervisor_last_poll_duration_seconds",
                                "Duration of the last poll cycle (all engines, rules, alerts, fixes).",
                                value=sup.last_poll_s)

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
        kinds = {name: engine_kind(state) for name, state in sup.engines.items()}
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
        yield from snapshot_families(sup.engines.values())

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
        yield from _self_monitoring(sup, kinds)

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
