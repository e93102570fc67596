"""The snapshot (`kvops.schema.snapshot.Snapshot`), built in this one module from the engine's parts:
the block manager and its host pool, the scheduler, the running counters (`stats.py`) and the process.

The engine only counts while it steps; everything derived (rates, maps, percentiles, per-tenant
rows) is computed here, when `/stats`, `/metrics` or `kvops engine generate --stats` asks.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import TYPE_CHECKING, Protocol

from kvops import __version__
from kvops.engine.block import BlockState
from kvops.engine.process_stats import read_process_stats
from kvops.engine.stats import LATENCY_BUCKETS, PROMPT_LENGTH_BUCKETS, EngineStats
from kvops.schema.snapshot import (
    BlockStats,
    EngineInfo,
    Histogram,
    PrefixCacheStats,
    RequestStats,
    Snapshot,
    SwapStats,
    SwapWindow,
    TenantStats,
    bucket_quantile,
    encode_block_map,
    encode_owner_map,
    percentile_fields,
)

if TYPE_CHECKING:
    import torch

    from kvops.engine.block_manager import BlockManager
    from kvops.engine.capacity import Capacity
    from kvops.engine.compiled import CompiledStep
    from kvops.engine.config import EngineConfig, NormalizationMode
    from kvops.engine.kv_pool import KVPool
    from kvops.engine.scheduler import Scheduler
    from kvops.engine.sequence import Sequence
    from kvops.engine.shadow_cache import ShadowPrefixCache
    from kvops.engine.threads import ThreadGovernor


class SnapshotSource(Protocol):
    """What a snapshot is built from: the parts of the engine (`LLMEngine`) this module reads, and nothing else.
    Named here rather than importing the engine, which imports this module to build its snapshots."""

    config: EngineConfig
    started_at: float
    device: torch.device
    model_name: str
    max_model_len: int
    kv_pool: KVPool
    capacity: Capacity
    compiled: CompiledStep
    block_manager: BlockManager
    scheduler: Scheduler
    stats: EngineStats
    shadow: ShadowPrefixCache
    potential: ShadowPrefixCache
    normalization: NormalizationMode
    sequences: dict[str, Sequence]
    threads: ThreadGovernor

    @property
    def dtype_name(self) -> str: ...

    @property
    def kv_cache_dtype_name(self) -> str: ...

    def kv_slots(self) -> tuple[int, int]: ...

    def salt_for(self, tenant: str) -> str: ...


def build_snapshot(engine: SnapshotSource, include_gpu: bool = True) -> Snapshot:
    now = time.time()
    return Snapshot(
        time=now,
        uptime_s=now - engine.started_at,
        engine=engine_info(engine),
        blocks=block_stats(engine),
        prefix_cache=prefix_cache_stats(engine),
        requests=request_stats(engine),
        prompt_lengths=prompt_length_histogram(engine.stats),
        ttft=latency_histogram(engine.stats.ttft_bucket_counts, engine.stats.ttft_seconds_sum),
        itl=latency_histogram(engine.stats.itl_bucket_counts, engine.stats.itl_seconds_sum),
        steps=list(engine.stats.steps),
        swap=swap_stats(engine),
        tenants=tenant_stats(engine),
        process=read_process_stats(include_gpu, device=str(engine.device), torch_threads=engine.threads.threads,
                                   others_busy_cpus=engine.threads.others_busy if engine.threads.fixed is None
                                   else None),
    )


def engine_info(engine: SnapshotSource) -> EngineInfo:
    config, bm = engine.config, engine.block_manager
    return EngineInfo(
        model=engine.model_name, engine_version=__version__, pid=os.getpid(), started_at=engine.started_at,
        device=str(engine.device), dtype=engine.dtype_name, kv_cache_dtype=engine.kv_cache_dtype_name,
        kv_cache_dtype_skip_layers=list(config.kv_cache_dtype_skip_layers), block_size=config.block_size,
        num_blocks=bm.num_blocks, max_model_len=engine.max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, kv_cache_bytes=engine.capacity.pool_bytes,
        bytes_per_token=engine.capacity.bytes_per_token, host_kv_cache_bytes=engine.kv_pool.host_pool_bytes,
        enable_prefix_caching=bm.enable_prefix_caching, eviction_policy=bm.eviction_policy,
        compile=engine.compiled.state, compile_s=engine.compiled.seconds,
    )


def block_stats(engine: SnapshotSource) -> BlockStats:
    bm = engine.block_manager
    counts = {state.value: bm.state_counts[state] for state in BlockState}
    counts[BlockState.SWAPPED.value] = bm.num_swapped_blocks  # host blocks: device blocks are never swapped
    allocated, used = engine.kv_slots()
    owners_by_block, owners = encode_owner_map(owner_map(bm))
    return BlockStats(counts=counts, usage=(counts["filling"] + counts["full"]) / bm.num_blocks,
                      state_map=encode_block_map(bm.state_map()), owner_map=owners_by_block, owners=owners,
                      allocated_slots=allocated, used_slots=used)


def owner_map(bm: BlockManager) -> list[str | None]:
    """The tenant owning each device block (None for a free one), block id order."""
    free = BlockState.FREE  # a local: this runs once per block at every snapshot
    return [block.owner if block.state is not free else None for block in bm.blocks]


def blocks_held(bm: BlockManager) -> Counter[str]:
    """Distinct blocks referenced by each tenant's live sequences."""
    held: dict[str, set[int]] = {}
    for seq in bm.seqs.values():
        held.setdefault(seq.tenant, set()).update(seq.block_ids)
    return Counter({tenant: len(ids) for tenant, ids in held.items()})


