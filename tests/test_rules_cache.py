"""The cache rules: tenant pollution, prompt variance, prefix caching off, block-size mismatch and
KV quantization error, as scenarios on synthetic histories (no model, no engine)."""

from __future__ import annotations

from typing import Any

import pytest

from kvops.history import EngineHistory
from kvops.rules import block_size_mismatch, kv_quant_error, prefix_caching_off, prompt_variance, tenant_pollution
from kvops.rules.block_size_mismatch import boundary_step_excess
from kvops.schema.diagnosis import Diagnosis, FixKind, Severity
from kvops.schema.reports import BlockSizeProfile, BlockSizeTiming, KVQuantProfile, LayerKVError
from kvops.schema.snapshot import StepSample
from tests.helpers.synthetic import ENGINE, T0, decode_steps, history_of, merged, steps_until


def only(diagnoses: list[Diagnosis]) -> Diagnosis:
    assert len(diagnoses) == 1, diagnoses
    return diagnoses[0]


def objectives(d: Diagnosis) -> list[tuple[str, str, str]]:
    """What the fix must move, as (measure, better, subject)."""
    assert d.fix is not None
    return [(o.measure, o.better, o.subject) for o in d.fix.objectives]


# -------------------------------------------------------- tenant_pollution


def tenants(caused: int = 2, polluter_hits: int = 0, victim_hits_late: int = 100, suffered: int = 1,
            victim_hits_early: int = 200, quota: int | None = None) -> Any:
    """Per 5 s snapshot: tenant x evicts `caused` of the others' blocks and sends 500 prompt tokens
    (`polluter_hits` of them hit); a and b each suffer `suffered` evictions and send 400 prompt
    tokens, `victim_hits_early` hitting before HALF and `victim_hits_late` after."""

    def scene(i: int, t: float) -> dict[str, Any]:
        late = max(0, i - 30)
        early = i - late
        victim = {"requests_total": 100 + i, "prompt_tokens_total": 10_000 + 400 * i,
                  "hit_tokens_total": 5_000 + victim_hits_early * early + victim_hits_late * late,
                  "evictions_suffered": suffered * i, "blocks_held": 30, "blocks_owned": 200}
        return {"tenants": {
            "a": victim,
            "b": victim,
            "x": {"requests_total": 10 * i, "prompt_tokens_total": 500 * i, "hit_tokens_total": polluter_hits * i,
                  "evictions_caused": caused * i, "blocks_held": 40 - i % 7, "blocks_owned": 300,
                  "quota_blocks": quota},
        }}

    return scene


def test_tenant_pollution_names_the_polluter_and_caps_it() -> None:
    d = only(tenant_pollution.evaluate(history_of(tenants()), tenant_pollution.Settings(), T0))
    assert d.rule == "tenant_pollution" and d.subject == "x" and d.severity is Severity.WARNING
    e = d.evidence
    assert e["evictions_caused"] == 120 and e["polluter_hit_rate"] == 0.0 and e["polluter_prompt_tokens"] == 30_000
    assert e["victims"] == "a,b" and e["victim_evictions_suffered"] == 120
    assert e["victim_evictions_suffered_per_s"] == pytest.approx(0.4)
    assert e["victim_hit_rate_earlier"] == pytest.approx(0.5) and e["victim_hit_rate_recent"] == pytest.approx(0.25)
    assert e["victim_hit_rate_before_window"] == pytest.approx(0.5)
    assert e["victim_hit_rate_drop"] == pytest.approx(0.25)
    # Its live sequences held at most 40 blocks, but one max_model_len request needs 128.
    assert e["blocks_held_peak"] == 40 and e["quota_blocks"] == 128
    assert d.fix is not None and d.fix.kind is FixKind.ADMIN and d.fix.action == "set_tenant_quota"
    assert d.fix.params == {"tenant": "x", "quota_blocks": 128}
    assert objectives(d) == [("victims_hit_rate", "higher", "x"),
                             ("evictions_caused_per_s", "lower", "x")]
    assert d.fix.objectives[1].min_effect == 0.5


