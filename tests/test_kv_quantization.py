"""KV quantization round trips: each format's error stays within its bound, and the paged cache
stores and moves quantized blocks (data and scales) without losing anything."""

from __future__ import annotations

import pytest
import torch

from kvops import kernels
from kvops.kernels.quantization import (
    FP8_MAX,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)


def _kv(tokens: int = 37, heads: int = 3, head_dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # K-like data: a few channels carry most of the magnitude, as in real attention heads.
    x = torch.randn(tokens, heads, head_dim, generator=g)
    x[..., :4] *= 8
    return x


def test_int8_error_is_within_half_a_step_per_token_and_head():
    x = _kv()
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]
    back = dequantize_int8(q, scale, torch.float32)
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + 1e-6).all()
    assert torch.nn.functional.cosine_similarity(back, x, dim=-1).min() > 0.999


def test_int8_all_zero_head_round_trips_to_zero():
    x = torch.zeros(2, 3, 64)
    q, scale = quantize_int8(x)
    assert torch.equal(dequantize_int8(q, scale, torch.float32), x)


def test_fp8_relative_error_within_e4m3_precision_and_saturates_beyond_range():
    x = _kv()
    back = dequantize_fp8(quantize_fp8(x, 1.0), 1.0, torch.float32)
    normal = x.abs() > 2**-6  # e4m3 normal range: 3 mantissa bits, half an ulp = 1/16 relative
    assert ((back - x).abs()[normal] <= x.abs()[normal] / 16 + 1e-7).all()
    big = torch.tensor([1000.0, -5000.0, 300.0])
    assert dequantize_fp8(quantize_fp8(big, 1.0), 1.0, torch.float32).tolist() == [FP8_MAX, -FP8_MAX, 288.0]
    # A scale brings the same values back into range.
    scaled = dequantize_fp8(quantize_fp8(big, 20.0), 20.0, torch.float32)
    assert ((scaled - big).abs() <= big.abs() / 16).all()


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_error_is_within_half_a_stored_step(group_size: int):
    x = _kv()
    packed, scale, zero = quantize_int4(x, group_size)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 32
    assert scale.dtype == zero.dtype == torch.bfloat16 and scale.shape[-1] == 64 // group_size
    back = dequantize_int4(packed, scale, zero, group_size, torch.float32)
    step = scale.float().repeat_interleave(group_size, dim=-1)
    assert ((back - x).abs() <= step / 2 * (1 + 1e-3) + 1e-6).all()
    groups = x.reshape(*x.shape[:-1], -1, group_size)
    ideal = (groups.amax(-1) - groups.amin(-1)) / 15
    assert (scale.float() <= ideal * 1.02 + 1e-6).all()  # the stored step is the ideal one, give or take rounding


def test_int4_group_with_a_large_offset_is_not_clipped():
    x = 100 + torch.rand(1, 1, 32) * 0.1  # bfloat16 cannot hold 100.0x: zero must round down, not up
    packed, scale, zero = quantize_int4(x, 32)
    back = dequantize_int4(packed, scale, zero, 32, torch.float32)
    assert ((back - x).abs() <= scale.float() / 2 + 1e-5).all()


def test_int4_rejects_a_group_that_does_not_divide_head_dim():
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_int4(torch.randn(2, 48), 32)


@pytest.mark.parametrize("kind", kernels.KV_CACHE_DTYPES)
def test_paged_write_then_gather_round_trips_through_the_cache(kind: str):
    layer = kernels.allocate_kv_cache_layer(kind, num_blocks=6, block_size=4, num_kv_heads=3, head_dim=64,
                                            dtype=torch.float32)
    k, v = _kv(10, seed=1), _kv(10, seed=2)
    slots = torch.tensor([5, 6, 7, 8, 9, 20, 21, 22, 23, 0])
    kernels.write_kv_cache(k, v, layer, slots)
    back = kernels.gather_kv(layer, slots)
    expected = kernels.dequantize_kv(layer, kernels.quantize_kv(layer, torch.stack((k, v))))
    assert torch.equal(back, expected)  # what the cache returns is exactly the quantized round trip
    cos = torch.nn.functional.cosine_similarity(back, torch.stack((k, v)), dim=-1).min()
    assert cos > {"auto": 0.999999, "int8": 0.999, "fp8": 0.99, "int4": 0.95}[kind]


@pytest.mark.parametrize("kind", kernels.KV_CACHE_DTYPES)
def test_swap_blocks_moves_data_and_scales_between_pools(kind: str):
    device = kernels.allocate_kv_cache_layer(kind, 4, 4, 3, 64, torch.float32)
    host = kernels.allocate_kv_cache_layer(kind, 2, 4, 3, 64, torch.float32)
    kernels.write_kv_cache(_kv(8), _kv(8, seed=3), device, torch.arange(8))
    before = kernels.gather_kv(device, torch.arange(8))
    kernels.swap_blocks(device, host, [(0, 1), (1, 0)])
    kernels.write_kv_cache(torch.zeros(8, 3, 64), torch.zeros(8, 3, 64), device, torch.arange(8))  # reused
    kernels.swap_blocks(host, device, [(1, 2), (0, 3)])
    assert torch.equal(kernels.gather_kv(device, torch.arange(8, 16)), before)


def test_bytes_per_token_per_dtype_match_the_allocated_pool():
    expected = {"auto": 2 * 3 * 64 * 4, "int8": 2 * 3 * (64 + 4), "fp8": 2 * 3 * 64, "int4": 2 * 3 * (32 + 8)}
    for kind, per_token in expected.items():
        assert kernels.layer_bytes_per_token(kind, 3, 64, torch.float32) == per_token
        layer = kernels.allocate_kv_cache_layer(kind, 10, 16, 3, 64, torch.float32)
        fixed = 8 if kind == "fp8" else 0  # fp8's two per-layer scales
        assert layer.nbytes - fixed == 10 * 16 * per_token
    assert kernels.layer_bytes_per_token("int4", 3, 64, torch.float32, group_size=64) == 2 * 3 * (32 + 4)
