"""The measures of a window of snapshots (kvops.supervisor.fixes.measures) and the verdict on a fix from its outcome
(kvops.supervisor.fixes.judge), on synthetic windows whose numbers are known."""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvops.rules as rules_pkg
from kvops.schema.diagnosis import Objective
from kvops.schema.snapshot import Snapshot
from kvops.schema.verdict import VerdictKind
from kvops.supervisor.fixes.judge import JudgeSettings, judge
from kvops.supervisor.fixes.measures import MEASURES, measure, split
from tests.helpers.synthetic import T0, decode_steps, history_of, merged, steps_until

EVERY = 5.0
N = 13  # 12 intervals of 5 s: a 60 s window, 3 intervals per part

Rate = float | Callable[[int], float]  # a counter's increase per interval (the i-th interval ends at snapshot i)


def cumulative(rate: Rate, i: int, base: float = 0.0) -> float:
    return base + sum(rate(j) if callable(rate) else rate for j in range(1, i + 1))


def traffic_scene(hits: Rate = 300, queries: Rate = 1000, finished: Rate = 3, aborted: Rate = 0, gen: Rate = 400,
                  ttft_sum: Rate = 0.6, ttft_count: Rate = 3, preemptions: Rate = 0,
                  **extra: Any) -> Callable[[int, float], dict[str, Any]]:
    """Counters growing by the given amount per interval; `extra` overrides merged in."""

    def scene(i: int, t: float) -> dict[str, Any]:
        return merged({
            "prefix_cache": {"queries_total": round(cumulative(queries, i, 100_000)),
                             "hits_total": round(cumulative(hits, i, 50_000))},
            "requests": {"finished_total": round(cumulative(finished, i, 1000)),
                         "aborted_total": round(cumulative(aborted, i)),
                         "generation_tokens_total": round(cumulative(gen, i, 64_000)),
                         "preemptions_total": round(cumulative(preemptions, i)),
                         "ttft_seconds_sum": cumulative(ttft_sum, i), "ttft_count": round(cumulative(ttft_count, i))},
        }, extra)

    return scene


def window(scene: Callable[[int, float], dict[str, Any]], end: float = T0, n: int = N) -> list[Snapshot]:
    return history_of(scene, n=n, every=EVERY, end=end).snapshots


BEFORE_END = T0 - 120.0


# ------------------------------------------------------------------ measures


def test_counter_measures_are_deltas_over_the_window() -> None:
    snaps = window(traffic_scene(hits=300, queries=1000, finished=3, aborted=1, gen=400, preemptions=5,
                                 ttft_sum=1.0, ttft_count=4))
    assert measure("hit_rate", snaps).value == pytest.approx(0.3)  # not the lifetime 0.5 of the base counters
    assert measure("hit_rate", snaps).parts == pytest.approx((0.3,) * 4)
    assert measure("preemptions_per_s", snaps).value == pytest.approx(1.0)
    assert measure("throughput_tokens_per_s", snaps).value == pytest.approx(80.0)
    assert measure("ttft_mean_s", snaps).value == pytest.approx(0.25)
    assert measure("error_share", snaps).value == pytest.approx(0.25)
    assert measure("hit_rate", snaps).traffic == 12 * 4  # finished + aborted


def test_a_restart_is_not_spanned() -> None:
    restart = T0 - 32.0  # between snapshot 6 (T0 - 30) and snapshot 5 (T0 - 35)

    def scene(i: int, t: float) -> dict[str, Any]:
        if t < restart:
            return {"requests": {"generation_tokens_total": 64_000 + 100 * i}}
        # The new run's counters start from 0 (100 tokens by its first snapshot, 2 s after the start).
        return {"engine": {"started_at": restart}, "uptime_s": t - restart,
                "requests": {"generation_tokens_total": 100 * (i - 5)}}

    snaps = window(scene)
    # 5 intervals of the old run and 6 of the new one, 100 tokens each, over 55 s: the pair across the
    # restart (its 64,500 -> 100 drop and its 5 s) counts for nothing.
    assert measure("throughput_tokens_per_s", snaps).value == pytest.approx(1100 / 55)