def test_tenant_pollution_quota_is_bounded_by_a_share_of_the_pool() -> None:
    def scene(i: int, t: float) -> dict[str, Any]:
        return merged(tenants()(i, t), {"tenants": {"x": {"blocks_held": 600}}})

    d = only(tenant_pollution.evaluate(history_of(scene), tenant_pollution.Settings(), T0))
    assert d.fix is not None and d.fix.params["quota_blocks"] == 256  # 25% of 1024


def test_tenant_pollution_tightens_a_quota_that_did_not_help() -> None:
    d = only(tenant_pollution.evaluate(history_of(tenants(quota=600)), tenant_pollution.Settings(), T0))
    assert d.fix is not None and d.fix.params["quota_blocks"] == 128 and d.evidence["current_quota_blocks"] == 600
    d = only(tenant_pollution.evaluate(history_of(tenants(quota=128)), tenant_pollution.Settings(), T0))
    assert d.fix is None  # nothing tighter fits one max_model_len request


def test_tenant_pollution_can_skip_the_hit_rate_check() -> None:
    steady = tenants(victim_hits_late=200)
    assert tenant_pollution.evaluate(history_of(steady), tenant_pollution.Settings(), T0) == []
    d = only(tenant_pollution.evaluate(history_of(steady), tenant_pollution.Settings(min_victim_hit_rate_drop=0), T0))
    assert d.evidence["victim_hit_rate_drop"] == pytest.approx(0.0)


@pytest.mark.parametrize("scene, n", [
    (lambda i, t: {}, 61),  # healthy: one tenant
    (tenants(caused=0, suffered=0, victim_hits_late=200), 61),  # tenants sharing peacefully
    (tenants(caused=1), 61),  # 60 evictions caused: just under 64
    (tenants(polluter_hits=50), 61),  # the "polluter" reuses 10% of its prompts: it is using the cache
    (tenants(victim_hits_late=200), 61),  # victims' hit rate not falling
    (tenants(suffered=0), 61),  # nobody suffers (the counters disagree): no victims
    (tenants(), 2),  # 5 s of data in a 300 s window
])
def test_tenant_pollution_stays_silent(scene: Any, n: int) -> None:
    assert tenant_pollution.evaluate(history_of(scene, n=n), tenant_pollution.Settings(), T0) == []


# --------------------------------------------------------- prompt_variance


def prompts(mode: str = "shadow", hits: int = 200, shadow_hits: int = 500, shadow_queries: int = 1000,
            mode_since: float = 0.0, caching: bool = True, finished: int = 5) -> Any:
    """Per 5 s snapshot: 1000 prompt tokens, `hits` of them hit; the shadow cache looks up
    `shadow_queries` of which `shadow_hits` would hit. The mode holds from `mode_since` on."""

    def scene(i: int, t: float) -> dict[str, Any]:
        return {"engine": {"enable_prefix_caching": caching},
                "requests": {"finished_total": 1000 + finished * i},
                "prefix_cache": {"normalization": mode if t >= mode_since else "off",
                                 "queries_total": 100_000 + 1000 * i, "hits_total": 50_000 + hits * i,
                                 "shadow_queries_total": shadow_queries * i, "shadow_hits_total": shadow_hits * i}}

    return scene


def test_prompt_variance_proposes_normalization_when_the_shadow_hits_more() -> None:
    d = only(prompt_variance.evaluate(history_of(prompts()), prompt_variance.Settings(), T0))
    assert d.severity is Severity.WARNING
    assert d.evidence["hit_rate"] == pytest.approx(0.2) and d.evidence["shadow_hit_rate"] == pytest.approx(0.5)
    assert d.evidence["gap"] == pytest.approx(0.3) and d.evidence["shadow_queried_tokens"] == 60_000
    assert d.fix is not None and d.fix.kind is FixKind.ADMIN and d.fix.action == "set_normalization"
    assert d.fix.params == {"mode": "on"}
    assert objectives(d) == [("hit_rate", "higher", "")]


