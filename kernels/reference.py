"""Torch reference implementations of the cache and attention ops (CPU, and the ground truth)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvops.kernels.attention_metadata import AttentionMetadata


def _flat(kv_cache: torch.Tensor) -> torch.Tensor:
    """[2, blocks, block_size, kv_heads, head_dim] -> [2, slots, kv_heads, head_dim] (a view)."""
    return kv_cache.view(2, -1, *kv_cache.shape[3:])


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V [tokens, kv_heads, head_dim] into one layer's cache
    [2 (K, V), blocks, block_size, kv_heads, head_dim] at `slot_mapping`; negative slots are skipped."""
    k_flat, v_flat = _flat(kv_cache)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[positions // block_size] * block_size + positions % block_size


def _decode_gather(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    cached = meta._cache.get("decode")
    if cached is None:
        lens = meta.decode_context_lens
        max_len = int(lens.max())
        positions = torch.arange(max_len)
        tables = meta.decode_block_tables
        block_index = (positions // meta.block_size).clamp(max=tables.shape[1] - 1)
        slots = tables[:, block_index] * meta.block_size + positions % meta.block_size
        valid = positions[None, :] < lens[:, None]
        slots = torch.where(valid, slots, 0)
        cached = (slots, valid[:, None, None, :])
        meta._cache["decode"] = cached
    return cached  # type: ignore[return-value]


def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [num_decodes, heads, head_dim] attends over each sequence's whole context in the paged cache."""
    slots, mask = _decode_gather(meta)
    kv = _flat(kv_cache)[:, slots].to(q.dtype)  # one gather for K and V: [2, n, ctx, kv_heads, d]
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [n, kv_heads, ctx, d]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def paged_prefill_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [prefill_tokens, heads, head_dim] of each span attends causally over its cached prefix and itself."""
    k_flat, v_flat = _flat(kv_cache)
    outputs = []
    offset = meta.num_decode_tokens
    for span in meta.prefills:
        n = span.end - span.start
        qs = q[span.start - offset : span.end - offset].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        slots = _slots(span.block_table, torch.arange(span.context_len), meta.block_size)
        k = k_flat[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = v_flat[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
        prefix = span.context_len - n
        if prefix == 0:
            out = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            rows = torch.arange(n)[:, None] + prefix
            mask = torch.arange(span.context_len)[None, :] <= rows
            out = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs) if outputs else q[:0]


def copy_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks (source, destination) within one layer's cache (fork's copy-on-write)."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs])
    dst = torch.tensor([d for _, d in pairs])
    kv_cache[:, dst] = kv_cache[:, src]
