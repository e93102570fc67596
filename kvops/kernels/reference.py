"""Torch reference implementations of the cache and attention ops (CPU, and the ground truth).

K/V are quantized on write and dequantized on read; attention always reads K/V back from the
cache, so a prompt gives the same result whether it is prefilled in one chunk or several.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvops.kernels import cascade_attention
from kvops.kernels.attention_metadata import AttentionMetadata
from kvops.kernels.kv_cache import KVCacheLayer, calibrate_fp8_scales
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
    calibrate_fp8_scales(layer, k, v)  # first write only; the Triton write calls it the same way
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


# A batched attention call costs about as much fixed overhead as attending over this many extra
# (padding) tokens per KV head and channel; merging sequences of unequal length into one padded call
# pays off while the padding it adds stays below that (measured with benchmarks/kernels_cpu.py).
_PAD_BUDGET = 2**15
# ... and a group's gathered K/V (float32) stays about this size: a batch-wide gather of a large batch
# is a fresh allocation bigger than the caches, and filling it costs more than the calls it saves.
_GATHER_BYTES = 2 * 2**20


@dataclass
class _Bucket:
    """Decode sequences attended together: `rows` of the batch, their blocks, padded to `length` tokens."""

    rows: torch.Tensor | slice
    blocks: torch.Tensor  # [len(rows), blocks_needed]
    length: int
    mask: torch.Tensor | None  # [len(rows), 1, 1, length]; None when every row has `length` tokens


def _gather_blocks(layer: KVCacheLayer, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """K/V of whole blocks [*, nb] -> [2, *, length, kv_heads, head_dim]: block-sized contiguous copies
    rather than one index per token, dequantized after the gather so only read tokens pay for it."""
    parts = []
    ids = blocks.reshape(-1)
    for t in layer.per_slot():
        bits = _bits(t)
        # index_select copies each block as one slice: 1.9x faster than advanced indexing (`bits[:, blocks]`),
        # which took 46% of a decode step at 16 x 1000-token contexts (docs/benchmarks.md, per-step profile).
        g = torch.index_select(bits, 1, ids).view(2, *blocks.shape, *bits.shape[2:])  # [2, *, nb, block_size, ...]
        parts.append(g.view(t.dtype).flatten(blocks.dim(), blocks.dim() + 1).narrow(blocks.dim(), 0, length))
    return dequantize_kv(layer, parts)


def _decode_buckets(meta: AttentionMetadata, row_cost: int) -> list[_Bucket]:
    """Group decode sequences by length so a long one does not make every short one attend over padding
    (sorted longest first; a sequence joins the current group while the padding stays cheap)."""
    cached = meta._cache.get("decode_buckets")
    if cached is not None:
        return cached  # type: ignore[return-value]
    lens = meta.on_host.decode_context_lens.tolist()  # host lengths: planning reads no device memory
    device = meta.decode_block_tables.device
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    for i in order:
        if (groups and (lens[groups[-1][0]] - lens[i]) * row_cost <= _PAD_BUDGET
                and (len(groups[-1]) + 1) * lens[groups[-1][0]] * row_cost * 4 <= _GATHER_BYTES):
            groups[-1].append(i)
        else:
            groups.append([i])
    bs = meta.block_size
    buckets = []
    for group in groups:
        length = lens[group[0]]
        group.sort()  # batch order within a bucket: one bucket's output is the whole answer
        rows: torch.Tensor | slice
        if len(group) == 1 or group[-1] - group[0] == len(group) - 1:
            rows = slice(group[0], group[-1] + 1)  # contiguous rows: a view, no index copy
        else:
            rows = torch.tensor(group, device=device)
        blocks = meta.decode_block_tables[rows, : -(-length // bs)]
        mask = None
        if any(lens[i] != length for i in group):
            group_lens = torch.tensor([lens[i] for i in group], device=device)
            mask = (torch.arange(length, device=device)[None, :] < group_lens[:, None])[:, None, None, :]
        buckets.append(_Bucket(rows, blocks, length, mask))
    meta._cache["decode_buckets"] = buckets
    return buckets


def paged_decode_attention(q: torch.Tensor, layer: KVCacheLayer, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [num_decodes, heads, head_dim] attends over each sequence's whole context in the paged cache; rows
    that share prefix blocks read them once (kvops/kernels/cascade_attention.py)."""
    plan = cascade_attention.plan(meta)
    if plan is None:
        return _plain_decode(q, layer, meta, scale)
    out = q.new_empty(q.shape)
    if plan.plain is not None:
        out[plan.plain_rows] = _plain_decode(q[plan.plain_rows], layer, plan.plain, scale)
    for group in plan.groups:
        out[group.rows] = _cascade_decode(q[group.rows], layer, group, scale)
    return out


