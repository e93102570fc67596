"""OOM risk at start: the configuration promises more KV than the pool holds.

`max_num_seqs` requests of `max_model_len` tokens need `max_num_seqs × ceil(max_model_len /
block_size)` blocks. A paged engine does not crash when they do not fit, it preempts: at full
concurrency of long requests it spends its time recomputing or swapping. This is a property of
the configuration, so one snapshot decides it.
"""

from __future__ import annotations

import math

from pydantic import Field

from kvops.history import EngineHistory
from kvops.rules.common import (
    GPU_HEADROOM,
    SnapshotRuleSettings,
    blocks_for,
    diagnosis,
    fresh_latest,
    gpu_free_bytes,
    memory_evidence,
)
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity

RULE_ID = "kv_oom_start"
TITLE = "OOM risk at start: the KV pool cannot hold max_num_seqs requests of max_model_len"
DESCRIPTION = "max_num_seqs × max_model_len of KV exceeds the block pool: long requests at full concurrency preempt"


class Settings(SnapshotRuleSettings):
    max_overcommit: float = Field(
        1.0, gt=0,
        description="fire when the blocks needed for max_num_seqs requests of max_model_len exceed the pool by "
                    "more than this factor (1.0: any overcommit; raise it when most requests are short and some "
                    "preemption at peak is accepted)")


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None:
        return []
    engine = latest.engine
    if engine.num_blocks <= 0 or engine.block_size <= 0 or engine.bytes_per_token <= 0:
        return []
    blocks_per_request = blocks_for(engine.max_model_len, engine.block_size)
    blocks_needed = engine.max_num_seqs * blocks_per_request
    overcommit = blocks_needed / engine.num_blocks
    if overcommit <= settings.max_overcommit:
        return []

    # What fits within the allowed overcommit, one knob at a time.
    allowed_blocks = settings.max_overcommit * engine.num_blocks
    fit_max_num_seqs = max(1, math.floor(allowed_blocks / blocks_per_request))
    fit_max_model_len = math.floor(allowed_blocks / engine.max_num_seqs) * engine.block_size
    block_bytes = engine.block_size * engine.bytes_per_token
    fit_kv_cache_memory = math.ceil(blocks_needed / settings.max_overcommit) * block_bytes
    extra_bytes = fit_kv_cache_memory - engine.kv_cache_bytes
    free = gpu_free_bytes(latest)

    pool_tokens = engine.num_blocks * engine.block_size
    tokens_needed = engine.max_num_seqs * engine.max_model_len
    max_concurrency = engine.num_blocks / blocks_per_request
    alternatives = (f"or max_model_len={fit_max_model_len}, " if fit_max_model_len > 0 else "") + \
        f"or kv_cache_memory={fit_kv_cache_memory} bytes"
    # Raising the budget keeps every capability, so it comes first when the GPU has the memory. Otherwise
    # lowering max_num_seqs: requests then queue, where a lower max_model_len would reject long ones.
    if free is not None and 0 < extra_bytes <= GPU_HEADROOM * free:
        params: dict[str, int] = {"kv_cache_memory": fit_kv_cache_memory}
        change = f"kv_cache_memory={fit_kv_cache_memory} bytes (+{extra_bytes}; the GPU has {free} free)"
        alternatives = f"or max_num_seqs={fit_max_num_seqs}"
    else:
        params = {"max_num_seqs": fit_max_num_seqs}
        change = f"max_num_seqs={fit_max_num_seqs}"

    summary = (f"{engine.max_num_seqs} requests of {engine.max_model_len} tokens need {blocks_needed} blocks, "
               f"the pool has {engine.num_blocks} ({overcommit:.2f}×); at most {max_concurrency:.2f} "
               f"max-length requests fit")
    # Overcommit is how paged engines are meant to run (vLLM logs it as "maximum concurrency"): an info
    # note for whoever sizes the engine, not something to page anyone about.
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.INFO, summary,
        {
            "bytes_per_token": engine.bytes_per_token,
            "block_size": engine.block_size,
            "num_blocks": engine.num_blocks,
            "pool_tokens": pool_tokens,
            "kv_cache_bytes": engine.kv_cache_bytes,
            "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.max_num_seqs,
            "blocks_per_request": blocks_per_request,
            "blocks_needed": blocks_needed,
            "tokens_needed": tokens_needed,
            "bytes_needed": blocks_needed * block_bytes,
            "overcommit": round(overcommit, 4),
            "max_concurrency_at_max_model_len": round(max_concurrency, 4),
            "fit_max_num_seqs": fit_max_num_seqs,
            "fit_max_model_len": fit_max_model_len if fit_max_model_len > 0 else None,
            "fit_kv_cache_memory_bytes": fit_kv_cache_memory,
            **memory_evidence(latest),
        },
        fix=Fix(kind=FixKind.RESTART, action="restart_engine", params=params,
                description=f"restart with {change} so that max_num_seqs requests of max_model_len fit within "
                            f"{settings.max_overcommit:g}× the pool ({alternatives})",
                # The configuration is what changes: the restarted engine's overcommit, 10% lower at least.
                objectives=[Objective(measure="overcommit", better="lower", min_effect=0.1)]),
    )]
