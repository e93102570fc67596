"""TensorRT-LLM: Triton's TensorRT-LLM backend (`nv_trt_llm_` metrics) and `trtllm-serve`, read into a snapshot.

Triton's backend (from Triton 23.11; tests/fixtures/published/tensorrt-llm-triton-*, its README's examples)
exports gauges keyed by a label: `nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=...}` with `max`,
`free`, `used` blocks and `tokens_per` block (and, by 2025, `fraction`: used over max),
`nv_trt_llm_request_metrics{request_type=...}` with `active`, `max` (the most it runs at once), `scheduled`,
`context` (and, by 2025, `waiting`: its queue), and `nv_trt_llm_inflight_batcher_metrics` (generation
requests, context tokens of the iteration). Triton's own `nv_inference_request_success` / `_failure` count
requests per model; only the TensorRT-LLM model's series are read (an ensemble's pre- and post-processing
models count the same requests again). A Triton serving vLLM exports `vllm:` names, read as vLLM.

`trtllm-serve` (the PyTorch backend's server) exports Prometheus text at `/prometheus/metrics` (its `/metrics` is
JSON iteration stats; `metrics_paths` below lets a watcher find the text). Its first release of it (PR #5785,
merged August 2025) has unprefixed names labelled `engine_type` / `model_name` (`time_to_first_token_seconds`,
`time_per_output_token_seconds`, `e2e_request_latency_seconds`, `request_queue_time_seconds`,
`request_success_total`); later releases prefix them `trtllm_` (tensorrt_llm/metrics/collector.py) and add, per
the pull requests that did: KV usage and the hit rate (`trtllm_kv_cache_utilization`, `trtllm_kv_cache_hit_rate`,
PR #11243, February 2026), the pool, queue and token counters (`trtllm_kv_cache_max_blocks`,
`_tokens_per_block`, `trtllm_num_requests_running` / `_waiting`, `trtllm_max_num_active_requests`,
`trtllm_prompt_tokens_total` / `trtllm_generation_tokens_total`, PR #12545, March 2026) and the reused and
missed block counters (`trtllm_kv_cache_reused_blocks_total` / `_missed_blocks_total`, PR #12132, March 2026).

Before either, a build of PR #5560 (June 2025, closed unmerged: no release has these names) served `pytrtllm:`
names at `/metrics`: running and waiting requests, prompt and generation tokens, and requests started,
completed, cancelled and failed; no KV, no latency. A published scrape of it exists, so it is read too.

What neither reports: the KV dtype, bytes per token, device, preemptions (the `max_utilization` scheduler
pauses requests; Triton's `paused_requests` is a gauge, not a count), swap, process metrics; Triton reports no
latency histograms or token counters. Each is marked unknown.
"""

from __future__ import annotations

from typing import Any

from kvops.adapters import common
from kvops.adapters.names import MetricSource, Reader, table
from kvops.adapters.prometheus import Scrape
from kvops.kinds.profile import EngineProfile, Recognition, Remedy
from kvops.schema.snapshot import Snapshot

