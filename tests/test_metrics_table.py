"""kvops.schema.metrics, the one table of snapshot fields and their metrics: a snapshot's numbers go to the engine's
`/metrics` text and come back through the kvops adapter unchanged, the supervisor's exporter publishes the
table's names, and every snapshot field is either declared or deliberately left out.

Pure Python: snapshots are built by hand, no model is loaded.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from kvops.adapters.kvops_metrics import snapshot_from_kvops_metrics
from kvops.adapters.prometheus import Scrape
from kvops.engine.serving.metrics import EngineMetrics
from kvops.schema.metrics import (
    EACH,
    ENGINE_INFO,
    ENGINE_INFO_LABELS,
    ENGINE_PREFIX,
    EVENT_METRICS,
    SNAPSHOT_METRICS,
    SUPERVISOR_PREFIX,
    SnapshotMetric,
    field_value,
    sample_name,
    split_each,
    supervisor_metrics,
)
from kvops.schema.snapshot import (
    BlockStats,
    EngineInfo,
    GpuStats,
    Histogram,
    PrefixCacheStats,
    ProcessStats,
    RequestStats,
    Snapshot,
    SwapStats,
    SwapWindow,
    TenantStats,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"

# Snapshot fields with no metric of their own, and why: a new field must be declared in the table or added here.
NOT_EXPORTED = {
    "schema_version", "source", "unknown", "time", "metrics_read", "data_problems",  # about the snapshot itself
    "uptime_s",  # the start time is exported; uptime is time() minus it
    "engine.pid", "engine.kv_cache_dtype_skip_layers", "engine.host_kv_cache_bytes",  # /stats only
    "engine.compile", "engine.compile_s",  # the compiled step: /stats and the engine's start line only
    "blocks.state_map", "blocks.owner_map", "blocks.owners",  # per-block maps: /stats only
    # windows and hit rates: PromQL rates the counters
    "prefix_cache.window_s", "prefix_cache.window_queries", "prefix_cache.window_hits",
    "prefix_cache.window_hit_rate", "prefix_cache.shadow_hit_rate", "prefix_cache.potential_hit_rate",
    "tenants.*.hit_rate", "swap.window.window_s", "swap.window.swap_out", "swap.window.swap_in",
    "swap.window.allocations",
    "prefix_cache.normalization", "swap.preemption_mode", "swap.swap_in_reused_total", "swap.host_state_map",
    "requests.live_requested_len_p50", "tenants.*.blocks_owned", "tenants.*.quota_blocks", "tenants.*.cache_salt",
    # the event histograms carry these (EVENT_METRICS), observed per request rather than read from the snapshot
    "requests.ttft_seconds_sum", "requests.ttft_count", "requests.itl_seconds_sum", "requests.itl_count",
    "generation_lengths",
    "ranks", "steps",  # other servers' ranks; the step series is /stats only
    "process.gpus.*.index", "process.gpus.*.name",  # the GPU series' labels
    "process.gpus.*.memory_kvops_source", "process.gpus.*.utilization_known",  # no series when not known
    # the KV event view: the supervisor exports what it reads of the stream itself (exporter._event_families)
    "kv_events",
    "residency",  # vLLM's own --kv-cache-metrics histograms, which it exports itself
    # vLLM's TTFT count less its end-to-end count less its live requests: series vLLM exports itself
    "requests.abandoned_total",
    # the gateway's policy and counters: the gateway exports them itself (kvops_gateway_*, docs/gateway.md); its
    # tenants' requests and tokens come through `tenants`
    "gateway",
}


def distinctive_snapshot() -> Snapshot:
    """Every field the table declares at a value of its own, none at its neutral default (0, True, "unknown"),
    floats exact in binary so that /100 and *100 come back equal."""
    return Snapshot(
        time=1_700_000_100.0, uptime_s=99.5,
        engine=EngineInfo(
            model="distinct-model", engine_version="9.8.7", pid=1, started_at=1_700_000_000.5, device="cuda:1",
            dtype="bfloat16", kv_cache_dtype="fp8", block_size=32, num_blocks=1201, max_model_len=4099,
            max_num_seqs=13, max_num_batched_tokens=2053, kv_cache_bytes=987_654_321, bytes_per_token=45_061,
            enable_prefix_caching=False, eviction_policy="lfu"),
        blocks=BlockStats(counts={"free": 1001, "filling": 3, "full": 97, "cached": 71, "pending_free": 29,
                                  "swapped": 7}, usage=0.15625, state_map="", allocated_slots=3203, used_slots=3167),
        prefix_cache=PrefixCacheStats(queries_total=50_023, hits_total=31_013, hit_rate=0.62, window_s=60.0,
                                      window_queries=0, window_hits=0, window_hit_rate=0.0, evictions_total=173,
                                      shadow_queries_total=7001, shadow_hits_total=5003,
                                      potential_queries_total=6007, potential_hits_total=4001),
        requests=RequestStats(running=11, waiting=17, finished_total=0, aborted_total=19, preemptions_total=23,
                              prompt_tokens_total=77_777, generation_tokens_total=55_553),
        prompt_lengths=Histogram(buckets=[], counts=[0], sum=0.0, count=0, p50=None, p95=None, p99=None),
        steps=[],
        swap=SwapStats(host_blocks=509, swapped_blocks=31, swapped_seqs=37, swap_out_total=401, swap_in_total=389,
                       swap_preemptions_total=41, swap_fallbacks_total=43,
                       window=SwapWindow(swap_out_per_s=2.75, swap_in_per_s=1.125, swap_rate=0.0625)),
        tenants={
            "alice": TenantStats(requests_total=301, prompt_tokens_total=40_009, hit_tokens_total=30_011,
                                 blocks_held=83, evictions_caused=47, evictions_suffered=53),
            "bob": TenantStats(requests_total=151, prompt_tokens_total=10_007, hit_tokens_total=2003, blocks_held=89,
                               evictions_caused=59, evictions_suffered=61),
        },
        process=ProcessStats(
            cpu_percent=137.5, rss_bytes=734_003_201, num_threads=67, torch_threads=5, others_busy_cpus=0.375,
            gpus=[GpuStats(index=1, name="NVIDIA H200", memory_used_bytes=10 * 2**30 + 1,
                           memory_total_bytes=141 * 2**30 + 3, memory_free_bytes=131 * 2**30 + 5,
                           memory_kvops_bytes=8 * 2**30 + 7, memory_others_bytes=2 * 2**30 + 9,
                           utilization_percent=62.5, engine_device=True),
                  GpuStats(index=3, name="NVIDIA H100", memory_used_bytes=2**30 + 11, memory_total_bytes=80 * 2**30,
                           utilization_percent=0.0, utilization_known=False)],
            gpu_status="ok"),
    )


def declared_values(snap: Snapshot, row: SnapshotMetric) -> dict[str, Any]:
    """The row's field in `snap`: {"": value}, or per key of the collection EACH stands for (a GPU by its index)."""
    if EACH not in row.field:
        return {"": field_value(snap, row.field)}
    collection, within = split_each(row.field)
    items = field_value(snap, collection)
    if isinstance(items, dict):
        return {key: field_value(item, within) if within else item for key, item in items.items()}
    return {str(item.index): field_value(item, within) for item in items}


