"""fp8 KV's per-layer scales: calibrated from the first K/V a layer is written (amax × margin / 448,
floored), fixed afterwards, shared by the torch reference and the Triton kernels, and what keeps a layer
with outlier keys from saturating."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvops import kernels
from kvops.kernels import reference
from kvops.kernels.kv_cache import fixed_fp8_scale
from kvops.kernels.quantization import FP8_MAX, FP8_SCALE_FLOOR, FP8_SCALE_MARGIN
from kvops.schema.reports import LayerKVError

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not IN_INTERPRETER, reason="runs in the TRITON_INTERPRET=1 child")
on_host = pytest.mark.skipif(IN_INTERPRETER, reason="the interpreter child runs only the Triton tests")


def _kv(tokens: int, heads: int = 2, head_dim: int = 64, seed: int = 0,
        k_gain: float = 1.0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, heads, head_dim, generator=g)
    k[..., :4] *= 8  # a few large channels, as real keys have
    v = torch.randn(tokens, heads, head_dim, generator=g) / 2
    return k * k_gain, v


def _layer(num_blocks: int = 4, block_size: int = 4, heads: int = 2, head_dim: int = 64) -> kernels.KVCacheLayer:
    return kernels.allocate_kv_cache_layer("fp8", num_blocks, block_size, heads, head_dim, torch.float32)


def _expected(x: torch.Tensor) -> float:
    return float(x.abs().amax()) * FP8_SCALE_MARGIN / FP8_MAX


@on_host
def test_first_write_calibrates_separate_k_and_v_scales_per_layer():
    layers = [_layer(), _layer()]
    for i, layer in enumerate(layers):
        assert not layer.scale_fixed and layer.scale.tolist() == [1.0, 1.0]
        k, v = _kv(6, seed=i, k_gain=1 + 10 * i)
        kernels.write_kv_cache(k, v, layer, torch.arange(6))
        assert layer.scale_fixed
        assert layer.scale.tolist() == pytest.approx([_expected(k), _expected(v)], rel=1e-6)
    assert layers[0].scale[0] != layers[0].scale[1]  # K and V calibrate apart
    assert layers[1].scale[0] > 5 * layers[0].scale[0]  # and so do layers


@on_host
def test_scales_stay_fixed_after_the_first_write():
    layer = _layer()
    k, v = _kv(4, seed=1)
    kernels.write_kv_cache(k, v, layer, torch.arange(4))
    scales, first = layer.scale.clone(), kernels.gather_kv(layer, torch.arange(4))
    big_k, big_v = _kv(4, seed=2, k_gain=100)
    kernels.write_kv_cache(big_k, big_v * 100, layer, torch.arange(4, 8))
    assert torch.equal(layer.scale, scales)  # blocks already written keep decoding as they were written
    assert torch.equal(kernels.gather_kv(layer, torch.arange(4)), first)
    # The larger later tokens saturate at ±448 × the fixed scale instead of moving it.
    later = kernels.gather_kv(layer, torch.arange(4, 8))[0]
    assert float(later.abs().max()) == pytest.approx(FP8_MAX * float(scales[0]))


@on_host
def test_an_all_zero_first_write_gets_the_floor():
    layer = _layer()
    zeros = torch.zeros(3, 2, 64)
    kernels.write_kv_cache(zeros, zeros, layer, torch.arange(3))
    assert layer.scale_fixed and layer.scale.tolist() == [FP8_SCALE_FLOOR, FP8_SCALE_FLOOR]
    k, v = _kv(2, seed=3)
    kernels.write_kv_cache(k / 100, v / 100, layer, torch.tensor([3, 4]))  # within ±448 × floor: no NaN, no inf
    back = kernels.gather_kv(layer, torch.tensor([3, 4]))
    assert back.isfinite().all() and F.cosine_similarity(back[1], v / 100, dim=-1).min() > 0.99


@on_host
def test_padding_and_empty_writes_do_not_calibrate():
    layer = _layer()
    k, v = _kv(3, seed=4)
    kernels.write_kv_cache(k, v, layer, torch.full((3,), -1))  # padding only: nothing is written
    assert not layer.scale_fixed
    k[1] *= 1000  # a padding token's K must not count in the amax
    kernels.write_kv_cache(k, v, layer, torch.tensor([0, -1, 1]))
    assert float(layer.scale[0]) == pytest.approx(_expected(k[[0, 2]]), rel=1e-6)


@on_host
def test_a_fixed_scale_can_still_be_asked_for_and_the_host_pool_takes_the_device_scales():
    with fixed_fp8_scale(1.0):
        fixed = _layer()
    k, v = _kv(4, seed=5)
    kernels.write_kv_cache(k, v, fixed, torch.arange(4))
    assert fixed.scale_fixed and fixed.scale.tolist() == [1.0, 1.0]
    device, host = _layer(), _layer(2)
    kernels.write_kv_cache(k, v, device, torch.arange(4))
    kernels.swap_blocks(device, host, [(0, 1)])
    assert host.scale_fixed and torch.equal(host.scale, device.scale)
    assert torch.equal(kernels.gather_kv(host, torch.arange(4, 8)), kernels.gather_kv(device, torch.arange(4)))


@on_host
@pytest.mark.parametrize(("given", "fixed"), [("calibrate", None), ("1.0", 1.0), (0.25, 0.25)])
def test_kv_cache_scale_setting_gives_the_pool_a_fixed_scale_or_calibrates(given: str | float, fixed: float | None):
    from kvops.engine.config import EngineConfig
    from kvops.engine.kv_pool import allocate_kv_pool

    config = EngineConfig(kv_cache_dtype="fp8", kv_cache_scale=given, kv_cache_memory="1MiB", swap_space="64KiB")
    assert config.fixed_kv_scale == fixed
    pool = allocate_kv_pool(config, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                            max_model_len=16)
    for layer in pool.device + pool.host:
        assert layer.scale_fixed is (fixed is not None)
        assert layer.scale.tolist() == [fixed or 1.0] * 2


@on_host
@pytest.mark.parametrize("given", ["abc", "0", "-1", "inf"])
def test_a_bad_kv_cache_scale_says_what_to_give(given: str):
    from kvops.engine.config import EngineConfig
    from kvops.schema.errors import ConfigError

    with pytest.raises(ConfigError, match="--kv-cache-scale"):
        EngineConfig(kv_cache_scale=given)


@on_host
def test_outlier_keys_stay_bounded_where_a_fixed_scale_of_one_saturates():
    """Keys 1000× larger than usual (what --debug-scale-k 3:1000 does to a layer): amax ~3e4, far past 448."""
    k, v = _kv(32, seed=6, k_gain=1000)

    def k_error(layer: kernels.KVCacheLayer) -> float:
        kernels.write_kv_cache(k, v, layer, torch.arange(32))
        back = kernels.gather_kv(layer, torch.arange(32))[0]
        return float((back - k).norm() / k.norm())

    with fixed_fp8_scale(1.0):
        saturated = k_error(_layer(8))
    calibrated = k_error(_layer(8))
    assert saturated > 0.85  # measured: 0.907 (mean cosine 0.63): the large channels clip to ±448
    assert calibrated < 0.04  # measured: 0.029 (mean cosine 0.9997): e4m3's 3-bit mantissa, nothing clipped


def test_profiles_from_before_the_scales_were_reported_still_parse():
    old = {"layer": 0, "kv_dtype": "fp8", "k_cosine": {10: 0.9997}, "v_cosine": {10: 0.9998}, "min_cosine": 0.9997,
           "below_threshold": False}
    entry = LayerKVError.model_validate(old)
    assert entry.k_scale is None and entry.v_scale is None and entry.k_rel_error is None


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the interpreter session")
def test_triton_path_reads_the_same_per_layer_scales():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parent.parent
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k",
                            "interpreted", __file__], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert "2 passed" in child.stdout.strip().splitlines()[-1]


@needs_interpreter
def test_interpreted_write_calibrates_like_the_reference():
    with kernels.use_backend("triton"):
        layer, ref = _layer(), _layer()
        k, v = _kv(10, seed=7, k_gain=50)
        slots = torch.tensor([3, -1, 0, 9, 12, -1, 5, 6, 15, 1])
        kernels.write_kv_cache(k, v, layer, torch.full((10,), -1))  # padding only: calibrates nothing
        assert not layer.scale_fixed
        kernels.write_kv_cache(k, v, layer, slots)
        reference.write_kv_cache(k, v, ref, slots)
        assert torch.equal(layer.scale, ref.scale) and layer.scale[0] != layer.scale[1]
        assert torch.equal(reference._bits(layer.data), reference._bits(ref.data))
        kernels.write_kv_cache(k * 3, v * 3, layer, torch.arange(16, 26) % 16)  # fixed: the scales do not move
        assert torch.equal(layer.scale, ref.scale)


@needs_interpreter
def test_interpreted_attention_dequantizes_with_each_layers_k_and_v_scales():
    from kvops.kernels import triton_attention
    from kvops.kernels.attention_metadata import AttentionMetadata, PrefillSpan

    with kernels.use_backend("triton"):
        layer = _layer(num_blocks=6, block_size=4, heads=1, head_dim=32)
        # K's scale ~100× V's: attention that mixed up the two scales would be far off.
        k, v = _kv(24, heads=1, head_dim=32, seed=8, k_gain=200)
        kernels.write_kv_cache(k, v, layer, torch.arange(24))
        assert layer.scale[0] > 50 * layer.scale[1]
        q = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(9)) / 400
        tables = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 4, 3, 0, 0, 0]])
        meta = AttentionMetadata(4, torch.zeros(2, dtype=torch.long), 2, tables, torch.tensor([23, 11]))
        expected = reference.paged_decode_attention(q, layer, meta, 0.125)
        torch.testing.assert_close(triton_attention.paged_decode_attention(q, layer, meta, 0.125, num_splits=1),
                                   expected, atol=2e-5, rtol=1e-4)
        qp = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(10)) / 400
        spans = [PrefillSpan(0, 5, 13, torch.tensor([2, 3, 4, 5]))]
        meta = AttentionMetadata(4, torch.zeros(5, dtype=torch.long), 0, torch.zeros(0, 0, dtype=torch.long),
                                 torch.zeros(0, dtype=torch.long), spans)
        torch.testing.assert_close(triton_attention.paged_prefill_attention(qp, layer, meta, 0.125),
                                   reference.paged_prefill_attention(qp, layer, meta, 0.125), atol=2e-5, rtol=1e-4)
