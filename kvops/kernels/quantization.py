"""KV quantization: pure quantize / dequantize functions over the last (head_dim) axis.

Formats (docs/kv-memory.md, "Quantized KV"):
- int8: symmetric, one float32 scale per token and head (amax / 127).
- fp8: e4m3 storage (`torch.float8_e4m3fn`) with one float32 scale per layer for K and one for V,
  calibrated from the first K/V written to the layer (amax × margin / 448, `fp8_scales`) and then fixed;
  values beyond ±448 × scale saturate. A fixed scale of 1.0 (vLLM's default without checkpoint scales)
  saturates a layer whose keys pass ±448, which is how such a layer used to lose accuracy.
- int4: asymmetric, one scale and one zero point per group of 32 or 64 channels
  (`kvops.schema.kv_dtypes.INT4_GROUP_SIZES`), two values per byte.
  Scale and zero are bfloat16: their rounding (2^-9 relative) is small beside int4's step (1/15 of the
  group's range), and float32 would cost a quarter of the memory int4 saves.
"""

from __future__ import annotations

import torch

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
SCALE_FLOOR = 1e-12  # keeps an all-zero token-head from dividing by zero; the Triton kernels use it too
# Headroom over the first write's amax: later tokens can be larger than the ones the scale was taken from
# (RoPE alone can lift a channel by up to √2 at positions the first prompt did not reach). e4m3 is a float
# format, so the headroom costs relative precision only for values near zero (below 2^-6 × scale).
FP8_SCALE_MARGIN = 1.5
# The smallest calibrated scale: an all-zero first write must not fix a scale of 0 (x / 0 on every later
# write). It sits below SmolLM2-135M's smallest calibrated V scale (~0.01), so it only decides degenerate
# layers, and a power of two so it adds no rounding; such a layer still holds values up to ±0.44.
FP8_SCALE_FLOOR = 2.0**-10


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (int8 [..., d], float32 scale [...])."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(SCALE_FLOOR) / 127.0
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x [..., d] -> float8_e4m3fn, saturating at ±448 × scale (a plain cast would give NaN on some devices)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_scales(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 [2]: the K and V scales that map amax × FP8_SCALE_MARGIN onto e4m3's ±448, floored.
    Computed where k and v live and never read back to the host, so calibrating costs no device sync."""
    amax = torch.stack((k.detach().abs().amax(), v.detach().abs().amax())).float()
    return (amax * (FP8_SCALE_MARGIN / FP8_MAX)).clamp_min(FP8_SCALE_FLOOR)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def quantize_int4(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., d] -> (uint8 [..., d/2] packed, low nibble first; bfloat16 scale and zero [..., d/group_size])."""
    d = x.shape[-1]
    if d % group_size or group_size % 2:
        raise ValueError(f"head_dim {d} is not a multiple of the int4 group size {group_size}")
    groups = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    low = groups.amin(dim=-1)
    high = groups.amax(dim=-1)
    # The stored zero is rounded down and the stored scale up, so the grid [zero, zero + 15 * scale]
    # still covers the group: no value is clipped and the error stays within half a step.
    zero = _round_bf16(low, down=True)
    scale = _round_bf16(((high - zero.float()) / 15.0).clamp_min(SCALE_FLOOR), down=False)
    q = torch.round((groups - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, 15)
    q = q.to(torch.uint8).reshape(*x.shape[:-1], d // 2, 2)
    packed = q[..., 0] | (q[..., 1] << 4)
    return packed, scale, zero


def _round_bf16(x: torch.Tensor, down: bool) -> torch.Tensor:
    """Round float32 to bfloat16 toward -inf (down) or +inf (up)."""
    rounded = x.to(torch.bfloat16)
    wrong = rounded.float() > x if down else rounded.float() < x
    toward = torch.full_like(rounded, float("-inf") if down else float("inf"))
    return torch.where(wrong, torch.nextafter(rounded, toward), rounded)


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).float()  # [..., d/2, 2]
    d = packed.shape[-1] * 2
    groups = q.reshape(*packed.shape[:-1], d // group_size, group_size)
    x = groups * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return x.reshape(*packed.shape[:-1], d).to(dtype)
