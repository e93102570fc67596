"""The engine's Prometheus exposition: values equal the snapshot, naming conventions, docs/metrics.md in sync.

Pure Python: snapshots are built by hand, no model is loaded.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvops.engine.serving.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, EngineMetrics
from kvops.schema.snapshot import (
    BLOCK_STATE_CODES,
    BlockStats,
    EngineInfo,
    GpuStats,
    Histogram,
    PrefixCacheStats,
    ProcessStats,
    RequestStats,
    Snapshot,
    StepSample,
    SwapStats,
    TenantStats,
    encode_block_map,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def make_snapshot(*, gpus: bool = True) -> Snapshot:
    """A realistic snapshot of a small engine serving two tenants, one of which pollutes the other's cache."""
    counts = {"free": 40, "filling": 3, "full": 9, "cached": 10, "pending_free": 2, "swapped": 0}
    codes = "F" * 9 + "f" * 3 + "c" * 10 + "p" * 2 + "." * 40
    return Snapshot(
        time=1_700_000_100.0,
        uptime_s=100.0,
        engine=EngineInfo(
            model="SmolLM2-135M-Instruct", engine_version="0.1.0", pid=4242, started_at=1_700_000_000.5,
            device="cpu", dtype="float32", kv_cache_dtype="int8", block_size=16, num_blocks=64,
            max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512, kv_cache_bytes=64 * 16 * 46080,
            bytes_per_token=46080, enable_prefix_caching=True, eviction_policy="lru",
        ),
        blocks=BlockStats(counts=counts, usage=12 / 64, state_map=encode_block_map(codes),
                          allocated_slots=12 * 16, used_slots=12 * 16 - 21),
        prefix_cache=PrefixCacheStats(queries_total=5000, hits_total=3200, hit_rate=0.64, window_s=60.0,
                                      window_queries=800, window_hits=400, window_hit_rate=0.5, evictions_total=17),
        requests=RequestStats(running=3, waiting=2, finished_total=40, aborted_total=1, preemptions_total=4,
                              prompt_tokens_total=5000, generation_tokens_total=2560),
        prompt_lengths=Histogram(buckets=[16, 32, 64, 128], counts=[1, 10, 30, 4, 0], sum=2600.0, count=45,
                                 p50=40.0, p95=90.0, p99=120.0),
        steps=[StepSample(t=1_700_000_099.0 + i * 0.05, duration_s=0.05, num_seqs=3, num_tokens=3, decode_only=True,
                          max_context_len=80 + i) for i in range(5)],
        swap=SwapStats(swapped_blocks=5, swap_out_total=30, swap_in_total=25),
        tenants={
            "alice": TenantStats(requests_total=30, prompt_tokens_total=4000, hit_tokens_total=3000, hit_rate=0.75,
                                 blocks_held=8, evictions_caused=0, evictions_suffered=12),
            "bob": TenantStats(requests_total=15, prompt_tokens_total=1000, hit_tokens_total=200, hit_rate=0.2,
                               blocks_held=4, evictions_caused=12, evictions_suffered=0),
        },
        process=ProcessStats(
            cpu_percent=185.0, rss_bytes=734_003_200, num_threads=9, torch_threads=2, others_busy_cpus=0.25,
            gpus=[GpuStats(index=0, name="NVIDIA H200", memory_used_bytes=10 * 2**30,
                           memory_total_bytes=141 * 2**30, memory_free_bytes=131 * 2**30,
                           memory_kvops_bytes=8 * 2**30, memory_others_bytes=2 * 2**30, memory_kvops_source="nvml",
                           utilization_percent=37.0, engine_device=True)] if gpus else [],
            gpu_status="ok" if gpus else "no GPU: the engine runs on cpu",
        ),
    )


def scrape(metrics: EngineMetrics) -> tuple[str, dict[str, list[Sample]]]:
    body, content_type = metrics.render()
    assert content_type == CONTENT_TYPE_LATEST and content_type.startswith("text/plain;")
    text = body.decode()
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return text, samples


