"""Smoke test of `kvops bench`: two systems on a tiny chat workload, results as JSON."""

from __future__ import annotations

import json

from kvops.bench.engine import main


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


def test_kv_quant_bench_reports_bytes_capacity_and_quality_per_dtype(tmp_path, capsys):
    from kvops.cli import main as cli_main

    out = tmp_path / "kv.json"
    assert cli_main(["bench", "kv-quant", "--quick", "--kv-cache-memory", "128MiB", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    variants = {(v["kv_cache_dtype"], v["group_size"]): v for v in report["variants"]}
    assert set(variants) == {("float32", None), ("int8", None), ("fp8", None), ("int4", 32), ("int4", 64)}
    assert variants[("int8", None)]["bytes_per_token"] == 12240
    assert abs(variants[("int8", None)]["capacity_ratio"] - 46080 / 12240) < 0.01
    assert variants[("int4", 32)]["capacity_ratio"] > 6
    assert abs(variants[("int8", None)]["perplexity_change"]) < 0.02  # int8 barely moves perplexity
    assert variants[("int4", 64)]["perplexity_change"] > variants[("int8", None)]["perplexity_change"]
    assert variants[("int8", None)]["next_token_agreement"] > variants[("int4", 64)]["next_token_agreement"]
    assert "int4/g64" in capsys.readouterr().out


def test_kv_quant_bench_with_a_budget_too_small_says_so(capsys):
    from kvops.bench.kv_quant import main as kv_main

    assert kv_main(["--quick", "--kv-cache-memory", "8MiB"]) == 2
    assert "raise --kv-cache-memory" in capsys.readouterr().err
