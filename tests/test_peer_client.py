"""vLLM's own serving benchmark client (`vllm bench serve`) against a real kvops engine, as `kvops bench vs-vllm`
runs it (kvops.bench.peer_client). Needs the vLLM venv of `kvops vllm setup` for the client; skipped without it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvops.bench import side_by_side
from kvops.bench.compare import CompareError, Server
from kvops.bench.peer_client import PEER_WORKLOADS, PeerWorkload, parse_result, peer_argv, run_peer_client
from kvops.processes import free_port
from kvops.vllm.install import default_venv_dir, probe_vllm, venv_python

VLLM_PYTHON = venv_python(default_venv_dir())
needs_client = pytest.mark.skipif(not probe_vllm(VLLM_PYTHON).installed,
                                  reason="vLLM's benchmark client comes with `kvops vllm setup`, not run here")
# Small enough for seconds on a 2-core machine, concurrent enough that ITL means the batched step.
TINY = PeerWorkload("tiny", "3 requests, random 24 in / 8 out, 2 at a time",
                    ["--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "8"], 2, 3)


def tokenizer() -> Path:
    from kvops.vllm.model_export import export_default_model

    return export_default_model()


@needs_client
def test_vllms_client_measures_a_kvops_engine_with_every_request_completed(shared_engine: str,
                                                                           monkeypatch: pytest.MonkeyPatch):
    """`kvops bench vs-vllm`'s peer phase on one real server (the vLLMs beside it need minutes to start)."""
    model = httpx.get(f"{shared_engine}/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
    monkeypatch.setattr(side_by_side, "PEER_WORKLOADS", (TINY,))
    settled: list[bool] = []
    phase = side_by_side.peer_client([Server("kvops", shared_engine, model)], VLLM_PYTHON, tokenizer(),
                                     lambda: settled.append(True))
    result = phase["tiny"]["servers"]["kvops"]
    assert result["completed"] == 3 and result["failed"] == 0 and settled == [True]
    # --ignore-eos: each request generated all 8 tokens, so 7 gaps between streamed tokens were timed.
    assert result["output_tok_s"] > 0 and result["mean_itl_ms"] > 0 and result["p99_itl_ms"] > 0
    assert 0 < result["mean_ttft_ms"] <= result["p99_ttft_ms"]
    assert phase["tiny"]["kvops_over_best_vllm"] is None  # no vLLM in this run to compare with


@needs_client
def test_a_server_that_is_not_there_is_a_one_line_reason_not_a_traceback():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(CompareError, match=f"{url}") as failed:
        run_peer_client(VLLM_PYTHON, url, "smollm2", tokenizer(), TINY, timeout_s=120)
    assert "vLLM's benchmark client" in str(failed.value) and "Cannot connect" in str(failed.value)


def test_the_three_workloads_are_the_peer_benchmarks_datasets_at_the_issue_shapes():
    by_name = {w.name: w for w in PEER_WORKLOADS}
    assert by_name["random-1"].concurrency == 1 and by_name["random-16"].concurrency == 16
    prefix = by_name["prefix-16"].dataset
    assert prefix[prefix.index("--dataset-name") + 1] == "prefix_repetition"
    argv = peer_argv(Path("/venv/bin/python"), "http://h:1", "m", Path("/tok"), by_name["random-16"], Path("/r/x.json"))
    for flag in ("--ignore-eos", "--save-result"):
        assert flag in argv
    assert argv[argv.index("--endpoint") + 1] == "/v1/completions"
    assert argv[argv.index("--result-dir") + 1] == "/r" and argv[argv.index("--result-filename") + 1] == "x.json"


def test_a_result_without_a_field_names_it():
    with pytest.raises(CompareError, match="p99_itl_ms"):
        parse_result({"output_throughput": 1.0, "mean_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "mean_itl_ms": 1.0,
                      "completed": 1})