def value(samples: dict[str, list[Sample]], metric: str, /, **labels: str) -> float:
    matching = [s.value for s in samples.get(metric, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, f"{metric}{labels}: {len(matching)} samples"
    return matching[0]


def exported_names(text: str) -> dict[str, str]:
    """Metric name -> type, from the `# TYPE` lines (counters carry `_total`, histograms their base name)."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))


def observed_metrics(snapshot_fn: object = None) -> EngineMetrics:
    snap = make_snapshot()
    metrics = EngineMetrics(snapshot_fn if callable(snapshot_fn) else (lambda: snap))
    metrics.observe_request_finished("alice", prompt_tokens=37, generation_tokens=64, finish_reason="length")
    metrics.observe_request_finished("alice", prompt_tokens=3, generation_tokens=1, finish_reason="stop")
    metrics.observe_request_finished("bob", prompt_tokens=1500, generation_tokens=10, finish_reason="abort")
    metrics.observe_time_to_first_token("alice", 0.3)
    metrics.observe_inter_token_latency("alice", 0.045)
    metrics.observe_inter_token_latency("alice", 0.055)
    metrics.observe_e2e_latency("bob", 75.0)
    return metrics


def test_snapshot_values_equal_the_snapshot() -> None:
    snap = make_snapshot()
    _, samples = scrape(EngineMetrics(lambda: snap))

    for state in BLOCK_STATE_CODES:
        assert value(samples, "kvops_kv_blocks", state=state) == snap.blocks.counts[state]
    assert sum(s.value for s in samples["kvops_kv_blocks"]) == value(samples, "kvops_kv_pool_blocks") == 64
    assert value(samples, "kvops_kv_cache_usage_ratio") == pytest.approx(12 / 64)
    assert value(samples, "kvops_kv_cache_bytes") == snap.engine.kv_cache_bytes
    assert value(samples, "kvops_kv_bytes_per_token") == 46080
    assert value(samples, "kvops_kv_allocated_slots") == 192
    assert value(samples, "kvops_kv_used_slots") == 171

    assert value(samples, "kvops_prefix_cache_queries_total") == 5000
    assert value(samples, "kvops_prefix_cache_hits_total") == 3200
    assert value(samples, "kvops_prefix_cache_evictions_total") == 17
    assert value(samples, "kvops_num_preemptions_total") == 4
    assert value(samples, "kvops_num_requests_running") == 3
    assert value(samples, "kvops_num_requests_waiting") == 2
    assert value(samples, "kvops_prompt_tokens_total") == 5000
    assert value(samples, "kvops_generation_tokens_total") == 2560
    assert value(samples, "kvops_requests_aborted_total") == 1
    assert value(samples, "kvops_swapped_blocks") == 5
    assert value(samples, "kvops_swap_out_blocks_total") == 30
    assert value(samples, "kvops_swap_in_blocks_total") == 25

    for tenant, stats in snap.tenants.items():
        assert value(samples, "kvops_tenant_blocks", tenant=tenant) == stats.blocks_held
        assert value(samples, "kvops_tenant_requests_total", tenant=tenant) == stats.requests_total
        assert value(samples, "kvops_tenant_prompt_tokens_total", tenant=tenant) == stats.prompt_tokens_total
        assert value(samples, "kvops_tenant_prefix_hit_tokens_total", tenant=tenant) == stats.hit_tokens_total
        assert value(samples, "kvops_tenant_cross_evictions_caused_total", tenant=tenant) == stats.evictions_caused
        assert value(samples, "kvops_tenant_cross_evictions_suffered_total", tenant=tenant) == stats.evictions_suffered
    assert {s.labels["tenant"] for s in samples["kvops_tenant_blocks"]} == {"alice", "bob"}

    assert value(samples, "kvops_process_resident_memory_bytes") == 734_003_200
    assert value(samples, "kvops_process_cpu_usage_ratio") == pytest.approx(1.85)
    assert value(samples, "kvops_process_threads") == 9
    assert value(samples, "kvops_engine_torch_threads") == 2
    assert value(samples, "kvops_engine_others_busy_cpus") == 0.25
    assert value(samples, "kvops_gpu_memory_used_bytes", gpu="0", name="NVIDIA H200") == 10 * 2**30
    assert value(samples, "kvops_gpu_memory_total_bytes", gpu="0") == 141 * 2**30
    assert value(samples, "kvops_gpu_utilization_ratio", gpu="0") == pytest.approx(0.37)
    assert value(samples, "kvops_gpu_memory_free_bytes", gpu="0") == 131 * 2**30
    assert value(samples, "kvops_gpu_memory_used_by_kvops_bytes", gpu="0") == 8 * 2**30
    assert value(samples, "kvops_gpu_memory_used_by_others_bytes", gpu="0") == 2 * 2**30
    assert value(samples, "kvops_gpu_engine_device", gpu="0") == 1
    assert value(samples, "kvops_gpu_status_info", status="ok") == 1

    [info] = samples["kvops_engine_info"]
    assert info.value == 1
    assert info.labels == {"model": "SmolLM2-135M-Instruct", "block_size": "16", "kv_cache_dtype": "int8",
                           "dtype": "float32", "eviction_policy": "lru", "device": "cpu", "version": "0.1.0"}
    assert value(samples, "kvops_engine_start_time_seconds") == 1_700_000_000.5
    assert value(samples, "kvops_engine_max_model_len") == 1024
    assert value(samples, "kvops_engine_max_num_seqs") == 8
    assert value(samples, "kvops_engine_max_num_batched_tokens") == 512
    assert value(samples, "kvops_prefix_caching_enabled") == 1


def test_scrapes_follow_the_latest_snapshot() -> None:
    snap = make_snapshot()
    metrics = EngineMetrics(lambda: snap)
    _, before = scrape(metrics)
    snap = snap.model_copy(deep=True)
    snap.blocks.counts.update(free=39, filling=4)
    snap.prefix_cache.hits_total += 16
    snap.tenants["carol"] = TenantStats(requests_total=1, prompt_tokens_total=20)
    snap.engine.eviction_policy = "lfu"
    _, after = scrape(metrics)
    assert value(before, "kvops_kv_blocks", state="free") == 40
    assert value(after, "kvops_kv_blocks", state="free") == 39
    assert value(after, "kvops_prefix_cache_hits_total") == 3216
    assert value(after, "kvops_tenant_prompt_tokens_total", tenant="carol") == 20
    assert [s.labels["eviction_policy"] for s in after["kvops_engine_info"]] == ["lfu"]


def test_missing_states_and_no_gpu() -> None:
    snap = make_snapshot(gpus=False)
    snap.blocks.counts = {"free": 60, "full": 4}  # an older engine that only reports some states
    _, samples = scrape(EngineMetrics(lambda: snap))
    assert {s.labels["state"]: s.value for s in samples["kvops_kv_blocks"]} == {
        "free": 60, "filling": 0, "full": 4, "cached": 0, "pending_free": 0, "swapped": 0,
    }
    assert not [name for name in samples if name.startswith("kvops_gpu_") and name != "kvops_gpu_status_info"]
    assert value(samples, "kvops_gpu_status_info", status="no GPU: the engine runs on cpu") == 1


def test_event_histograms_and_counter() -> None:
    _, samples = scrape(observed_metrics())

    def bucket(name: str, tenant: str, le: str) -> float:
        return value(samples, f"{name}_bucket", tenant=tenant, le=le)

    assert value(samples, "kvops_request_prompt_tokens_count", tenant="alice") == 2
    assert value(samples, "kvops_request_prompt_tokens_sum", tenant="alice") == 40
    assert bucket("kvops_request_prompt_tokens", "alice", "5.0") == 1
    assert bucket("kvops_request_prompt_tokens", "alice", "50.0") == 2
    assert bucket("kvops_request_prompt_tokens", "bob", "1000.0") == 0
    assert bucket("kvops_request_prompt_tokens", "bob", "2000.0") == 1
    assert bucket("kvops_request_generation_tokens", "alice", "1.0") == 1
    assert bucket("kvops_request_generation_tokens", "alice", "+Inf") == 2
    assert value(samples, "kvops_request_generation_tokens_sum", tenant="alice") == 65
    les = [s.labels["le"] for s in samples["kvops_request_prompt_tokens_bucket"] if s.labels["tenant"] == "bob"]
    assert les == [str(float(b)) for b in TOKEN_BUCKETS] + ["+Inf"]

    assert value(samples, "kvops_time_to_first_token_seconds_count", tenant="alice") == 1
    assert bucket("kvops_time_to_first_token_seconds", "alice", "0.2") == 0
    assert bucket("kvops_time_to_first_token_seconds", "alice", "0.3") == 1
    assert value(samples, "kvops_inter_token_latency_seconds_count", tenant="alice") == 2
    assert value(samples, "kvops_inter_token_latency_seconds_sum", tenant="alice") == pytest.approx(0.1)
    assert bucket("kvops_inter_token_latency_seconds", "alice", "0.04") == 0
    assert bucket("kvops_inter_token_latency_seconds", "alice", "0.06") == 2
    assert bucket("kvops_e2e_request_latency_seconds", "bob", "60.0") == 0
    assert bucket("kvops_e2e_request_latency_seconds", "bob", "120.0") == 1
    assert LATENCY_BUCKETS[0] == 0.001 and LATENCY_BUCKETS[-1] >= 60

    assert value(samples, "kvops_requests_finished_total", tenant="alice", finish_reason="length") == 1
    assert value(samples, "kvops_requests_finished_total", tenant="alice", finish_reason="stop") == 1
    assert value(samples, "kvops_requests_finished_total", tenant="bob", finish_reason="abort") == 1
    assert value(samples, "kvops_metrics_snapshot_errors_total") == 0


def test_naming_conventions() -> None:
    text, samples = scrape(observed_metrics())
    types = exported_names(text)
    assert all(name.startswith("kvops_") for name in types), sorted(types)
    assert all(name.startswith("kvops_") for name in samples)
    for name, kind in types.items():
        assert name.endswith("_total") == (kind == "counter"), (name, kind)
        assert not name.endswith("_created"), name
    assert "_created" not in text  # the client's creation timestamps are left out
    for name in types:
        if name.endswith("_ratio") and name != "kvops_process_cpu_usage_ratio":
            assert all(0 <= s.value <= 1 for s in samples[name]), name
    assert {kind for kind in types.values()} == {"counter", "gauge", "histogram"}


def test_private_registry() -> None:
    from prometheus_client import REGISTRY

    a, b = EngineMetrics(make_snapshot), EngineMetrics(make_snapshot)  # no duplicate-name clash between engines
    a.observe_time_to_first_token("alice", 0.1)
    _, samples_b = scrape(b)
    assert "kvops_time_to_first_token_seconds_count" not in samples_b
    assert REGISTRY.get_sample_value("kvops_time_to_first_token_seconds_count", {"tenant": "alice"}) is None


def test_failing_snapshot_still_scrapes() -> None:
    calls = 0

    def broken() -> Snapshot:
        nonlocal calls
        calls += 1
        raise ConnectionError("engine state unavailable")

    metrics = observed_metrics(broken)
    _, samples = scrape(metrics)
    assert calls == 1
    assert value(samples, "kvops_metrics_snapshot_errors_total") == 1
    assert value(samples, "kvops_requests_finished_total", tenant="bob", finish_reason="abort") == 1
    assert value(samples, "kvops_time_to_first_token_seconds_count", tenant="alice") == 1
    assert "kvops_kv_blocks" not in samples and "kvops_engine_info" not in samples
    _, samples = scrape(metrics)
    assert value(samples, "kvops_metrics_snapshot_errors_total") == 2


def test_malformed_snapshot_leaves_out_every_snapshot_family() -> None:
    snap = make_snapshot()
    snap.tenants["alice"].blocks_held = "many"  # type: ignore[assignment]  # pydantic does not validate assignment
    _, samples = scrape(EngineMetrics(lambda: snap))
    assert value(samples, "kvops_metrics_snapshot_errors_total") == 1
    assert "kvops_engine_info" not in samples and "kvops_tenant_blocks" not in samples


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not on PATH: `promtool check metrics` skipped")
def test_promtool_check_metrics() -> None:
    text, _ = scrape(observed_metrics())
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "", result.stdout  # lint warnings too


def engine_doc_lines() -> list[str]:
    """docs/metrics.md up to the supervisor's section (tests/test_exporter.py checks that one against
    the supervisor's exporter)."""
    return DOCS.read_text().split("\n## The supervisor's per-engine series")[0].splitlines()


def documented_names() -> set[str]:
    names = set()
    for line in engine_doc_lines():
        match = re.match(r"^\|\s*`(kvops_[a-z0-9_]+)`\s*\|", line)
        if match:
            names.add(match.group(1))
    return names


def test_docs_list_every_exported_metric() -> None:
    text, _ = scrape(observed_metrics())
    exported = set(exported_names(text))
    documented = documented_names()
    assert exported - documented == set(), "exported but not in docs/metrics.md"
    assert documented - exported == set(), "in docs/metrics.md but not exported"


def test_docs_types_match() -> None:
    text, _ = scrape(observed_metrics())
    types = exported_names(text)
    for line in engine_doc_lines():
        match = re.match(r"^\|\s*`(kvops_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|", line)
        if match:
            assert types[match.group(1)] == match.group(2), match.group(1)
