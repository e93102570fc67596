"""The read-only kinds, llama.cpp's server, TGI and TensorRT-LLM, on their published scrapes.

Each kind is one module of kvops.kinds. The scrapes are copied verbatim from public sources (their docs, issues
and pull requests; tests/fixtures/published/SOURCES.md names each one, its version and what was cut), across the
versions where names changed: llama.cpp before and after it dropped `llamacpp:kv_cache_usage_ratio`, Triton's
TensorRT-LLM backend before and after `request_type="waiting"` and `kv_cache_block_type="fraction"`, and
trtllm-serve's first, unprefixed names. No scrape of Hugging Face's own TGI was found; the TGI-format one is IBM's
vLLM adapter for TGIS, which exports TGI's names.

No runnable CPU build of these servers installs here without compiling (llama.cpp and TGI's router are C++ and
Rust builds, TensorRT-LLM needs an NVIDIA GPU), so there are no live tests: everything here reads saved scrapes.
Each test checks numbers against the file it reads, the fields the server does not report, and what
`kvops doctor --metrics-file` prints for it (exit 0 or 1, never 2: a scrape it cannot read).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvops.adapters.prometheus import Scrape
from kvops.cli import main
from kvops.kinds import PROFILES, detect, profile, snapshot_from_scrape
from kvops.kinds.profile import Capability, Remedy
from kvops.schema.snapshot import Snapshot
from kvops.supervisor.launchers import managed_kind

PUBLISHED = Path(__file__).resolve().parent / "fixtures" / "published"
READ_ONLY = ("llamacpp", "tgi", "tensorrt_llm")
FIXTURES = {
    "llamacpp-ik-2025-08-pr695-kv-cache-usage.txt": "llamacpp",
    "llamacpp-2025-02-pr11915-nan-busy-slots-excerpt.txt": "llamacpp",
    "llamacpp-2025-06-pr13196-no-kv-cache-excerpt.txt": "llamacpp",
    "tgi-format-ibm-vllm-tgis-pr18-excerpt.txt": "tgi",
    "tensorrt-llm-triton-23.12-readme-inflight-batcher.txt": "tensorrt_llm",
    "tensorrt-llm-triton-2025-readme-kv-fraction-disagg.txt": "tensorrt_llm",
    "trtllm-serve-2025-07-pr5785-unprefixed-ttft-excerpt.txt": "tensorrt_llm",
    "trtllm-serve-2026-03-aibrix2004-e2e-excerpt.txt": "tensorrt_llm",
    "trtllm-serve-2025-06-pr5560-pytrtllm-excerpt.txt": "tensorrt_llm",
    "trtllm-serve-2026-source-test-hit-rate-line.txt": "tensorrt_llm",
}


def scrape_of(name: str) -> Scrape:
    return Scrape.parse((PUBLISHED / name).read_text())


def read(name: str) -> Snapshot:
    return snapshot_from_scrape(FIXTURES[name], scrape_of(name), 1_700_000_000.0)


def doctor(name: str, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    code = main(["doctor", "--metrics-file", str(PUBLISHED / name), *flags])
    return code, capsys.readouterr().out


def line(text: str, title: str) -> str:
    found = [row for row in text.splitlines() if f"] {title}:" in row]
    assert found, (title, text)
    return found[0]


# ------------------------------------------------------------------ recognition and the profiles


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_each_scrape_is_recognised_as_its_kind_and_read_cleanly(name: str) -> None:
    scrape = scrape_of(name)
    assert scrape.damaged_lines == []  # the excerpts are cut at line boundaries
    found = detect(scrape)
    assert found is not None and found.kind == FIXTURES[name]
    assert found.kind not in ("vllm", "sglang", "kvops")
    snap = read(name)
    assert snap.source == FIXTURES[name]
    for names in snap.metrics_read.values():  # doctor -v names only metrics the scrape has
        for metric in names:
            assert scrape.has(metric.split("{")[0]) or scrape.has(f"{metric}_bucket"), (name, metric)
    assert "swap" in snap.unknown and "tenants" in snap.unknown and "requests.preemptions_total" in snap.unknown


def test_the_read_only_kinds_are_registered_and_claim_nothing_kvops_only() -> None:
    for kind in READ_ONLY:
        found = profile(kind)
        assert PROFILES[kind] is found and found.read_scrape is not None and managed_kind(kind) is None
        assert not any(found.can(capability) for capability in Capability)
        assert all(found.remedy(situation) for situation in Remedy)  # every remedy in the server's own words
        assert "{port}" in found.remedies[Remedy.START]
        for source in found.metrics.values():
            assert source.names and source.provided_by
    assert "--parallel" in profile("llamacpp").remedy(Remedy.QUEUEING)
    assert "--max-batch-total-tokens" in profile("tgi").remedy(Remedy.QUEUEING)
    assert "enable_block_reuse" in profile("tensorrt_llm").remedy(Remedy.PREFIX_CACHING_ON)


def test_the_existing_published_scrapes_keep_their_kind() -> None:
    # Adding three prefixes must not pull a vLLM or SGLang scrape over: each still reads as what it is.
    for path in sorted(PUBLISHED.glob("*.txt")):
        expected = path.name.split("-")[0]
        if expected in ("vllm", "sglang"):
            found = detect(Scrape.parse(path.read_text()))
            assert found is not None and found.kind == expected, path.name


def test_a_vllm_scrape_carrying_tgi_names_reads_as_vllm() -> None:
    # IBM's vLLM exports TGI's names beside its own `vllm:` ones (the TGI fixture is a cut of such a scrape):
    # with vLLM's series added, they outnumber TGI's and the scrape is vLLM's. The vLLM lines are a published
    # vLLM scrape, appended whole.
    mixed = ((PUBLISHED / "tgi-format-ibm-vllm-tgis-pr18-excerpt.txt").read_text()
             + (PUBLISHED / "vllm-0.10.0-v1-glm45-deprecated-gpu-prefix-excerpt.txt").read_text())
    scrape = Scrape.parse(mixed)
    assert sum(name.startswith("tgi_") for name in scrape.names) < sum(
        name.startswith("vllm:") for name in scrape.names)
    found = detect(scrape)
    assert found is not None and found.kind == "vllm"


# ------------------------------------------------------------------ llama.cpp


def test_llamacpp_with_kv_usage_reads_its_numbers() -> None:
    # ik_llama.cpp (a fork with llama.cpp's names), Aug 2025: KV usage 0.491063, 6886 prompt / 3469 generated tokens.
    snap = read("llamacpp-ik-2025-08-pr695-kv-cache-usage.txt")
    assert snap.blocks.usage == pytest.approx(0.491063)
    assert snap.requests.prompt_tokens_total == 6886 and snap.requests.generation_tokens_total == 3469
    assert snap.requests.running == 0 and snap.requests.waiting == 0
    # The seconds spent generating over the tokens generated: 3544.27 s / 3469 tokens.
    assert snap.requests.itl_seconds_sum == pytest.approx(3544.27) and snap.requests.itl_count == 3469
    assert snap.metrics_read["blocks.usage"] == ["llamacpp:kv_cache_usage_ratio"]
    for field in ("engine.num_blocks", "prefix_cache", "ttft", "itl", "requests.finished_total",
                  "requests.aborted_total", "prompt_lengths"):
        assert not snap.knows(field), field
    assert snap.knows("blocks") and snap.knows("requests.waiting")


def test_llamacpp_after_the_kv_gauges_were_dropped_says_so() -> None:
    # June 2025 (after PR #13660): no kv_cache_* series; the excerpt has the token counters only.
    snap = read("llamacpp-2025-06-pr13196-no-kv-cache-excerpt.txt")
    assert not snap.knows("blocks") and snap.blocks.usage == 0.0
    assert snap.requests.prompt_tokens_total == 143 and snap.requests.generation_tokens_total == 673
    assert snap.requests.itl_seconds_sum == pytest.approx(29.567) and snap.requests.itl_count == 673
    assert not snap.knows("requests.waiting") and not snap.knows("requests.running")  # cut before them


def test_llamacpp_nan_before_the_first_decode_is_not_a_number_kvops_uses() -> None:
    # Feb 2025: `llamacpp:n_busy_slots_per_decode -nan` before any generation (fixed by PR #11915).
    scrape = scrape_of("llamacpp-2025-02-pr11915-nan-busy-slots-excerpt.txt")
    # Typed `counter`, so the parser names its sample with `_total`.
    assert math.isnan(scrape.samples["llamacpp:n_busy_slots_per_decode_total"][0][1])
    snap = read("llamacpp-2025-02-pr11915-nan-busy-slots-excerpt.txt")
    assert snap.requests.prompt_tokens_total == 0 and snap.data_problems == []


def test_doctor_reads_llamacpp(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = doctor("llamacpp-ik-2025-08-pr695-kv-cache-usage.txt", capsys)
    assert code in (0, 1)
    assert "49.1% in use" in line(text, "KV cache usage")
    assert line(text, "Queueing").endswith("0 waiting, 0 running, KV usage 49%")
    assert "[-] Prefix cache hit rate" in text and "[-] Time to first token" in text
    code, text = doctor("llamacpp-2025-06-pr13196-no-kv-cache-excerpt.txt", capsys)
    assert code in (0, 1)
    assert "[-] KV cache usage" in text and "llamacpp:kv_cache_usage_ratio" in text  # what would report it
    assert "PR #13660" in text


# ------------------------------------------------------------------ TGI


def test_tgi_format_reads_queue_and_batch_and_nothing_else() -> None:
    snap = read("tgi-format-ibm-vllm-tgis-pr18-excerpt.txt")
    assert snap.requests.waiting == 0 and snap.requests.running == 0
    assert snap.metrics_read == {"requests.waiting": ["tgi_queue_size"], "requests.running": ["tgi_batch_current_size"]}
    for field in ("blocks", "engine.num_blocks", "ttft", "itl", "prompt_lengths", "prefix_cache",
                  "requests.finished_total", "requests.aborted_total", "requests.prompt_tokens_total"):
        assert not snap.knows(field), field


def test_tgi_failures_without_successes_stay_unknown() -> None:
    # The failure counter appears with the first failure: only beside a success counter is its absence a 0.
    snap = read("tgi-format-ibm-vllm-tgis-pr18-excerpt.txt")
    assert not snap.knows("requests.aborted_total") and not snap.knows("requests.finished_total")


def test_doctor_reads_tgi(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = doctor("tgi-format-ibm-vllm-tgis-pr18-excerpt.txt", capsys)
    assert code in (0, 1)
    assert line(text, "Queueing").endswith("0 waiting, 0 running")
    assert "[-] KV cache usage" in text and "[-] Inter-token latency" in text
    assert "tgi_request_mean_time_per_token_duration" in text


# ------------------------------------------------------------------ TensorRT-LLM


def test_triton_23_12_reads_blocks_and_requests() -> None:
    # Triton 23.12's README example: 1 of 6239 blocks used, 64 tokens a block, max 512 requests, 0 active.
    snap = read("tensorrt-llm-triton-23.12-readme-inflight-batcher.txt")
    assert snap.engine.num_blocks == 6239 and snap.engine.block_size == 64 and snap.engine.max_num_seqs == 512
    assert snap.blocks.counts["full"] == 1 and snap.blocks.counts["free"] == 6238
    assert snap.blocks.usage == pytest.approx(1 / 6239)
    assert snap.requests.running == 0
    assert snap.engine.model == "tensorrt_llm"  # Triton's model name: its `model` label
    assert not snap.knows("requests.waiting")  # request_type="waiting" came later
    for field in ("ttft", "itl", "requests.prompt_tokens_total", "prefix_cache", "requests.finished_total"):
        assert not snap.knows(field), field
    assert snap.data_problems == []


def test_triton_2025_reads_the_queue_and_flags_a_fraction_that_disagrees() -> None:
    # The 2025 README example adds request_type="waiting" (1) and kv_cache_block_type="fraction" (0.4875), whose
    # lines come from another run than used / max (1 / 6239): the blocks are read, the disagreement reported.
    snap = read("tensorrt-llm-triton-2025-readme-kv-fraction-disagg.txt")
    assert snap.requests.waiting == 1 and snap.requests.running == 0
    assert snap.blocks.usage == pytest.approx(1 / 6239)
    assert len(snap.data_problems) == 1 and "0.4875" in snap.data_problems[0]


def test_triton_base_metrics_count_the_tensorrt_llm_models_requests() -> None:
    # The same README's next block: Triton's own per-model counters, typed `counter` without `_total`. Alone they
    # could be any Triton backend's; beside the backend's block (the README shows the two from one endpoint) they
    # give the TensorRT-LLM model's finished and failed requests.
    base = (PUBLISHED / "tensorrt-llm-triton-23.12-readme-base-metrics.txt").read_text()
    assert detect(Scrape.parse(base)) is None
    both = (PUBLISHED / "tensorrt-llm-triton-23.12-readme-inflight-batcher.txt").read_text() + base
    snap = snapshot_from_scrape("tensorrt_llm", Scrape.parse(both), 1_700_000_000.0)
    assert snap.knows("requests.finished_total") and snap.knows("requests.aborted_total")
    assert snap.requests.finished_total == 0 and snap.requests.aborted_total == 0
    assert snap.metrics_read["requests.finished_total"] == ["nv_inference_request_success_total"]


def test_trtllm_serve_unprefixed_names_read_as_tensorrt_llm() -> None:
    # trtllm-serve's first Prometheus names (PR #5785): no prefix, `model_name="undefined"`.
    snap = read("trtllm-serve-2025-07-pr5785-unprefixed-ttft-excerpt.txt")
    assert snap.engine.model == "undefined"
    assert snap.ttft is not None and snap.ttft.count == 2 and snap.ttft.counts[0] == 2  # both at most 2.5 s
    assert snap.metrics_read["ttft"] == ["time_to_first_token_seconds"]
    assert any("time_to_first_token_seconds_sum" in problem for problem in snap.data_problems)  # cut before it
    assert not snap.knows("blocks") and not snap.knows("requests.waiting") and not snap.knows("itl")
    e2e = read("trtllm-serve-2026-03-aibrix2004-e2e-excerpt.txt")
    assert e2e.source == "tensorrt_llm" and not e2e.knows("ttft")  # end-to-end latency alone: nothing kvops reads


def test_trtllm_serve_pr5560_pytrtllm_names_read_as_tensorrt_llm(capsys: pytest.CaptureFixture[str]) -> None:
    # The PyTorch backend's `pytrtllm:` names (PR #5560, closed unmerged: a build of that branch, never a
    # release). Before: refused, no kind's names (doctor's exit code 2).
    snap = read("trtllm-serve-2025-06-pr5560-pytrtllm-excerpt.txt")
    assert snap.engine.model == "deepseek-ai/DeepSeek-V3-0324"
    requests = snap.requests
    assert (requests.running, requests.waiting) == (1, 0)
    assert (requests.prompt_tokens_total, requests.generation_tokens_total) == (201121, 81896)
    assert (requests.finished_total, requests.aborted_total) == (707, 0)  # 708 started: 707 + 1 running
    assert snap.metrics_read["requests.aborted_total"] == ["pytrtllm:request_cancelled_total",
                                                           "pytrtllm:request_failed_total"]
    assert not snap.knows("blocks") and not snap.knows("ttft") and not snap.knows("prefix_cache.hit_rate")
    for source in profile("tensorrt_llm").metrics.values():  # no remedy names the unreleased build's metrics
        assert not any(name.startswith("pytrtllm:") for name in source.names), source
    code, text = doctor("trtllm-serve-2025-06-pr5560-pytrtllm-excerpt.txt", capsys)
    assert code == 0
    assert line(text, "Queueing").endswith("0 waiting, 1 running")
    assert "0 of 707 ended requests" in line(text, "Aborted requests")


def test_trtllm_serve_hit_rate_gauge_alone_is_the_hit_rate() -> None:
    # trtllm-serve from PR #11243 (Feb 2026) exports `trtllm_kv_cache_hit_rate` before PR #12132 added the
    # reused / missed block counters behind it. The line is TensorRT-LLM's own test's example of it (SOURCES.md).
    # Before: the gauge was not read, the hit rate unknown.
    snap = read("trtllm-serve-2026-source-test-hit-rate-line.txt")
    assert snap.prefix_cache.hit_rate == 0.5 and snap.knows("prefix_cache.hit_rate")
    assert snap.metrics_read["prefix_cache.hit_rate"] == ["trtllm_kv_cache_hit_rate"]
    assert not snap.knows("prefix_cache.queries_total")  # a rate, not the lookups behind it
    assert snap.engine.model == "llama"


def test_doctor_reads_tensorrt_llm(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = doctor("tensorrt-llm-triton-23.12-readme-inflight-batcher.txt", capsys)
    assert code in (0, 1)
    assert "of 6239 blocks" in line(text, "KV cache usage")
    assert "request_type=\"waiting\"" in line(text, "Queueing") or "request_type=\"waiting\"" in text
    code, text = doctor("tensorrt-llm-triton-2025-readme-kv-fraction-disagg.txt", capsys)
    assert code == 1 and "0.4875" in text
    assert line(text, "Queueing").endswith("1 waiting, 0 running, KV usage 0%")
    code, text = doctor("trtllm-serve-2025-07-pr5785-unprefixed-ttft-excerpt.txt", capsys)
    assert code in (0, 1)
    assert "over 2 requests" in line(text, "Time to first token")
