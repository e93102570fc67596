"""The per-layer KV quantization error profile, taken on demand.

A fixed prompt set is decoded greedily through a private cache in the KV dtype under test (the
serving pool is not touched). Each layer's K and V are also kept in full precision as they are
produced; at the chosen decode steps the dequantized cache is compared with them, token by token
and head by head (cosine similarity, averaged). A layer below the threshold is one to keep in the
model dtype (`--kv-cache-dtype-skip-layers`).

fp8 layers use the serving pool's calibrated scales when it has them (so the profile measures what
serving stores); otherwise they calibrate on the profile's own prefill, as a fresh pool would.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvops import kernels
from kvops.engine.errors import InvalidRequestError
from kvops.engine.kv_pool import layer_kv_dtypes
from kvops.engine.kv_quality import private_kv_pool, share_fp8_scales
from kvops.kernels import AttentionMetadata, KVCacheLayer, PrefillSpan
from kvops.schema.reports import KVQuantProfile, LayerKVError

if TYPE_CHECKING:
    from kvops.engine.config import EngineConfig
    from kvops.engine.engine import LLMEngine

PROFILE_PROMPTS = (
    "Explain how a paged KV cache works in an LLM inference server.",
    "Write a short Python function that checks whether a number is prime.",
    "What are the main causes of the French Revolution? Answer in a few sentences.",
    "Summarize the plot of Romeo and Juliet for a ten-year-old.",
)
DEFAULT_STEPS = (10, 50, 100)
DEFAULT_THRESHOLD = 0.99


def profile_kv_error(
    engine: LLMEngine,
    kv_cache_dtype: str | None = None,
    group_size: int | None = None,
    skip_layers: Sequence[int] | None = None,
    steps: Sequence[int] = DEFAULT_STEPS,
    threshold: float = DEFAULT_THRESHOLD,
) -> KVQuantProfile:
    """Profile the engine's KV dtype, or another one (to ask "would int4 be safe here?")."""
    started = time.perf_counter()
    config = _config_under_test(engine, kv_cache_dtype, group_size, skip_layers)
    steps = _checked_steps(steps, threshold)
    model = engine.model
    kinds = layer_kv_dtypes(config, model.num_layers, model.head_dim)
    prompts = [engine.encode_chat([{"role": "user", "content": text}]) for text in PROFILE_PROMPTS]
    longest = max(len(p) for p in prompts) + steps[-1]
    if longest > engine.max_model_len:
        raise InvalidRequestError(f"decode step {steps[-1]} would go past max_model_len {engine.max_model_len}: "
                                  "ask for fewer steps", "steps")

    block_size = config.block_size
    blocks_per_seq = -(-longest // block_size)
    tables = [torch.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq) for i in range(len(prompts))]
    quantized = private_kv_pool(engine, kinds, blocks_per_seq * len(prompts), config.kv_cache_group_size)
    reference = private_kv_pool(engine, ["auto"] * model.num_layers, blocks_per_seq * len(prompts), 32)
    scale_source = share_fp8_scales(engine.kv_pool.device, quantized)

    def slots_of(seq: int, positions: torch.Tensor) -> torch.Tensor:
        return tables[seq][positions // block_size] * block_size + positions % block_size

    slot_mapping = torch.empty(0, dtype=torch.long)

    def keep_full_precision(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kernels.write_kv_cache(k, v, reference[layer], slot_mapping)

    # Prefill every prompt in one forward pass.
    ids, positions, slots, spans, last = [], [], [], [], []
    for seq, prompt in enumerate(prompts):
        start = len(ids)
        pos = torch.arange(len(prompt))
        ids.extend(prompt)
        positions.append(pos)
        slots.append(slots_of(seq, pos))
        spans.append(PrefillSpan(start, start + len(prompt), len(prompt), tables[seq]))
        last.append(start + len(prompt) - 1)
    slot_mapping = torch.cat(slots)
    meta = AttentionMetadata(block_size, slot_mapping, 0, torch.zeros(0, 0, dtype=torch.long),
                             torch.zeros(0, dtype=torch.long), spans)
    logits = model.forward(torch.tensor(ids), torch.cat(positions), meta, quantized, torch.tensor(last),
                           keep_full_precision)
    tokens = logits.argmax(-1)
    lengths = torch.tensor([len(p) for p in prompts])

    cosines: dict[int, dict[str, dict[int, float]]] = {i: {"k": {}, "v": {}} for i in range(model.num_layers)}
    rel_errors: dict[int, list[float]] = {}
    compared = 0
    for step in range(1, steps[-1] + 1):
        slot_mapping = torch.stack([slots_of(seq, lengths[seq : seq + 1])[0] for seq in range(len(prompts))])
        lengths = lengths + 1
        meta = AttentionMetadata(block_size, slot_mapping, len(prompts), torch.stack(tables), lengths, [])
        logits = model.forward(tokens, lengths - 1, meta, quantized, torch.arange(len(prompts)), keep_full_precision)
        tokens = logits.argmax(-1)
        if step in steps:
            context = torch.cat([slots_of(seq, torch.arange(int(lengths[seq]))) for seq in range(len(prompts))])
            compared = int(context.numel())
            _compare(quantized, reference, context, step, cosines, rel_errors)

    layers = _layer_errors(engine, kinds, quantized, cosines, rel_errors, threshold)
    return KVQuantProfile(
        kv_cache_dtype=engine.dtype_name if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
        group_size=config.kv_cache_group_size if config.kv_cache_dtype == "int4" else None,
        skip_layers=list(config.kv_cache_dtype_skip_layers), threshold=threshold, steps=steps,
        prompts=len(prompts), tokens_compared=compared, duration_s=round(time.perf_counter() - started, 3),
        layers=layers, flagged=[entry.layer for entry in layers if entry.below_threshold],
        fp8_scales=scale_source if "fp8" in kinds else None,
    )


def _config_under_test(engine: LLMEngine, kv_cache_dtype: str | None, group_size: int | None,
                       skip_layers: Sequence[int] | None) -> EngineConfig:
    """The engine's config with the KV settings asked for (the engine's own where none is)."""
    return dataclasses.replace(
        engine.config,
        kv_cache_dtype=kv_cache_dtype or engine.config.kv_cache_dtype,
        kv_cache_group_size=group_size or engine.config.kv_cache_group_size,
        kv_cache_dtype_skip_layers=engine.config.kv_cache_dtype_skip_layers if skip_layers is None else skip_layers,
    )


def _checked_steps(steps: Sequence[int], threshold: float) -> list[int]:
    """The decode steps to compare at, sorted; a 400 naming the field when they or the threshold make no sense."""
    ordered = sorted(set(steps))
    if not ordered or ordered[0] < 1:
        raise InvalidRequestError(f"steps must be positive decode step numbers (got {list(ordered)})", "steps")
    if not 0 < threshold <= 1:
        raise InvalidRequestError(f"threshold must be in (0, 1] (got {threshold})", "threshold")
    return ordered


def _compare(quantized: Sequence[KVCacheLayer], reference: Sequence[KVCacheLayer], context: torch.Tensor, step: int,
             cosines: dict[int, dict[str, dict[int, float]]], rel_errors: dict[int, list[float]]) -> None:
    """At one decode step: each layer's dequantized K and V against the full-precision copies, over the context."""
    for layer in range(len(quantized)):
        got = kernels.gather_kv(quantized[layer], context).float()
        want = kernels.gather_kv(reference[layer], context).float()
        cos = F.cosine_similarity(got, want, dim=-1)
        cosines[layer]["k"][step] = round(float(cos[0].mean()), 6)
        cosines[layer]["v"][step] = round(float(cos[1].mean()), 6)
        # Overwritten at every compared step: the last one (the longest context) is reported.
        rel = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1).clamp_min(1e-12)
        rel_errors[layer] = [round(float(x), 6) for x in rel]


def _layer_errors(engine: LLMEngine, kinds: Sequence[str], quantized: Sequence[KVCacheLayer],
                  cosines: dict[int, dict[str, dict[int, float]]], rel_errors: dict[int, list[float]],
                  threshold: float) -> list[LayerKVError]:
    layers = []
    for layer, kind in enumerate(kinds):
        worst = min(min(cosines[layer]["k"].values()), min(cosines[layer]["v"].values()))
        scales = quantized[layer].scale.tolist() if kind == "fp8" else [None, None]  # type: ignore[union-attr]
        layers.append(LayerKVError(layer=layer, kv_dtype=engine.dtype_name if kind == "auto" else kind,
                                   k_cosine=cosines[layer]["k"], v_cosine=cosines[layer]["v"],
                                   min_cosine=worst, below_threshold=worst < threshold,
                                   k_rel_error=rel_errors[layer][0], v_rel_error=rel_errors[layer][1],
                                   k_scale=scales[0], v_scale=scales[1]))
    return layers