KIND = "tensorrt_llm"
BLOCKS, REQUESTS = "nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_request_metrics"
BLOCK_TYPE, REQUEST_TYPE = "kv_cache_block_type", "request_type"
TRITON = "Triton's TensorRT-LLM backend (23.11 and later)"
SERVE = "trtllm-serve (its /prometheus/metrics)"
KV_GAUGES = "trtllm-serve releases since PR #11243 (Feb 2026; trtllm_ names)"
ITERATION = "trtllm-serve releases since PR #12545 (March 2026; trtllm_ names)"
REUSE = "trtllm-serve releases since PR #12132 (March 2026), with enable_block_reuse"
PY = "pytrtllm:"  # the names of PR #5560's build
PYTRTLLM = "trtllm-serve built from PR #5560 (June 2025, never released)"
PY_CANCELLED, PY_FAILED = f"{PY}request_cancelled_total", f"{PY}request_failed_total"
METRICS = table(
    MetricSource("blocks.usage", (f'{BLOCKS}{{{BLOCK_TYPE}="used"}}', "trtllm_kv_cache_utilization"),
                 f"{TRITON} (used over max blocks); {KV_GAUGES}"),
    MetricSource("engine.num_blocks", (f'{BLOCKS}{{{BLOCK_TYPE}="max"}}', "trtllm_kv_cache_max_blocks"),
                 f"{TRITON}; {ITERATION}"),
    MetricSource("engine.block_size", (f'{BLOCKS}{{{BLOCK_TYPE}="tokens_per"}}', "trtllm_kv_cache_tokens_per_block"),
                 f"{TRITON}; {ITERATION}"),
    MetricSource("engine.max_num_seqs", (f'{REQUESTS}{{{REQUEST_TYPE}="max"}}', "trtllm_max_num_active_requests"),
                 f"{TRITON}; {ITERATION}"),
    MetricSource("requests.running", (f'{REQUESTS}{{{REQUEST_TYPE}="active"}}', "trtllm_num_requests_running"),
                 f"{TRITON}; {ITERATION}"),
    MetricSource("requests.waiting", (f'{REQUESTS}{{{REQUEST_TYPE}="waiting"}}', "trtllm_num_requests_waiting"),
                 f"Triton's TensorRT-LLM backend from 2025; {ITERATION}"),
    # Triton types its counters without `_total`; the Prometheus parser reads them with `_total` added.
    MetricSource("requests.finished_total", ("nv_inference_request_success_total", "trtllm_request_success_total",
                                             "request_success_total"),
                 f"Triton 23.12 and later (its base metrics); {SERVE}"),
    MetricSource("requests.aborted_total", ("nv_inference_request_failure_total",), "Triton 23.12 and later"),
    MetricSource("requests.prompt_tokens_total", ("trtllm_prompt_tokens_total",), ITERATION),
    MetricSource("requests.generation_tokens_total", ("trtllm_generation_tokens_total",), ITERATION),
    MetricSource("prefix_cache.hits_total", ("trtllm_kv_cache_reused_blocks_total",), REUSE),
    MetricSource("prefix_cache.queries_total", ("trtllm_kv_cache_missed_blocks_total",),
                 f"{REUSE} (reused plus missed blocks)"),
    # A rate without the counters behind it, before PR #12132 exported them.
    MetricSource("prefix_cache.hit_rate", ("trtllm_kv_cache_hit_rate",), f"{KV_GAUGES}, with enable_block_reuse"),
    MetricSource("ttft", ("trtllm_time_to_first_token_seconds", "time_to_first_token_seconds"), SERVE),
    MetricSource("itl", ("trtllm_time_per_output_token_seconds", "time_per_output_token_seconds"), SERVE),
)
# PR #5560's build, read through its own names so that no remedy sends an operator to a build that was never released.
PY_METRICS = {**METRICS, **table(
    MetricSource("requests.running", (f"{PY}num_requests_running",), PYTRTLLM),
    MetricSource("requests.waiting", (f"{PY}num_requests_waiting",), PYTRTLLM),
    MetricSource("requests.finished_total", (f"{PY}request_completed_total",), PYTRTLLM),
    MetricSource("requests.aborted_total", (PY_CANCELLED, PY_FAILED), PYTRTLLM),
    MetricSource("requests.prompt_tokens_total", (f"{PY}prompt_tokens_total",), PYTRTLLM),
    MetricSource("requests.generation_tokens_total", (f"{PY}generation_tokens_total",), PYTRTLLM),
)}
# trtllm-serve's first names carry no prefix: these mark its scrape (they match `_bucket`, `_sum`, `_count`).
UNPREFIXED = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds")
NEVER = ("engine.max_num_batched_tokens", "engine.bytes_per_token", "engine.kv_cache_bytes", "engine.dtype",
         "engine.device", "engine.kv_cache_dtype", "engine.enable_prefix_caching", "requests.preemptions_total",
         "prompt_lengths", "generation_lengths", "swap", "tenants", "steps", "process")
UNFINISHED = ("abort", "cancelled", "error")  # trtllm-serve finish reasons of requests that got no full answer
USAGE_AGREES = 0.01  # Triton's `fraction` against used / max blocks


def snapshot_from_tensorrt_llm(scrape: Scrape, t: float, model_card: dict[str, Any] | None = None,
                               started_at: float | None = None) -> Snapshot:
    triton = any(name.startswith("nv_trt_llm_") for name in scrape.names)
    data = common.neutral_for(KIND, scrape, t, model_card, REQUESTS if triton else _first_series(scrape))
    read = Reader(scrape, data, PY_METRICS if any(name.startswith(PY) for name in scrape.names) else METRICS)
    if triton:
        _triton(read)
        if not (model_card or {}).get("id"):  # Triton names the model in its repository: `model="tensorrt_llm"`
            data["engine"]["model"] = scrape.label(REQUESTS, "model") or data["engine"]["model"]
    else:
        _serve(read)
    common.read_max_model_len(data, model_card)
    for field in NEVER:
        if field != "process" or not scrape.has("process_start_time_seconds"):
            read.unknown(field)
    common.read_histograms(read, ("ttft", "itl"))
    for field in ("ttft", "itl"):
        name = read.name(field)
        if name and not scrape.has(f"{name}_sum"):
            read.problem(f"{name} has buckets but no {name}_sum (a cut scrape?): its mean is not known")
    data["process"]["gpu_status"] = "not reported by TensorRT-LLM's metrics"
    if scrape.has("process_start_time_seconds"):  # trtllm-serve's Python exporter has the process metrics
        return common.finish_from_process(data, scrape, started_at)
    return common.finish(data, started_at)


