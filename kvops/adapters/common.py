"""What every adapter shares: a neutral snapshot to fill in, and histogram percentiles from buckets.

Neutral values are the ones rules read as "nothing happening" (0 counters, empty tenants, no steps, no
swap), so a field another server does not export can never make a rule fire. Each such field is listed
in `Snapshot.unknown`, so doctor says "not checked" instead of "fine".
"""

from __future__ import annotations

import math
from typing import Any

from kvops.adapters.names import Reader
from kvops.adapters.prometheus import Scrape
from kvops.schema.snapshot import Histogram, Snapshot, bucket_quantile, percentile_fields

# Without a pool size in the scrape, block counts are expressed in per-mille of the pool: usage and its
# trend stay exact, absolute block numbers are marked unknown.
NOMINAL_BLOCKS = 1000


def neutral(source: str, t: float, model: str) -> dict[str, Any]:
    """A snapshot's JSON form with every required field at its neutral value."""
    return {
        "source": source,
        "unknown": [],
        "time": t,
        "uptime_s": 0.0,
        "engine": {
            "model": model, "engine_version": "", "pid": 0, "started_at": 0.0, "device": "unknown",
            "dtype": "unknown", "kv_cache_dtype": "unknown", "block_size": 1, "num_blocks": 0,
            "max_model_len": 0, "max_num_seqs": 0, "max_num_batched_tokens": 0, "kv_cache_bytes": 0,
            "bytes_per_token": 0, "enable_prefix_caching": True, "eviction_policy": "unknown",
        },
        "blocks": {"counts": {state: 0 for state in ("free", "filling", "full", "cached", "pending_free", "swapped")},
                   "usage": 0.0, "state_map": "", "allocated_slots": 0, "used_slots": 0},
        "prefix_cache": {"queries_total": 0, "hits_total": 0, "hit_rate": 0.0, "window_s": 0.0,
                         "window_queries": 0, "window_hits": 0, "window_hit_rate": 0.0, "evictions_total": 0},
        "requests": {"running": 0, "waiting": 0, "finished_total": 0, "aborted_total": 0, "preemptions_total": 0,
                     "prompt_tokens_total": 0, "generation_tokens_total": 0},
        "prompt_lengths": histogram_json(None),
        "steps": [],
        "swap": {},
        "tenants": {},
        "process": {"cpu_percent": 0.0, "rss_bytes": 0, "num_threads": 0, "gpus": [],
                    "gpu_status": f"not reported by {source}"},
    }


def histogram_json(parsed: tuple[list[float], list[int], float, int] | None) -> dict[str, Any]:
    if parsed is None:
        return {"buckets": [], "counts": [0], "sum": 0.0, "count": 0, **percentile_fields(lambda q: None)}
    bounds, counts, total, count = parsed
    return Histogram(buckets=bounds, counts=counts, sum=total, count=count,
                     **percentile_fields(lambda q: bucket_quantile(bounds, counts, q / 100))).model_dump()


def fill_blocks(data: dict[str, Any], usage: float | None, num_blocks: int | None, block_size: int | None) -> None:
    """Block counts from a usage fraction: live blocks (usage × pool) as `full`, the rest `free` (the
    servers do not split cached from free). A missing pool size gives NOMINAL_BLOCKS."""
    engine, blocks = data["engine"], data["blocks"]
    if block_size:
        engine["block_size"] = block_size
    else:
        data["unknown"].append("engine.block_size")
    if not num_blocks:
        num_blocks = NOMINAL_BLOCKS
        data["unknown"].append("engine.num_blocks")
    engine["num_blocks"] = num_blocks
    if usage is None or math.isnan(usage):
        data["unknown"].append("blocks")
        blocks["counts"]["free"] = num_blocks
        return
    usage = min(1.0, max(0.0, usage))
    live = round(usage * num_blocks)
    blocks["usage"] = usage
    blocks["counts"].update(full=live, free=num_blocks - live)
    # Slots: the servers report no fill level inside blocks, so allocated = used (no fragmentation claimed).
    blocks["allocated_slots"] = blocks["used_slots"] = live * engine["block_size"]
    data["unknown"].extend(["blocks.state_map", "blocks.used_slots"])


def neutral_for(source: str, scrape: Scrape, t: float, model_card: dict[str, Any] | None,
          model_metric: str) -> dict[str, Any]:
    """The neutral snapshot of a `source` server, named after its model: /v1/models' id, else the
    `model_name` label of `model_metric`."""
    card = model_card or {}
    # `model_name` on vLLM and newer SGLang; early SGLang (0.3) labels its series `name`.
    model = str(card.get("id") or scrape.label(model_metric, "model_name") or scrape.label(model_metric, "name")
                or "unknown")
    data = neutral(source, t, model)
    data["engine"]["engine_version"] = source
    return data


def read_max_model_len(data: dict[str, Any], model_card: dict[str, Any] | None) -> None:
    """`engine.max_model_len` from `/v1/models`' model card (vLLM and SGLang put it there, not in /metrics)."""
    max_model_len = (model_card or {}).get("max_model_len")
    if max_model_len:
        data["engine"]["max_model_len"] = int(max_model_len)
    else:
        data["unknown"].append("engine.max_model_len")


def read_histograms(read: Reader, fields: tuple[str, ...]) -> None:
    """Histogram fields from the metrics the names table gives; `prompt_lengths` is required (neutral when
    absent), the others are None when absent. Absent ones are marked unknown."""
    for field in fields:
        name = read.name(field)
        parsed = read.scrape.histogram(name) if name else None
        if parsed is None:
            read.unknown(field)
        if field == "prompt_lengths" or parsed is not None:
            read.data[field] = histogram_json(parsed)


def finish_from_process(data: dict[str, Any], scrape: Scrape, started_at: float | None) -> Snapshot:
    """`finish` for a server whose scrape has the Prometheus client's process metrics (vLLM, SGLang):
    its memory and start time come from there."""
    data["unknown"].extend(["tenants", "steps", "process.cpu_percent", "process.gpus"])
    rss = scrape.value("process_resident_memory_bytes")
    if rss is None:
        data["unknown"].append("process.rss_bytes")
    else:
        data["process"]["rss_bytes"] = round(rss)
    return finish(data, scrape.value("process_start_time_seconds") or started_at)


def finish(data: dict[str, Any], started_at: float | None) -> Snapshot:
    """Uptime from the process start (Prometheus's `process_start_time_seconds`, or when kvops first saw
    the server); validated into the one snapshot schema."""
    if started_at is None:
        data["unknown"].append("uptime_s")
        started_at = data["time"] - 3600.0  # rates then read as "over the last hour"; marked unknown
    data["engine"]["started_at"] = started_at
    data["uptime_s"] = max(0.0, data["time"] - started_at)
    data["unknown"] = sorted(set(data["unknown"]))
    return Snapshot.model_validate(data)


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0
