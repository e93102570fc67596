"""Which of the server's metrics each doctor line read, for `-v`: the snapshot fields a line (or the rule
behind it) uses, looked up in the snapshot's record of the metrics each field came from."""

from __future__ import annotations

from kvops.doctor.report import Check, Status
from kvops.schema.snapshot import Snapshot

USAGE = ("blocks.usage", "engine.num_blocks", "engine.block_size")
HITS = ("prefix_cache.queries_total", "prefix_cache.hits_total", "prefix_cache.hit_rate",
        "engine.enable_prefix_caching")
FIELDS_BY_RULE: dict[str, tuple[str, ...]] = {
    "kv_oom_runtime": (*USAGE, "requests.preemptions_total", "requests.running", "requests.waiting"),
    "kv_oom_start": (*USAGE, "engine.max_model_len"),
    "swap_storm": ("swap", "requests.preemptions_total"),
    "prompt_variance": (*HITS, "prompt_lengths"),
    "prefix_caching_off": (*HITS, "requests.prompt_tokens_total"),
    "no_prefix_hits": (*HITS, "prompt_lengths"),
    "block_size_mismatch": ("engine.block_size", "prompt_lengths", "generation_lengths", *HITS),
    "queueing": ("requests.waiting", "requests.running", "blocks.usage", "requests.preemptions_total", "ttft"),
    "aborted_requests": ("requests.aborted_total", "requests.finished_total"),
    "latency_slo": ("ttft", "itl"),
}
FIELDS_BY_TITLE: dict[str, tuple[str, ...]] = {
    "KV cache usage": USAGE,
    "Preemptions": ("requests.preemptions_total",),
    "Prefix cache hit rate": HITS,
    "Swap": ("swap",),
    "Prompt lengths": ("prompt_lengths",),
    "Queueing": ("requests.waiting", "requests.running", "blocks.usage"),
    "Aborted requests": ("requests.aborted_total", "requests.finished_total"),
    "Time to first token": ("ttft",),
    "Inter-token latency": ("itl",),
    "Ranks": ("blocks.usage", "requests.running", "requests.waiting"),
    "Maximum concurrency": (*USAGE, "engine.max_model_len"),
}


def attach_metrics(checks: list[Check], latest: Snapshot) -> None:
    """Fill each check's `metrics` with the server metrics behind the fields it reads (nothing for a kvops
    engine read through its snapshot API, which names no metrics)."""
    if not latest.metrics_read:
        return
    for check in checks:
        if check.status is Status.SKIPPED:
            continue  # it read nothing: its remedy names what it lacked
        fields = FIELDS_BY_RULE.get(check.rule or "") or FIELDS_BY_TITLE.get(check.title, ())
        names: list[str] = []
        for field in fields:
            names.extend(n for n in latest.metrics_read.get(field, []) if n not in names)
        check.metrics = names