def _first_series(scrape: Scrape) -> str:
    """A trtllm-serve series to take the model's name from (its `model_name` label; "undefined" in early ones)."""
    return next((name for name in sorted(scrape.names) if name.startswith(("trtllm_", PY, *UNPREFIXED))), "")


def _typed(read: Reader, name: str, label: str, field: str, kind: str) -> float | None:
    """One gauge of a labelled family (`nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"}`)."""
    value = read.scrape.by_label(name, label).get(kind)
    if value is not None:
        read.note(field, f'{name}{{{label}="{kind}"}}')
    return value


def _triton(read: Reader) -> None:
    data, requests = read.data, read.data["requests"]
    max_blocks = _typed(read, BLOCKS, BLOCK_TYPE, "engine.num_blocks", "max")
    used = _typed(read, BLOCKS, BLOCK_TYPE, "blocks.usage", "used")
    tokens_per = _typed(read, BLOCKS, BLOCK_TYPE, "engine.block_size", "tokens_per")
    usage = None
    if max_blocks and used is not None:
        usage = read.fraction("blocks.usage", f"{BLOCKS} used / max", used / max_blocks)
        read.note("blocks.usage", f'{BLOCKS}{{{BLOCK_TYPE}="max"}}')
        fraction = read.scrape.by_label(BLOCKS, BLOCK_TYPE).get("fraction")
        if fraction is not None and abs(fraction - usage) > USAGE_AGREES:
            read.problem(f'{BLOCKS}{{{BLOCK_TYPE}="fraction"}} = {fraction:g} but used / max = {used:g} / '
                         f"{max_blocks:g} = {usage:.4g}: the blocks are read, the fraction is not")
    common.fill_blocks(data, usage, round(max_blocks) if max_blocks else None,
                       round(tokens_per) if tokens_per else None)
    for field, kind in (("engine.max_num_seqs", "max"), ("requests.running", "active"),
                        ("requests.waiting", "waiting")):
        value = _typed(read, REQUESTS, REQUEST_TYPE, field, kind)
        if value is None:
            read.unknown(field)
        elif field == "engine.max_num_seqs":
            data["engine"]["max_num_seqs"] = round(value)
        else:
            requests[field.split(".")[1]] = round(value)
    # Triton counts per model: only the TensorRT-LLM model's series, not an ensemble's other steps.
    models = set(read.scrape.by_label(REQUESTS, "model"))
    for field in ("requests.finished_total", "requests.aborted_total"):
        name = METRICS[field].names[0]
        counts = read.scrape.by_label(name, "model")
        mine = [value for model, value in counts.items() if model in models]
        if mine:
            read.note(field, name)
            requests[field.split(".")[1]] = round(sum(mine))
        else:
            read.unknown(field)
    for field in ("requests.prompt_tokens_total", "requests.generation_tokens_total", "prefix_cache"):
        read.unknown(field)


def _serve(read: Reader) -> None:
    scrape, data, requests = read.scrape, read.data, read.data["requests"]
    max_blocks = read.scrape.value("trtllm_kv_cache_max_blocks")
    tokens_per = read.scrape.value("trtllm_kv_cache_tokens_per_block")
    usage = read.scrape.mean("trtllm_kv_cache_utilization")
    if usage is not None:
        read.note("blocks.usage", "trtllm_kv_cache_utilization")
        usage = read.fraction("blocks.usage", "trtllm_kv_cache_utilization", usage)
    for field, value in (("engine.num_blocks", max_blocks), ("engine.block_size", tokens_per)):
        if value is not None:
            read.note(field, METRICS[field].names[1])
    common.fill_blocks(data, usage, round(max_blocks) if max_blocks else None,
                       round(tokens_per) if tokens_per else None)
    most = scrape.value("trtllm_max_num_active_requests")
    if most is None:
        read.unknown("engine.max_num_seqs")
    else:
        read.note("engine.max_num_seqs", "trtllm_max_num_active_requests")
        data["engine"]["max_num_seqs"] = round(most)
    read.counts("requests.running", "requests.waiting", "requests.prompt_tokens_total",
                "requests.generation_tokens_total")
    name = next((n for n in read.sources["requests.finished_total"].names if not n.startswith("nv_") and scrape.has(n)),
                None)
    by_reason = scrape.by_label(name, "finished_reason") if name else {}
    if name is None:
        read.unknown("requests.finished_total")
        read.unknown("requests.aborted_total")
    elif name.startswith(PY):
        _py_ended(read, name)
    else:
        read.note("requests.finished_total", name)
        requests["finished_total"] = round(sum(v for r, v in by_reason.items() if r not in UNFINISHED)
                                           if by_reason else scrape.value(name) or 0)
        requests["aborted_total"] = round(sum(by_reason.get(r, 0.0) for r in UNFINISHED))
        read.note("requests.aborted_total", *(f'{name}{{finished_reason="{r}"}}' for r in UNFINISHED))
    _block_reuse(read)


