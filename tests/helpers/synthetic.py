"""Synthetic snapshots and histories, so rule tests read like scenarios.

`snapshot(t, **overrides)` is a realistic engine at time `t` (every required field filled with a
sane, healthy default); overrides deep-merge into its JSON form, e.g.
`snapshot(t, blocks={"counts": {"free": 10}}, engine={"block_size": 32})`. `history_of(scene)`
builds an `EngineHistory` from `scene(i, t) -> overrides`, one snapshot every `every` seconds
ending at `end`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvops.history import EngineHistory, HealthSample
from kvops.schema.engines import EngineExit
from kvops.schema.snapshot import BLOCK_STATE_CODES, Snapshot, encode_block_map

T0 = 1_750_000_000.0  # "now" in every scenario
STARTED_AT = T0 - 3600.0  # the engine has been up an hour unless a scenario says otherwise
ENGINE = "test-engine"

Scene = Callable[[int, float], dict[str, Any]]


def _defaults(t: float) -> dict[str, Any]:
    return {
        "time": t,
        "uptime_s": t - STARTED_AT,
        "engine": {
            "model": "SmolLM2-135M-Instruct",
            "engine_version": "0.1.0",
            "pid": 4242,
            "started_at": STARTED_AT,
            "device": "cpu",
            "dtype": "float32",
            "kv_cache_dtype": "float32",
            "kv_cache_dtype_skip_layers": [],
            "block_size": 16,
            "num_blocks": 1024,
            "max_model_len": 2048,  # 128 blocks: 8 requests fill the pool, 4 is the default
            "max_num_seqs": 4,
            "max_num_batched_tokens": 2048,
            "bytes_per_token": 46080,  # SmolLM2-135M fp32
            "enable_prefix_caching": True,
            "eviction_policy": "lru",
        },
        "blocks": {
            "counts": {"free": 900, "filling": 4, "full": 40, "cached": 80, "pending_free": 0, "swapped": 0},
            "allocated_slots": 44 * 16,
            "used_slots": 44 * 16 - 4 * 8,
        },
        "prefix_cache": {
            "queries_total": 100_000, "hits_total": 50_000, "hit_rate": 0.5,
            "window_s": 60.0, "window_queries": 2000, "window_hits": 1000, "window_hit_rate": 0.5,
            "evictions_total": 0, "normalization": "off",
        },
        "requests": {
            "running": 4, "waiting": 0, "finished_total": 1000, "aborted_total": 0, "preemptions_total": 0,
            "prompt_tokens_total": 100_000, "generation_tokens_total": 64_000,
        },
        "prompt_lengths": {
            "buckets": [16.0, 64.0, 256.0, 1024.0], "counts": [0, 600, 300, 100, 0], "sum": 100_000.0,
            "count": 1000, "p50": 64.0, "p95": 256.0, "p99": 1024.0,
        },
        "steps": [],
        "swap": {},
        "tenants": {},
        "process": {"cpu_percent": 40.0, "rss_bytes": 2 * 2**30, "num_threads": 8, "gpus": [],
                    "gpu_status": "no GPU"},
    }


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def merged(*overrides: dict[str, Any]) -> dict[str, Any]:
    """Several override dicts deep-merged, later ones winning (`{**a, **b}` would drop nested keys)."""
    result: dict[str, Any] = {}
    for override in overrides:
        result = _merge(result, override)
    return result


def snapshot(t: float = T0, **overrides: Any) -> Snapshot:
    data = _merge(_defaults(t), overrides)
    engine, blocks = data["engine"], data["blocks"]
    # Derived fields stay consistent with the overridden ones unless given explicitly.
    engine.setdefault("kv_cache_bytes", engine["num_blocks"] * engine["block_size"] * engine["bytes_per_token"])
    counts = blocks["counts"]
    live = counts.get("filling", 0) + counts.get("full", 0)
    blocks.setdefault("usage", live / engine["num_blocks"])
    blocks.setdefault("state_map", encode_block_map("".join(
        BLOCK_STATE_CODES[state] * counts.get(state, 0) for state in ("full", "filling", "cached", "pending_free",
                                                                       "free"))))
    return Snapshot.model_validate(data)


def gpu(utilization: float = 90.0, used: int = 40 * 2**30, total: int = 80 * 2**30, index: int = 0,
        kvops: int | None = None, engine_device: bool = True) -> dict[str, Any]:
    """One GPU as the engine reports it; `kvops` of `used` is the engine's (default: all of it)."""
    ours = used if kvops is None else kvops
    return {"index": index, "name": "NVIDIA H100", "memory_used_bytes": used, "memory_total_bytes": total,
            "memory_free_bytes": max(0, total - used), "memory_kvops_bytes": ours,
            "memory_others_bytes": max(0, used - ours), "memory_kvops_source": "nvml",
            "utilization_percent": utilization, "engine_device": engine_device}


def on_gpu(utilization: float = 90.0, cpu_percent: float = 40.0, **gpu_fields: Any) -> dict[str, Any]:
    """Overrides for an engine on cuda:0 with one GPU."""
    return {"engine": {"device": "cuda:0"},
            "process": {"cpu_percent": cpu_percent, "gpus": [gpu(utilization, **gpu_fields)], "gpu_status": "ok"}}


def decode_steps(start: float, end: float, every: float = 0.05, duration: Callable[[int, float], float] | float = 0.02,
                 num_seqs: int = 4, context_start: int = 100) -> list[dict[str, Any]]:
    """Decode-only steps from `start` to `end`, the longest context growing by one token per step;
    `duration(context_len, t)` or a constant."""
    steps = []
    n = int((end - start) / every)
    for i in range(n + 1):
        t = start + i * every
        context = context_start + i
        seconds = duration(context, t) if callable(duration) else duration
        steps.append({"t": t, "duration_s": seconds, "num_seqs": num_seqs, "num_tokens": num_seqs,
                      "decode_only": True, "max_context_len": context})
    return steps


def steps_until(steps: Sequence[dict[str, Any]], t: float, keep: int = 512) -> list[dict[str, Any]]:
    """What a snapshot at `t` carries: the last `keep` steps that ended by then."""
    return [s for s in steps if s["t"] <= t][-keep:]


def history_of(scene: Scene | None = None, n: int = 61, every: float = 5.0, end: float = T0,
               engine: str = ENGINE, **history_fields: Any) -> EngineHistory:
    """n snapshots, `every` seconds apart, the last at `end`; `scene(i, t)` gives each one's overrides."""
    history = EngineHistory(engine=engine, **history_fields)
    for i in range(n):
        t = end - (n - 1 - i) * every
        history.add(snapshot(t, **(scene(i, t) if scene else {})))
    return history


def with_health(history: EngineHistory, ups: Sequence[bool], every: float = 5.0, end: float = T0,
                error: str = "connection refused") -> EngineHistory:
    for i, up in enumerate(ups):
        history.record_health(HealthSample(t=end - (len(ups) - 1 - i) * every, up=up, error="" if up else error))
    return history


def with_exits(history: EngineHistory, times: Sequence[float], exit_code: int | None = 1, signal: int | None = None,
               stderr: Sequence[str] = ("RuntimeError: CUDA out of memory",)) -> EngineHistory:
    for t in times:
        history.record_exit(EngineExit(t=t, exit_code=exit_code, signal=signal, stderr_tail=tuple(stderr)))
    return history
