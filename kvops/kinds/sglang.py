"""SGLang's `/metrics` (a server started with `--enable-metrics`) as a kvops snapshot, across its two naming eras.

SGLang 0.3 labels its series `name=` and counts requests as `sglang:num_requests_running` /
`sglang:num_requests_waiting` (plus `sglang:queue_req`), with `sglang:cache_hit_rate` in percent. From 0.4 the
label is `model_name=`, the gauges are `sglang:num_running_reqs` / `sglang:num_queue_reqs`, the hit rate is a
fraction, and counters arrive: `sglang:num_requests_total`, `sglang:num_aborted_requests_total`,
`sglang:cached_tokens_total`. Data-parallel and disaggregated servers label per-rank gauges `dp_rank` /
`tp_rank` / `pp_rank` and `engine_type` (unified, prefill, decode). The radix cache is token-granular, so the
pool is counted in tokens (block_size 1).
"""

from __future__ import annotations

from typing import Any

from kvops.adapters import common
from kvops.adapters.names import MetricSource, Reader, ranks, table
from kvops.adapters.prometheus import Scrape
from kvops.kinds.profile import EngineProfile, Recognition, Remedy
from kvops.schema.snapshot import Snapshot

KIND = "sglang"

NEWER = "SGLang 0.4 and later"
METRICS = table(
    MetricSource("blocks.usage", ("sglang:token_usage",), "every SGLang version with --enable-metrics"),
    MetricSource("engine.num_blocks", ("sglang:max_total_num_tokens",), "SGLang 0.3 (dropped from later versions)"),
    MetricSource("requests.running", ("sglang:num_running_reqs", "sglang:num_requests_running"),
                 "every SGLang version with --enable-metrics"),
    MetricSource("requests.waiting", ("sglang:num_queue_reqs", "sglang:num_requests_waiting"),
                 "every SGLang version with --enable-metrics"),
    MetricSource("requests.finished_total", ("sglang:num_requests_total",), NEWER),
    MetricSource("requests.aborted_total", ("sglang:num_aborted_requests_total",), "SGLang 0.4.7 and later"),
    MetricSource("requests.transfer_failed_total", ("sglang:num_transfer_failed_reqs_total",),
                 "a disaggregated (prefill/decode) SGLang 0.4.7 and later"),
    MetricSource("requests.prompt_tokens_total", ("sglang:prompt_tokens_total",), "every SGLang version"),
    MetricSource("requests.generation_tokens_total", ("sglang:generation_tokens_total",), "every SGLang version"),
    MetricSource("prefix_cache.hits_total", ("sglang:cached_tokens_total",), "SGLang 0.4.5 and later"),
    MetricSource("prefix_cache.hit_rate", ("sglang:cache_hit_rate",),
                 "every SGLang version (a recent rate; percent before 0.4)"),
    MetricSource("prompt_lengths", ("sglang:prompt_tokens_histogram", "sglang:request_prompt_tokens"),
                 "SGLang 0.3, or later versions with --collect-tokens-histogram"),
    MetricSource("generation_lengths", ("sglang:generation_tokens_histogram", "sglang:request_generation_tokens"),
                 "SGLang 0.3, or later versions with --collect-tokens-histogram"),
    MetricSource("ttft", ("sglang:time_to_first_token_seconds",), "every SGLang version"),
    MetricSource("itl", ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
                 "every SGLang version (inter_token_latency from 0.4.7)"),
)
# Names only the 0.3 era has: its hit rate is in percent.
FIRST_ERA = ("sglang:num_requests_running", "sglang:queue_req", "sglang:new_seq")