def test_a_falling_counter_counts_from_its_reset_when_the_start_is_unknown() -> None:
    def scene(i: int, t: float) -> dict[str, Any]:
        # A scrape without the process start: started_at is made up per snapshot (and marked unknown).
        made_up = {"unknown": ["uptime_s"], "engine": {"started_at": t - 3600}, "uptime_s": 3600.0}
        return merged(made_up, {"requests": {"preemptions_total": 50 + 5 * i if i < 6 else 5 * (i - 6)}})

    snaps = window(scene)
    assert measure("preemptions_per_s", snaps).value == pytest.approx((5 * 5 + 0 + 6 * 5) / 60)


def test_tenant_measures_take_the_subject() -> None:
    def scene(i: int, t: float) -> dict[str, Any]:
        return {"tenants": {
            "x": {"prompt_tokens_total": 500 * i, "hit_tokens_total": 0, "evictions_caused": 10 * i},
            "a": {"prompt_tokens_total": 100 * i, "hit_tokens_total": 50 * i, "evictions_caused": 1 * i},
            "b": {"prompt_tokens_total": 100 * i, "hit_tokens_total": 30 * i}}}

    snaps = window(scene)
    assert measure("victims_hit_rate", snaps, "x").value == pytest.approx(80 / 200)  # x's own prompts left out
    assert measure("victims_hit_rate", snaps, "a").value == pytest.approx(30 / 600)
    assert measure("evictions_caused_per_s", snaps, "x").value == pytest.approx(2.0)
    assert measure("evictions_caused_per_s", snaps, "a").value == pytest.approx(0.2)
    unknown = window(lambda i, t: merged(scene(i, t), {"unknown": ["tenants"]}))
    assert measure("victims_hit_rate", unknown, "x").value is None


def test_gauge_and_step_measures() -> None:
    steps = decode_steps(T0 - 120, T0, every=0.5, duration=lambda ctx, t: 0.030 if t < T0 - 60 else 0.020)
    usages = [0.5, 0.9, 0.7] * 5

    def scene(i: int, t: float) -> dict[str, Any]:
        return {"steps": steps_until(steps, t), "blocks": {"usage": usages[i], "allocated_slots": 100,
                                                            "used_slots": 80 if i % 2 else 60}}

    snaps = window(scene)
    assert measure("decode_step_ms", snaps).value == pytest.approx(20.0)  # the window's steps only
    assert measure("decode_step_ms", window(scene, end=T0 - 60)).value == pytest.approx(30.0)
    assert measure("slot_efficiency", snaps).value == pytest.approx((7 * 0.6 + 6 * 0.8) / 13)
    assert measure("kv_usage_max", snaps).value == 0.9
    # kv_oom_start's overcommit: 4 requests of 2048 tokens (128 blocks of 16) over 1024 blocks.
    assert measure("overcommit", snaps).value == pytest.approx(0.5)
    assert measure("overcommit", window(lambda i, t: {"engine": {"num_blocks": 256}})).value == pytest.approx(2.0)


def test_latency_means_come_from_the_histograms_where_a_server_reports_only_those() -> None:
    # vLLM and SGLang report TTFT and inter-token latency as histograms; `requests`' running sums stay 0.
    def histogram(total: float, count: int) -> dict[str, Any]:
        return {"buckets": [0.1, 1.0], "counts": [count, 0, 0], "sum": total, "count": count,
                "p50": None, "p95": None, "p99": None}

    snaps = window(lambda i, t: {"itl": histogram(0.04 * 100 * i, 100 * i), "ttft": histogram(0.5 * 3 * i, 3 * i)})
    assert measure("itl_mean_s", snaps).value == pytest.approx(0.04)
    assert measure("ttft_mean_s", snaps).value == pytest.approx(0.5)
    assert measure("itl_mean_s", window(traffic_scene())).value is None  # neither sums nor a histogram


