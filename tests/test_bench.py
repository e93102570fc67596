"""Smoke test of `kvops bench`: two systems on a tiny chat workload, results as JSON."""

from __future__ import annotations

import json

from kvops.bench import main


def test_quick_bench_writes_comparable_results(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--workload", "chat", "--systems", "kvops,hf-generate", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    chat = report["workloads"]["chat"]
    systems = chat["systems"]
    assert set(systems) == {"kvops", "hf-generate"}
    assert all(s["tok_s"] > 0 for s in systems.values())
    requested = sum(chat["max_tokens"])
    assert systems["kvops"]["generated_tokens"] == systems["hf-generate"]["generated_tokens"] == requested
    assert chat["ratios"]["hf-generate"] > 0
    # the markdown table is printed on stdout
    assert "| chat | kvops |" in capsys.readouterr().out
