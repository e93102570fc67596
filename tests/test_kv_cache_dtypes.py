"""Quantized KV on the real model: the pool shrinks by the expected factor, capacity grows with it,
outputs stay close to fp32, named layers stay in full precision, and the error profile finds a
layer whose K overflows fp8."""

from __future__ import annotations

import pytest
import torch

from kvops.engine.config import EngineConfig
from kvops.engine.kv_error_profile import profile_kv_error
from kvops.engine.llm import LLM
from kvops.engine.sampling import SamplingParams
from kvops.kernels.kv_cache import fixed_fp8_scale
from kvops.schema.errors import ConfigError

FP32_BYTES_PER_TOKEN = 46080  # SmolLM2-135M: 30 layers × 3 KV heads × 64 × 2 (K, V) × 4 bytes
EXPECTED_BYTES_PER_TOKEN = {
    "auto": FP32_BYTES_PER_TOKEN,
    "int8": 30 * 2 * 3 * (64 + 4),  # int8 data + a float32 scale per token and head
    "fp8": 30 * 2 * 3 * 64,
    "int4": 30 * 2 * 3 * (32 + 2 * 2 * 2),  # packed nibbles + bfloat16 scale and zero per group of 32
}


def _engine(**overrides: object) -> LLM:
    return LLM(EngineConfig(**{"kv_cache_memory": "32MiB", "max_model_len": 512, **overrides}))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    return {kind: _engine(kv_cache_dtype=kind) for kind in EXPECTED_BYTES_PER_TOKEN}


def test_bytes_per_token_and_capacity_follow_the_dtype(engines: dict[str, LLM]):
    fp32 = engines["auto"].engine
    for kind, llm in engines.items():
        engine = llm.engine
        expected = EXPECTED_BYTES_PER_TOKEN[kind]
        snap = engine.snapshot(include_gpu=False)
        assert snap.engine.bytes_per_token == engine.capacity.bytes_per_token == expected
        assert snap.engine.kv_cache_dtype == ("float32" if kind == "auto" else kind)
        # Measured from the tensors actually allocated, not from the formula.
        fixed = 30 * 8 if kind == "fp8" else 0  # fp8's per-layer K and V scales
        assert engine.kv_pool.allocated_bytes - fixed == engine.capacity.tokens * expected
        assert engine.capacity.num_blocks == 32 * 2**20 // (16 * expected)
        ratio = engine.capacity.tokens / fp32.capacity.tokens
        assert ratio == pytest.approx(FP32_BYTES_PER_TOKEN / expected, rel=0.02)
    assert engines["int4"].engine.capacity.tokens > 5 * fp32.capacity.tokens


def test_quantized_greedy_output_stays_close_to_fp32(engines: dict[str, LLM], chat_prompts: list[list[int]]):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    prompts = chat_prompts[:6]
    reference = [o.token_ids for o in engines["auto"].generate(prompts, greedy)]

    def agreement(kind: str) -> float:
        outputs = [o.token_ids for o in engines[kind].generate(prompts, greedy)]
        same = 0
        for got, want in zip(outputs, reference, strict=True):
            for a, b in zip(got, want, strict=False):
                if a != b:
                    break
                same += 1
        return same / sum(len(r) for r in reference)

    # A 135M model's greedy path has near-ties (top-2 logit margins of 0.05), so even int8 diverges
    # somewhere on some prompts; the ordering and the rough level are what a user relies on.
    int8, fp8, int4 = agreement("int8"), agreement("fp8"), agreement("int4")
    assert int8 >= 0.6 and fp8 >= 0.35 and int4 > 0.1
    assert int8 > int4 and fp8 > int4


