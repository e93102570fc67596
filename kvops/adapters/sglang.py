"""SGLang's `/metrics` (server started with `--enable-metrics`) as a kvops snapshot.

Names from SGLang's production-metrics documentation: `sglang:token_usage`, `sglang:cache_hit_rate`,
`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:num_used_tokens`, `sglang:prompt_tokens_total`,
`sglang:generation_tokens_total`, `sglang:num_requests_total`; newer versions add
`sglang:cached_tokens_total`, `sglang:max_total_num_tokens` and a `sglang:prompt_tokens_histogram`.
SGLang's radix cache is token-granular, so the pool is counted in tokens (block_size 1).
"""

from __future__ import annotations

from typing import Any

from kvops.adapters import common
from kvops.adapters.prometheus import Scrape
from kvops.schema.snapshot import Snapshot


def snapshot_from_sglang(scrape: Scrape, t: float, model_card: dict[str, Any] | None = None,
                         started_at: float | None = None) -> Snapshot:
    data = common.neutral_for("sglang", scrape, t, model_card, "sglang:token_usage")
    unknown: list[str] = data["unknown"]
    prefix = data["prefix_cache"]

    pool_tokens = scrape.value("sglang:max_total_num_tokens")
    usage = scrape.mean("sglang:token_usage")
    if usage is None and pool_tokens:
        used = scrape.value("sglang:num_used_tokens")
        usage = None if used is None else used / pool_tokens
    common.fill_blocks(data, usage, round(pool_tokens) if pool_tokens else None, 1)
    common.read_max_model_len(data, model_card)
    unknown.extend(["engine.max_num_seqs", "engine.max_num_batched_tokens", "engine.bytes_per_token",
                    "engine.kv_cache_bytes", "engine.dtype", "engine.device", "engine.kv_cache_dtype",
                    "engine.enable_prefix_caching"])

    common.read_requests(data, scrape, {"running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
                                        "finished_total": "sglang:num_requests_total",
                                        "aborted_total": "sglang:num_aborted_requests_total",
                                        "prompt_tokens_total": "sglang:prompt_tokens_total",
                                        "generation_tokens_total": "sglang:generation_tokens_total"})
    unknown.append("requests.preemptions_total")  # SGLang retracts requests; no counter in its documented set

    cached = scrape.value("sglang:cached_tokens_total")
    prompt_tokens = scrape.value("sglang:prompt_tokens_total")
    if cached is not None and prompt_tokens is not None:
        # Both are counted per finished request: its whole prompt, and the part served from the radix cache.
        prefix.update(queries_total=round(prompt_tokens), hits_total=round(cached),
                      hit_rate=common.ratio(cached, prompt_tokens))
    else:
        unknown.extend(["prefix_cache.queries_total", "prefix_cache.hits_total"])
        rate = scrape.mean("sglang:cache_hit_rate")  # a recent rate, without the counters behind it
        if rate is None:
            unknown.append("prefix_cache.hit_rate")
        else:
            prefix["hit_rate"] = prefix["window_hit_rate"] = rate
    unknown.extend(["prefix_cache.evictions_total", "prefix_cache.normalization", "prefix_cache.shadow_hit_rate",
                    "prefix_cache.potential_hit_rate"])

    common.read_prompt_lengths(data, scrape, "sglang:prompt_tokens_histogram")
    unknown.append("swap")
    return common.finish_from_process(data, scrape, started_at)
