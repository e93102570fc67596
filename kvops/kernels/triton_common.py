"""Pieces the Triton kernels share: the KV-format codes, the host-side layout of a cache layer, and the
jit helpers that quantize and dequantize one tile exactly as `quantization.py` does.

Importing this module imports triton and defines jit functions, so `TRITON_INTERPRET` must already be
set when it is first imported (triton reads it when a kernel is defined, not when it is launched).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvops.kernels.kv_cache import KVCacheLayer

# Kernels defined while this was set run on numpy in the interpreter; the dispatch layer needs to know.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

KIND_CODES = {"auto": 0, "int8": 1, "fp8": 2, "int4": 3}


@dataclass(frozen=True)
class CacheArgs:
    """A layer's tensors as a kernel sees them: slot-indexed views, their strides, and the format."""

    data: torch.Tensor  # [2, slots, kv_heads, d or d/2]; fp8 as uint8 bits
    scale: torch.Tensor  # int8 [2, slots, heads]; int4 [2, slots, heads, groups]; fp8 [2]; auto: a dummy
    zero: torch.Tensor  # int4 only, like scale; otherwise a dummy
    kind: int
    group_size: int
    head_dim: int

    @property
    def strides(self) -> tuple[int, int, int]:
        return self.data.stride(0), self.data.stride(1), self.data.stride(2)

    @property
    def scale_strides(self) -> tuple[int, int, int]:
        if self.scale.dim() < 3:  # per-layer (fp8) or dummy: only the K/V index is used
            return self.scale.stride(0), 0, 0
        return self.scale.stride(0), self.scale.stride(1), self.scale.stride(2)


def cache_args(layer: KVCacheLayer) -> CacheArgs:
    data = layer.data.view(torch.uint8) if layer.data.dtype == torch.float8_e4m3fn else layer.data
    data = data.view(2, -1, *data.shape[3:])  # slot = block * block_size + offset; fails loudly if not a view
    if data.stride(-1) != 1:
        raise ValueError("the Triton kernels need the KV cache's last dimension to be contiguous")
    dummy = data.new_zeros(1, dtype=torch.float32)
    scale = layer.scale if layer.scale is not None else dummy
    if layer.kind in ("int8", "int4"):
        scale = scale.view(2, -1, *scale.shape[3:])
    zero = layer.zero.view(2, -1, *layer.zero.shape[3:]) if layer.zero is not None else dummy
    return CacheArgs(data, scale, zero, KIND_CODES[layer.kind], max(layer.group_size, 2), layer.head_dim)


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 models get exact fp32 dot products (not TF32), so the kernels match the reference closely."""
    return "ieee" if dtype == torch.float32 else None


@triton.jit
def round_half_even(x):
    """torch.round's rounding (ties to even), built from floor so it behaves the same in the interpreter."""
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def round_bf16(x, DOWN: tl.constexpr):
    """float32 -> the nearest bfloat16 value toward -inf (DOWN) or +inf, returned as float32.

    Dropping the low 16 bits rounds toward zero; a negative value rounded down (or a positive one up)
    that lost bits instead moves one bfloat16 step away from zero.
    """
    bits = x.to(tl.int32, bitcast=True)
    trunc = (bits >> 16) << 16
    inexact = (bits & 0xFFFF) != 0
    away = inexact & ((x < 0) if DOWN else (x > 0))
    return tl.where(away, trunc + 0x10000, trunc).to(tl.float32, bitcast=True)


@triton.jit
def encode_e4m3(y):
    """float32 already clamped to ±448 -> e4m3fn bits (int32 0..255), rounding to nearest even.

    Done with integer ops rather than a cast to tl.float8e4nv: that cast needs sm89+ on the GPU, and the
    interpreter's version drops the carry when rounding up crosses a power of two (1.97 -> 1.0).
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    # Normal: round the 23-bit mantissa to 3 bits (a carry correctly bumps the exponent), rebias 127 -> 7.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Below 2^-6 e4m3 is subnormal, in steps of 2^-9; a round-up to 8 is exactly the smallest normal.
    subnormal = round_half_even(tl.abs(y) * 512.0).to(tl.int32)
    code = tl.where(mag < 0x3C800000, subnormal, normal)
    return code | (sign << 7)


@triton.jit
def decode_e4m3(code):
    """e4m3fn bits (any integer type) -> float32, exactly (every e4m3 value is a float32)."""
    c = code.to(tl.int32) & 0xFF
    exponent = (c >> 3) & 15
    mantissa = c & 7
    normal = (((c >> 7) << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2^-9
    return tl.where(exponent == 0, tl.where(c >= 128, -subnormal, subnormal), normal)


@triton.jit
def load_kv_tile(data_ptr, scale_ptr, zero_ptr, kv, slots, head, tok_mask,
                 s_kv, s_slot, s_head, ss_kv, ss_slot, ss_head,
                 KIND: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr):
    """K (kv=0) or V (kv=1) of `slots` [BLOCK_N] for one KV head, dequantized to float32 [BLOCK_N, BLOCK_D].

    Channels past HEAD_DIM (the power-of-two padding) and masked tokens read as 0.
    """
    slots = slots.to(tl.int64)
    base = data_ptr + kv * s_kv + slots[:, None] * s_slot + head * s_head
    if KIND == 3:  # int4: byte j holds channels 2j (low nibble) and 2j + 1, both in group 2j // GROUP
        HALF: tl.constexpr = BLOCK_D // 2
        offs = tl.arange(0, HALF)
        mask = tok_mask[:, None] & (offs[None, :] < HEAD_DIM // 2)
        packed = tl.load(base + offs[None, :], mask=mask, other=0).to(tl.int32)
        group = offs // (GROUP // 2)
        sbase = kv * ss_kv + slots[:, None] * ss_slot + head * ss_head + group[None, :]
        scale = tl.load(scale_ptr + sbase, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + sbase, mask=mask, other=0.0).to(tl.float32)
        low = (packed & 15).to(tl.float32) * scale + zero
        high = (packed >> 4).to(tl.float32) * scale + zero
        return tl.interleave(low, high)
    offs_d = tl.arange(0, BLOCK_D)
    mask = tok_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    raw = tl.load(base + offs_d[None, :], mask=mask, other=0)
    if KIND == 0:
        return raw.to(tl.float32)
    if KIND == 1:
        scale = tl.load(scale_ptr + kv * ss_kv + slots * ss_slot + head * ss_head, mask=tok_mask, other=0.0)
        return raw.to(tl.float32) * scale[:, None]
    scale = tl.load(scale_ptr + kv * ss_kv)  # fp8: one static scale per layer for K and one for V
    return decode_e4m3(raw) * scale