def _plain_decode(q: torch.Tensor, layer: KVCacheLayer, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    kv_heads = layer.data.shape[3]
    buckets = _decode_buckets(meta, kv_heads * layer.head_dim)
    out = q.new_empty(q.shape) if len(buckets) > 1 else None
    for b in buckets:
        kv = _gather_blocks(layer, b.blocks, b.length).to(q.dtype).transpose(2, 3)  # [2, n, kv_heads, len, d]
        o = F.scaled_dot_product_attention(q[b.rows].unsqueeze(2), kv[0], kv[1], attn_mask=b.mask, scale=scale,
                                           enable_gqa=True).squeeze(2)
        if out is None:
            return o
        out[b.rows] = o
    assert out is not None
    return out


def _cascade_decode(q: torch.Tensor, layer: KVCacheLayer, group: cascade_attention.CascadeGroup,
                    scale: float) -> torch.Tensor:
    """One group's rows: the shared blocks once for all of them, then each row's own blocks, merged."""
    rows, heads, d = q.shape
    kv_heads = layer.data.shape[3]
    per_kv = heads // kv_heads  # query heads on one KV head, grouped as `enable_gqa` does
    qg = q.view(rows, kv_heads, per_kv, d)
    prefix = _gather_blocks(layer, group.prefix_blocks, group.prefix_blocks.numel() * layer.block_size)
    prefix = prefix.to(q.dtype).transpose(1, 2).unsqueeze(1)  # [2, 1, kv_heads, prefix_len, d]
    stacked = qg.permute(1, 0, 2, 3).reshape(1, kv_heads, rows * per_kv, d)
    o1, lse1 = cascade_attention.attend(stacked, prefix[0], prefix[1], None, scale)
    o1 = o1.view(kv_heads, rows, per_kv, d).permute(1, 0, 2, 3)
    lse1 = lse1.view(kv_heads, rows, per_kv).permute(1, 0, 2)
    o2, lse2 = torch.empty_like(qg), lse1.new_empty(lse1.shape)
    for b in _decode_buckets(group.suffix, kv_heads * d):
        kv = _gather_blocks(layer, b.blocks, b.length).to(q.dtype).transpose(2, 3)  # [2, n, kv_heads, len, d]
        o2[b.rows], lse2[b.rows] = cascade_attention.attend(qg[b.rows], kv[0], kv[1], b.mask, scale)
    return cascade_attention.merge(o1, lse1, o2, lse2).reshape(rows, heads, d).to(q.dtype)  # merged in float


def _prefill_mask(meta: AttentionMetadata, n: int, context_len: int, device: torch.device) -> torch.Tensor:
    """New token i (at position context_len - n + i) sees positions <= its own; shared by all layers."""
    key = f"prefill_mask:{n}:{context_len}"
    mask = meta._cache.get(key)
    if mask is None:
        mask = torch.ones(n, context_len, dtype=torch.bool, device=device).tril(context_len - n)
        meta._cache[key] = mask
    return mask  # type: ignore[return-value]


def paged_prefill_attention(
    q: torch.Tensor, layer: KVCacheLayer, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [prefill_tokens, heads, head_dim] of each span attends causally over its cached prefix and itself."""
    outputs = []
    offset = meta.num_decode_tokens
    bs = meta.block_size
    for span in meta.prefills:
        n = span.end - span.start
        qs = q[span.start - offset : span.end - offset].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        blocks = span.block_table[: -(-span.context_len // bs)]
        kv = _gather_blocks(layer, blocks, span.context_len).to(q.dtype).transpose(1, 2).unsqueeze(1)
        k, v = kv[0], kv[1]  # [1, kv_heads, ctx, d]
        if span.context_len == n:
            out = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = _prefill_mask(meta, n, span.context_len, q.device)
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
    # Each index lives with the tensor it indexes: the gather runs where the source is, the scatter where
    # the destination is, and one copy crosses between them (device <-> pinned host on CUDA).
    source = torch.tensor([s for s, _ in pairs], device=src.data.device)
    target = torch.tensor([d for _, d in pairs], device=dst.data.device)
    for s, d in zip(src.per_slot(), dst.per_slot(), strict=True):
        _bits(d)[:, target] = _bits(s)[:, source].to(d.device)
    if src.kind == "fp8" and src.scale_fixed and not dst.scale_fixed:
        # fp8 bytes mean nothing without the layer's scales: the host pool takes the device layer's on the
        # first swap-out, so a host block decodes like the device block it came from.
        assert src.scale is not None and dst.scale is not None
        dst.scale.copy_(src.scale.to(dst.scale.device))
        dst.scale_fixed = True
