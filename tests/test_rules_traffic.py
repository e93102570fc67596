"""The traffic rules (queueing, no_prefix_hits, aborted_requests, latency_slo) as scenarios on synthetic
histories: each fires on its bad case with the right numbers, and stays quiet on the healthy case and on the
neighbouring rule's case."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvops.rules import aborted_requests, latency_slo, no_prefix_hits, prompt_variance, queueing
from kvops.schema.diagnosis import Diagnosis, FixKind, Severity
from tests.helpers.synthetic import T0, history_of, merged


def only(diagnoses: list[Diagnosis]) -> Diagnosis:
    assert len(diagnoses) == 1, diagnoses
    return diagnoses[0]


def histogram(per_snapshot: list[int], i: int, buckets: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0),
              mean: float = 1.2) -> dict[str, Any]:
    """A cumulative latency histogram after `i` snapshots that each added `per_snapshot` (per bucket)."""
    counts = [c * i for c in per_snapshot]
    return {"buckets": list(buckets), "counts": counts, "sum": mean * sum(counts), "count": sum(counts),
            "p50": None, "p95": None, "p99": None}


# Per snapshot: 10 first tokens in (0.5, 1] s, 10 in (1, 2] s. Over 24 intervals: 240 + 240, p50 1.0, p95 1.9.
TTFT = [0, 10, 10, 0, 0]


# ------------------------------------------------------------------ queueing


def queue(waiting: int = 3, running: int = 4, usage: float = 0.05, preempt: int = 0, **extra: Any) -> Any:
    def scene(i: int, t: float) -> dict[str, Any]:
        return merged({"requests": {"waiting": waiting, "running": running, "preemptions_total": preempt * i},
                       "blocks": {"usage": usage}, "ttft": histogram(TTFT, i)}, extra)
    return scene


def test_queueing_fires_at_the_concurrency_cap_with_room_in_the_pool() -> None:
    d = only(queueing.evaluate(history_of(queue()), queueing.Settings(), T0))
    assert d.rule == "queueing" and d.severity is Severity.WARNING
    ev = d.evidence
    assert ev["waiting"] == 3 and ev["running"] == 4 and ev["waiting_share"] == 1.0 and ev["kv_usage_max"] == 0.05
    assert ev["ttft_p50_s"] == pytest.approx(1.0) and ev["ttft_p95_s"] == pytest.approx(1.9)
    assert ev["ttft_count"] == 480 and ev["max_num_seqs"] == 4 and ev["at_concurrency_cap"] is True
    assert "max_num_seqs" in d.summary and d.fix is not None and d.fix.kind is FixKind.REPORT


def test_queueing_catches_the_sglang_backlog() -> None:
    # The published SGLang 0.4 scrape: 162 running, 2826 queued, KV 28%, mean TTFT ~214 s; no histogram here.
    def scene(i: int, t: float) -> dict[str, Any]:
        return {"source": "sglang", "unknown": ["engine.max_num_seqs", "requests.preemptions_total", "tenants"],
                "requests": {"running": 162, "waiting": 2826, "ttft_count": 10 * i, "ttft_seconds_sum": 2140.0 * i},
                "blocks": {"usage": 0.28}}

    d = only(queueing.evaluate(history_of(scene), queueing.Settings(), T0))
    assert d.severity is Severity.CRITICAL  # 2826 waiting >= 10 x 162 running, and TTFT >= 30 s
    assert d.evidence["ttft_mean_s"] == pytest.approx(214.0) and d.evidence["ttft_p95_s"] is None
    assert d.evidence["max_num_seqs"] is None and d.evidence["at_concurrency_cap"] is None
    assert d.evidence["preemptions"] is None and d.evidence["kv_usage"] == 0.28
    assert "--max-running-requests" in d.summary and "--chunked-prefill-size" in d.summary


def test_queueing_names_vllm_knobs_and_goes_critical_on_slow_first_tokens() -> None:
    slow = [0, 0, 0, 0, 20]  # every first token above the top bound: p95 reads 5 s
    history = history_of(lambda i, t: merged(queue(source="vllm")(i, t), {"ttft": histogram(slow, i)}))
    d = only(queueing.evaluate(history, queueing.Settings(critical_ttft_s=5.0), T0))
    assert d.severity is Severity.CRITICAL and "--max-num-batched-tokens" in d.summary


@pytest.mark.parametrize("scene", [
    lambda i, t: {},  # healthy: nothing waits
    queue(usage=0.95, preempt=1),  # the pool is full and preempting: kv_oom_runtime's case
    queue(usage=0.85),  # nearly full: KV-bound even before preempting
    queue(preempt=2),  # preemptions rising though usage reads low
    queue(waiting=1),  # one request waiting now and then: under the mean
    lambda i, t: queue()(i, t) if i % 2 else {},  # waiting in half the snapshots only
    queue(unknown=["requests.waiting"]),  # the server does not report its queue
])
def test_queueing_stays_quiet(scene: Any) -> None:
    assert queueing.evaluate(history_of(scene), queueing.Settings(), T0) == []


# ------------------------------------------------------------ no_prefix_hits


def lookups(queried: int = 1131, hit: int = 0, source: str = "vllm", caching: bool = True, p50: float = 64.0,
            mode: str = "off", shadow_hit: int = 0, **extra: Any) -> Any:
    """Over the 60 intervals of a history: `queried` prompt tokens looked up, `hit` of them hit; 60 requests."""
    def scene(i: int, t: float) -> dict[str, Any]:
        return merged({"source": source, "unknown": [] if source == "kvops" else ["tenants"],
                       "engine": {"enable_prefix_caching": caching},
                       "requests": {"finished_total": 1000 + i},
                       "prefix_cache": {"queries_total": 100_000 + round(queried * i / 60),
                                        "hits_total": 50_000 + round(hit * i / 60), "normalization": mode,
                                        "shadow_queries_total": round(queried * i / 60),
                                        "shadow_hits_total": round(shadow_hit * i / 60)},
                       "prompt_lengths": {"p50": p50}}, extra)
    return scene


def test_no_prefix_hits_fires_on_the_vllm_zero_hit_server() -> None:
    # vLLM 0.26 with prefix caching on: 0 hits over 1131 queried tokens.
    history = history_of(lookups(engine={"model": "Qwen/Qwen3-Next-80B-A3B-Instruct"}))
    d = only(no_prefix_hits.evaluate(history, no_prefix_hits.Settings(), T0))
    assert d.severity is Severity.WARNING and d.fix is not None and d.fix.kind is FixKind.REPORT
    ev = d.evidence
    assert ev["queried_tokens"] == 1131 and ev["hit_tokens"] == 0 and ev["hit_rate"] == 0.0
    assert ev["block_size"] == 16 and ev["prompt_tokens_p50"] == 64.0 and ev["short_prompts"] is False
    assert ev["hybrid_model_hint"] is True and "hybrid" in d.summary
    # One problem, one diagnosis: prompt_variance's low-hit-rate note yields to it.
    assert prompt_variance.evaluate(history_of(lookups(queried=3000)), prompt_variance.Settings(), T0) == []


def test_no_prefix_hits_says_when_prompts_are_shorter_than_a_block() -> None:
    d = only(no_prefix_hits.evaluate(history_of(lookups(p50=8.0)), no_prefix_hits.Settings(), T0))
    assert d.evidence["short_prompts"] is True and "shorter than one block of 16" in d.summary


def test_a_low_but_not_zero_hit_rate_stays_prompt_variances() -> None:
    scene = lookups(queried=3000, hit=60)  # 2%
    assert no_prefix_hits.evaluate(history_of(scene), no_prefix_hits.Settings(), T0) == []
    assert only(prompt_variance.evaluate(history_of(scene), prompt_variance.Settings(), T0)).severity is Severity.INFO


def test_no_prefix_hits_on_a_kvops_engine_once_normalization_cannot_help() -> None:
    for scene in (lookups(source="kvops", mode="on"), lookups(source="kvops", mode="shadow", shadow_hit=5)):
        d = only(no_prefix_hits.evaluate(history_of(scene), no_prefix_hits.Settings(), T0))
        assert d.evidence["queried_tokens"] == 1131


@pytest.mark.parametrize("scene", [
    lambda i, t: {},  # healthy: counters flat
    lookups(caching=False),  # caching off: prefix_caching_off's case
    lookups(queried=500),  # too few tokens looked up
    lookups(hit=100),  # ~9% hit: not "none"
    lookups(source="kvops"),  # normalization off: prompt_variance proposes measuring it
    lookups(source="kvops", mode="shadow", shadow_hit=600),  # shadow measured that normalization helps
    lookups(unknown=["prefix_cache.queries_total"]),
])
def test_no_prefix_hits_stays_quiet(scene: Any) -> None:
    assert no_prefix_hits.evaluate(history_of(scene), no_prefix_hits.Settings(), T0) == []


# ---------------------------------------------------------- aborted_requests


def ends(finished: int, aborted: int, source: str = "kvops", **extra: Any) -> Any:
    def scene(i: int, t: float) -> dict[str, Any]:
        return merged({"source": source, "requests": {"finished_total": 1000 + round(finished * i / 60),
                                                      "aborted_total": 10 + round(aborted * i / 60)}}, extra)
    return scene


def test_aborted_requests_fires_on_the_sglang_aborts() -> None:
    # SGLang 0.4.9: 157 aborted of 217 requests; the adapter takes the aborted ones out of num_requests_total,
    # so the snapshot says 60 finished, 157 aborted (tests/test_real_scrapes.py reads the real scrape).
    d = only(aborted_requests.evaluate(history_of(ends(60, 157, source="sglang")), aborted_requests.Settings(), T0))
    assert d.severity is Severity.CRITICAL
    assert d.evidence["aborted"] == 157 and d.evidence["ended"] == 217 and d.evidence["finished"] == 60
    assert d.evidence["aborted_share"] == pytest.approx(157 / 217, abs=1e-4) and "queueing" in d.summary


def test_aborted_requests_warns_on_a_kvops_engine() -> None:
    d = only(aborted_requests.evaluate(history_of(ends(60, 10)), aborted_requests.Settings(), T0))
    assert d.severity is Severity.WARNING and d.evidence["ended"] == 70
    assert d.evidence["aborted_share"] == pytest.approx(10 / 70, abs=1e-4)


@pytest.mark.parametrize("scene", [
    lambda i, t: {},  # healthy: nothing ends
    ends(60, 3),  # 5%
    ends(5, 5),  # half aborted, but only 10 ended
    ends(60, 30, unknown=["requests.aborted_total"]),  # not counted by the server
])
def test_aborted_requests_stays_quiet(scene: Any) -> None:
    assert aborted_requests.evaluate(history_of(scene), aborted_requests.Settings(), T0) == []


def abandons(finished: int, abandoned: int, dips: int = 0) -> Any:
    """vLLM 0.32: hang-ups are not aborts (its abort count stays 0) but show as requests with a first token and no
    end; `dips` requests waiting for their first token at every odd snapshot take the estimate down meanwhile."""
    def scene(i: int, t: float) -> dict[str, Any]:
        return {"source": "vllm", "requests": {"finished_total": 1000 + round(finished * i / 60), "aborted_total": 0,
                                               "abandoned_total": max(0, 50 + round(abandoned * i / 60)
                                                                      - (dips if i % 2 else 0))}}
    return scene


def test_abandoned_requests_count_as_aborted_and_are_named_apart() -> None:
    d = only(aborted_requests.evaluate(history_of(abandons(20, 40, dips=3)), aborted_requests.Settings(), T0))
    assert d.evidence["aborted"] == 40 and d.evidence["abandoned"] == 40 and d.evidence["ended"] == 60
    assert d.severity is Severity.CRITICAL and "40 of them abandoned" in d.summary and "vllm" in d.summary


def test_a_dipping_estimate_is_not_read_as_a_counter_reset() -> None:
    """The estimate's dips (requests waiting) would each add a whole value under Prometheus's increase."""
    assert aborted_requests.evaluate(history_of(abandons(60, 0, dips=5)), aborted_requests.Settings(), T0) == []


def test_aborted_requests_settings_are_ordered() -> None:
    with pytest.raises(ValidationError):
        aborted_requests.Settings(warning_share=0.6, critical_share=0.5)


# --------------------------------------------------------------- latency_slo


def latencies(ttft: list[int] = TTFT, itl: list[int] = (0, 0, 0, 0, 0)) -> Any:
    itl_buckets = (0.01, 0.05, 0.1, 0.5)
    return lambda i, t: {"ttft": histogram(ttft, i), "itl": histogram(list(itl), i, itl_buckets, 0.03)}


def test_latency_slo_fires_per_broken_metric() -> None:
    history = history_of(latencies(itl=[0, 100, 0, 0, 0]))  # ITL in (0.01, 0.05]: p95 0.048
    settings = latency_slo.Settings(window_s=120, ttft_slo_s=1.5, itl_slo_s=0.02)
    by_subject = {d.subject: d for d in latency_slo.evaluate(history, settings, T0)}
    ttft, itl = by_subject["ttft"], by_subject["itl"]
    assert ttft.severity is Severity.WARNING and itl.severity is Severity.CRITICAL  # 0.048 >= 2 x 0.02
    assert ttft.evidence["ttft_p50_s"] == pytest.approx(1.0) and ttft.evidence["ttft_p95_s"] == pytest.approx(1.9)
    assert ttft.evidence["slo_s"] == 1.5 and ttft.evidence["count"] == 480 and ttft.evidence["percentile"] == 95
    assert itl.evidence["itl_p95_s"] == pytest.approx(0.048) and itl.evidence["count"] == 2400


def test_latency_slo_critical_from_twice_the_slo_and_any_reported_percentile() -> None:
    history = history_of(latencies())
    d = only(latency_slo.evaluate(history, latency_slo.Settings(window_s=120, ttft_slo_s=0.9), T0))
    assert d.severity is Severity.CRITICAL  # 1.9 >= 2 x 0.9
    d = only(latency_slo.evaluate(history, latency_slo.Settings(window_s=120, ttft_slo_s=0.9, percentile=50), T0))
    assert d.severity is Severity.WARNING and d.evidence["value_s"] == pytest.approx(1.0)


@pytest.mark.parametrize("settings", [
    latency_slo.Settings(),  # no SLO: doctor shows the percentiles, nothing fires
    latency_slo.Settings(ttft_slo_s=2.0),  # p95 1.9 is within it
    latency_slo.Settings(ttft_slo_s=0.5, min_requests=10_000),  # too few first tokens
    latency_slo.Settings(itl_slo_s=0.01),  # no token gaps observed
])
def test_latency_slo_stays_quiet(settings: latency_slo.Settings) -> None:
    assert latency_slo.evaluate(history_of(latencies()), settings, T0) == []


def test_latency_slo_without_histograms_is_quiet() -> None:
    assert latency_slo.evaluate(history_of(), latency_slo.Settings(ttft_slo_s=0.1, itl_slo_s=0.01), T0) == []


def test_latency_slo_percentile_must_be_one_histograms_report() -> None:
    with pytest.raises(ValidationError):
        latency_slo.Settings(percentile=90)


# ------------------------------------------------------------------ KV-bound queueing (kv_oom_runtime's)


def full_pool(waiting: int, preemptions_per_snapshot: int = 0) -> Any:
    def scene(i: int, t: float) -> dict[str, Any]:
        return {"blocks": {"counts": {"free": 4, "filling": 20, "full": 1000, "cached": 0, "pending_free": 0,
                                      "swapped": 0}},
                "requests": {"running": 16, "waiting": waiting, "preemptions_total": preemptions_per_snapshot * i}}
    return scene


def test_a_full_pool_with_a_queue_is_kv_bound_queueing_not_queueing() -> None:
    from kvops.rules import kv_oom_runtime
    history = history_of(full_pool(waiting=9))
    d = only(kv_oom_runtime.evaluate(history, kv_oom_runtime.Settings(), T0))
    assert d.severity is Severity.WARNING and d.evidence["kv_bound_queueing"] is True
    assert "9 request(s) wait for KV blocks: KV-bound queueing" in d.summary
    assert queueing.evaluate(history, queueing.Settings(), T0) == []  # the pool has no room: not queueing's case
    # Preemptions on top: critical. No queue and no preemptions: a full pool that serves, silent.
    preempting = only(kv_oom_runtime.evaluate(history_of(full_pool(9, 1)), kv_oom_runtime.Settings(), T0))
    assert preempting.severity is Severity.CRITICAL
    assert kv_oom_runtime.evaluate(history_of(full_pool(waiting=0)), kv_oom_runtime.Settings(), T0) == []
