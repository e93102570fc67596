"""Hugging Face Text Generation Inference (TGI): its router's `/metrics` read into a snapshot.

What it reports (its metrics reference, docs/source/reference/metrics.md): the queue (`tgi_queue_size`), the
running batch (`tgi_batch_current_size`), requests that succeeded or failed (`tgi_request_success`,
`tgi_request_failure` by `err`), and per-request histograms: prompt lengths (`tgi_request_input_length`),
generated tokens (`tgi_request_generated_tokens`), the mean time per token of each request
(`tgi_request_mean_time_per_token_duration`: inter-token latency, one mean per request rather than one
observation per token), time queued and end to end. The token totals are those histograms' sums. The names are
the same from TGI 1.x to 3.x; the set grew (`tgi_request_skipped_tokens` for speculation, the batch forward /
decode / filter durations). Forks that keep the router (tgi-gaudi) export the same names. IBM's vLLM adapter for
TGIS also exports `tgi_` names, beside vLLM's own `vllm:` ones, which outnumber them: such a scrape is read as
vLLM.

What it does not report: KV usage or the pool (`--max-batch-total-tokens`, inferred at warm-up, is not
exported; `tgi_batch_current_max_tokens` is what the running batch reserves, not the pool), time to first token
(no histogram: its prefill batches are timed, not requests), prefix-cache hits, preemptions, process metrics.
Each is marked unknown.
"""

from __future__ import annotations

from typing import Any

from kvops.adapters import common
from kvops.adapters.names import MetricSource, Reader, table
from kvops.adapters.prometheus import Scrape
from kvops.kinds.profile import EngineProfile, Recognition, Remedy
from kvops.schema.snapshot import Snapshot

KIND = "tgi"
EVERY = "every TGI version (its router exports them by default)"
METRICS = table(
    MetricSource("requests.running", ("tgi_batch_current_size",), EVERY),
    MetricSource("requests.waiting", ("tgi_queue_size",), EVERY),
    # Typed `counter` without `_total`: the Prometheus parser reads their samples with `_total` added.
    MetricSource("requests.finished_total", ("tgi_request_success_total", "tgi_request_success"), EVERY),
    MetricSource("requests.aborted_total", ("tgi_request_failure_total", "tgi_request_failure"),
                 "every TGI version, once a request has failed (validation, overloaded, generation)"),
    MetricSource("requests.prompt_tokens_total", ("tgi_request_input_length_sum",), EVERY),
    MetricSource("requests.generation_tokens_total", ("tgi_request_generated_tokens_sum",), EVERY),
    MetricSource("prompt_lengths", ("tgi_request_input_length",), EVERY),
    MetricSource("generation_lengths", ("tgi_request_generated_tokens",), EVERY),
    MetricSource("itl", ("tgi_request_mean_time_per_token_duration",), f"{EVERY}: one mean per request"),
)
# Fields TGI's /metrics has no name for in any version.
NEVER = ("engine.max_num_seqs", "engine.max_num_batched_tokens", "engine.bytes_per_token", "engine.kv_cache_bytes",
         "engine.dtype", "engine.device", "engine.kv_cache_dtype", "engine.enable_prefix_caching",
         "requests.preemptions_total", "prefix_cache", "ttft", "swap", "tenants", "steps", "process")


def snapshot_from_tgi(scrape: Scrape, t: float, model_card: dict[str, Any] | None = None,
                      started_at: float | None = None) -> Snapshot:
    data = common.neutral_for(KIND, scrape, t, model_card, "tgi_queue_size")
    read = Reader(scrape, data, METRICS)
    common.fill_blocks(data, None, None, None)  # no KV usage, pool or block size in any version
    common.read_max_model_len(data, model_card)
    for field in NEVER:
        read.unknown(field)
    requests = data["requests"]
    read.counts("requests.running", "requests.waiting", "requests.finished_total", "requests.prompt_tokens_total",
                "requests.generation_tokens_total")
    failed = read.value("requests.aborted_total")
    if failed is not None:
        requests["aborted_total"] = round(failed)
    elif "requests.finished_total" not in data["unknown"]:
        # The failure counter appears with the first failure: beside a success counter, its absence is 0.
        data["unknown"].remove("requests.aborted_total")
    common.read_histograms(read, ("prompt_lengths", "generation_lengths", "itl"))
    data["process"]["gpu_status"] = "not reported by TGI"
    return common.finish(data, started_at)


PROFILE = EngineProfile(
    kind=KIND,
    title="TGI",
    recognition=Recognition(metric_prefixes=("tgi_",), owned_by=("text-generation-inference",)),
    read_scrape=snapshot_from_tgi,
    metrics=METRICS,
    flags={"max_num_seqs": "--max-batch-size", "max_num_batched_tokens": "--max-batch-prefill-tokens",
           "max_model_len": "--max-total-tokens"},
    remedies={
        Remedy.QUEUEING: "raise --max-batch-total-tokens (or leave it unset for warm-up to size it), "
                         "--max-batch-prefill-tokens and --max-batch-size if set; lower --max-waiting-tokens so "
                         "queued requests join the running batch sooner",
        Remedy.LONG_PROMPTS: "cap them (--max-input-tokens, --max-total-tokens), or route long prompts to their own "
                             "server",
        Remedy.PREFIX_CACHING_ON: "run TGI 3 with prefix caching on (the default; PREFIX_CACHING=1)",
        Remedy.POOL_SIZE_LOG: "TGI: 'Setting max batch total tokens to'",
        Remedy.START: "text-generation-launcher --model-id MODEL --port {port}",
        Remedy.CAPACITY: "lower --max-batch-size or --max-concurrent-requests, or give the KV cache more memory "
                         "(--cuda-memory-fraction: warm-up sizes --max-batch-total-tokens from it)",
    },
    # A watched server only: no admin API, no preemption counter, no swap, no KV events.
    capabilities=frozenset(),
    notes={"kv_pool_flag": "--cuda-memory-fraction (warm-up sizes --max-batch-total-tokens from it)",
           "max_concurrent_requests": "--max-concurrent-requests (past it, TGI answers 429 'Model is overloaded')"},
)
