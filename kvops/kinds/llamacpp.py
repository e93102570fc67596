"""llama.cpp's server (`llama-server --metrics`): its `/metrics` read into a snapshot, across its versions.

What it reports (checked on the published scrapes in tests/fixtures/published/llamacpp-*): counters of prompt and
generated tokens with the seconds spent on each (`llamacpp:prompt_tokens_total` / `prompt_seconds_total`,
`llamacpp:tokens_predicted_total` / `tokens_predicted_seconds_total`), their averages as gauges, the requests
being processed (`llamacpp:requests_processing`, one per busy slot) and the ones deferred because every slot is
busy (`llamacpp:requests_deferred`: its queue). Builds before PR #13660 (May 2025), and forks such as
ik_llama.cpp, also export `llamacpp:kv_cache_usage_ratio` (used cells over the context's cells) and
`llamacpp:kv_cache_tokens`; later builds dropped both, so their KV usage is unknown. From PR #9283 (2024) there
are `llamacpp:n_decode_total` and `llamacpp:n_busy_slots_per_decode` (`-nan` before the first decode).

What it does not report: the pool's size (`--ctx-size` cells, split over `--parallel` slots), a block size (the
cache is cell-granular), latency histograms (only the seconds spent generating: a mean time per generated
token), prefix-cache hits, finished or aborted requests, preemptions, process metrics. Each is marked unknown.
"""

from __future__ import annotations

from typing import Any

from kvops.adapters import common
from kvops.adapters.names import MetricSource, Reader, table
from kvops.adapters.prometheus import Scrape
from kvops.kinds.profile import EngineProfile, Recognition, Remedy
from kvops.schema.snapshot import Snapshot

KIND = "llamacpp"
EVERY = "every llama-server started with --metrics"
METRICS = table(
    MetricSource("blocks.usage", ("llamacpp:kv_cache_usage_ratio",),
                 "llama-server builds before PR #13660 (May 2025) and forks such as ik_llama.cpp; later builds "
                 "export no KV usage"),
    MetricSource("requests.running", ("llamacpp:requests_processing",), EVERY),
    MetricSource("requests.waiting", ("llamacpp:requests_deferred",), EVERY),
    MetricSource("requests.prompt_tokens_total", ("llamacpp:prompt_tokens_total",), EVERY),
    MetricSource("requests.generation_tokens_total", ("llamacpp:tokens_predicted_total",), EVERY),
    MetricSource("requests.itl_seconds_sum", ("llamacpp:tokens_predicted_seconds_total",),
                 "llama-server builds from March 2024 (PR #5937): a mean time per token, no histogram"),
)
# Fields llama-server's /metrics has no name for in any version.
NEVER = ("engine.max_num_seqs", "engine.max_num_batched_tokens", "engine.bytes_per_token",
         "engine.kv_cache_bytes", "engine.dtype", "engine.device", "engine.kv_cache_dtype",
         "engine.enable_prefix_caching", "requests.finished_total", "requests.aborted_total",
         "requests.preemptions_total", "prefix_cache", "prompt_lengths", "generation_lengths", "ttft", "itl", "swap",
         "tenants", "steps", "process")


def snapshot_from_llamacpp(scrape: Scrape, t: float, model_card: dict[str, Any] | None = None,
                           started_at: float | None = None) -> Snapshot:
    data = common.neutral_for(KIND, scrape, t, model_card, "llamacpp:requests_processing")
    read = Reader(scrape, data, METRICS)
    usage_name = read.name("blocks.usage")
    usage = scrape.value(usage_name) if usage_name else None
    if usage is not None:
        usage = read.fraction("blocks.usage", usage_name or "", usage)
    # Cells, not blocks: block size 1; the pool's cell count is not exported, so blocks are per-mille of it.
    common.fill_blocks(data, usage, None, 1)
    common.read_max_model_len(data, model_card)
    for field in NEVER:
        read.unknown(field)
    read.counts("requests.running", "requests.waiting", "requests.prompt_tokens_total",
                "requests.generation_tokens_total")
    _generation_seconds(read)
    data["process"]["gpu_status"] = "not reported by llama-server"
    return common.finish(data, started_at)


def _generation_seconds(read: Reader) -> None:
    """The seconds spent generating and the tokens generated, as the cumulative inter-token sums: their ratio
    over an interval is the mean time per generated token (each slot's own time, so per sequence). The counter
    counts a request's first token too, so the mean is a little under the true gap. No histogram in any version."""
    seconds = read.value("requests.itl_seconds_sum")
    tokens = read.scrape.value("llamacpp:tokens_predicted_total")
    if seconds is not None and tokens is not None:
        read.note("requests.itl_count", "llamacpp:tokens_predicted_total")
        read.data["requests"].update(itl_seconds_sum=seconds, itl_count=round(tokens))


PROFILE = EngineProfile(
    kind=KIND,
    title="llama.cpp",
    # ik_llama.cpp and other forks export the same `llamacpp:` names with the same meaning: read as llama.cpp.
    recognition=Recognition(metric_prefixes=("llamacpp:",), owned_by=("llamacpp",)),
    read_scrape=snapshot_from_llamacpp,
    metrics=METRICS,
    flags={"max_num_seqs": "--parallel"},  # slots: the requests it runs at once
    remedies={
        Remedy.QUEUEING: "raise --parallel (more slots); each slot gets --ctx-size / --parallel cells, so raise "
                         "--ctx-size with it (or --kv-unified to share one pool)",
        Remedy.LONG_PROMPTS: "give each slot room (--ctx-size / --parallel cells), or route long prompts to their "
                             "own server",
        Remedy.PREFIX_CACHING_ON: "send \"cache_prompt\": true (the default) and set --cache-reuse N to reuse "
                                  "cached chunks past a change",
        Remedy.POOL_SIZE_LOG: "llama.cpp: 'n_ctx' and 'KV buffer size'",
        Remedy.START: "llama-server -m MODEL.gguf --port {port} --metrics",
        Remedy.CAPACITY: "lower --parallel (fewer slots at once), or raise --ctx-size for a larger KV cache "
                         "(--cache-type-k / --cache-type-v q8_0 halve its memory)",
    },
    # A watched server only: no admin API, no preemption counter, no swap, no KV events.
    capabilities=frozenset(),
    notes={"enable_metrics": "--metrics", "kv_pool_flag": "--ctx-size"},
)
