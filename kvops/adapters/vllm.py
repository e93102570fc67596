"""vLLM's `/metrics` as a kvops snapshot.

Names from vLLM's production-metrics documentation: the V1 engine's (`vllm:kv_cache_usage_perc`,
`vllm:prefix_cache_queries_total` / `_hits_total`, ...) and the V0 engine's older ones
(`vllm:gpu_cache_usage_perc`, `vllm:num_requests_swapped`, `vllm:gpu_prefix_cache_hit_rate`), whichever
the scrape has. `vllm:cache_config_info` (labels `block_size`, `num_gpu_blocks`, `cache_dtype`,
`enable_prefix_caching`, `kv_cache_memory_bytes`) gives the pool when present; `/v1/models` gives
`max_model_len`. `kv_cache_memory_bytes` is the KV budget (`--kv-cache-memory-bytes`, or
`VLLM_CPU_KVCACHE_SPACE` on CPU; "None" when a GPU server sizes it from `--gpu-memory-utilization`); the
bytes per token are that budget over the pool's tokens (num_gpu_blocks x block_size), an upper bound by the
budget's unused remainder (under 0.1% on a large pool, ~3% on a 64 MiB one). The scrape does not say
whether vLLM runs on a CPU or a GPU: `engine.device` stays unknown.
"""

from __future__ import annotations

from typing import Any

from kvops.adapters import common
from kvops.adapters.prometheus import Scrape
from kvops.schema.snapshot import Snapshot


def _int_label(scrape: Scrape, name: str, label: str) -> int | None:
    raw = scrape.label(name, label)
    try:
        return int(float(raw)) if raw not in (None, "", "None") else None
    except ValueError:
        return None


def snapshot_from_vllm(scrape: Scrape, t: float, model_card: dict[str, Any] | None = None,
                       started_at: float | None = None) -> Snapshot:
    data = common.neutral_for("vllm", scrape, t, model_card, "vllm:num_requests_running")
    unknown: list[str] = data["unknown"]
    engine, prefix = data["engine"], data["prefix_cache"]

    config = "vllm:cache_config_info"
    if scrape.has(config):
        engine["kv_cache_dtype"] = scrape.label(config, "cache_dtype") or "unknown"
        caching = scrape.label(config, "enable_prefix_caching")
        if caching is not None:
            engine["enable_prefix_caching"] = caching.lower() == "true"
        else:
            unknown.append("engine.enable_prefix_caching")
    else:
        unknown.extend(["engine.kv_cache_dtype", "engine.enable_prefix_caching"])
    block_size = _int_label(scrape, config, "block_size")
    usage = scrape.first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    common.fill_blocks(data, None if usage is None else scrape.mean(usage[0]),
                _int_label(scrape, config, "num_gpu_blocks"), block_size)
    common.read_max_model_len(data, model_card)
    budget = _int_label(scrape, config, "kv_cache_memory_bytes")
    pool_tokens = engine["num_blocks"] * engine["block_size"] if "engine.num_blocks" not in unknown else 0
    if budget and pool_tokens and block_size:
        engine["kv_cache_bytes"] = budget
        engine["bytes_per_token"] = budget // pool_tokens
    else:
        unknown.extend(["engine.bytes_per_token", "engine.kv_cache_bytes"])
    unknown.extend(["engine.max_num_seqs", "engine.max_num_batched_tokens", "engine.dtype", "engine.device"])

    common.read_requests(data, scrape, {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
                                        "finished_total": "vllm:request_success_total",
                                        "preemptions_total": "vllm:num_preemptions_total",
                                        "prompt_tokens_total": "vllm:prompt_tokens_total",
                                        "generation_tokens_total": "vllm:generation_tokens_total"})
    unknown.append("requests.aborted_total")

    queries, hits = scrape.value("vllm:prefix_cache_queries_total"), scrape.value("vllm:prefix_cache_hits_total")
    if queries is not None and hits is not None:
        prefix.update(queries_total=round(queries), hits_total=round(hits), hit_rate=common.ratio(hits, queries))
    else:
        unknown.extend(["prefix_cache.queries_total", "prefix_cache.hits_total"])
        v0_rate = scrape.mean("vllm:gpu_prefix_cache_hit_rate")  # V0: a rate without the counters behind it
        if v0_rate is None or v0_rate < 0:  # -1: prefix caching disabled
            unknown.append("prefix_cache.hit_rate")
        else:
            prefix["hit_rate"] = v0_rate
    unknown.extend(["prefix_cache.window_hit_rate", "prefix_cache.evictions_total", "prefix_cache.normalization",
                    "prefix_cache.shadow_hit_rate", "prefix_cache.potential_hit_rate"])

    common.read_prompt_lengths(data, scrape, "vllm:request_prompt_tokens")
    generations = scrape.histogram("vllm:request_generation_tokens")
    if generations is not None:
        data["generation_lengths"] = common.histogram_json(generations)

    swapped = scrape.value("vllm:num_requests_swapped")  # V0 only: V1 recomputes, it never swaps
    if swapped is None:
        unknown.append("swap")
    else:
        data["swap"] = {"preemption_mode": "swap", "swapped_seqs": round(swapped)}
        unknown.extend(["swap.window", "swap.swap_out_total", "swap.swap_in_total"])
    return common.finish_from_process(data, scrape, started_at)