def snapshot_from_sglang(scrape: Scrape, t: float, model_card: dict[str, Any] | None = None,
                         started_at: float | None = None) -> Snapshot:
    data = common.neutral_for(KIND, scrape, t, model_card, "sglang:token_usage")
    read = Reader(scrape, data, METRICS)
    usage_name = read.name("blocks.usage")
    usage = scrape.mean(usage_name) if usage_name else None
    pool_tokens = read.value("engine.num_blocks")
    used_tokens = scrape.value("sglang:num_used_tokens")
    if usage is None and pool_tokens and used_tokens is not None:
        usage = used_tokens / pool_tokens
        read.note("blocks.usage", "sglang:num_used_tokens", "sglang:max_total_num_tokens")
    if usage is not None:
        usage = read.fraction("blocks.usage", usage_name or "sglang:num_used_tokens", usage)
    common.fill_blocks(data, usage, round(pool_tokens) if pool_tokens else None, 1)
    common.read_max_model_len(data, model_card)
    for field in ("engine.max_num_seqs", "engine.max_num_batched_tokens", "engine.bytes_per_token",
                  "engine.kv_cache_bytes", "engine.dtype", "engine.device", "engine.kv_cache_dtype",
                  "engine.enable_prefix_caching", "requests.preemptions_total", "swap"):
        read.unknown(field)  # preemptions: SGLang retracts requests without a counter in these versions

    requests = data["requests"]
    read.counts("requests.running", "requests.waiting", "requests.finished_total", "requests.aborted_total",
                "requests.prompt_tokens_total", "requests.generation_tokens_total")

    if "requests.aborted_total" not in data["unknown"] and "requests.finished_total" not in data["unknown"]:
        # SGLang's num_requests_total counts every request that ended, aborted ones too (its 0.4.9 scrape: 157
        # aborted of 217); the snapshot counts them apart.
        requests["finished_total"] = max(0, requests["finished_total"] - requests["aborted_total"])
    failed_name = read.name("requests.transfer_failed_total")
    if failed_name is not None:  # a decode node's KV transfers that failed: requests that got no answer
        requests["aborted_total"] += round(scrape.value(failed_name) or 0)
        if "requests.aborted_total" in data["unknown"]:
            data["unknown"].remove("requests.aborted_total")
        read.note("requests.aborted_total", failed_name)
    _prefix_cache(read)
    common.read_histograms(read, ("prompt_lengths", "generation_lengths", "ttft", "itl"))
    data["ranks"] = [r.model_dump() for r in ranks(scrape, usage_name, read.name("requests.running"),
                                                  read.name("requests.waiting"))]
    return common.finish_from_process(data, scrape, started_at)


def _prefix_cache(read: Reader) -> None:
    scrape, prefix = read.scrape, read.data["prefix_cache"]
    cached = read.value("prefix_cache.hits_total")
    prompt_tokens = scrape.value("sglang:prompt_tokens_total")
    if cached is not None and prompt_tokens is not None:
        # Both count per request: its whole prompt, and the part the radix cache served.
        read.note("prefix_cache.queries_total", "sglang:prompt_tokens_total")
        if cached > prompt_tokens:
            read.problem(f"sglang:cached_tokens_total = {cached:g} is more than sglang:prompt_tokens_total = "
                         f"{prompt_tokens:g}: more cached tokens than prompt tokens")
        prefix.update(queries_total=round(prompt_tokens), hits_total=round(cached),
                      hit_rate=common.ratio(min(cached, prompt_tokens), prompt_tokens))
        read.unknown("prefix_cache.window_hit_rate")
    else:
        read.unknown("prefix_cache.queries_total")
        read.unknown("prefix_cache.hits_total")
        rate_name = read.name("prefix_cache.hit_rate")
        rate = scrape.mean(rate_name) if rate_name else None  # a recent rate, without the counters behind it
        if rate is None:
            read.unknown("prefix_cache.hit_rate")
            read.unknown("prefix_cache.window_hit_rate")
        else:
            if any(scrape.has(name) for name in FIRST_ERA):
                rate /= 100  # SGLang 0.3 reports percent
            prefix["hit_rate"] = prefix["window_hit_rate"] = read.fraction("prefix_cache.hit_rate",
                                                                           rate_name or "", rate)
    for field in ("prefix_cache.evictions_total", "prefix_cache.normalization", "prefix_cache.shadow_hit_rate",
                  "prefix_cache.potential_hit_rate"):
        read.unknown(field)


PROFILE = EngineProfile(
    kind=KIND,
    title="SGLang",
    recognition=Recognition(metric_prefixes=("sglang:",), owned_by=("sglang",)),
    read_scrape=snapshot_from_sglang,
    metrics=METRICS,
    remedies={
        Remedy.QUEUEING: "raise --max-running-requests, and --chunked-prefill-size so queued prompts are prefilled "
                         "faster",
        Remedy.LONG_PROMPTS: "cap them (--context-length), or route long prompts to their own engine",
        Remedy.PREFIX_CACHING_ON: "restart without --disable-radix-cache",
        Remedy.POOL_SIZE_LOG: "SGLang: 'max_total_num_tokens'",
        Remedy.START: "python -m sglang.launch_server --model-path MODEL --port {port} --enable-metrics",
        Remedy.CAPACITY: "lower --max-running-requests or raise --mem-fraction-static for a larger KV pool",
    },
    # The radix cache is token-granular: no block size to propose. It retracts requests without a counter.
    capabilities=frozenset(),
    notes={"enable_metrics": "--enable-metrics",
           "no_preemption_counter": "SGLang retracts requests without a counter"},
)