def test_skipped_layers_stay_in_the_model_dtype():
    llm = _engine(kv_cache_dtype="int4", kv_cache_dtype_skip_layers="model.layers.0,5")
    engine = llm.engine
    assert engine.kv_pool.layer_dtypes[0] == engine.kv_pool.layer_dtypes[5] == "auto"
    assert engine.kv_pool.device[5].data.dtype == torch.float32
    assert engine.kv_pool.device[1].data.dtype == torch.uint8
    per_layer_fp32 = FP32_BYTES_PER_TOKEN // 30
    per_layer_int4 = EXPECTED_BYTES_PER_TOKEN["int4"] // 30
    assert engine.capacity.bytes_per_token == 2 * per_layer_fp32 + 28 * per_layer_int4
    assert engine.snapshot(include_gpu=False).engine.kv_cache_dtype_skip_layers == [0, 5]
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_cache_dtype": "int4", "kv_cache_dtype_skip_layers": "30"}, r"names layer 30.*30 layers \(0..29\)"),
        ({"kv_cache_dtype_skip_layers": "attention.3"}, "cannot read 'attention.3' as a layer"),
        ({"kv_cache_dtype": "int2"}, "--kv-cache-dtype 'int2' is not one of auto, int8, fp8, int4"),
        ({"kv_cache_dtype": "int4", "kv_cache_group_size": 48}, "--kv-cache-group-size must be one of"),
    ],
)
def test_bad_kv_dtype_settings_are_refused_with_the_fix(overrides: dict[str, object], message: str):
    with pytest.raises(ConfigError, match=message):
        _engine(**overrides)


def test_profile_of_int8_flags_nothing_and_covers_every_layer_and_step(engines: dict[str, LLM]):
    profile = profile_kv_error(engines["int8"].engine)
    assert profile.kv_cache_dtype == "int8" and profile.steps == [10, 50, 100]
    assert [entry.layer for entry in profile.layers] == list(range(30))
    assert all(set(entry.k_cosine) == set(entry.v_cosine) == {10, 50, 100} for entry in profile.layers)
    assert profile.flagged == []
    assert min(entry.min_cosine for entry in profile.layers) > 0.999
    # The unquantized cache is, layer by layer, exactly the full-precision K/V.
    exact = profile_kv_error(engines["auto"].engine, steps=[5])
    assert all(entry.min_cosine == pytest.approx(1.0, abs=1e-6) for entry in exact.layers)
    # Another dtype can be profiled without restarting: int4 is measurably worse than int8.
    int4 = profile_kv_error(engines["int8"].engine, kv_cache_dtype="int4", steps=[10])
    assert int4.kv_cache_dtype == "int4" and int4.group_size == 32
    assert max(e.min_cosine for e in int4.layers) < min(e.min_cosine for e in profile.layers)


def _overflow_layer_3(llm: LLM) -> None:
    """Scale layer 3's K projection 1000×: its keys go far past fp8's ±448 at scale 1.0."""
    model = llm.engine.model
    model.layers[3].qkv[model.q_size : model.q_size + model.kv_size] *= 1000


def test_calibrated_fp8_scales_keep_an_outlier_layer_that_a_fixed_scale_saturates():
    llm = _engine(kv_cache_dtype="fp8")
    _overflow_layer_3(llm)
    with fixed_fp8_scale(1.0):  # the old behaviour (private pools at scale 1.0): flagged, and skipping fixes it
        profile = profile_kv_error(llm.engine, steps=[10])
        assert profile.fp8_scales == "fixed" and profile.flagged == [3]
        bad = profile.layers[3]
        assert bad.below_threshold and bad.k_cosine[10] < 0.99 < bad.v_cosine[10]
        assert bad.k_scale == bad.v_scale == 1.0
        fixed = profile_kv_error(llm.engine, skip_layers=[3], steps=[10])
        assert fixed.flagged == [] and fixed.layers[3].kv_dtype == "float32" and fixed.layers[3].k_scale is None
    # Calibrated on the profile's prefill (the serving pool has written nothing yet): layer 3's K scale
    # grows with its keys and nothing is flagged.
    calibrated = profile_kv_error(llm.engine, steps=[10])
    assert calibrated.fp8_scales == "calibrated" and calibrated.flagged == []
    layer3, others = calibrated.layers[3], calibrated.layers[:3] + calibrated.layers[4:]
    assert layer3.k_cosine[10] > 0.999 and layer3.k_rel_error is not None and layer3.k_rel_error < 0.05
    assert layer3.k_scale is not None and layer3.k_scale > 100 * max(e.k_scale or 0 for e in others)
    assert bad.k_rel_error is not None and bad.k_rel_error > 0.5  # what the fixed scale did to the same layer
