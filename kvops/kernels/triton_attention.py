"""Triton paged attention: decode (flash-decoding split-K with a log-sum-exp merge) and prefill over a
cached prefix, both reading K/V through block tables and dequantizing int8 / fp8 / int4 in the kernel.

Head dims are padded to the next power of two with masked loads; any block size works because a tile's
slots are computed per token (block_table[pos // block_size] * block_size + pos % block_size).
Launch parameters are picked by a small heuristic rather than `@triton.autotune`, so the same kernels
run unchanged under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvops.kernels.attention_metadata import AttentionMetadata
from kvops.kernels.kv_cache import KVCacheLayer
from kvops.kernels.triton_common import INTERPRETED, cache_args, dot_precision, load_kv_tile

LOG2E = 1.4426950408889634


@triton.jit
def online_softmax_step(s, v, m, l, acc, DOT_PRECISION: tl.constexpr):  # noqa: E741
    """One tile of flash attention: scores `s` (log2 scale, masked to -inf) and values `v` folded
    into the running max `m`, sum `l` and output `acc`."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def attend_kv_tile(q, m, l, acc, pos, tok_mask, visible, table_ptr, block_size, kv_head, qk_scale,  # noqa: E741
                   data_ptr, scale_ptr, zero_ptr, s_kv, s_slot, s_head, ss_kv, ss_slot, ss_head,
                   KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Fold the K/V at positions `pos` of one sequence (its block table row at `table_ptr`) into the
    running softmax state; `visible` [rows, BLOCK_N] masks the scores (padding, and causality in prefill)."""
    block = tl.load(table_ptr + pos // block_size, mask=tok_mask, other=0)
    slots = block.to(tl.int64) * block_size + pos % block_size
    k = load_kv_tile(data_ptr, scale_ptr, zero_ptr, 0, slots, kv_head, tok_mask,
                     s_kv, s_slot, s_head, ss_kv, ss_slot, ss_head, KIND, HEAD_DIM, BLOCK_D, GROUP)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(visible, s, -float("inf"))
    v = load_kv_tile(data_ptr, scale_ptr, zero_ptr, 1, slots, kv_head, tok_mask,
                     s_kv, s_slot, s_head, ss_kv, ss_slot, ss_head, KIND, HEAD_DIM, BLOCK_D, GROUP)
    return online_softmax_step(s, v.to(q.dtype), m, l, acc, DOT_PRECISION)


@triton.jit
def _decode_split_kernel(
    q_ptr, out_ptr, lse_ptr, data_ptr, scale_ptr, zero_ptr, tables_ptr, lens_ptr,
    qk_scale, tokens_per_split, block_size,
    s_qb, s_qh, s_ob, s_oh, s_os, s_lb, s_lh, s_tb,
    s_kv, s_slot, s_head, ss_kv, ss_slot, ss_head,
    GROUP_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (sequence, KV head, split): all the query heads of the group over tokens of one split.

    Writes the split's normalized output and its log2-sum-exp; the merge kernel combines splits.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP_HEADS
    heads = kv_head * GROUP_HEADS + offs_h
    q = tl.load(q_ptr + seq * s_qb + heads[:, None] * s_qh + offs_d[None, :],
                mask=h_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if UPCAST:  # dots run in q's dtype; this makes it float32
        q = q.to(tl.float32)
    m = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)  # noqa: E741 (the usual name in flash attention)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        tok_mask = pos < end
        m, l, acc = attend_kv_tile(  # noqa: E741
            q, m, l, acc, pos, tok_mask, tok_mask[None, :], tables_ptr + seq * s_tb, block_size, kv_head, qk_scale,
            data_ptr, scale_ptr, zero_ptr, s_kv, s_slot, s_head, ss_kv, ss_slot, ss_head,
            KIND, HEAD_DIM, BLOCK_D, GROUP, DOT_PRECISION)
    # A split past the end of a short sequence saw no token: it weighs zero in the merge.
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), -float("inf"))
    tl.store(out_ptr + seq * s_ob + heads[:, None] * s_oh + split * s_os + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(lse_ptr + seq * s_lb + heads * s_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    s_pb, s_ph, s_ps, s_lb, s_lh, s_ob, s_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Combine the splits of one (sequence, head): weights 2^(lse_i - max lse), normalized."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + seq * s_lb + head * s_lh + offs_s, mask=s_mask, other=-float("inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    weight = tl.where(s_mask, weight, 0.0)
    parts = tl.load(part_ptr + seq * s_pb + head * s_ph + offs_s[:, None] * s_ps + offs_d[None, :],
                    mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + seq * s_ob + head * s_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, out_ptr, data_ptr, scale_ptr, zero_ptr, tables_ptr, starts_ptr, lens_ptr, ctx_ptr,
    qk_scale, block_size,
    s_qt, s_qh, s_ot, s_oh, s_tb,
    s_kv, s_slot, s_head, ss_kv, ss_slot, ss_head,
    GROUP_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (span, tile of BLOCK_M new tokens, query head): causal attention over prefix + new tokens."""
    span = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    n_new = tl.load(lens_ptr + span)
    if m0 >= n_new:  # spans are ragged; the grid is sized for the longest
        return
    q_start = tl.load(starts_ptr + span)
    context_len = tl.load(ctx_ptr + span)
    prefix = context_len - n_new
    kv_head = head // GROUP_HEADS

    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = rows < n_new
    q_pos = prefix + rows
    q = tl.load(q_ptr + (q_start + rows)[:, None] * s_qt + head * s_qh + offs_d[None, :],
                mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(context_len, prefix + m0 + BLOCK_M)  # the tile's last query sees no further
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        tok_mask = pos < kv_end
        causal = tok_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        m, l, acc = attend_kv_tile(  # noqa: E741
            q, m, l, acc, pos, tok_mask, causal, tables_ptr + span * s_tb, block_size, kv_head, qk_scale,
            data_ptr, scale_ptr, zero_ptr, s_kv, s_slot, s_head, ss_kv, ss_slot, ss_head,
            KIND, HEAD_DIM, BLOCK_D, GROUP, DOT_PRECISION)
    out = acc / l[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * s_ot + head * s_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM))


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, enough to exercise the merge
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_n(dtype: torch.dtype, head_dim: int) -> int:
    if INTERPRETED:
        return 16  # small tiles keep the interpreter fast and put several tiles in one split
    return 32 if dtype == torch.float32 or head_dim > 128 else 64


