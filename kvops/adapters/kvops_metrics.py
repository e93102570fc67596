"""A kvops engine's own `/metrics` as a snapshot: for `kvops doctor --metrics-file` on a saved scrape.

Every metric is read back into the snapshot field `kvops.schema.metrics` declares for it, so a snapshot's numbers
make the round trip through the engine's text unchanged. A live kvops engine is read from `/stats` (the full
snapshot) instead; the scrape lacks the block map, the step series and the shadow/potential hit rates' mode,
which are marked unknown here.
"""

from __future__ import annotations

from typing import Any

from kvops.adapters.common import finish, histogram_json, neutral, ratio
from kvops.adapters.prometheus import Scrape
from kvops.schema.metrics import (
    EACH,
    ENGINE_INFO,
    ENGINE_INFO_LABELS,
    EVENT_METRICS,
    SNAPSHOT_METRICS,
    MetricType,
    SnapshotMetric,
    by_stem,
    field_type,
    sample_name,
    split_each,
)
from kvops.schema.snapshot import Snapshot


def _number(path: str, value: float) -> Any:
    """A sample's float as the snapshot field's type."""
    kind = field_type(path)
    if kind is bool:
        return value > 0
    if kind is int:
        return round(value)
    return value


def _put(data: dict[str, Any], path: str, value: Any, key: str = "") -> None:
    """Set a dotted path of the snapshot's JSON form, creating the dicts on the way; EACH stands for `key`."""
    *parents, leaf = path.replace(EACH, key).split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[leaf] = value


def _read_row(scrape: Scrape, row: SnapshotMetric, data: dict[str, Any], gpus: dict[str, dict[str, Any]]) -> None:
    """One row's series into `data` (GPUs into `gpus`, by NVML index); a vital row's absence marked unknown."""
    name = row.engine_sample
    within = split_each(row.field)[1]
    match row.labels:
        case ():
            value = scrape.value(name)
            if value is None:
                if row.vital:
                    data["unknown"].append(row.field)
                return
            _put(data, row.field, _number(row.field, value * row.divisor))
        case ("status",):
            status = scrape.label(name, "status")
            if status is not None:
                _put(data, row.field, status)
        case ("state",) | ("tenant",):
            for key, value in scrape.by_label(name, row.labels[0]).items():
                _put(data, row.field, _number(row.field, value * row.divisor), key)
        case ("gpu", "name"):
            for labels, value in scrape.samples.get(name, []):
                gpu = gpus.setdefault(labels.get("gpu", "0"), {"index": int(labels.get("gpu", 0)),
                                                               "name": labels.get("name", "")})
                gpu[within] = _number(row.field, value * row.divisor)
                if row.known:
                    gpu[row.known] = True
        case _:
            raise ValueError(f"{name}: no way to read labels {row.labels}")


def snapshot_from_kvops_metrics(scrape: Scrape, t: float, model_card: dict[str, Any] | None = None,
                                started_at: float | None = None) -> Snapshot:
    data = neutral("kvops", t, scrape.label(ENGINE_INFO, "model") or str((model_card or {}).get("id") or "unknown"))
    unknown: list[str] = data["unknown"]
    engine = data["engine"]

    # The swap section only when the engine exports it (engines before swap did not).
    swap = scrape.has(by_stem("swap_out_blocks").engine_sample)
    gpus: dict[str, dict[str, Any]] = {}
    for row in SNAPSHOT_METRICS:
        if row.engine is not None and (swap or not row.field.startswith("swap.")):
            _read_row(scrape, row, data, gpus)
    for label, path in ENGINE_INFO_LABELS.items():
        if label not in ("model", "block_size"):
            _put(data, path, scrape.label(ENGINE_INFO, label) or ("" if label == "version" else "unknown"))
    # A 16-token block when neither the label nor the value says (the engine's default).
    block_size = scrape.label(ENGINE_INFO, "block_size") or scrape.value(by_stem("engine_block_size").engine_sample)
    engine["block_size"] = int(float(block_size or 16))
    unknown.append("blocks.state_map")

    cache = data["prefix_cache"]
    cache["hit_rate"] = ratio(cache["hits_total"], cache["queries_total"])
    # The mode is not exported; shadow counters that moved say shadow mode was on at some point.
    if cache.get("shadow_queries_total", 0) > 0:
        cache["normalization"] = "shadow"
    unknown.extend(["prefix_cache.window_hit_rate", "prefix_cache.normalization"])

    for metric in EVENT_METRICS:
        if metric.reads_into is None:
            continue
        if metric.type is MetricType.HISTOGRAM:  # one series per tenant: summed
            parsed = scrape.histogram(metric.name)
            if parsed is None:
                unknown.append(metric.reads_into)
            else:
                _put(data, metric.reads_into, histogram_json(parsed))
        elif (total := scrape.value(sample_name(metric.name, metric.type))) is not None:
            _put(data, metric.reads_into, _number(metric.reads_into, total))

    if swap:
        data["swap"]["preemption_mode"] = "swap" if data["swap"].get("host_blocks") else "recompute"
        unknown.append("swap.window.allocations")
    else:
        unknown.append("swap")

    for stats in data["tenants"].values():
        stats["hit_rate"] = ratio(stats.get("hit_tokens_total", 0), stats.get("prompt_tokens_total", 0))

    process = data["process"]
    # A GPU without a utilization series was not sampled (a MIG slice); its other facts still count.
    process["gpus"] = [{"memory_used_bytes": 0, "memory_total_bytes": 0, "utilization_percent": 0.0,
                        "utilization_known": False, **gpu} for _, gpu in sorted(gpus.items(), key=lambda i: int(i[0]))]
    if not scrape.has(by_stem("gpu_status_info").engine_sample):  # engines before the status series
        process["gpu_status"] = "ok" if process["gpus"] else "no GPU series in the scrape"
    unknown.append("steps")
    start = scrape.value(by_stem("engine_start_time_seconds").engine_sample)
    return finish(data, start if start else started_at)
