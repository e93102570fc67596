"""scripts/gpu-check without a GPU: the no-CUDA refusal, and the whole plumbing in `--device cpu --smoke` (real
child processes, real engines, real transformers, tiny sizes), plus the error and time-out paths of a part."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvops.bench import gpu_check
from kvops.bench.gpu_check_parts import compare_tokens

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})}, check=False)


def test_without_cuda_it_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    # An empty CUDA_VISIBLE_DEVICES hides every GPU, so this holds on a GPU machine too.
    done = _run("--out", str(out), env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scripts/gpu-check: no CUDA device is visible to torch (")
    assert "NVIDIA GPU" in lines[0]
    assert not out.exists()


def test_smoke_on_cpu_runs_every_part_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    done = _run("--device", "cpu", "--smoke", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["all_parts_ran"] is True and report["smoke"] is True
    assert report["command"].endswith(f"--device cpu --smoke --out {out}")
    for key in ("gpu", "gpu_memory_gib", "driver", "torch", "torch_cuda", "triton", "transformers"):
        assert key in report["machine"]
    assert report["machine"]["device"] == "cpu" and report["date"] and report["finished"]
    parts = report["parts"]
    assert list(parts) == list(gpu_check.PART_ORDER)
    assert parts["bandwidth"]["status"] == "skipped" and "--smoke" in parts["bandwidth"]["reason"]
    for name in ("parity", "throughput", "kv_quant"):
        assert parts[name]["status"] == "ok", parts[name]
        assert 0 < parts[name]["wall_s"] <= parts[name]["budget_s"]

    parity = parts["parity"]["result"]
    fp32 = parity["float32"]
    assert fp32["all_matched"] is True and fp32["matched_prompts"] == fp32["of"] == 2
    for row in fp32["per_prompt"]:  # tokens really compared: both sides generated them, and they are equal
        assert len(row["kvops"]) == len(row["transformers"]) == 4 and row["kvops"] == row["transformers"]
        assert row["matched"] is True and row["first_diff"] is None and row["match_fraction"] == 1.0
    assert parity["bfloat16"]["kvops_dtype"] == "bfloat16"
    assert 0.0 <= parity["bfloat16"]["mean_match_fraction"] <= 1.0
    assert "transformers_vs_its_float32" in parity["bfloat16"]

    throughput = parts["throughput"]["result"]
    assert throughput["dtype"] == "float32" and throughput["requests"] == 2
    assert throughput["kvops_tok_s"] > 0 and throughput["transformers_tok_s"] > 0 and throughput["ratio"] > 0
    assert throughput["systems"]["kvops"]["generated_tokens"] == 8

    summary = report["summary"]
    assert summary["float32_parity_all_matched"] is True and summary["copy_gbs"] is None
    assert set(summary["kv_quant"]) == {"auto", "int8"}

    variants = parts["kv_quant"]["result"]["variants"]
    assert [v["variant"] for v in variants] == ["auto", "int8"]
    assert 0.0 <= variants[1]["greedy_agreement"] <= 1.0 and variants[1]["min_layer_cosine"] <= 1.0


def _namespace(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"device": "cpu", "smoke": True, **kw})


def test_a_failing_part_records_its_error_and_traceback(tmp_path: Path) -> None:
    entry = gpu_check.run_part("bandwidth", _namespace(smoke=False), 60, tmp_path)
    assert entry["status"] == "error"
    assert entry["error"] == "RuntimeError: the Triton bandwidth part needs a CUDA device"
    assert "Traceback" in entry["traceback"] and entry["result"] is None


def test_a_part_past_its_budget_is_killed_and_recorded(tmp_path: Path) -> None:
    entry = gpu_check.run_part("parity", _namespace(), 1.0, tmp_path)
    assert entry["status"] == "timeout" and "budget of 1 s" in entry["error"]
    assert entry["wall_s"] < 10


def test_parts_fail_independently_and_the_exit_code_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    def fake_run_part(name: str, args: argparse.Namespace, budget_s: float, workdir: Path) -> dict[str, Any]:
        ran.append(name)
        failed = name == "parity"
        return {"status": "error" if failed else "ok", "wall_s": 0.1, "budget_s": budget_s,
                "error": "RuntimeError: boom" if failed else None, "result": None if failed else {}}

    monkeypatch.setattr(gpu_check, "run_part", fake_run_part)
    out = tmp_path / "r.json"
    assert gpu_check.main(["--device", "cpu", "--smoke", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert ran == ["parity", "throughput", "kv_quant"]  # bandwidth is skipped in --smoke, the rest still ran
    assert report["all_parts_ran"] is False and report["parts"]["parity"]["error"] == "RuntimeError: boom"


def test_cpu_without_smoke_is_refused() -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--device", "cpu"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(("got", "want", "expected"), [
    ([1, 2, 3], [1, 2, 3], (True, None, 1.0)),
    ([1, 9, 3], [1, 2, 3], (False, 1, 0.3333)),
    ([7, 2, 3, 4], [1, 2, 3, 4], (False, 0, 0.0)),
    ([1, 2], [1, 2, 3], (False, 2, 0.6667)),
])
def test_compare_tokens(got: list[int], want: list[int], expected: tuple[bool, int | None, float]) -> None:
    result = compare_tokens(got, want)
    assert (result["matched"], result["first_diff"], result["match_fraction"]) == expected


def test_in_turn_each_part_gets_what_is_left_of_the_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budgets: dict[str, float] = {}

    def fake_run_part(name: str, args: argparse.Namespace, budget_s: float, workdir: Path) -> dict[str, Any]:
        budgets[name] = budget_s
        return {"status": "ok", "wall_s": 0.0, "budget_s": budget_s, "error": None, "result": {}}

    monkeypatch.setattr(gpu_check, "run_part", fake_run_part)
    args = _namespace(device="cuda:0", smoke=False, parts=list(gpu_check.PART_ORDER), out=str(tmp_path / "r.json"))
    report: dict[str, Any] = {"parts": {}}
    # 40 s of the total left: every part is cut to that, none gets its own larger budget.
    gpu_check.run_in_turn(args, report, tmp_path, time.monotonic() - (gpu_check.TOTAL_S - 40))
    assert list(budgets) == list(gpu_check.PART_ORDER) and all(30 < b <= 40 for b in budgets.values())
    # Less than MIN_PART_S left: nothing starts, each part says why.
    budgets.clear()
    gpu_check.run_in_turn(args, report, tmp_path, time.monotonic() - (gpu_check.TOTAL_S - 5))
    assert budgets == {} and all(e["status"] == "skipped" and "total left" in e["reason"]
                                 for e in report["parts"].values())
    assert sum(gpu_check.BUDGETS_S.values()) < gpu_check.TOTAL_S < 8 * 60