def _dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """The interpreter computes bfloat16 dot products wrongly (triton 3.9: garbage); upcast there only."""
    return torch.float32 if INTERPRETED and dtype == torch.bfloat16 else dtype


def plan_splits(batch: int, kv_heads: int, max_len: int, block_n: int, sms: int) -> tuple[int, int]:
    """(splits, tokens per split): enough programs to fill the device about twice over, but no split
    shorter than a few tiles, where the merge would cost more than the parallelism buys."""
    want = max(1, math.ceil(2 * sms / max(batch * kv_heads, 1)))
    most = max(1, math.ceil(max_len / (4 * block_n)))
    splits = min(want, most)
    per_split = math.ceil(math.ceil(max_len / splits) / block_n) * block_n
    return math.ceil(max_len / per_split), per_split


def _decode_inputs(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block tables and lengths on the cache's device, built once per step and shared by all layers."""
    key = f"triton_decode:{device}"
    cached = meta._cache.get(key)
    if cached is None:
        max_len = int(meta.on_host.decode_context_lens.max())  # the host copy: no device sync
        cached = (meta.decode_block_tables.to(device, torch.int32), meta.decode_context_lens.to(device, torch.int32),
                  max_len)
        meta._cache[key] = cached
    return cached  # type: ignore[return-value]


def paged_decode_attention(q: torch.Tensor, layer: KVCacheLayer, meta: AttentionMetadata, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    """Same contract as `reference.paged_decode_attention`; `num_splits` overrides the split heuristic."""
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    tables, lens, max_len = _decode_inputs(meta, q.device)
    cache = cache_args(layer)
    kv_heads = cache.data.shape[2]
    group_heads = num_heads // kv_heads
    block_n = _block_n(q.dtype, head_dim)
    if num_splits is None:
        splits, per_split = plan_splits(batch, kv_heads, max_len, block_n, _sm_count(q.device))
    else:
        per_split = math.ceil(math.ceil(max_len / num_splits) / block_n) * block_n
        splits = math.ceil(max_len / per_split)
    lse = torch.empty(batch, num_heads, splits, device=q.device, dtype=torch.float32)
    # One split writes straight into the output; several write float32 partials for the merge.
    part = out.unsqueeze(2) if splits == 1 else torch.empty(batch, num_heads, splits, head_dim, device=q.device,
                                                             dtype=torch.float32)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, part, lse, cache.data, cache.scale, cache.zero, tables, lens,
        scale * LOG2E, per_split, meta.block_size,
        q.stride(0), q.stride(1), part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        tables.stride(0), *cache.strides, *cache.scale_strides,
        GROUP_HEADS=group_heads, BLOCK_H=max(16, triton.next_power_of_2(group_heads)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n, KIND=cache.kind, GROUP=cache.group_size,
        DOT_PRECISION=dot_precision(_dot_dtype(q.dtype)), UPCAST=_dot_dtype(q.dtype) != q.dtype,
        num_warps=4,
    )
    if splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            part, lse, out, splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits),
        )
    return out


def _prefill_inputs(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, ...]:
    key = f"triton_prefill:{device}"
    cached = meta._cache.get(key)
    if cached is None:
        spans = meta.on_host.prefills  # padded on the host, then one copy per tensor
        width = max(int(s.block_table.shape[0]) for s in spans)
        tables = torch.zeros(len(spans), width, dtype=torch.int32)
        for i, s in enumerate(spans):
            tables[i, : s.block_table.shape[0]] = s.block_table
        offset = meta.num_decode_tokens
        # Rows, not columns: the kernel indexes each by span with unit stride.
        host = torch.tensor([[s.start - offset for s in spans], [s.end - s.start for s in spans],
                             [s.context_len for s in spans]], dtype=torch.int32).to(device)
        cached = (tables.to(device), host[0], host[1], host[2], max(s.end - s.start for s in spans))
        meta._cache[key] = cached
    return cached  # type: ignore[return-value]


def paged_prefill_attention(q: torch.Tensor, layer: KVCacheLayer, meta: AttentionMetadata,
                            scale: float) -> torch.Tensor:
    """Same contract as `reference.paged_prefill_attention`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    if not meta.prefills or q.shape[0] == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    tables, starts, lens, ctx, max_new = _prefill_inputs(meta, q.device)
    cache = cache_args(layer)
    kv_heads = cache.data.shape[2]
    block_m = 16 if INTERPRETED else 64
    block_n = _block_n(q.dtype, head_dim)
    _prefill_kernel[(len(meta.prefills), triton.cdiv(max_new, block_m), num_heads)](
        q, out, cache.data, cache.scale, cache.zero, tables, starts, lens, ctx,
        scale * LOG2E, meta.block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        *cache.strides, *cache.scale_strides,
        GROUP_HEADS=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, KIND=cache.kind, GROUP=cache.group_size,
        DOT_PRECISION=dot_precision(_dot_dtype(q.dtype)), UPCAST=_dot_dtype(q.dtype) != q.dtype,
        num_warps=4,
    )
    return out
