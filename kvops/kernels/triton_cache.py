"""Triton cache write: scatter new K/V into the paged cache by slot mapping, quantizing on the fly.

One program per (token, KV head) writes both K and V, with the same arithmetic as `quantization.py`
(scales from the same amax / min / max, ties rounded to even, int4's bfloat16 scale rounded up and
zero rounded down), so the cache holds the same bytes as the torch reference writes, give or take a
float rounding step if the device's float ops differ from the host's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvops.kernels.kv_cache import KVCacheLayer, calibrate_fp8_scales
from kvops.kernels.quantization import FP8_MAX, SCALE_FLOOR
from kvops.kernels.triton_common import cache_args, encode_e4m3, round_bf16, round_half_even


@triton.jit
def _div(x, y):
    """IEEE round-to-nearest division, as torch computes it: triton's `/` may be approximate on the GPU,
    and one ulp there can move a value across a rounding boundary and change a stored byte."""
    return tl.math.div_rn(x, y)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, slot_ptr, data_ptr, scale_ptr, zero_ptr,
    s_kt, s_kh, s_vt, s_vh,
    s_kv, s_slot, s_head, ss_kv, ss_slot, ss_head,
    KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, FP8_LIMIT: tl.constexpr, TINY: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding tokens: nothing to write
        return
    for kv in tl.static_range(2):
        src = k_ptr + token * s_kt + head * s_kh if kv == 0 else v_ptr + token * s_vt + head * s_vh
        dst = data_ptr + kv * s_kv + slot * s_slot + head * s_head
        sdst = kv * ss_kv + slot * ss_slot + head * ss_head
        if KIND == 3:
            # Two channels per byte: load the even and odd channels of each group as separate tiles.
            HALF: tl.constexpr = GROUP // 2
            g = tl.arange(0, BLOCK_G)[:, None]
            j = tl.arange(0, HALF)[None, :]
            mask = (g < HEAD_DIM // GROUP) & (j < HALF)
            even = tl.load(src + g * GROUP + 2 * j, mask=mask, other=0.0).to(tl.float32)
            odd = tl.load(src + g * GROUP + 2 * j + 1, mask=mask, other=0.0).to(tl.float32)
            # Padding groups must not pull a real group's min / max: they read as ±inf here.
            low = tl.minimum(tl.min(tl.where(mask, even, float("inf")), axis=1),
                             tl.min(tl.where(mask, odd, float("inf")), axis=1))
            high = tl.maximum(tl.max(tl.where(mask, even, -float("inf")), axis=1),
                              tl.max(tl.where(mask, odd, -float("inf")), axis=1))
            gmask = tl.arange(0, BLOCK_G) < HEAD_DIM // GROUP
            low = tl.where(gmask, low, 0.0)
            high = tl.where(gmask, high, 0.0)
            zero = round_bf16(low, DOWN=True)
            scale = round_bf16(tl.maximum(_div(high - zero, 15.0), TINY), DOWN=False)
            q_even = tl.minimum(tl.maximum(round_half_even(_div(even - zero[:, None], scale[:, None])), 0.0), 15.0)
            q_odd = tl.minimum(tl.maximum(round_half_even(_div(odd - zero[:, None], scale[:, None])), 0.0), 15.0)
            packed = q_even.to(tl.int32) | (q_odd.to(tl.int32) << 4)
            tl.store(dst + g * HALF + j, packed.to(tl.uint8), mask=mask)
            tl.store(scale_ptr + sdst + tl.arange(0, BLOCK_G), scale.to(tl.bfloat16), mask=gmask)
            tl.store(zero_ptr + sdst + tl.arange(0, BLOCK_G), zero.to(tl.bfloat16), mask=gmask)
        else:
            offs = tl.arange(0, BLOCK_D)
            mask = offs < HEAD_DIM
            x = tl.load(src + offs, mask=mask, other=0.0)
            if KIND == 0:
                tl.store(dst + offs, x.to(data_ptr.dtype.element_ty), mask=mask)
            elif KIND == 1:
                xf = x.to(tl.float32)
                scale = _div(tl.maximum(tl.max(tl.abs(xf), axis=0), TINY), 127.0)
                q = tl.minimum(tl.maximum(round_half_even(_div(xf, scale)), -127.0), 127.0)
                tl.store(dst + offs, q.to(tl.int8), mask=mask)
                tl.store(scale_ptr + sdst, scale)
            else:
                scale = tl.load(scale_ptr + kv * ss_kv)  # the layer's calibrated K or V scale
                y = tl.minimum(tl.maximum(_div(x.to(tl.float32), scale), -FP8_LIMIT), FP8_LIMIT)
                tl.store(dst + offs, encode_e4m3(y).to(tl.uint8), mask=mask)


_last: tuple[torch.Tensor, torch.Tensor] | None = None


def _on_device(slot_mapping: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The engine builds one slot mapping per step on the host and every layer writes with it:
    copy it to the device once, not once per layer."""
    global _last
    if slot_mapping.device == device:
        return slot_mapping
    if _last is None or _last[0] is not slot_mapping:
        _last = (slot_mapping, slot_mapping.to(device, non_blocking=True))
    return _last[1]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, layer: KVCacheLayer, slot_mapping: torch.Tensor) -> None:
    """Same contract as `reference.write_kv_cache`: k, v [tokens, kv_heads, head_dim]; slots < 0 skipped."""
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    cache = cache_args(layer)
    slots = _on_device(slot_mapping, k.device)
    if layer.kind == "fp8" and not layer.scale_fixed:
        # The same calibration as the reference, before the kernel reads the scales: padding (slot < 0)
        # is left out of the amax, and a write of padding only calibrates nothing. The engine's slot
        # mapping is a host tensor, so the check reads no device memory (and it runs once per layer).
        written = slot_mapping >= 0
        if bool(written.any()):
            calibrate_fp8_scales(layer, k, v, written.to(k.device, non_blocking=True))
    group = layer.group_size or 32
    _write_kv_kernel[(tokens, heads)](
        k, v, slots, cache.data, cache.scale, cache.zero,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache.strides, *cache.scale_strides,
        KIND=cache.kind, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), GROUP=group,
        BLOCK_G=triton.next_power_of_2(max(head_dim // group, 1)), FP8_LIMIT=FP8_MAX, TINY=SCALE_FLOOR,
    )
