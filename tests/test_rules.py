"""The rules catalog: the registry, evaluate_all, and the capacity and liveness rules, as scenarios
on synthetic histories (no model, no engine)."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import kvops.rules as rules_pkg
from kvops.history import EngineHistory
from kvops.rules import (
    RULES,
    Rule,
    crash_loop,
    engine_down,
    evaluate_all,
    host_bound,
    kv_oom_runtime,
    kv_oom_start,
    swap_storm,
)
from kvops.rules.common import recent_steps
from kvops.schema.diagnosis import Diagnosis, FixKind, Severity
from tests.helpers.synthetic import (
    ENGINE,
    T0,
    decode_steps,
    gpu,
    history_of,
    merged,
    on_gpu,
    snapshot,
    steps_until,
    with_exits,
    with_health,
)

BLOCK_BYTES = 16 * 46080  # block_size × bytes_per_token of the synthetic engine


def only(diagnoses: list[Diagnosis]) -> Diagnosis:
    assert len(diagnoses) == 1, diagnoses
    return diagnoses[0]


def objectives(d: Diagnosis) -> list[tuple[str, str, str]]:
    """What the fix must move, as (measure, better, subject)."""
    assert d.fix is not None
    return [(o.measure, o.better, o.subject) for o in d.fix.objectives]


# ---------------------------------------------------------------- registry


def test_registry_lists_every_rule_with_stable_ids() -> None:
    assert set(RULES) == {
        "kv_oom_start", "kv_oom_runtime", "block_size_mismatch", "tenant_pollution", "prompt_variance", "salt_split",
        "prefix_caching_off", "swap_storm", "kv_quant_error", "host_bound", "engine_down", "crash_loop",
        "gateway_down", "queueing", "no_prefix_hits", "aborted_requests", "latency_slo", "prefix_cache_thrash",
        "low_hit_cause",
    }
    for rule_id, rule in RULES.items():
        assert rule.id == rule_id and re.fullmatch(r"[a-z][a-z0-9_]*", rule_id)
        assert rule.description
        rule.settings_type()  # every threshold has a default
        with pytest.raises(ValidationError):
            rule.settings_type(no_such_threshold=1)  # a typo in the config is an error


def test_healthy_engine_gets_no_diagnosis() -> None:
    assert evaluate_all(history_of(), None, T0) == []
    assert evaluate_all(history_of(lambda i, t: on_gpu()), None, T0) == []


def test_no_data_gives_no_diagnosis() -> None:
    assert evaluate_all(EngineHistory(engine=ENGINE), None, T0) == []


def test_evaluate_all_survives_a_failing_rule(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def broken(history: EngineHistory, settings: BaseModel, now: float) -> list[Diagnosis]:
        raise ZeroDivisionError("boom")

    class NoSettings(BaseModel):
        pass

    monkeypatch.setitem(rules_pkg.RULES, "broken", Rule("broken", broken, NoSettings, "always raises"))
    history = history_of(lambda i, t: {"engine": {"max_num_seqs": 16}})  # kv_oom_start fires
    diagnoses = evaluate_all(history, None, T0)
    assert [d.rule for d in diagnoses] == ["kv_oom_start"]
    assert "rule failed" in capsys.readouterr().err


def test_evaluate_all_uses_given_settings_and_defaults_for_the_rest() -> None:
    history = history_of(lambda i, t: {"engine": {"max_num_seqs": 16}})
    assert evaluate_all(history, {"kv_oom_start": kv_oom_start.Settings(max_overcommit=3.0)}, T0) == []
    assert [d.rule for d in evaluate_all(history, {"engine_down": engine_down.Settings()}, T0)] == ["kv_oom_start"]


def test_evaluate_all_skips_a_rule_given_the_wrong_settings(capsys: pytest.CaptureFixture) -> None:
    history = history_of(lambda i, t: {"engine": {"max_num_seqs": 16}})
    assert evaluate_all(history, {"kv_oom_start": engine_down.Settings()}, T0) == []
    assert "rule failed" in capsys.readouterr().err


def test_rules_do_not_change_the_history() -> None:
    history = history_of(lambda i, t: {"engine": {"max_num_seqs": 16}})
    before = [s.model_dump() for s in history.snapshots]
    evaluate_all(history, None, T0)
    assert [s.model_dump() for s in history.snapshots] == before


def test_recent_steps_joins_overlapping_snapshot_tails_once() -> None:
    steps = decode_steps(T0 - 600, T0, every=0.5)  # 1201 steps; each snapshot carries the last 512
    history = history_of(lambda i, t: {"steps": steps_until(steps, t)}, n=121)
    collected = recent_steps(history.window(600), T0 - 400)
    assert [s.t for s in collected] == [s["t"] for s in steps if s["t"] >= T0 - 400]


# ------------------------------------------------------------ kv_oom_start


def test_kv_oom_start_fires_when_full_concurrency_overflows_the_pool() -> None:
    history = history_of(lambda i, t: {"engine": {"max_num_seqs": 16}})  # 16 × 128 blocks vs 1024
    d = only(kv_oom_start.evaluate(history, kv_oom_start.Settings(), T0))
    assert d.rule == "kv_oom_start" and d.engine == ENGINE and d.severity is Severity.INFO
    e = d.evidence
    assert e["bytes_per_token"] == 46080 and e["pool_tokens"] == 1024 * 16
    assert e["tokens_needed"] == 16 * 2048 and e["blocks_needed"] == 2048 and e["overcommit"] == 2.0
    assert e["max_concurrency_at_max_model_len"] == 8.0
    assert e["fit_max_num_seqs"] == 8 and e["fit_max_model_len"] == 1024
    assert e["fit_kv_cache_memory_bytes"] == 2048 * BLOCK_BYTES
    assert e["rss_bytes"] == 2 * 2**30 and e["gpu_memory_free_bytes"] is None
    # On the CPU the free memory is unknown: fewer sequences (requests queue) rather than a bigger budget.
    assert d.fix is not None and d.fix.kind is FixKind.RESTART and d.fix.action == "restart_engine"
    assert d.fix.params == {"max_num_seqs": 8}
    assert objectives(d) == [("overcommit", "lower", "")]


def test_kv_oom_start_raises_the_budget_when_the_gpu_has_the_memory() -> None:
    history = history_of(lambda i, t: merged({"engine": {"max_num_seqs": 16}}, on_gpu(used=10 * 2**30)))
    d = only(kv_oom_start.evaluate(history, kv_oom_start.Settings(), T0))
    assert d.fix is not None and d.fix.params == {"kv_cache_memory": 2048 * BLOCK_BYTES}
    assert d.evidence["gpu_memory_free_bytes"] == 70 * 2**30


def test_kv_oom_start_caps_concurrency_when_the_gpu_is_full() -> None:
    history = history_of(lambda i, t: merged({"engine": {"max_num_seqs": 16}}, on_gpu(used=80 * 2**30 - 2**20)))
    d = only(kv_oom_start.evaluate(history, kv_oom_start.Settings(), T0))
    assert d.fix is not None and d.fix.params == {"max_num_seqs": 8}


def test_kv_oom_start_counts_whole_blocks() -> None:
    # 8 × 2048 tokens fill the pool exactly: no risk. One token more per request needs a 129th block each.
    exact = history_of(lambda i, t: {"engine": {"max_num_seqs": 8}})
    assert kv_oom_start.evaluate(exact, kv_oom_start.Settings(), T0) == []
    over = history_of(lambda i, t: {"engine": {"max_num_seqs": 8, "max_model_len": 2049}})
    d = only(kv_oom_start.evaluate(over, kv_oom_start.Settings(), T0))
    assert d.evidence["blocks_needed"] == 8 * 129 and d.fix is not None and d.fix.params == {"max_num_seqs": 7}


@pytest.mark.parametrize("history, settings, now", [
    (history_of(), kv_oom_start.Settings(), T0),  # healthy: 4 × 128 blocks of 1024
    (history_of(lambda i, t: {"engine": {"max_num_seqs": 16}}), kv_oom_start.Settings(max_overcommit=2.0), T0),
    (history_of(lambda i, t: {"engine": {"max_num_seqs": 16}}), kv_oom_start.Settings(), T0 + 600),  # stale
    (EngineHistory(engine=ENGINE), kv_oom_start.Settings(), T0),  # no data
])
def test_kv_oom_start_stays_silent(history: EngineHistory, settings: kv_oom_start.Settings, now: float) -> None:
    assert kv_oom_start.evaluate(history, settings, now) == []


# ---------------------------------------------------------- kv_oom_runtime

LONG_PROMPTS = {
    "engine": {"max_num_seqs": 32},
    # p95 prompt 1024 + 256 generated on average: 80 blocks a sequence, 11 of them fit in 90% of the pool
    "prompt_lengths": {"p95": 1024.0},
    "requests": {"running": 32, "finished_total": 1000, "generation_tokens_total": 256_000},
}


def draining(rate: float, left_at_end: float, preemptions: Any = 0) -> Any:
    """Reclaimable blocks falling `rate` per second to `left_at_end` at T0 (flat at 800 before)."""

    def scene(i: int, t: float) -> dict[str, Any]:
        reclaimable = int(min(800, left_at_end + rate * (T0 - t)))
        counts = {"free": reclaimable - reclaimable // 4, "cached": reclaimable // 4, "filling": 32,
                  "full": 1024 - reclaimable - 32}
        preempted = preemptions(t) if callable(preemptions) else preemptions
        return {**LONG_PROMPTS, "blocks": {"counts": counts},
                "requests": {**LONG_PROMPTS["requests"], "preemptions_total": preempted}}

    return scene


def test_kv_oom_runtime_warns_before_the_pool_runs_dry() -> None:
    history = history_of(draining(rate=4.0, left_at_end=200))
    d = only(kv_oom_runtime.evaluate(history, kv_oom_runtime.Settings(), T0))
    assert d.severity is Severity.WARNING
    assert d.evidence["reclaimable_blocks"] == 200 and d.evidence["reclaimable_trend_per_s"] == pytest.approx(-4.0)
    assert d.evidence["time_to_exhaustion_s"] == pytest.approx(50.0)
    assert d.evidence["blocks_per_seq"] == 80
    assert d.fix is not None and d.fix.kind is FixKind.RESTART and d.fix.params == {"max_num_seqs": 11}
    # No preemption yet: the fix must lower the pool's peak usage.
    assert objectives(d) == [("kv_usage_max", "lower", "")]


def test_kv_oom_runtime_is_critical_within_30_seconds() -> None:
    d = only(kv_oom_runtime.evaluate(history_of(draining(rate=10.0, left_at_end=200)), kv_oom_runtime.Settings(), T0))
    assert d.severity is Severity.CRITICAL and d.evidence["time_to_exhaustion_s"] == pytest.approx(20.0)


def test_kv_oom_runtime_raises_the_budget_when_the_gpu_has_room() -> None:
    scene = draining(rate=4.0, left_at_end=200)
    history = history_of(lambda i, t: merged(scene(i, t), on_gpu(used=10 * 2**30)))
    d = only(kv_oom_runtime.evaluate(history, kv_oom_runtime.Settings(), T0))
    assert d.fix is not None and d.fix.params == {"kv_cache_memory": math.ceil(32 * 80 / 0.9) * BLOCK_BYTES}


def test_kv_oom_runtime_exhausted_pool_with_rising_preemptions_is_critical() -> None:
    # Flat at 10 reclaimable blocks (1%): no trend left to read, but preemptions climb 0.2/s then 0.5/s.
    def preemptions(t: float) -> int:
        return int(0.2 * (t - (T0 - 300))) if t < T0 - 30 else int(0.2 * 270 + 0.5 * (t - (T0 - 30)))

    history = history_of(draining(rate=0.0, left_at_end=10, preemptions=preemptions))
    d = only(kv_oom_runtime.evaluate(history, kv_oom_runtime.Settings(), T0))
    assert d.severity is Severity.CRITICAL and d.evidence["time_to_exhaustion_s"] == 0.0
    assert d.evidence["preemptions_per_s_recent"] == pytest.approx(0.5, abs=0.05)
    assert d.evidence["preemptions_per_s_earlier"] == pytest.approx(0.2, abs=0.05)
    assert d.fix is not None and objectives(d) == [("preemptions_per_s", "lower", "")]


def test_kv_oom_runtime_warns_on_steady_preemptions_with_blocks_left() -> None:
    history = history_of(draining(rate=0.0, left_at_end=300, preemptions=lambda t: int(0.5 * (t - (T0 - 300)))))
    d = only(kv_oom_runtime.evaluate(history, kv_oom_runtime.Settings(), T0))
    assert d.severity is Severity.WARNING and d.evidence["time_to_exhaustion_s"] is None


@pytest.mark.parametrize("scene, n, now", [
    (draining(rate=0.0, left_at_end=800), 61, T0),  # healthy: flat
    (draining(rate=4.0, left_at_end=500), 61, T0),  # 125 s left: just beyond the 120 s warning
    # preemptions falling: 0.5/s, then 0.12/s
    (draining(rate=0.0, left_at_end=300,
              preemptions=lambda t: int(0.5 * (t - (T0 - 300))) if t < T0 - 30 else int(135 + 0.12 * (t - T0 + 30))),
     61, T0),
    (draining(rate=4.0, left_at_end=200), 3, T0),  # 10 s of data in a 60 s window
    (draining(rate=4.0, left_at_end=200), 61, T0 + 120),  # stale
])
def test_kv_oom_runtime_stays_silent(scene: Any, n: int, now: float) -> None:
    assert kv_oom_runtime.evaluate(history_of(scene, n=n), kv_oom_runtime.Settings(), now) == []


def test_kv_oom_runtime_ignores_the_previous_engine_run() -> None:
    # The engine restarted 20 s ago: the drain before it belongs to another pool.
    scene = draining(rate=4.0, left_at_end=200)
    history = history_of(lambda i, t: {**scene(i, t), "uptime_s": max(0.0, t - (T0 - 20))})
    assert kv_oom_runtime.evaluate(history, kv_oom_runtime.Settings(), T0) == []


# -------------------------------------------------------------- swap_storm

STEPS = decode_steps(T0 - 600, T0, every=0.5, duration=lambda ctx, t: 0.04 if t > T0 - 60 else 0.02)
STORM = {
    "engine": {"max_num_seqs": 16},
    "blocks": {"counts": {"free": 4, "cached": 4, "filling": 16, "full": 1000}},
    "requests": {"running": 16},
    "swap": {"preemption_mode": "swap", "host_blocks": 2048, "swapped_blocks": 300, "swapped_seqs": 5,
             "window": {"window_s": 60.0, "swap_out": 480, "swap_in": 360, "allocations": 960,
                        "swap_out_per_s": 8.0, "swap_in_per_s": 6.0, "swap_rate": 0.5}},
}


def storm(swap_window: dict[str, Any] | None = None, steps: list[dict[str, Any]] = STEPS,
          **extra: Any) -> Any:
    def scene(i: int, t: float) -> dict[str, Any]:
        window = {**STORM["swap"]["window"], **(swap_window or {})}
        return {**STORM, "swap": {**STORM["swap"], "window": window}, "steps": steps_until(steps, t), **extra}

    return scene


def test_swap_storm_fires_on_rate_volume_and_latency() -> None:
    d = only(swap_storm.evaluate(history_of(storm(), n=121), swap_storm.Settings(), T0))
    assert d.rule == "swap_storm" and d.severity is Severity.WARNING
    e = d.evidence
    assert e["swap_rate"] == 0.5 and e["swap_out_per_s"] == 8.0 and e["swapped_seqs"] == 5
    assert e["decode_p95_ms_baseline"] == pytest.approx(20.0) and e["decode_p95_ms_recent"] == pytest.approx(40.0)
    assert e["latency_increase"] == pytest.approx(1.0)
    # Sequences grow as long as the steps' contexts (78 blocks, more than the 63.5 each holds now): 11 fit
    # in 90% of the pool.
    assert d.fix is not None and d.fix.params == {"max_num_seqs": 11}
    assert objectives(d) == [("swap_out_per_s", "lower", "")]


def test_swap_storm_is_critical_when_every_allocation_swaps() -> None:
    d = only(swap_storm.evaluate(history_of(storm({"swap_rate": 1.2}), n=121), swap_storm.Settings(), T0))
    assert d.severity is Severity.CRITICAL


@pytest.mark.parametrize("scene", [
    storm({"swap_rate": 0.19}),  # just under the rate threshold
    storm({"swap_out_per_s": 0.5}),  # a high rate on almost no volume
    storm({"allocations": 10}),  # too few allocations for a rate
    storm(steps=decode_steps(T0 - 600, T0, every=0.5)),  # decode steps as fast as before: no jump
    storm(uptime_s=50.0),  # no baseline before the storm: no evidence of a jump
    lambda i, t: {},  # healthy
])
def test_swap_storm_stays_silent(scene: Any) -> None:
    assert swap_storm.evaluate(history_of(scene, n=121), swap_storm.Settings(), T0) == []


def test_swap_storm_without_latency_requirement_fires_on_rate_alone() -> None:
    history = history_of(storm(uptime_s=50.0), n=121)
    d = only(swap_storm.evaluate(history, swap_storm.Settings(require_latency_jump=False), T0))
    assert d.evidence["latency_increase"] is None


# -------------------------------------------------------------- host_bound


def test_host_bound_fires_when_the_cpu_is_saturated_and_the_gpu_idles() -> None:
    history = history_of(lambda i, t: on_gpu(utilization=20.0, cpu_percent=98.0))
    d = only(host_bound.evaluate(history, host_bound.Settings(), T0))
    assert d.severity is Severity.WARNING
    assert d.evidence["cpu_percent"] == 98.0 and d.evidence["gpu_utilization_percent"] == 20.0
    assert d.evidence["cpu_saturated_percent"] == 90.0 and d.evidence["gpus"] == "NVIDIA H100"
    assert d.fix is not None and d.fix.kind is FixKind.REPORT and "graph capture" in d.fix.description


@pytest.mark.parametrize("scene, settings", [
    (lambda i, t: {"process": {"cpu_percent": 100.0}}, host_bound.Settings()),  # CPU engine, no GPU
    (lambda i, t: merged(on_gpu(20.0, 98.0), {"process": {"gpu_status": "NVML unavailable: install nvidia-ml-py",
                                                                   "gpus": []}}), host_bound.Settings()),
    (lambda i, t: on_gpu(utilization=80.0, cpu_percent=98.0), host_bound.Settings()),  # GPU busy
    (lambda i, t: on_gpu(utilization=20.0, cpu_percent=85.0), host_bound.Settings()),  # just under 90%
    (lambda i, t: on_gpu(utilization=20.0, cpu_percent=98.0), host_bound.Settings(cpu_cores=4)),
    (lambda i, t: merged(on_gpu(20.0, 98.0), {"requests": {"running": 0}}), host_bound.Settings()),  # no work
    # a MIG slice: NVML does not sample its utilization, which then reads 0 — not an idle GPU
    (lambda i, t: {"engine": {"device": "cuda:0"}, "process": {
        "cpu_percent": 98.0, "gpu_status": "ok", "gpus": [{**gpu(0.0), "utilization_known": False}]}},
     host_bound.Settings()),
])
def test_host_bound_stays_silent(scene: Any, settings: host_bound.Settings) -> None:
    assert host_bound.evaluate(history_of(scene), settings, T0) == []


def test_host_bound_needs_enough_samples() -> None:
    history = history_of(lambda i, t: on_gpu(utilization=20.0, cpu_percent=98.0), n=2)
    assert host_bound.evaluate(history, host_bound.Settings(), T0) == []


# ------------------------------------------------------------- engine_down


def test_engine_down_after_consecutive_failed_checks() -> None:
    history = with_health(EngineHistory(engine=ENGINE), [True, True, False, False, False])
    d = only(engine_down.evaluate(history, engine_down.Settings(), T0))
    assert d.severity is Severity.CRITICAL
    assert d.evidence["consecutive_failures"] == 3 and d.evidence["down_since"] == T0 - 10
    assert d.evidence["down_for_s"] == 10.0 and d.evidence["last_up_at"] == T0 - 15
    assert d.evidence["last_error"] == "connection refused"
    assert d.fix is not None and d.fix.kind is FixKind.REPORT and "backoff" in d.fix.description


def test_engine_down_of_a_watched_engine_says_kvops_cannot_restart_it() -> None:
    history = with_health(EngineHistory(engine=ENGINE, managed=False), [False] * 4)
    d = only(engine_down.evaluate(history, engine_down.Settings(), T0))
    assert d.evidence["last_up_at"] is None and d.evidence["consecutive_failures"] == 4
    assert d.fix is not None and "does not manage" in d.fix.description


@pytest.mark.parametrize("ups", [[True] * 5, [False, False, False, True], [False, False], []])
def test_engine_down_stays_silent(ups: list[bool]) -> None:
    assert engine_down.evaluate(with_health(EngineHistory(engine=ENGINE), ups), engine_down.Settings(), T0) == []


# -------------------------------------------------------------- crash_loop


def test_crash_loop_on_repeated_exits() -> None:
    history = with_exits(EngineHistory(engine=ENGINE, restarts_total=3), [T0 - 200, T0 - 100, T0 - 10],
                         stderr=[f"line {i}" for i in range(20)])
    d = only(crash_loop.evaluate(history, crash_loop.Settings(), T0))
    assert d.severity is Severity.CRITICAL
    assert d.evidence["exits_in_window"] == 3 and d.evidence["exit_codes"] == "1,1,1"
    assert d.evidence["last_exit_at"] == T0 - 10 and d.evidence["last_exit_code"] == 1
    assert d.evidence["last_stderr"] == "\n".join(f"line {i}" for i in range(10, 20))
    assert d.fix is not None and d.fix.kind is FixKind.REPORT


def test_crash_loop_reports_signals() -> None:
    history = with_exits(EngineHistory(engine=ENGINE), [T0 - 30, T0 - 20, T0 - 10], exit_code=None, signal=9)
    d = only(crash_loop.evaluate(history, crash_loop.Settings(), T0))
    assert d.evidence["signals"] == "9,9,9" and d.evidence["last_signal"] == 9 and "signal 9" in d.summary


def test_crash_loop_when_the_manager_gave_up() -> None:
    history = with_exits(EngineHistory(engine=ENGINE, crash_loop=True), [T0 - 3000])
    d = only(crash_loop.evaluate(history, crash_loop.Settings(), T0))
    assert d.evidence["crash_loop"] is True and d.evidence["last_exit_at"] == T0 - 3000
    assert d.fix is not None and "stopped restarting" in d.fix.description


@pytest.mark.parametrize("times, exit_code", [
    ([T0 - 100, T0 - 10], 1),  # two crashes: below three
    ([T0 - 700, T0 - 100, T0 - 10], 1),  # the first fell out of the window
    ([T0 - 30, T0 - 20, T0 - 10], 0),  # clean exits are requested stops
    ([], 1),
])
def test_crash_loop_stays_silent(times: list[float], exit_code: int) -> None:
    history = with_exits(EngineHistory(engine=ENGINE), times, exit_code=exit_code)
    assert crash_loop.evaluate(history, crash_loop.Settings(), T0) == []


def test_snapshot_builder_defaults_are_consistent() -> None:
    snap = snapshot()
    assert sum(v for k, v in snap.blocks.counts.items() if k != "swapped") == snap.engine.num_blocks
    assert snap.engine.kv_cache_bytes == snap.engine.num_blocks * BLOCK_BYTES
