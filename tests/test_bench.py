"""Smoke test of `kvops bench`: two systems on a tiny chat workload, results as JSON."""

from __future__ import annotations

import json

import pytest

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


# ------------------------------------------------------------------------- kvops bench compare


def test_compare_with_an_unreachable_url_says_so_in_one_line(capsys):
    from kvops.cli import main as cli_main

    assert cli_main(["bench", "compare", "http://127.0.0.1:9", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot reach http://127.0.0.1:9" in err and "Traceback" not in err
    assert cli_main(["bench", "compare", "localhost:9"]) == 2
    assert "not an http(s) URL" in capsys.readouterr().err


def test_compare_workloads_scale_down_to_seconds():
    from kvops.bench.compare import shapes

    full = {s.name: s for s in shapes(1.0)}
    assert (full["stream"].requests, full["stream"].max_tokens) == (1, 64)
    assert (full["chats"].requests, full["chats"].max_tokens) == (16, 64)
    assert (full["shared-prefix"].requests, full["shared-prefix"].max_tokens, full["shared-prefix"].prefix_tokens) == (
        16, 32, 600)
    tiny = {s.name: s for s in shapes(0.1)}
    assert tiny["chats"].requests == 2 and tiny["chats"].max_tokens == 6 and tiny["shared-prefix"].prefix_tokens == 60


@pytest.fixture
def kvops_engine(shared_engine: str) -> str:
    """A real `kvops engine serve` with a small KV pool: the session's (conftest.py)."""
    return shared_engine


def test_one_streamed_request_times_its_first_token_and_the_decode_after_it(kvops_engine):
    from kvops.bench.compare import discover, streamed

    server = discover(kvops_engine, None, None)
    tokens, first, whole = streamed(server, [1, 2, 3, 4, 5, 6, 7, 8], 12)
    # ignore_eos: exactly the tokens asked for, the first of them before the last (both from the one request)
    assert tokens == 12 and 0 < first < whole


def test_compare_sends_the_same_requests_to_each_server_in_alternating_order(kvops_engine, tmp_path, capsys):
    from kvops.cli import main as cli_main

    out = tmp_path / "compare.json"
    # The same engine twice, under two names: the comparison machinery end to end, in seconds.
    assert cli_main(["bench", "compare", kvops_engine, kvops_engine, "--names", "a,b", "--scale", "0.1",
                     "--rounds", "2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [s["name"] for s in report["servers"]] == ["a", "b"]
    assert all(s["ignore_eos"] and s["model"] for s in report["servers"])
    assert report["machine"]["cores"] and report["date"] and report["command"].startswith("kvops bench compare ")
    assert set(report["workloads"]) == {"stream", "chats", "shared-prefix"}
    for workload in report["workloads"].values():
        assert workload["orders"] == [["a", "b"], ["b", "a"]]  # a slow spell hits both
        for result in workload["servers"].values():
            # greedy with ignore_eos: every server generates exactly what was asked
            assert result["tokens"] == workload["requested_tokens"] and result["complete"]
            assert result["tok_s"] > 0 and len(result["rounds_tok_s"]) == 2
        assert workload["ratio_to_first"]["a"] == 1.0 and workload["ratio_to_first"]["b"] > 0
    assert report["workloads"]["shared-prefix"]["prefix_tokens"] == 60
    assert "| workload | a tok/s | b tok/s | b / a |" in table and "| chats: 2 concurrent chats x 6 tokens |" in table