def test_prompt_variance_proposes_shadow_mode_to_measure_a_low_hit_rate() -> None:
    d = only(prompt_variance.evaluate(history_of(prompts(mode="off", hits=50)), prompt_variance.Settings(), T0))
    assert d.severity is Severity.INFO and d.evidence["hit_rate"] == pytest.approx(0.05)
    assert d.evidence["requests"] == 300
    assert d.fix is not None and d.fix.params == {"mode": "shadow"} and d.fix.objectives == []


@pytest.mark.parametrize("scene, settings", [
    (prompts(shadow_hits=340), prompt_variance.Settings()),  # gap 0.14: just under 0.15
    (prompts(shadow_queries=30, shadow_hits=15), prompt_variance.Settings()),  # 1800 shadow tokens only
    (prompts(mode_since=T0 - 60), prompt_variance.Settings()),  # shadow mode switched on a minute ago
    (prompts(mode="on"), prompt_variance.Settings()),  # already on
    (prompts(caching=False), prompt_variance.Settings()),  # no real hit rate: prefix_caching_off's case
    (prompts(mode="off", hits=500), prompt_variance.Settings()),  # off, but the hit rate is fine
    (prompts(mode="off", hits=50, finished=0), prompt_variance.Settings()),  # off, low, but few requests
    (prompts(mode="off", hits=50), prompt_variance.Settings(suggest_shadow=False)),
    (lambda i, t: {}, prompt_variance.Settings()),  # healthy: counters flat
])
def test_prompt_variance_stays_silent(scene: Any, settings: prompt_variance.Settings) -> None:
    assert prompt_variance.evaluate(history_of(scene), settings, T0) == []


# ------------------------------------------------------ prefix_caching_off


def caching_off(potential_hits: int = 600, potential_queries: int = 1000, off_since: float = 0.0) -> Any:
    def scene(i: int, t: float) -> dict[str, Any]:
        off = t >= off_since
        return {"engine": {"enable_prefix_caching": not off},
                "prefix_cache": {"queries_total": 100_000 + 1000 * i, "hits_total": 50_000 if off else 50_000 + 500 * i,
                                 "potential_queries_total": potential_queries * i,
                                 "potential_hits_total": potential_hits * i,
                                 "potential_hit_rate": potential_hits / potential_queries}}

    return scene


def test_prefix_caching_off_on_a_shared_prefix_workload() -> None:
    d = only(prefix_caching_off.evaluate(history_of(caching_off()), prefix_caching_off.Settings(), T0))
    assert d.severity is Severity.WARNING
    assert d.evidence["potential_hit_rate"] == pytest.approx(0.6) and d.evidence["potential_queried_tokens"] == 60_000
    assert d.evidence["hit_rate"] == 0.0
    assert d.fix is not None and d.fix.kind is FixKind.ADMIN and d.fix.action == "set_prefix_caching"
    assert d.fix.params == {"enabled": True}
    assert objectives(d) == [("hit_rate", "higher", "")]
    assert d.fix.objectives[0].min_effect == 0.05  # absolute: the hit rate before is 0


@pytest.mark.parametrize("scene", [
    lambda i, t: {},  # caching on
    caching_off(potential_hits=290),  # 29%: just under 30%
    caching_off(potential_queries=30, potential_hits=20),  # 1800 tokens looked up
    caching_off(off_since=T0 - 60),  # switched off a minute ago: the window is mostly caching on
])
def test_prefix_caching_off_stays_silent(scene: Any) -> None:
    assert prefix_caching_off.evaluate(history_of(scene), prefix_caching_off.Settings(), T0) == []


# ----------------------------------------------------- block_size_mismatch


