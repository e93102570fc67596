"""Torch reference implementations of the cache and attention ops (CPU, and the ground truth).

K/V are quantized on write and dequantized on read; attention always reads K/V back from the
cache, so a prompt gives the same result whether it is prefilled in one chunk or several.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvops.kernels.attention_metadata import AttentionMetadata
from kvops.kernels.kv_cache import KVCacheLayer
from kvops.kernels.quantization import (
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)


def _slot_view(t: torch.Tensor) -> torch.Tensor:
    """[2, blocks, block_size, ...] -> [2, slots, ...] (a view)."""
    return t.view(2, -1, *t.shape[3:])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 as raw bytes: CPU torch has no index_copy or gather for float8, and moving bits is exact."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _gather(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return _bits(_slot_view(t))[:, slots].view(t.dtype)


def quantize_kv(layer: KVCacheLayer, kv: torch.Tensor) -> list[torch.Tensor]:
    """kv [2, tokens, kv_heads, head_dim] -> the per-slot tensors of `layer.per_slot()`, in its format."""
    if layer.kind == "auto":
        return [kv.to(layer.data.dtype)]
    if layer.kind == "int8":
        return list(quantize_int8(kv))
    if layer.kind == "fp8":
        assert layer.scale is not None
        return [torch.stack([quantize_fp8(kv[i], layer.scale[i]) for i in range(2)])]
    return list(quantize_int4(kv, layer.group_size))


def dequantize_kv(layer: KVCacheLayer, parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of `quantize_kv`: per-slot tensors [2, ...] -> K/V [2, ..., head_dim] in `layer.dtype`."""
    if layer.kind == "auto":
        return parts[0].to(layer.dtype)
    if layer.kind == "int8":
        return dequantize_int8(parts[0], parts[1], layer.dtype)
    if layer.kind == "fp8":
        assert layer.scale is not None
        scale = layer.scale.view(2, *([1] * (parts[0].dim() - 1)))
        return dequantize_fp8(parts[0], scale, layer.dtype)
    return dequantize_int4(parts[0], parts[1], parts[2], layer.group_size, layer.dtype)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, layer: KVCacheLayer, slot_mapping: torch.Tensor) -> None:
    """Quantize new K/V [tokens, kv_heads, head_dim] into one layer's cache at `slot_mapping`;
    negative slots are skipped."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    if layer.kind == "auto":
        data = _slot_view(layer.data)
        data[0].index_copy_(0, slot_mapping, k.to(data.dtype))
        data[1].index_copy_(0, slot_mapping, v.to(data.dtype))
        return
    parts = quantize_kv(layer, torch.stack((k, v)))
    for target, part in zip(layer.per_slot(), parts, strict=True):
        _bits(_slot_view(target)).index_copy_(1, slot_mapping, _bits(part))


def gather_kv(layer: KVCacheLayer, slots: torch.Tensor) -> torch.Tensor:
    """K/V of `slots` (any shape) read back from the cache: [2, *slots.shape, kv_heads, head_dim]."""
    return dequantize_kv(layer, [_gather(t, slots) for t in layer.per_slot()])


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


def paged_decode_attention(q: torch.Tensor, layer: KVCacheLayer, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [num_decodes, heads, head_dim] attends over each sequence's whole context in the paged cache."""
    slots, mask = _decode_gather(meta)
    kv = gather_kv(layer, slots).to(q.dtype)  # one gather for K and V: [2, n, ctx, kv_heads, d]
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [n, kv_heads, ctx, d]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def paged_prefill_attention(
    q: torch.Tensor, layer: KVCacheLayer, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [prefill_tokens, heads, head_dim] of each span attends causally over its cached prefix and itself."""
    outputs = []
    offset = meta.num_decode_tokens
    for span in meta.prefills:
        n = span.end - span.start
        qs = q[span.start - offset : span.end - offset].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        slots = _slots(span.block_table, torch.arange(span.context_len), meta.block_size)
        kv = gather_kv(layer, slots).to(q.dtype).transpose(1, 2).unsqueeze(1)  # [2, 1, kv_heads, ctx, d]
        k, v = kv[0], kv[1]
        prefix = span.context_len - n
        if prefix == 0:
            out = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            rows = torch.arange(n)[:, None] + prefix
            mask = torch.arange(span.context_len)[None, :] <= rows
            out = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs) if outputs else q[:0]


def copy_blocks(layer: KVCacheLayer, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks (source, destination) within one layer's cache (fork's copy-on-write)."""
    swap_blocks(layer, layer, pairs)


def swap_blocks(src: KVCacheLayer, dst: KVCacheLayer, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks, data and scales, from one pool to another (device <-> host swap)."""
    if not pairs:
        return
    source = torch.tensor([s for s, _ in pairs])
    target = torch.tensor([d for _, d in pairs])
    for s, d in zip(src.per_slot(), dst.per_slot(), strict=True):
        _bits(d)[:, target] = _bits(s)[:, source].to(d.device)