def test_unreported_and_untrafficked_measures_are_none() -> None:
    unreported = window(traffic_scene(unknown=["swap", "requests.ttft_seconds_sum"]))
    assert measure("swap_out_per_s", unreported).value is None
    assert measure("swap_out_per_s", unreported).parts == ()
    assert measure("ttft_mean_s", unreported).value is None
    idle = window(traffic_scene(queries=0, hits=0, finished=0))
    assert measure("hit_rate", idle).value is None and measure("error_share", idle).value is None
    assert measure("hit_rate", idle).traffic == 0


def test_caching_off_is_a_hit_rate_of_zero() -> None:
    off = window(traffic_scene(queries=0, hits=0, engine={"enable_prefix_caching": False},
                               requests={"prompt_tokens_total": 0}))
    assert measure("hit_rate", off).value is None  # nothing prefilled either
    prefilled = window(lambda i, t: merged(traffic_scene(queries=0, hits=0)(i, t), {
        "engine": {"enable_prefix_caching": False}, "requests": {"prompt_tokens_total": 100_000 + 900 * i}}))
    assert measure("hit_rate", prefilled).value == 0.0


def test_parts_split_the_window_evenly() -> None:
    snaps = window(traffic_scene())
    pieces = split(snaps, 4)
    assert [len(p) for p in pieces] == [4, 4, 4, 4]
    assert all(a[-1] is b[0] for a, b in itertools.pairwise(pieces))  # boundaries shared
    assert set(MEASURES) >= {"hit_rate", "preemptions_per_s", "swap_out_per_s", "victims_hit_rate",
                             "evictions_caused_per_s", "throughput_tokens_per_s", "ttft_mean_s", "error_share",
                             "decode_step_ms", "slot_efficiency", "kv_usage_max", "overcommit", "itl_mean_s",
                             "waiting_mean"}
    assert MEASURES["hit_rate"](snaps, "").value == pytest.approx(0.3)


# ------------------------------------------------------------------ judge

HIT_RATE = [Objective(measure="hit_rate", better="higher")]


def test_improved_with_guards_held() -> None:
    verdict = judge(HIT_RATE, window(traffic_scene(hits=300), BEFORE_END), window(traffic_scene(hits=600)))
    assert verdict.kind is VerdictKind.IMPROVED
    change = verdict.objectives[0]
    assert (change.before, change.after, change.ok) == (pytest.approx(0.3), pytest.approx(0.6), True)
    assert [g.measure for g in verdict.guards] == ["throughput_tokens_per_s", "ttft_mean_s", "error_share"]
    assert all(g.ok for g in verdict.guards)
    assert verdict.traffic_before == verdict.traffic_after == 36
    assert verdict.before_window == (BEFORE_END - 60, BEFORE_END) and verdict.after_window == (T0 - 60, T0)
    assert verdict.message.startswith("hit_rate rose from 0.3 to 0.6 (+100%, noise ±0, needed +10%); guards held:")
    assert "throughput 80→80 tok/s" in verdict.message and "errors 0%→0%" in verdict.message


