"""`kvops bench vs-vllm`: verdicts against the better vLLM, the plots and the table from a report, and a
clear exit when vLLM is absent. The servers themselves are real in the command (docs/benchmarks.md has its
run); here the report is built by hand, since a run takes minutes and the real vLLM."""

from __future__ import annotations

import struct

import pytest

from kvops.bench import side_by_side


def _workload(kvops: float, vllm: float, omp: float) -> dict:
    return {"servers": {"kvops": {"tok_s": kvops}, "vllm": {"tok_s": vllm}, "vllm-omp": {"tok_s": omp}}}


def _report() -> dict:
    workloads = {"stream": _workload(30.0, 20.0, 12.0), "chats": _workload(300.0, 100.0, 160.0),
                 "shared-prefix": _workload(100.0, 50.0, 40.0)}
    return {
        "date": "2026-12-01T14:00:00+00:00", "command": "kvops bench vs-vllm",
        "machine": {"cpu": "a CPU", "cores": 2, "memory_gib": 23.5},
        "quiet": {"workloads": workloads, "verdicts": side_by_side.verdicts(workloads)},
        "concurrency_sweep": {"concurrency": [1, 2, 4], "max_tokens": 32,
                              "tok_s": {"kvops": [20.0, 35.0, 60.0], "vllm": [18.0, 30.0, 50.0]}},
        "context_sweep": {"context_tokens": [128, 256], "max_tokens": 32,
                          "decode_tok_s": {"kvops": [22.0, 21.0], "vllm": [20.0, 19.0]},
                          "first_token_s": {"kvops": [0.2, 0.4], "vllm": [0.3, 0.5]}},
    }


def test_each_workload_is_judged_against_the_better_vllm():
    verdicts = side_by_side.verdicts(_report()["quiet"]["workloads"])
    assert verdicts["stream"] == {"kvops_tok_s": 30.0, "best_vllm_tok_s": 20.0, "ratio": 1.5, "target": 1.5,
                                  "met": True}
    assert verdicts["chats"]["best_vllm_tok_s"] == 160.0 and verdicts["chats"]["ratio"] == 1.875
    assert not verdicts["chats"]["met"]  # 2x the worse vLLM is not enough
    assert verdicts["shared-prefix"]["met"]


def test_the_table_names_every_workload_and_what_was_missed():
    text = side_by_side.table(_report())
    assert "| quiet | chats | 300.0 | 100.0 | 160.0 | 1.88 | ≥ 2.0 (**missed**) |" in text
    assert "| quiet | stream | 30.0 | 20.0 | 12.0 | 1.50 | ≥ 1.5 (met) |" in text
    assert "2 cores" in text and "kvops bench vs-vllm" in text


def test_a_phase_without_targets_records_the_ratio_and_claims_nothing():
    report = _report()
    workloads = report["quiet"]["workloads"]
    report["busy_core"] = {"workloads": workloads, "verdicts": side_by_side.verdicts(workloads, targeted=False)}
    assert report["busy_core"]["verdicts"]["chats"] == {"kvops_tok_s": 300.0, "best_vllm_tok_s": 160.0, "ratio": 1.875}
    assert "| busy_core | chats | 300.0 | 100.0 | 160.0 | 1.88 | — |" in side_by_side.table(report)


def test_the_scaling_plots_are_png_files(tmp_path):
    pytest.importorskip("matplotlib")
    written = side_by_side.plot(_report(), tmp_path)
    assert [p.name for p in written] == ["scaling-concurrency.png", "scaling-context.png"]
    for path in written:
        head = path.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", head[16:24])
        assert width > 300 and height > 200


def test_without_vllm_it_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVOPS_VLLM_VENV", str(tmp_path / "no-venv"))
    assert side_by_side.main(["--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "kvops vllm setup" in err
    assert not (tmp_path / "r.json").exists()


def test_the_peer_clients_numbers_get_a_table_of_their_own():
    report = _report()
    servers = {name: {"output_tok_s": rate, "mean_ttft_ms": 600.0, "p99_ttft_ms": 900.0, "mean_itl_ms": 70.0,
                      "p99_itl_ms": 150.0, "completed": 48, "failed": 0}
               for name, rate in (("kvops", 150.0), ("vllm", 120.0), ("vllm-omp", 200.0))}
    report["peer_client_bf16"] = {"dtype": "bfloat16", "workloads": {"random-16": {
        "description": "16 concurrent", "concurrency": 16, "prompts": 48, "servers": servers,
        "kvops_over_best_vllm": 0.75}}}
    text = side_by_side.table(report)
    assert "vLLM's own client (peer_client_bf16)" in text
    assert "| random-16 | kvops | 150.0 | 600 / 900 | 70 / 150 | 0.75 |" in text
    assert "| random-16 | vllm-omp | 200.0 | 600 / 900 | 70 / 150 |  |" in text