def profile(configured_ms: float = 22.0, configured: int = 16, measured_at: float = T0 - 600, iqr_ms: float = 1.0,
            lengths_from: str = "recent") -> BlockSizeProfile:
    timings = {8: (24.0, 0.02), 16: (22.0, 0.03), 32: (18.0, 0.06), 64: (17.5, 0.25)}
    timings[configured] = (configured_ms, timings[configured][1])
    fastest = min(timings.values(), key=lambda v: v[0])[0]
    return BlockSizeProfile(
        configured=configured, best=min(timings, key=lambda b: timings[b][0]),
        candidates=[BlockSizeTiming(block_size=b, decode_step_ms=ms, relative=ms / fastest, fragmentation=frag,
                                    iqr_ms=iqr_ms) for b, (ms, frag) in timings.items()],
        context_lens=[300, 700, 1500], batch_size=8, repeats=5, measured_at=measured_at, duration_s=12.0,
        lengths_from=lengths_from)


STEADY_STEPS = decode_steps(T0 - 300, T0, every=0.5)


def periodic(context: int, t: float) -> float:
    return 0.03 if context % 16 == 1 else 0.02  # the step that opens a new block is 50% slower


def with_profile(history: EngineHistory, measured: BlockSizeProfile | None) -> EngineHistory:
    history.block_size_profile = measured
    return history


def test_block_size_mismatch_proposes_the_fastest_candidate_that_does_not_waste_the_pool() -> None:
    history = with_profile(history_of(lambda i, t: {"steps": steps_until(STEADY_STEPS, t)}), profile())
    d = only(block_size_mismatch.evaluate(history, block_size_mismatch.Settings(), T0))
    assert d.severity is Severity.WARNING
    e = d.evidence
    # 64 is the profile's best but would leave 25% of slots empty (vs 3%): 32 is proposed.
    assert e["profile_best"] == 64 and e["proposed_block_size"] == 32
    assert e["configured_decode_step_ms"] == 22.0 and e["proposed_decode_step_ms"] == 18.0
    assert e["slowdown"] == pytest.approx(22 / 18 - 1, abs=1e-4)
    assert e["decode_step_ms_median"] == pytest.approx(20.0) and e["boundary_step_excess"] == pytest.approx(0.0)
    assert e["fragmentation"] == pytest.approx(1 - 672 / 704, abs=1e-4)
    assert d.fix is not None and d.fix.kind is FixKind.RESTART and d.fix.params == {"block_size": 32}
    assert objectives(d) == [("decode_step_ms", "lower", "")]


def test_block_size_mismatch_takes_the_profiles_best_when_it_fits() -> None:
    d = only(block_size_mismatch.evaluate(with_profile(history_of(), profile()),
                                          block_size_mismatch.Settings(max_fragmentation_increase=0.5), T0))
    assert d.fix is not None and d.fix.params == {"block_size": 64}
    assert d.fix.objectives == []  # no decode steps to measure


@pytest.mark.parametrize("measured", [
    profile(configured_ms=19.7),  # 9.4% slower than 32: under 10%
    profile(configured_ms=17.0),  # the configured size is the fastest
    profile(measured_at=T0 - 2 * 86400),  # too old
    profile(configured=32, configured_ms=18.0),  # taken before a restart, at block size 32
    profile(iqr_ms=5.0),  # 22 vs 18 ms, but steps spread by 5 ms: noise
    profile(lengths_from="default"),  # measured on the fixed lengths, before anything was served
    None,  # never measured, and no periodicity either
])
def test_block_size_mismatch_stays_silent(measured: BlockSizeProfile | None) -> None:
    history = with_profile(history_of(), measured)
    assert block_size_mismatch.evaluate(history, block_size_mismatch.Settings(), T0) == []


def test_block_size_periodicity_without_a_profile_only_suggests_measuring() -> None:
    steps = decode_steps(T0 - 300, T0, every=0.5, duration=periodic)
    fragmented = {"blocks": {"allocated_slots": 704, "used_slots": 352}}
    history = history_of(lambda i, t: {"steps": steps_until(steps, t), **fragmented})
    d = only(block_size_mismatch.evaluate(history, block_size_mismatch.Settings(), T0))
    assert d.severity is Severity.INFO
    assert d.evidence["boundary_step_excess"] == pytest.approx(0.5) and d.evidence["fragmentation"] == 0.5
    assert d.fix is not None and d.fix.kind is FixKind.REPORT and d.fix.objectives == []

    assert block_size_mismatch.evaluate(history, block_size_mismatch.Settings(suggest_profile=False), T0) == []
    not_fragmented = history_of(lambda i, t: {"steps": steps_until(steps, t)})
    assert block_size_mismatch.evaluate(not_fragmented, block_size_mismatch.Settings(), T0) == []


