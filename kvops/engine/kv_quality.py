"""Measuring what a KV dtype does to the model, outside the serving pool.

Both the error profile and the quality benchmark run the model over a private cache in the KV
dtype under test, so nothing they do touches the blocks that serve requests. Their fp8 layers take
the serving pool's calibrated scales when it has them, so they measure what serving stores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvops import kernels
from kvops.kernels import AttentionMetadata, KVCacheLayer, PrefillSpan

if TYPE_CHECKING:
    from kvops.engine.engine import LLMEngine


def private_kv_pool(engine: LLMEngine, kinds: Sequence[str], num_blocks: int, group_size: int) -> list[KVCacheLayer]:
    """A fresh cache of `num_blocks` blocks, one layer per entry of `kinds`, shaped like the engine's."""
    model = engine.model
    return [kernels.allocate_kv_cache_layer(kind, num_blocks, engine.config.block_size, model.num_kv_heads,
                                            model.head_dim, engine.dtype, group_size, device=engine.device)
            for kind in kinds]


def share_fp8_scales(serving: Sequence[KVCacheLayer], private: Sequence[KVCacheLayer]) -> str:
    """Give each private fp8 layer the serving layer's scales where those are calibrated; say where the
    private scales come from: "serving", "calibrated" (on the private pool's first write) or "fixed"."""
    if any(layer.kind == "fp8" and layer.scale_fixed for layer in private):
        return "fixed"  # allocated under `fixed_fp8_scale`: nothing to calibrate or share
    shared = False
    for mine, theirs in zip(private, serving, strict=True):
        if mine.kind == theirs.kind == "fp8" and theirs.scale_fixed:
            assert mine.scale is not None and theirs.scale is not None
            mine.scale.copy_(theirs.scale)
            mine.scale_fixed = shared = True
    return "serving" if shared else "calibrated"


@dataclass
class TextScore:
    perplexity: float
    predictions: list[int]  # the model's top-1 next token at every position but the last


def score_text(engine: LLMEngine, token_ids: Sequence[int], chunk: int = 256) -> TextScore:
    """Perplexity of `token_ids` under the engine's model and KV dtypes, prefilled `chunk` tokens at a
    time, so every chunk after the first reads its context back from the (quantized) cache."""
    if len(token_ids) < 2:
        raise ValueError("scoring a text needs at least two tokens")
    block_size = engine.config.block_size
    pool = private_kv_pool(engine, engine.kv_pool.layer_dtypes, -(-len(token_ids) // block_size),
                           engine.config.kv_cache_group_size)
    share_fp8_scales(engine.kv_pool.device, pool)
    table = torch.arange(pool[0].num_blocks)
    ids = torch.tensor(list(token_ids))
    log_likelihood = 0.0
    predictions: list[int] = []
    for start in range(0, len(ids), chunk):
        end = min(len(ids), start + chunk)
        positions = torch.arange(start, end)
        slots = table[positions // block_size] * block_size + positions % block_size
        meta = AttentionMetadata(block_size, slots, 0, torch.zeros(0, 0, dtype=torch.long),
                                 torch.zeros(0, dtype=torch.long), [PrefillSpan(0, end - start, end, table)])
        logits = engine.model.forward(ids[start:end], positions, meta, pool, torch.arange(end - start))
        scored = min(end, len(ids) - 1) - start  # the last token has no next token to score
        logprobs = torch.log_softmax(logits[:scored], dim=-1)
        log_likelihood += float(logprobs.gather(1, ids[start + 1 : start + 1 + scored, None].to(logprobs.device)).sum())
        predictions.extend(logits[:scored].argmax(-1).tolist())
    return TextScore(math.exp(-log_likelihood / (len(ids) - 1)), predictions)