def prefix_cache_stats(engine: SnapshotSource) -> PrefixCacheStats:
    stats, shadow, potential = engine.stats, engine.shadow, engine.potential
    window_queries, window_hits = stats.prefix_window_counts()
    return PrefixCacheStats(
        queries_total=stats.prefix_queries_total,
        hits_total=stats.prefix_hits_total,
        hit_rate=stats.prefix_hits_total / stats.prefix_queries_total if stats.prefix_queries_total else 0.0,
        window_s=stats.window_s,
        window_queries=window_queries,
        window_hits=window_hits,
        window_hit_rate=window_hits / window_queries if window_queries else 0.0,
        evictions_total=engine.block_manager.evictions_total,
        normalization=engine.normalization.value,
        shadow_queries_total=shadow.queries_total,
        shadow_hits_total=shadow.hits_total,
        shadow_hit_rate=shadow.hit_rate,
        potential_queries_total=potential.queries_total,
        potential_hits_total=potential.hits_total,
        potential_hit_rate=potential.hit_rate,
    )


def request_stats(engine: SnapshotSource) -> RequestStats:
    stats, scheduler = engine.stats, engine.scheduler
    return RequestStats(
        running=len(scheduler.running), waiting=len(scheduler.waiting),
        finished_total=stats.finished_total, aborted_total=stats.aborted_total,
        preemptions_total=scheduler.preemptions_total,
        prompt_tokens_total=stats.prompt_tokens_total,
        generation_tokens_total=stats.generation_tokens_total,
        live_requested_len_p50=live_requested_len_p50(engine),
        ttft_seconds_sum=stats.ttft_seconds_sum, ttft_count=stats.ttft_count,
        itl_seconds_sum=stats.itl_seconds_sum, itl_count=stats.itl_count,
    )


def live_requested_len_p50(engine: SnapshotSource) -> int | None:
    """The upper median over live requests of prompt + max_tokens, capped at max_model_len."""
    lengths = sorted(min(seq.prompt_len + seq.params.max_tokens, engine.max_model_len)
                     for seq in engine.sequences.values() if not seq.finished)
    return lengths[len(lengths) // 2] if lengths else None


def percentile(sorted_values: list[int], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def prompt_length_histogram(stats: EngineStats) -> Histogram:
    """All prompt lengths in buckets; the percentiles over the recent ones (the buckets are too coarse)."""
    recent = sorted(stats.recent_prompt_lengths())
    return Histogram(
        buckets=list(PROMPT_LENGTH_BUCKETS),
        counts=list(stats.prompt_bucket_counts),
        sum=float(stats.prompt_length_sum),
        count=stats.prompt_length_count,
        **percentile_fields(lambda q: percentile(recent, q)),
    )


def latency_histogram(counts: list[int], total_s: float) -> Histogram:
    """A latency histogram in seconds; percentiles as Prometheus's histogram_quantile reads the buckets."""
    bounds = list(LATENCY_BUCKETS)
    return Histogram(buckets=bounds, counts=list(counts), sum=total_s, count=sum(counts),
                     **percentile_fields(lambda q: bucket_quantile(bounds, counts, q / 100)))


def swap_stats(engine: SnapshotSource) -> SwapStats:
    bm, scheduler = engine.block_manager, engine.scheduler
    return SwapStats(
        preemption_mode=str(engine.config.preemption_mode), host_blocks=bm.num_host_blocks,
        swapped_blocks=bm.num_swapped_blocks, swapped_seqs=len(scheduler.swapped),
        swap_out_total=bm.swap_out_blocks_total, swap_in_total=bm.swap_in_blocks_total,
        swap_in_reused_total=bm.swap_in_reused_total,
        swap_preemptions_total=scheduler.swap_preemptions_total,
        swap_fallbacks_total=scheduler.swap_fallbacks_total,
        window=swap_window(engine.stats), host_state_map=encode_block_map(bm.host_state_map()),
    )


def swap_window(stats: EngineStats) -> SwapWindow:
    """Swap activity over the stats window. The swap rate is blocks swapped out per block allocated:
    0 when preemption never swaps, 1 when every block handed out pushed one out."""
    out, into, allocations, span = stats.swap_window_counts()
    return SwapWindow(window_s=stats.window_s, swap_out=out, swap_in=into, allocations=allocations,
                      swap_out_per_s=out / span, swap_in_per_s=into / span,
                      swap_rate=out / allocations if allocations else 0.0)


def tenant_stats(engine: SnapshotSource) -> dict[str, TenantStats]:
    """One row per tenant anything is known about: requests, blocks, a quota or evictions."""
    bm, counted = engine.block_manager, engine.stats.tenants
    held = blocks_held(bm)
    tenants: dict[str, TenantStats] = {}
    for name in set(counted) | set(bm.tenants) | set(held) | set(bm.quotas):
        counters = counted.get(name)
        evictions = bm.tenants.get(name)
        prompt_tokens = counters.prompt_tokens_total if counters else 0
        hit_tokens = counters.hit_tokens_total if counters else 0
        tenants[name] = TenantStats(
            requests_total=counters.requests_total if counters else 0,
            prompt_tokens_total=prompt_tokens,
            hit_tokens_total=hit_tokens,
            hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            blocks_held=held.get(name, 0),
            blocks_owned=bm.owned.get(name, 0),
            quota_blocks=bm.quotas.get(name),
            cache_salt=engine.salt_for(name),
            evictions_caused=evictions.evictions_caused if evictions else 0,
            evictions_suffered=evictions.evictions_suffered if evictions else 0,
        )
    return tenants