def engine_text(snap: Snapshot) -> str:
    metrics = EngineMetrics(lambda: snap)
    metrics.observe_request_finished("alice", 120, 30, "stop")
    metrics.observe_request_finished("bob", 700, 3, "length")
    metrics.observe_time_to_first_token("alice", 0.25)
    metrics.observe_inter_token_latency("bob", 0.0625)
    return metrics.render()[0].decode()


def test_a_snapshot_makes_the_round_trip_through_the_engines_text():
    snap = distinctive_snapshot()
    back = snapshot_from_kvops_metrics(Scrape.parse(engine_text(snap)), snap.time)
    rows = [row for row in SNAPSHOT_METRICS if row.engine is not None]
    compared = 0
    for row in rows:
        sent, read = declared_values(snap, row), declared_values(back, row)
        assert read == sent, (row.engine_name, row.field)
        compared += len(sent)
    assert compared > len(rows)  # the labelled rows compared per state, tenant and GPU
    for path in ENGINE_INFO_LABELS.values():
        assert field_value(back, path) == field_value(snap, path), path
    assert [gpu.utilization_known for gpu in back.process.gpus] == [True, False]
    # the event metrics the adapter reads back
    assert back.requests.finished_total == 2
    assert (back.prompt_lengths.count, back.prompt_lengths.sum) == (2, 820.0)
    assert back.ttft is not None and (back.ttft.count, back.ttft.sum) == (1, 0.25)
    assert back.itl is not None and (back.itl.count, back.itl.sum) == (1, 0.0625)