def test_boundary_step_excess_normalizes_batch_sizes_and_needs_samples() -> None:
    # Bigger batches are slower, but no step is slower for opening a block: no excess.
    steps = [StepSample(t=T0 + i, duration_s=0.01 * (1 + i % 3), num_seqs=1 + i % 3, num_tokens=1 + i % 3,
                        decode_only=True, max_context_len=100 + i) for i in range(400)]
    assert boundary_step_excess(steps, 16, 8) == pytest.approx(0.0)
    assert boundary_step_excess(steps[:40], 16, 8) is None  # 3 boundary steps
    assert boundary_step_excess(steps, 1, 8) is None  # every step opens a block


# ---------------------------------------------------------- kv_quant_error


def kv_profile(flagged: dict[int, float], dtype: str = "fp8", skip: tuple[int, ...] = ()) -> KVQuantProfile:
    layers = [LayerKVError(layer=i, kv_dtype=dtype, k_cosine={10: flagged.get(i, 0.9995)},
                           v_cosine={10: 0.9999}, min_cosine=flagged.get(i, 0.9995), below_threshold=i in flagged)
              for i in range(30)]
    return KVQuantProfile(kv_cache_dtype=dtype, group_size=None, skip_layers=list(skip), threshold=0.99,
                          steps=[10, 50, 100], prompts=4, tokens_compared=1200, duration_s=3.0, layers=layers,
                          flagged=sorted(flagged))


def quantized(skip: list[int], measured: KVQuantProfile | None) -> EngineHistory:
    history = history_of(lambda i, t: {"engine": {"kv_cache_dtype": "fp8", "kv_cache_dtype_skip_layers": skip,
                                                  "bytes_per_token": 11520}})
    history.kv_profile = measured
    return history


def test_kv_quant_error_keeps_flagged_layers_in_full_precision() -> None:
    d = only(kv_quant_error.evaluate(quantized([5], kv_profile({3: 0.95, 7: 0.985})), kv_quant_error.Settings(), T0))
    assert d.subject == "" and d.severity is Severity.WARNING
    assert d.evidence["flagged_layers"] == "3,7" and d.evidence["worst_layer"] == 3
    assert d.evidence["worst_cosine"] == 0.95 and d.evidence["proposed_skip_layers"] == "3,5,7"
    assert d.fix is not None and d.fix.kind is FixKind.RESTART
    assert d.fix.params == {"kv_cache_dtype_skip_layers": [3, 5, 7]}
    assert d.fix.objectives == []  # its effect shows in the KV error profile only, not in snapshots


def test_kv_quant_error_is_critical_for_a_broken_layer() -> None:
    d = only(kv_quant_error.evaluate(quantized([], kv_profile({3: 0.4})), kv_quant_error.Settings(), T0))
    assert d.severity is Severity.CRITICAL and d.fix is not None
    assert d.fix.params == {"kv_cache_dtype_skip_layers": [3]}


@pytest.mark.parametrize("skip, measured", [
    ([], None),  # never profiled
    ([], kv_profile({})),  # profiled, nothing flagged
    ([3], kv_profile({3: 0.95})),  # flagged layer already skipped (the profile predates the restart)
    ([], kv_profile({3: 0.95}, dtype="int4")),  # a probe of another dtype
])
def test_kv_quant_error_stays_silent(skip: list[int], measured: KVQuantProfile | None) -> None:
    assert kv_quant_error.evaluate(quantized(skip, measured), kv_quant_error.Settings(), T0) == []


def test_kv_quant_error_needs_a_current_snapshot() -> None:
    history = EngineHistory(engine=ENGINE)
    history.kv_profile = kv_profile({3: 0.95})
    assert kv_quant_error.evaluate(history, kv_quant_error.Settings(), T0) == []