def test_a_change_within_the_noise_is_no_effect() -> None:
    # Before: the hit rate swings 0.2 / 0.4 from one sub-window to the next (0.3 over the window).
    swinging = traffic_scene(hits=lambda j: 200 if (j - 1) // 3 % 2 == 0 else 400)
    before = window(swinging, BEFORE_END)
    parts = measure("hit_rate", before).parts
    assert parts == pytest.approx((0.2, 0.4, 0.2, 0.4))
    # After: 0.36, +20%: above the 10% asked for, inside 2 standard deviations of the parts.
    verdict = judge(HIT_RATE, before, window(traffic_scene(hits=360)))
    assert verdict.kind is VerdictKind.NO_EFFECT
    assert verdict.objectives[0].noise == pytest.approx(2 * statistics.stdev(parts))
    assert verdict.objectives[0].ok is False
    assert judge(HIT_RATE, before, window(traffic_scene(hits=360)), JudgeSettings(noise_k=0)).kind \
        is VerdictKind.IMPROVED


def test_too_small_an_effect_is_no_effect() -> None:
    verdict = judge(HIT_RATE, window(traffic_scene(hits=300), BEFORE_END), window(traffic_scene(hits=320)))
    assert verdict.kind is VerdictKind.NO_EFFECT  # +6.7%, 10% needed


def test_an_objective_moving_the_wrong_way_is_worse() -> None:
    verdict = judge(HIT_RATE, window(traffic_scene(hits=300), BEFORE_END), window(traffic_scene(hits=150)))
    assert verdict.kind is VerdictKind.WORSE and verdict.objectives[0].ok is False


def test_a_broken_guard_is_worse() -> None:
    # The hit rate doubles, but throughput falls 30%: beyond the 10% tolerated.
    verdict = judge(HIT_RATE, window(traffic_scene(hits=300, gen=400), BEFORE_END),
                    window(traffic_scene(hits=600, gen=280)))
    assert verdict.kind is VerdictKind.WORSE
    assert verdict.objectives[0].ok is True
    throughput = verdict.guards[0]
    assert throughput.measure == "throughput_tokens_per_s" and throughput.ok is False
    assert "guard broke: throughput 80→56 tok/s" in verdict.message
    # 5% slower is within the tolerance.
    assert judge(HIT_RATE, window(traffic_scene(hits=300, gen=400), BEFORE_END),
                 window(traffic_scene(hits=600, gen=380))).kind is VerdictKind.IMPROVED


def paced(gen: Rate, itl_s: float, waiting: int = 0, **counters: Any) -> Callable[[int, float], dict[str, Any]]:
    """traffic_scene, with `itl_s` seconds between a request's tokens and `waiting` requests queued."""
    base = traffic_scene(gen=gen, **counters)

    def scene(i: int, t: float) -> dict[str, Any]:
        tokens = cumulative(gen, i)
        return merged(base(i, t), {"requests": {"waiting": waiting, "itl_seconds_sum": itl_s * tokens,
                                                "itl_count": round(tokens)}})

    return scene


def test_a_throughput_fall_with_less_traffic_is_no_slowdown() -> None:
    # Open-loop traffic dips after the fix: 2 requests per interval instead of 3, 240 tokens instead of 400 (-40%).
    # Nothing waited and each token took as long as before: the engine generated what was asked of it.
    before = window(paced(gen=400, itl_s=0.05, hits=300, finished=3), BEFORE_END)
    after = window(paced(gen=240, itl_s=0.048, hits=600, finished=2))
    assert measure("itl_mean_s", before).value == pytest.approx(0.05)
    assert measure("waiting_mean", window(paced(gen=240, itl_s=0.05, waiting=2))).value == 2
    verdict = judge(HIT_RATE, before, after)
    assert verdict.kind is VerdictKind.IMPROVED
    throughput = verdict.guards[0]
    assert (throughput.before, throughput.after, throughput.ok) == (pytest.approx(80), pytest.approx(48), True)
    assert throughput.note == "demand fell: 0 requests waiting on average after the fix, 50→48 ms between tokens"
    assert "guards held: throughput 80→48 tok/s (demand fell: " in verdict.message


@pytest.mark.parametrize(("waiting", "itl_after"), [(2, 0.05), (0, 0.07)], ids=["requests-waited", "tokens-slower"])
def test_a_throughput_fall_with_a_queue_or_slower_tokens_breaks_the_guard(waiting: int, itl_after: float) -> None:
    before = window(paced(gen=400, itl_s=0.05, hits=300, finished=3), BEFORE_END)
    after = window(paced(gen=240, itl_s=itl_after, waiting=waiting, hits=600, finished=2))
    verdict = judge(HIT_RATE, before, after)
    assert verdict.kind is VerdictKind.WORSE
    assert verdict.guards[0].ok is False and verdict.guards[0].note == ""
    assert "guard broke: throughput 80→48 tok/s" in verdict.message


def test_a_throughput_fall_counts_where_the_source_reports_no_token_latency() -> None:
    before = window(traffic_scene(hits=300, gen=400), BEFORE_END)
    after = window(traffic_scene(hits=600, gen=240, finished=2))  # no inter-token latency: cannot tell demand
    assert measure("itl_mean_s", after).value is None
    assert judge(HIT_RATE, before, after).kind is VerdictKind.WORSE


def test_the_error_guard_is_absolute() -> None:
    before = window(traffic_scene(hits=300, finished=99, aborted=1), BEFORE_END)  # 1% errors
    assert judge(HIT_RATE, before, window(traffic_scene(hits=600, finished=97, aborted=3))).kind \
        is VerdictKind.IMPROVED  # 3%: +2 points, within 5
    assert judge(HIT_RATE, before, window(traffic_scene(hits=600, finished=90, aborted=10))).kind is VerdictKind.WORSE


def test_too_little_traffic_is_inconclusive() -> None:
    verdict = judge(HIT_RATE, window(traffic_scene(hits=300), BEFORE_END),
                    window(traffic_scene(hits=600, finished=1)))  # 12 requests ended after
    assert verdict.kind is VerdictKind.INCONCLUSIVE and verdict.traffic_after == 12
    assert "too little traffic" in verdict.message and "20 needed" in verdict.message
    assert judge(HIT_RATE, window(traffic_scene(hits=300), BEFORE_END), window(traffic_scene(hits=600, finished=1)),
                 JudgeSettings(min_traffic=10)).kind is VerdictKind.IMPROVED


def test_an_unmeasurable_objective_is_inconclusive() -> None:
    swaps = [Objective(measure="swap_out_per_s", better="lower")]
    verdict = judge(swaps, window(traffic_scene(unknown=["swap"]), BEFORE_END), window(traffic_scene()))
    assert verdict.kind is VerdictKind.INCONCLUSIVE and verdict.message == "swap_out_per_s not measurable before"
    unknown = judge([Objective(measure="no_such_measure", better="lower")], window(traffic_scene(), BEFORE_END),
                    window(traffic_scene()))
    assert unknown.kind is VerdictKind.INCONCLUSIVE
    empty = judge([], window(traffic_scene(), BEFORE_END), window(traffic_scene()))
    assert empty.kind is VerdictKind.INCONCLUSIVE and empty.message == "no measurable objective"


def test_min_effect_is_absolute_from_zero() -> None:
    objective = [Objective(measure="hit_rate", better="higher", min_effect=0.05)]
    before = window(traffic_scene(hits=0), BEFORE_END)
    assert measure("hit_rate", before).value == 0.0
    small = judge(objective, before, window(traffic_scene(hits=40)))  # +0.04
    assert small.kind is VerdictKind.NO_EFFECT
    big = judge(objective, before, window(traffic_scene(hits=80)))  # +0.08
    assert big.kind is VerdictKind.IMPROVED
    assert "needed +0.05" in big.message


def test_lower_is_better_and_per_tenant_objectives() -> None:
    def tenants(caused: int, victim_hits: int) -> Callable[[int, float], dict[str, Any]]:
        def scene(i: int, t: float) -> dict[str, Any]:
            return merged(traffic_scene()(i, t), {"tenants": {
                "x": {"prompt_tokens_total": 500 * i, "evictions_caused": caused * i},
                "a": {"prompt_tokens_total": 100 * i, "hit_tokens_total": victim_hits * i}}})

        return scene

    objectives = [Objective(measure="victims_hit_rate", better="higher", subject="x"),
                  Objective(measure="evictions_caused_per_s", better="lower", min_effect=0.5, subject="x")]
    verdict = judge(objectives, window(tenants(20, 10), BEFORE_END), window(tenants(2, 60)))
    assert verdict.kind is VerdictKind.IMPROVED, verdict.message
    assert [c.subject for c in verdict.objectives] == ["x", "x"]
    assert "victims_hit_rate[x] rose from 0.1 to 0.6" in verdict.message
    # The evictions stopped but the others' hit rate did not recover: not every objective improved.
    assert judge(objectives, window(tenants(20, 10), BEFORE_END), window(tenants(2, 10))).kind \
        is VerdictKind.NO_EFFECT



def test_every_rules_objectives_name_a_measure() -> None:
    sources = (Path(rules_pkg.__file__).parent).glob("*.py")
    named = {name for source in sources for name in re.findall(r'Objective\(measure="(\w+)"', source.read_text())}
    assert named and named <= set(MEASURES)