def test_the_distinctive_snapshot_tells_every_field_apart():
    """A row read into the wrong field, or not read, cannot pass the round trip by luck."""
    snap = distinctive_snapshot()
    numbers = [value for row in SNAPSHOT_METRICS if row.engine is not None and not row.labels
               for value in declared_values(snap, row).values() if not isinstance(value, bool)]
    assert 0 not in numbers and len(set(numbers)) == len(numbers)


def test_the_engine_exports_exactly_the_table():
    families = {family.name: family for family in text_string_to_metric_families(engine_text(distinctive_snapshot()))}
    expected = {ENGINE_INFO: ("gauge", "Engine identity and configuration; always 1.")}
    expected |= {row.engine_name: (row.type.value, row.engine.help) for row in SNAPSHOT_METRICS if row.engine}
    expected |= {row.name: (row.type.value, row.help) for row in EVENT_METRICS}
    assert {name: (f.type, f.documentation) for name, f in families.items()} == expected


class _State(SimpleNamespace):
    pass


def test_the_exporters_series_are_the_tables():
    from kvops.supervisor import exporter  # the supervisor package only here: the rest of the file needs none of it

    snap = distinctive_snapshot()
    state = _State(name="e1", history=SimpleNamespace(latest=snap, is_up=True))
    families = {f.name: f for f in exporter.snapshot_families([state])}  # type: ignore[list-item]
    rows = supervisor_metrics()
    assert list(families) == [row.supervisor_name for row in rows]
    for row in rows:
        family = families[row.supervisor_name]
        assert (family.type, family.documentation) == (row.type.value, row.supervisor_help)
        assert all(sample.labels["engine"] == "e1" and sample.labels["kind"] == "kvops" for sample in family.samples)
    usage = families["kvops_engine_kv_cache_usage_ratio"].samples
    assert [s.value for s in usage] == [snap.blocks.usage]
    # only the engine's own GPU, and its utilization as a ratio
    util = families["kvops_engine_gpu_utilization_ratio"].samples
    assert [(s.labels["gpu"], s.value) for s in util] == [("1", 0.625)]


def test_names_are_written_out_only_where_they_break_the_rule():
    for row in SNAPSHOT_METRICS:
        if row.engine is not None and row.engine.name:
            assert row.engine.name != ENGINE_PREFIX + row.stem, row.stem
        if row.supervisor is not None and row.supervisor.name:
            assert row.supervisor.name != SUPERVISOR_PREFIX + row.stem, row.stem
    names = [row.engine_name for row in SNAPSHOT_METRICS if row.engine] + [row.name for row in EVENT_METRICS]
    names += [row.supervisor_name for row in SNAPSHOT_METRICS if row.supervisor]
    assert len(set(names)) == len(names)


def _leaves(model: type[BaseModel], whole: set[str], prefix: str = "") -> Iterator[str]:
    """Every field path of a schema model, EACH for the items of a list or dict of models; a path in `whole` is one
    leaf, not walked into."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
        args = typing.get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and prefix + name not in whole:
            yield from _leaves(annotation, whole, f"{prefix}{name}.")
        elif args and isinstance(args[-1], type) and issubclass(args[-1], BaseModel) \
                and prefix + name not in whole:
            yield from _leaves(args[-1], whole, f"{prefix}{name}.{EACH}.")
        else:
            yield prefix + name


def test_every_snapshot_field_is_declared_or_left_out_on_purpose():
    declared = {row.field.removesuffix(f".{EACH}") for row in SNAPSHOT_METRICS}
    declared |= set(ENGINE_INFO_LABELS.values()) | {row.reads_into for row in EVENT_METRICS if row.reads_into}
    leaves = set(_leaves(Snapshot, NOT_EXPORTED | declared))
    assert leaves - declared - NOT_EXPORTED == set()  # a new field: declare it in kvops.schema.metrics
    assert NOT_EXPORTED & declared == set()
    assert NOT_EXPORTED - leaves == set()  # no stale entry


def test_docs_name_every_metric_of_the_table_and_no_other():
    """docs/metrics.md's tables, engine and supervisor sections, against the table's names."""
    documented = set(re.findall(r"^\|\s*`(kvops_[a-z0-9_]+)`", DOCS.read_text(), re.M))
    declared = {ENGINE_INFO} | {sample_name(row.name, row.type) for row in EVENT_METRICS}
    for row in SNAPSHOT_METRICS:
        if row.engine is not None:
            declared.add(row.engine_sample)
        if row.supervisor is not None:
            declared.add(sample_name(row.supervisor_name, row.type))
    assert documented == declared
