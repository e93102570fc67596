"""Snapshot ↔ Prometheus, declared once: every metric a kvops engine's `/metrics` exposes, and the per-engine
series the supervisor's `/metrics` republishes from the snapshot it holds.

Three places derive from these tables and nowhere else names a metric: the engine's exposition
(`kvops.engine.serving.metrics`), the adapter that reads a kvops engine's scrape back into a snapshot
(`kvops.adapters.kvops_metrics`) and the supervisor's exporter (`kvops.supervisor.exporter`).

Two naming schemes, each a prefix before one stem: the engine's own `kvops_<stem>`, and the supervisor's
`kvops_engine_<stem>` with the labels `engine` and `kind` before the row's own. A scheme's name is written
out only where it breaks its rule (the engine's older names: `kvops_num_requests_running`, not
`kvops_requests_running`). Counters are named without `_total`: prometheus-client appends it to the sample.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

from kvops.schema.snapshot import Snapshot

ENGINE_PREFIX = "kvops_"
SUPERVISOR_PREFIX = "kvops_engine_"
SUPERVISOR_LABELS = ("engine", "kind")  # before each row's own labels on the supervisor's series
EACH = "*"  # in a field path: each key of a dict (tenants, block states) or each item of a list (GPUs)


class MetricType(StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class Exposed:
    """How one scheme exposes a row: its HELP text ("": the engine's), and its name where the scheme's rule does not
    give it."""

    help: str = ""
    name: str = ""


@dataclass(frozen=True, slots=True)
class SnapshotMetric:
    """One snapshot field as a metric family.

    `field` is a dotted path into `Snapshot`; with EACH in it, the family has one series per key or item, named
    by `labels` (a block state, a tenant, a GPU's index and name). The value is the field divided by `divisor`
    (percent as a ratio: 100); a reader multiplies it back. `optional`: a None field has no series (never a
    made-up 0), and a family left without series is left out (no GPU families on a CPU engine). `known`: a boolean
    field beside the field's own that is False when the value was not read.
    `vital`: a scrape without the series marks the field unknown in the snapshot read back, because rules and
    doctor judge it; the others read as their neutral 0.
    """

    stem: str
    type: MetricType
    field: str
    unit: str
    engine: Exposed | None
    supervisor: Exposed | None = None
    labels: tuple[str, ...] = ()
    divisor: float = 1.0
    optional: bool = False
    known: str = ""
    vital: bool = False

    @property
    def engine_name(self) -> str:
        """The engine's family name ("" when the engine does not expose the row)."""
        if self.engine is None:
            return ""
        return self.engine.name or ENGINE_PREFIX + self.stem

    @property
    def supervisor_name(self) -> str:
        """The supervisor's family name ("" when the supervisor does not republish the row)."""
        if self.supervisor is None:
            return ""
        return self.supervisor.name or SUPERVISOR_PREFIX + self.stem

    @property
    def supervisor_help(self) -> str:
        if self.supervisor is None:
            return ""
        return self.supervisor.help or (self.engine.help if self.engine else "")

    @property
    def engine_sample(self) -> str:
        """The sample name in the engine's text: a counter's with `_total`."""
        return sample_name(self.engine_name, self.type)


@dataclass(frozen=True, slots=True)
class EventMetric:
    """A metric the engine updates as requests finish (not read from the snapshot), and the snapshot field a
    scrape's values are read into (None: not read back)."""

    name: str
    type: MetricType
    help: str
    unit: str
    labels: tuple[str, ...]
    reads_into: str | None


def sample_name(family: str, kind: MetricType) -> str:
    return family + "_total" if kind is MetricType.COUNTER else family


def _g(stem: str, field: str, unit: str, text: str, **options: Any) -> SnapshotMetric:
    return SnapshotMetric(stem, MetricType.GAUGE, field, unit, Exposed(text), **options)


def _c(stem: str, field: str, unit: str, text: str, **options: Any) -> SnapshotMetric:
    return SnapshotMetric(stem, MetricType.COUNTER, field, unit, Exposed(text), **options)


TOKENS = "tokens"
BLOCKS = "blocks"
BYTES = "bytes"
GPU_LABELS = ("gpu", "name")

# The engine identity family: always 1, each label the value of one `engine.` field.
ENGINE_INFO = "kvops_engine_info"
ENGINE_INFO_HELP = "Engine identity and configuration; always 1."
ENGINE_INFO_LABELS: dict[str, str] = {
    "model": "engine.model", "block_size": "engine.block_size", "kv_cache_dtype": "engine.kv_cache_dtype",
    "dtype": "engine.dtype", "eviction_policy": "engine.eviction_policy", "device": "engine.device",
    "version": "engine.engine_version",
}

# In the engine's exposition order. The supervisor republishes the rows with a `supervisor` entry, in its own order
# (SUPERVISOR_ORDER), the numbers that mean the same on every kind of engine.
SNAPSHOT_METRICS: tuple[SnapshotMetric, ...] = (
    _g("engine_start_time_seconds", "engine.started_at", "unix seconds", "Engine start time, unix seconds."),
    _g("engine_max_model_len", "engine.max_model_len", TOKENS,
       "Longest sequence (prompt + generation) accepted, in tokens.", vital=True),
    _g("engine_max_num_seqs", "engine.max_num_seqs", "sequences", "Most sequences running at once.", vital=True),
    _g("engine_max_num_batched_tokens", "engine.max_num_batched_tokens", TOKENS, "Token budget of one engine step."),
    _g("prefix_caching_enabled", "engine.enable_prefix_caching", "", "1 when prefix caching is on, else 0.",
       supervisor=Exposed()),
    # A value, not only the info label: PromQL cannot compute with a label (blocks per request in alerts/).
    _g("engine_block_size", "engine.block_size", TOKENS, "Tokens per KV block.",
       supervisor=Exposed(name="kvops_engine_kv_block_size_tokens")),
    # KV cache pool
    _g("kv_pool_blocks", "engine.num_blocks", BLOCKS, "Blocks in the KV pool.", vital=True,
       supervisor=Exposed("Blocks in the engine's KV pool.")),
    _g("kv_cache_bytes", "engine.kv_cache_bytes", BYTES, "Bytes of the preallocated KV pool.", vital=True),
    _g("kv_bytes_per_token", "engine.bytes_per_token", BYTES, "KV bytes one token takes, all layers, K and V.",
       vital=True),
    _g("kv_cache_usage_ratio", "blocks.usage", "ratio", "Fraction of blocks holding live sequences' K/V "
       "(filling + full).", vital=True, supervisor=Exposed(
           "Fraction (0-1) of the KV pool holding running sequences' K/V; the rest is free or cached (reclaimable).")),
    _g("kv_blocks", f"blocks.counts.{EACH}", BLOCKS, "Blocks in each state; the device states sum to the pool size, "
       "swapped counts host-pool blocks.", labels=("state",)),
    _g("kv_allocated_slots", "blocks.allocated_slots", TOKENS, "Token slots in blocks held by live sequences."),
    _g("kv_used_slots", "blocks.used_slots", TOKENS, "Allocated token slots that hold a computed token."),
    # prefix cache
    _c("prefix_cache_queries", "prefix_cache.queries_total", TOKENS,
       "Prompt tokens looked up in the prefix cache (first admission only).", vital=True, supervisor=Exposed(
           "Prompt tokens looked up in the prefix cache.", "kvops_engine_prefix_cache_query_tokens")),
    _c("prefix_cache_hits", "prefix_cache.hits_total", TOKENS, "Prompt tokens served from the prefix cache.",
       vital=True, supervisor=Exposed(name="kvops_engine_prefix_cache_hit_tokens")),
    _c("prefix_cache_evictions", "prefix_cache.evictions_total", BLOCKS, "Cached blocks evicted to make room."),
    # The shadow lookups behind the prompt_variance and prefix_caching_off rules, so Prometheus rules can
    # compare the same hit rates the supervisor does.
    _c("prefix_cache_shadow_queries", "prefix_cache.shadow_queries_total", TOKENS, "Normalization shadow mode: "
       "prompt tokens looked up in the normalized shadow cache."),
    _c("prefix_cache_shadow_hits", "prefix_cache.shadow_hits_total", TOKENS, "Normalization shadow mode: prompt "
       "tokens that would have hit with normalization on."),
    _c("prefix_cache_potential_queries", "prefix_cache.potential_queries_total", TOKENS, "Prefix caching off: prompt "
       "tokens looked up in the shadow cache."),
    _c("prefix_cache_potential_hits", "prefix_cache.potential_hits_total", TOKENS, "Prefix caching off: prompt "
       "tokens caching would have served."),
    # Rates between counters are PromQL's on the engine; the supervisor's also serves vLLM V0, which exports only
    # a rate.
    SnapshotMetric("prefix_cache_hit_ratio", MetricType.GAUGE, "prefix_cache.hit_rate", "ratio", None, Exposed(
        "Prefix cache hits over lookups (0-1) since the engine started; rate the token counters for a window.")),
    # requests
    _g("num_requests_running", "requests.running", "requests", "Sequences running.", vital=True,
       supervisor=Exposed("Requests running.", "kvops_engine_requests_running")),
    _g("num_requests_waiting", "requests.waiting", "requests", "Requests waiting for admission.", vital=True,
       supervisor=Exposed(name="kvops_engine_requests_waiting")),
    _c("num_preemptions", "requests.preemptions_total", "preemptions", "Sequences preempted for lack of blocks.",
       vital=True, supervisor=Exposed("Sequences preempted for lack of KV blocks.", "kvops_engine_preemptions")),
    _c("prompt_tokens", "requests.prompt_tokens_total", TOKENS, "Prompt tokens admitted.",
       supervisor=Exposed()),
    _c("generation_tokens", "requests.generation_tokens_total", TOKENS, "Tokens generated.",
       supervisor=Exposed()),
    _c("requests_aborted", "requests.aborted_total", "requests", "Requests aborted."),
    # swap
    _g("host_pool_blocks", "swap.host_blocks", BLOCKS, "Blocks in the host swap pool (--swap-space)."),
    _g("swapped_blocks", "swap.swapped_blocks", BLOCKS, "Blocks whose content is in the host swap pool."),
    _g("swapped_sequences", "swap.swapped_seqs", "sequences", "Sequences swapped out, waiting to resume."),
    _c("swap_out_blocks", "swap.swap_out_total", BLOCKS, "Blocks swapped out to host memory."),
    _c("swap_in_blocks", "swap.swap_in_total", BLOCKS, "Blocks swapped back in from host memory."),
    _c("swap_preemptions", "swap.swap_preemptions_total", "preemptions", "Preemptions that swapped a sequence out."),
    _c("swap_fallbacks", "swap.swap_fallbacks_total", "preemptions", "Preemptions that would have swapped but found "
       "the host pool full and recomputed instead."),
    _g("swap_out_rate_blocks_per_second", "swap.window.swap_out_per_s", "blocks/s",
       "Blocks swapped out per second over the snapshot window."),
    _g("swap_in_rate_blocks_per_second", "swap.window.swap_in_per_s", "blocks/s",
       "Blocks swapped in per second over the snapshot window."),
    _g("swap_rate", "swap.window.swap_rate", "ratio",
       "Blocks swapped out per block allocated over the snapshot window (0..1+)."),
    # tenants: the engine caps the `tenant` label (kvops/tenancy/labels.py, TenantLabels)
    _g("tenant_blocks", f"tenants.{EACH}.blocks_held", BLOCKS, "Blocks held by the tenant's live sequences.",
       labels=("tenant",)),
    # The supervisor republishes these for every engine that reports tenants, or has a gateway that does
    # (kvops.supervisor.gateway_tenants), `tenant` capped per engine the same way.
    _c("tenant_requests", f"tenants.{EACH}.requests_total", "requests", "Requests admitted for the tenant.",
       labels=("tenant",), supervisor=Exposed()),
    _c("tenant_prompt_tokens", f"tenants.{EACH}.prompt_tokens_total", TOKENS, "Prompt tokens admitted for the tenant.",
       labels=("tenant",), supervisor=Exposed()),
    _c("tenant_prefix_hit_tokens", f"tenants.{EACH}.hit_tokens_total", TOKENS,
       "The tenant's prompt tokens served from the cache.", labels=("tenant",), supervisor=Exposed()),
    _c("tenant_cross_evictions_caused", f"tenants.{EACH}.evictions_caused", BLOCKS,
       "Other tenants' cached blocks evicted by this tenant's allocations.", labels=("tenant",)),
    _c("tenant_cross_evictions_suffered", f"tenants.{EACH}.evictions_suffered", BLOCKS,
       "This tenant's cached blocks evicted by other tenants' allocations.", labels=("tenant",)),
    # process
    _g("process_resident_memory_bytes", "process.rss_bytes", BYTES, "Resident memory of the engine process."),
    _g("process_cpu_usage_ratio", "process.cpu_percent", "cores", "CPU used by the engine process, in cores (psutil "
       "cpu_percent / 100; above 1 on several cores).", divisor=100.0),
    _g("process_threads", "process.num_threads", "threads", "Threads of the engine process."),
    _g("engine_torch_threads", "process.torch_threads", "threads", "Torch threads the forward pass runs on "
       "(--threads; auto follows the CPUs other processes leave free).", optional=True),
    _g("engine_others_busy_cpus", "process.others_busy_cpus", "cores", "CPUs' worth of work other processes did at "
       "the last --threads auto check, in cores.", optional=True),
    # GPUs, per NVML index: a series only for a fact that was read; the status says why there are none. The
    # supervisor republishes only the engine's own GPU(s): the other GPUs of its host would repeat under every engine.
    _g("gpu_status_info", "process.gpu_status", "", "Why GPU series are present or not: status is \"ok\" or the "
       "reason (no GPU: the engine runs on cpu, NVML unavailable: ...); always 1.", labels=("status",),
       supervisor=Exposed("The engine's GPU read: status is \"ok\" or why there are no GPU series (e.g. no GPU: the "
                          "engine runs on cpu); always 1.")),
    _g("gpu_memory_total_bytes", f"process.gpus.{EACH}.memory_total_bytes", BYTES, "GPU memory in total (NVML).",
       labels=GPU_LABELS, optional=True, supervisor=Exposed("Memory of the engine's GPU (NVML).")),
    _g("gpu_memory_used_bytes", f"process.gpus.{EACH}.memory_used_bytes", BYTES,
       "GPU memory in use by every process (NVML).", labels=GPU_LABELS, optional=True,
       supervisor=Exposed("Memory in use on the engine's GPU, every process (NVML).")),
    _g("gpu_memory_free_bytes", f"process.gpus.{EACH}.memory_free_bytes", BYTES, "GPU memory free (NVML).",
       labels=GPU_LABELS, optional=True, supervisor=Exposed("Memory free on the engine's GPU (NVML).")),
    _g("gpu_memory_used_by_kvops_bytes", f"process.gpus.{EACH}.memory_kvops_bytes", BYTES, "GPU memory held by this "
       "engine process (NVML per-process list, else torch's reserved memory).", labels=GPU_LABELS, optional=True,
       supervisor=Exposed("Memory the engine process holds on its GPU.")),
    _g("gpu_memory_used_by_others_bytes", f"process.gpus.{EACH}.memory_others_bytes", BYTES, "GPU memory in use by "
       "other processes and the driver (used minus this engine's).", labels=GPU_LABELS, optional=True,
       supervisor=Exposed("Memory other processes (and the driver) use on the engine's GPU.")),
    _g("gpu_utilization_ratio", f"process.gpus.{EACH}.utilization_percent", "ratio", "GPU busy fraction over NVML's "
       "last sample period.", labels=GPU_LABELS, divisor=100.0, optional=True, known="utilization_known",
       supervisor=Exposed("Busy fraction (0-1) of the engine's GPU over NVML's last sample period.")),
    _g("gpu_engine_device", f"process.gpus.{EACH}.engine_device", "", "1 on the GPU the engine runs on, 0 on the "
       "others listed.", labels=GPU_LABELS, optional=True),
)

# The supervisor's series in its exposition order (its per-engine scalars first, then the GPU status and GPUs).
SUPERVISOR_ORDER: tuple[str, ...] = (
    "kv_cache_usage_ratio", "kv_pool_blocks", "engine_block_size", "prefix_caching_enabled", "prefix_cache_queries",
    "prefix_cache_hits", "prefix_cache_hit_ratio", "num_requests_running", "num_requests_waiting", "num_preemptions",
    "prompt_tokens", "generation_tokens", "gpu_status_info", "gpu_memory_total_bytes", "gpu_memory_used_bytes",
    "gpu_memory_free_bytes", "gpu_memory_used_by_kvops_bytes", "gpu_memory_used_by_others_bytes",
    "gpu_utilization_ratio", "tenant_requests", "tenant_prompt_tokens", "tenant_prefix_hit_tokens",
)

# The engine's event metrics, per finished request or generated token; `tenant` capped like the snapshot's.
EVENT_METRICS: tuple[EventMetric, ...] = (
    EventMetric("kvops_request_prompt_tokens", MetricType.HISTOGRAM, "Prompt length of finished requests, in tokens.",
                TOKENS, ("tenant",), "prompt_lengths"),
    # Not read back: a kvops scrape's doctor report has always judged generation lengths from the token counters.
    EventMetric("kvops_request_generation_tokens", MetricType.HISTOGRAM, "Tokens generated per finished request.",
                TOKENS, ("tenant",), None),
    EventMetric("kvops_time_to_first_token_seconds", MetricType.HISTOGRAM,
                "Time from arrival to the first generated token.", "seconds", ("tenant",), "ttft"),
    EventMetric("kvops_inter_token_latency_seconds", MetricType.HISTOGRAM,
                "Time between consecutive generated tokens of a request.", "seconds", ("tenant",), "itl"),
    EventMetric("kvops_e2e_request_latency_seconds", MetricType.HISTOGRAM, "Time from arrival to finish of a request.",
                "seconds", ("tenant",), None),
    EventMetric("kvops_requests_finished", MetricType.COUNTER,
                "Requests finished, by finish reason (stop, length, abort).", "requests", ("tenant", "finish_reason"),
                "requests.finished_total"),
    EventMetric("kvops_metrics_snapshot_errors", MetricType.COUNTER,
                "Scrapes whose snapshot read failed (snapshot metrics left out).", "scrapes", (), None),
)


def by_stem(stem: str) -> SnapshotMetric:
    for row in SNAPSHOT_METRICS:
        if row.stem == stem:
            return row
    raise KeyError(stem)


def event(name: str) -> EventMetric:
    for row in EVENT_METRICS:
        if row.name == name:
            return row
    raise KeyError(name)


def supervisor_metrics() -> tuple[SnapshotMetric, ...]:
    """The rows the supervisor republishes, in its exposition order."""
    return tuple(by_stem(stem) for stem in SUPERVISOR_ORDER)


def field_value(obj: Any, path: str) -> Any:
    """The value at a dotted path below `obj` (a snapshot, or the item an EACH stands for), attribute by attribute."""
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def split_each(path: str) -> tuple[str, str]:
    """A path with EACH as (the collection's path, the field within each item; "" when the items are the values)."""
    collection, _, within = path.partition(f".{EACH}")
    return collection, within.removeprefix(".")


def field_type(path: str) -> type:
    """The Python type of a snapshot field (int, float, bool, str), read off the schema's models: how a reader turns
    a sample's float back into the field."""
    annotation: Any = Snapshot
    for part in path.split("."):
        if part == EACH:
            args = get_args(annotation)
            annotation = args[-1]  # dict[str, X] and list[X] alike
            continue
        annotation = annotation.model_fields[part].annotation
        if get_origin(annotation) in (Union, types.UnionType):
            annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        raise TypeError(f"{path} is a model, not a field")
    return annotation


__all__ = ["EACH", "ENGINE_INFO", "ENGINE_INFO_HELP", "ENGINE_INFO_LABELS", "ENGINE_PREFIX", "EVENT_METRICS",
           "GPU_LABELS", "SNAPSHOT_METRICS", "SUPERVISOR_LABELS", "SUPERVISOR_ORDER", "SUPERVISOR_PREFIX",
           "EventMetric", "Exposed", "MetricType", "SnapshotMetric", "by_stem", "event", "field_type", "field_value",
           "sample_name", "split_each", "supervisor_metrics"]