def _py_ended(read: Reader, completed: str) -> None:
    """PR #5560's build counts the requests that ended apart: completed, cancelled and failed (its one scrape: 708
    started = 707 completed + 1 running + 0 + 0), so completed ones are the finished ones."""
    scrape, requests = read.scrape, read.data["requests"]
    read.note("requests.finished_total", completed)
    requests["finished_total"] = round(scrape.value(completed) or 0)
    unfinished = [name for name in (PY_CANCELLED, PY_FAILED) if scrape.has(name)]
    if unfinished:
        read.note("requests.aborted_total", *unfinished)
        requests["aborted_total"] = round(sum(scrape.value(name) or 0.0 for name in unfinished))
    else:
        read.unknown("requests.aborted_total")


def _block_reuse(read: Reader) -> None:
    """Prefix-cache hits in blocks: reused out of reused plus missed (with enable_block_reuse); before those
    counters, the hit rate gauge alone."""
    prefix = read.data["prefix_cache"]
    reused = read.value("prefix_cache.hits_total")
    missed = read.value("prefix_cache.queries_total")
    if reused is not None and missed is not None:
        prefix.update(queries_total=round(reused + missed), hits_total=round(reused),
                      hit_rate=common.ratio(reused, reused + missed))
    elif (rate := read.value("prefix_cache.hit_rate", mean=True)) is not None:
        prefix["hit_rate"] = read.fraction("prefix_cache.hit_rate", "trtllm_kv_cache_hit_rate", rate)
    for field in ("prefix_cache.window_hit_rate", "prefix_cache.evictions_total", "prefix_cache.normalization",
                  "prefix_cache.shadow_hit_rate", "prefix_cache.potential_hit_rate"):
        read.unknown(field)


PROFILE = EngineProfile(
    kind=KIND,
    title="TensorRT-LLM",
    recognition=Recognition(metric_prefixes=("nv_trt_llm_", "trtllm_", PY, *UNPREFIXED), owned_by=("tensorrt_llm",)),
    read_scrape=snapshot_from_tensorrt_llm,
    metrics=METRICS,
    flags={"max_num_seqs": "max_batch_size", "max_num_batched_tokens": "max_num_tokens",
           "enable_prefix_caching": "enable_block_reuse"},
    remedies={
        Remedy.QUEUEING: "raise max_batch_size and max_num_tokens (the engine's build limits, and trtllm-serve's "
                         "options), and on Triton set batch_scheduler_policy to max_utilization",
        Remedy.LONG_PROMPTS: "cap them (max_input_len / max_seq_len), turn on enable_chunked_context, or route long "
                             "prompts to their own server",
        Remedy.PREFIX_CACHING_ON: "turn block reuse on: kv_cache_config enable_block_reuse (trtllm-serve), "
                                  "enable_kv_cache_reuse (Triton's config.pbtxt)",
        Remedy.POOL_SIZE_LOG: "TensorRT-LLM: 'Number of blocks in KV cache primary pool'",
        Remedy.START: "trtllm-serve MODEL --port {port} (Prometheus text at /prometheus/metrics)",
        Remedy.CAPACITY: "lower max_batch_size, or give the KV cache more of the free GPU memory: kv_cache_config "
                         "free_gpu_memory_fraction (trtllm-serve), kv_cache_free_gpu_mem_fraction (Triton)",
    },
    # A watched server only: no admin API, no preemption counter, no swap, no KV events read by kvops.
    capabilities=frozenset(),
    notes={"kv_pool_flag": "kv_cache_config free_gpu_memory_fraction (trtllm-serve), "
                            "kv_cache_free_gpu_mem_fraction (Triton)"},
    # Triton and PR #5560's build serve the text at /metrics; trtllm-serve's /metrics is JSON iteration stats.
    metrics_paths=("/metrics", "/prometheus/metrics"),
)
