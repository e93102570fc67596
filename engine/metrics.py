"""The engine's Prometheus exposition (`/metrics`), with the official `prometheus-client`.

Two kinds of metrics share one private `CollectorRegistry`:

- event metrics (histograms and a counter) that the engine updates as requests finish and tokens
  come out, through the `observe_*` methods;
- everything else, read from the latest `Snapshot` at scrape time by a custom collector, so that
  `/metrics` and `/stats` always agree.

A scrape never fails because of one bad read: when `snapshot_fn` raises, the snapshot families are
left out (and `kvops_metrics_snapshot_errors_total` counts it) while the event metrics still go out.
Every metric is listed in docs/metrics.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvops.engine.config import DEFAULT_MAX_TENANT_LABELS
from kvops.engine.stats import LATENCY_BUCKETS
from kvops.schema.snapshot import BLOCK_STATE_CODES, ProcessStats, Snapshot, TenantStats

log = structlog.get_logger("kvops.engine.metrics")

OTHER_TENANT = "other"  # the label of the tenants summed together (TenantLabels)
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


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    # `name` carries no `_total`: the client appends it to the sample.
    return CounterMetricFamily(name, documentation, value=value)


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


def snapshot_families(snap: Snapshot, labels: TenantLabels | None = None) -> Iterator[Metric]:
    """Every snapshot-derived metric family, values exactly those of the snapshot (`/stats`); per-tenant values
    summed by `labels` (None: every tenant its own label)."""
    engine = snap.engine
    info = GaugeMetricFamily(
        "kvops_engine_info", "Engine identity and configuration; always 1.",
        labels=["model", "block_size", "kv_cache_dtype", "dtype", "eviction_policy", "device", "version"],
    )
    info.add_metric([engine.model, str(engine.block_size), engine.kv_cache_dtype, engine.dtype,
                     engine.eviction_policy, engine.device, engine.engine_version], 1)
    yield info
    yield _gauge("kvops_engine_start_time_seconds", "Engine start time, unix seconds.", engine.started_at)
    yield _gauge("kvops_engine_max_model_len", "Longest sequence (prompt + generation) accepted, in tokens.",
                 engine.max_model_len)
    yield _gauge("kvops_engine_max_num_seqs", "Most sequences running at once.", engine.max_num_seqs)
    yield _gauge("kvops_engine_max_num_batched_tokens", "Token budget of one engine step.",
                 engine.max_num_batched_tokens)
    yield _gauge("kvops_prefix_caching_enabled", "1 when prefix caching is on, else 0.",
                 1 if engine.enable_prefix_caching else 0)
    # A value, not only the info label: PromQL cannot compute with a label (blocks per request in alerts/).
    yield _gauge("kvops_engine_block_size", "Tokens per KV block.", engine.block_size)

    # KV cache pool
    yield _gauge("kvops_kv_pool_blocks", "Blocks in the KV pool.", engine.num_blocks)
    yield _gauge("kvops_kv_cache_bytes", "Bytes of the preallocated KV pool.", engine.kv_cache_bytes)
    yield _gauge("kvops_kv_bytes_per_token", "KV bytes one token takes, all layers, K and V.", engine.bytes_per_token)
    yield _gauge("kvops_kv_cache_usage_ratio", "Fraction of blocks holding live sequences' K/V (filling + full).",
                 snap.blocks.usage)
    blocks = GaugeMetricFamily("kvops_kv_blocks", "Blocks in each state; the device states sum to the pool size, "
                               "swapped counts host-pool blocks.", labels=["state"])
    for state in BLOCK_STATE_CODES:
        blocks.add_metric([state], snap.blocks.counts.get(state, 0))
    yield blocks
    yield _gauge("kvops_kv_allocated_slots", "Token slots in blocks held by live sequences.",
                 snap.blocks.allocated_slots)
    yield _gauge("kvops_kv_used_slots", "Allocated token slots that hold a computed token.", snap.blocks.used_slots)

    # prefix cache
    yield _counter("kvops_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (first admission only).",
                   snap.prefix_cache.queries_total)
    yield _counter("kvops_prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                   snap.prefix_cache.hits_total)
    yield _counter("kvops_prefix_cache_evictions", "Cached blocks evicted to make room.",
                   snap.prefix_cache.evictions_total)
    # The shadow lookups behind the prompt_variance and prefix_caching_off rules, so Prometheus rules can
    # compare the same hit rates the supervisor does.
    yield _counter("kvops_prefix_cache_shadow_queries", "Normalization shadow mode: prompt tokens looked up in "
                   "the normalized shadow cache.", snap.prefix_cache.shadow_queries_total)
    yield _counter("kvops_prefix_cache_shadow_hits", "Normalization shadow mode: prompt tokens that would have hit "
                   "with normalization on.", snap.prefix_cache.shadow_hits_total)
    yield _counter("kvops_prefix_cache_potential_queries", "Prefix caching off: prompt tokens looked up in the "
                   "shadow cache.", snap.prefix_cache.potential_queries_total)
    yield _counter("kvops_prefix_cache_potential_hits", "Prefix caching off: prompt tokens caching would have "
                   "served.", snap.prefix_cache.potential_hits_total)

    # requests
    yield _gauge("kvops_num_requests_running", "Sequences running.", snap.requests.running)
    yield _gauge("kvops_num_requests_waiting", "Requests waiting for admission.", snap.requests.waiting)
    yield _counter("kvops_num_preemptions", "Sequences preempted for lack of blocks.", snap.requests.preemptions_total)
    yield _counter("kvops_prompt_tokens", "Prompt tokens admitted.", snap.requests.prompt_tokens_total)
    yield _counter("kvops_generation_tokens", "Tokens generated.", snap.requests.generation_tokens_total)
    yield _counter("kvops_requests_aborted", "Requests aborted.", snap.requests.aborted_total)

    # swap
    swap = snap.swap
    yield _gauge("kvops_host_pool_blocks", "Blocks in the host swap pool (--swap-space).", swap.host_blocks)
    yield _gauge("kvops_swapped_blocks", "Blocks whose content is in the host swap pool.", swap.swapped_blocks)
    yield _gauge("kvops_swapped_sequences", "Sequences swapped out, waiting to resume.", swap.swapped_seqs)
    yield _counter("kvops_swap_out_blocks", "Blocks swapped out to host memory.", swap.swap_out_total)
    yield _counter("kvops_swap_in_blocks", "Blocks swapped back in from host memory.", swap.swap_in_total)
    yield _counter("kvops_swap_preemptions", "Preemptions that swapped a sequence out.", swap.swap_preemptions_total)
    yield _counter("kvops_swap_fallbacks", "Preemptions that would have swapped but found the host pool full "
                   "and recomputed instead.", swap.swap_fallbacks_total)
    yield _gauge("kvops_swap_out_rate_blocks_per_second", "Blocks swapped out per second over the snapshot window.",
                 swap.window.swap_out_per_s)
    yield _gauge("kvops_swap_in_rate_blocks_per_second", "Blocks swapped in per second over the snapshot window.",
                 swap.window.swap_in_per_s)
    yield _gauge("kvops_swap_rate", "Blocks swapped out per block allocated over the snapshot window (0..1+).",
                 swap.window.swap_rate)

    # tenants: at most `labels.limit` of them by name, the rest summed as tenant="other" (TenantLabels)
    by_label = _tenants_by_label(snap, labels)
    tenant_families: list[tuple[Metric, str]] = [
        (GaugeMetricFamily("kvops_tenant_blocks", "Blocks held by the tenant's live sequences.",
                           labels=["tenant"]), "blocks_held"),
        (CounterMetricFamily("kvops_tenant_requests", "Requests admitted for the tenant.",
                             labels=["tenant"]), "requests_total"),
        (CounterMetricFamily("kvops_tenant_prompt_tokens", "Prompt tokens admitted for the tenant.",
                             labels=["tenant"]), "prompt_tokens_total"),
        (CounterMetricFamily("kvops_tenant_prefix_hit_tokens", "The tenant's prompt tokens served from the cache.",
                             labels=["tenant"]), "hit_tokens_total"),
        (CounterMetricFamily("kvops_tenant_cross_evictions_caused",
                             "Other tenants' cached blocks evicted by this tenant's allocations.",
                             labels=["tenant"]), "evictions_caused"),
        (CounterMetricFamily("kvops_tenant_cross_evictions_suffered",
                             "This tenant's cached blocks evicted by other tenants' allocations.",
                             labels=["tenant"]), "evictions_suffered"),
    ]
    for family, field in tenant_families:
        for label, members in by_label.items():
            family.add_metric([label], sum(getattr(stats, field) for stats in members))
        yield family

    # process
    process = snap.process
    yield _gauge("kvops_process_resident_memory_bytes", "Resident memory of the engine process.", process.rss_bytes)
    yield _gauge("kvops_process_cpu_usage_ratio",
                 "CPU used by the engine process, in cores (psutil cpu_percent / 100; above 1 on several cores).",
                 process.cpu_percent / 100.0)
    yield _gauge("kvops_process_threads", "Threads of the engine process.", process.num_threads)
    if process.torch_threads is not None:
        yield _gauge("kvops_engine_torch_threads", "Torch threads the forward pass runs on (--threads; auto follows "
                     "the CPUs other processes leave free).", process.torch_threads)
    if process.others_busy_cpus is not None:
        yield _gauge("kvops_engine_others_busy_cpus", "CPUs' worth of work other processes did at the last --threads "
                     "auto check, in cores.", process.others_busy_cpus)
    yield from gpu_families(process)


def gpu_families(process: ProcessStats) -> Iterator[Metric]:
    """Per GPU NVML reads (label `gpu`: NVML's index, `name`): a series only for a fact that was read, so a
    CPU engine, a missing NVML or an unknown split has no series rather than a 0; `kvops_gpu_status_info`
    says why (its `status` is the snapshot's `gpu_status`)."""
    status = GaugeMetricFamily("kvops_gpu_status_info", "Why GPU series are present or not: status is \"ok\" or "
                               "the reason (no GPU: the engine runs on cpu, NVML unavailable: ...); always 1.",
                               labels=["status"])
    status.add_metric([process.gpu_status], 1)
    yield status
    labels = ["gpu", "name"]
    families = {
        "total": GaugeMetricFamily("kvops_gpu_memory_total_bytes", "GPU memory in total (NVML).", labels=labels),
        "used": GaugeMetricFamily("kvops_gpu_memory_used_bytes", "GPU memory in use by every process (NVML).",
                                  labels=labels),
        "free": GaugeMetricFamily("kvops_gpu_memory_free_bytes", "GPU memory free (NVML).", labels=labels),
        "kvops": GaugeMetricFamily("kvops_gpu_memory_used_by_kvops_bytes", "GPU memory held by this engine process "
                                   "(NVML per-process list, else torch's reserved memory).", labels=labels),
        "others": GaugeMetricFamily("kvops_gpu_memory_used_by_others_bytes", "GPU memory in use by other processes "
                                    "and the driver (used minus this engine's).", labels=labels),
        "util": GaugeMetricFamily("kvops_gpu_utilization_ratio", "GPU busy fraction over NVML's last sample "
                                  "period.", labels=labels),
        "engine": GaugeMetricFamily("kvops_gpu_engine_device", "1 on the GPU the engine runs on, 0 on the others "
                                    "listed.", labels=labels),
    }
    for gpu in process.gpus:
        values = {"total": gpu.memory_total_bytes, "used": gpu.memory_used_bytes, "free": gpu.memory_free_bytes,
                  "kvops": gpu.memory_kvops_bytes, "others": gpu.memory_others_bytes,
                  "util": gpu.utilization_percent / 100.0 if gpu.utilization_known else None,
                  "engine": 1 if gpu.engine_device else 0}
        for key, value in values.items():
            if value is not None:
                families[key].add_metric([str(gpu.index), gpu.name], value)
    yield from (family for family in families.values() if family.samples)


class EngineMetrics:
    """The engine's `/metrics`: event metrics updated by the engine plus the latest snapshot at scrape time."""

    def __init__(self, snapshot_fn: Callable[[], Snapshot],
                 max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        self.tenant_labels = TenantLabels(max_tenant_labels)
        self.registry = CollectorRegistry()
        events = CollectorRegistry()
        self._events = events

        def per_tenant(name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, documentation, ["tenant"], buckets=buckets, registry=events)

        self.request_prompt_tokens = per_tenant(
            "kvops_request_prompt_tokens", "Prompt length of finished requests, in tokens.", TOKEN_BUCKETS)
        self.request_generation_tokens = per_tenant(
            "kvops_request_generation_tokens", "Tokens generated per finished request.", TOKEN_BUCKETS)
        self.time_to_first_token = per_tenant(
            "kvops_time_to_first_token_seconds", "Time from arrival to the first generated token.", LATENCY_BUCKETS)
        self.inter_token_latency = per_tenant(
            "kvops_inter_token_latency_seconds", "Time between consecutive generated tokens of a request.",
            LATENCY_BUCKETS)
        self.e2e_latency = per_tenant(
            "kvops_e2e_request_latency_seconds", "Time from arrival to finish of a request.", LATENCY_BUCKETS)
        self.requests_finished = Counter(
            "kvops_requests_finished", "Requests finished, by finish reason (stop, length, abort).",
            ["tenant", "finish_reason"], registry=events,
        )
        self.snapshot_errors = Counter(
            "kvops_metrics_snapshot_errors", "Scrapes whose snapshot read failed (snapshot metrics left out).",
            registry=events,
        )
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


__all__ = ["LATENCY_BUCKETS", "OTHER_TENANT", "TOKEN_BUCKETS", "EngineMetrics", "TenantLabels", "snapshot_families"]
