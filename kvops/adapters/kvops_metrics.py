"""A kvops engine's own `/metrics` as a snapshot: for `kvops doctor --metrics-file` on a saved scrape.

A live kvops engine is read from `/stats` (the full snapshot) instead; the scrape lacks the block map,
the step series and the shadow/potential hit rates' mode, which are marked unknown here.
"""

from __future__ import annotations

from typing import Any

from kvops.adapters.common import finish, histogram_json, neutral, ratio
from kvops.adapters.prometheus import Scrape
from kvops.schema.snapshot import Snapshot


def snapshot_from_kvops_metrics(scrape: Scrape, t: float, model_card: dict[str, Any] | None = None,
                                started_at: float | None = None) -> Snapshot:
    info = "kvops_engine_info"
    data = neutral("kvops", t, scrape.label(info, "model") or str((model_card or {}).get("id") or "unknown"))
    unknown: list[str] = data["unknown"]
    engine = data["engine"]

    def number(name: str, default: float = 0.0, path: str = "") -> float:
        value = scrape.value(name)
        if value is None:
            if path:
                unknown.append(path)
            return default
        return value

    for key in ("dtype", "kv_cache_dtype", "eviction_policy", "device"):
        engine[key] = scrape.label(info, key) or "unknown"
    engine["engine_version"] = scrape.label(info, "version") or ""
    engine["block_size"] = int(float(scrape.label(info, "block_size") or number("kvops_engine_block_size", 16)))
    engine["num_blocks"] = round(number("kvops_kv_pool_blocks", path="engine.num_blocks"))
    engine["max_model_len"] = round(number("kvops_engine_max_model_len", path="engine.max_model_len"))
    engine["max_num_seqs"] = round(number("kvops_engine_max_num_seqs", path="engine.max_num_seqs"))
    engine["max_num_batched_tokens"] = round(number("kvops_engine_max_num_batched_tokens"))
    engine["kv_cache_bytes"] = round(number("kvops_kv_cache_bytes", path="engine.kv_cache_bytes"))
    engine["bytes_per_token"] = round(number("kvops_kv_bytes_per_token", path="engine.bytes_per_token"))
    engine["enable_prefix_caching"] = number("kvops_prefix_caching_enabled", 1.0) > 0

    counts = {state: round(v) for state, v in scrape.by_label("kvops_kv_blocks", "state").items()}
    data["blocks"]["counts"].update(counts)
    data["blocks"]["usage"] = number("kvops_kv_cache_usage_ratio", path="blocks.usage")
    data["blocks"]["allocated_slots"] = round(number("kvops_kv_allocated_slots"))
    data["blocks"]["used_slots"] = round(number("kvops_kv_used_slots"))
    unknown.append("blocks.state_map")

    queries = number("kvops_prefix_cache_queries_total", path="prefix_cache.queries_total")
    hits = number("kvops_prefix_cache_hits_total", path="prefix_cache.hits_total")
    data["prefix_cache"].update(
        queries_total=round(queries), hits_total=round(hits), hit_rate=ratio(hits, queries),
        evictions_total=round(number("kvops_prefix_cache_evictions_total")),
        shadow_queries_total=round(number("kvops_prefix_cache_shadow_queries_total")),
        shadow_hits_total=round(number("kvops_prefix_cache_shadow_hits_total")),
        potential_queries_total=round(number("kvops_prefix_cache_potential_queries_total")),
        potential_hits_total=round(number("kvops_prefix_cache_potential_hits_total")))
    # The mode is not exported; shadow counters that moved say shadow mode was on at some point.
    if data["prefix_cache"]["shadow_queries_total"] > 0:
        data["prefix_cache"]["normalization"] = "shadow"
    unknown.extend(["prefix_cache.window_hit_rate", "prefix_cache.normalization"])

    finished = scrape.value("kvops_requests_finished_total")
    data["requests"].update(
        running=round(number("kvops_num_requests_running", path="requests.running")),
        waiting=round(number("kvops_num_requests_waiting", path="requests.waiting")),
        finished_total=round(finished or 0), aborted_total=round(number("kvops_requests_aborted_total")),
        preemptions_total=round(number("kvops_num_preemptions_total", path="requests.preemptions_total")),
        prompt_tokens_total=round(number("kvops_prompt_tokens_total")),
        generation_tokens_total=round(number("kvops_generation_tokens_total")))
    prompts = scrape.histogram("kvops_request_prompt_tokens")
    data["prompt_lengths"] = histogram_json(prompts)
    if prompts is None:
        unknown.append("prompt_lengths")
    for field, name in (("ttft", "kvops_time_to_first_token_seconds"), ("itl", "kvops_inter_token_latency_seconds")):
        latency = scrape.histogram(name)  # one series per tenant: summed
        if latency is None:
            unknown.append(field)
        else:
            data[field] = histogram_json(latency)

    if scrape.has("kvops_swap_out_blocks_total"):
        data["swap"] = {
            "host_blocks": round(number("kvops_host_pool_blocks")),
            "swapped_blocks": round(number("kvops_swapped_blocks")),
            "swapped_seqs": round(number("kvops_swapped_sequences")),
            "swap_out_total": round(number("kvops_swap_out_blocks_total")),
            "swap_in_total": round(number("kvops_swap_in_blocks_total")),
            "swap_preemptions_total": round(number("kvops_swap_preemptions_total")),
            "swap_fallbacks_total": round(number("kvops_swap_fallbacks_total")),
            "window": {"swap_out_per_s": number("kvops_swap_out_rate_blocks_per_second"),
                       "swap_in_per_s": number("kvops_swap_in_rate_blocks_per_second"),
                       "swap_rate": number("kvops_swap_rate")},
        }
        data["swap"]["preemption_mode"] = "swap" if data["swap"]["host_blocks"] else "recompute"
        unknown.append("swap.window.allocations")
    else:
        unknown.append("swap")

    tenants: dict[str, dict[str, Any]] = {}
    for key, name in (("blocks_held", "kvops_tenant_blocks"), ("requests_total", "kvops_tenant_requests_total"),
                      ("prompt_tokens_total", "kvops_tenant_prompt_tokens_total"),
                      ("hit_tokens_total", "kvops_tenant_prefix_hit_tokens_total"),
                      ("evictions_caused", "kvops_tenant_cross_evictions_caused_total"),
                      ("evictions_suffered", "kvops_tenant_cross_evictions_suffered_total")):
        for tenant, value in scrape.by_label(name, "tenant").items():
            tenants.setdefault(tenant, {})[key] = round(value)
    for stats in tenants.values():
        stats["hit_rate"] = ratio(stats.get("hit_tokens_total", 0), stats.get("prompt_tokens_total", 0))
    data["tenants"] = tenants

    process = data["process"]
    process.update(rss_bytes=round(number("kvops_process_resident_memory_bytes")),
                   cpu_percent=100 * number("kvops_process_cpu_usage_ratio"),
                   num_threads=round(number("kvops_process_threads")))
    used = scrape.samples.get("kvops_gpu_memory_used_bytes", [])
    totals = {labels.get("gpu"): v for labels, v in scrape.samples.get("kvops_gpu_memory_total_bytes", [])}
    utils = {labels.get("gpu"): v for labels, v in scrape.samples.get("kvops_gpu_utilization_ratio", [])}
    process["gpus"] = [{"index": int(labels.get("gpu", 0)), "name": labels.get("name", ""),
                        "memory_used_bytes": round(v),
                        "memory_total_bytes": round(totals.get(labels.get("gpu"), 0)),
                        "utilization_percent": 100 * utils.get(labels.get("gpu"), 0.0)} for labels, v in used]
    process["gpu_status"] = "ok" if process["gpus"] else "no GPU series in the scrape"
    unknown.append("steps")
    start = scrape.value("kvops_engine_start_time_seconds")
    return finish(data, start if start else started_at)
