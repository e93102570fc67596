"""The load generator: spec validation, prompt text, arrival processes, and runs against one real engine."""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvops.loadgen import (
    LoadError,
    LoadReport,
    LoadSpec,
    PromptBuilder,
    Stream,
    add_noise,
    arrival_times,
    load_tokenizer,
    load_workload,
    main,
    run_load,
    start_load,
)
from kvops.loadgen.runner import Runner
from kvops.processes import free_port
from kvops.prompt_normalization import normalize_prompt

ROOT = Path(__file__).resolve().parent.parent


def _error(data: dict[str, object]) -> str:
    with pytest.raises(ValidationError) as info:
        LoadSpec.model_validate(data)
    return str(info.value)


def _workload(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "load.toml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------ spec


def test_unknown_key_is_named_with_the_file(tmp_path: Path) -> None:
    path = _workload(tmp_path, "duration_s = 5\n[[streams]]\ntenant = 'a'\nrate = 1\nburst = 3\n")
    with pytest.raises(LoadError, match=r"load\.toml: streams\[0\]\.burst: unknown key"):
        load_workload(path)
    assert "Extra inputs" in _error({"streams": [{"rate": 1}], "durations": 3})


def test_rate_and_concurrency_exclusive() -> None:
    assert "not both" in _error({"streams": [{"rate": 1, "concurrency": 2}]})
    assert "give rate" in _error({"streams": [{"tenant": "a"}]})
    assert "arrival applies to rate streams only" in _error({"streams": [{"concurrency": 2, "arrival": "fixed"}]})


def test_bad_distribution_parameters(tmp_path: Path) -> None:
    assert "dist = 'lognormal' needs sigma" in _error({"streams": [{"rate": 1, "prompt": {"dist": "lognormal",
                                                                                           "median": 200}}]})
    assert "value does not apply to dist = 'uniform'" in _error(
        {"streams": [{"rate": 1, "prompt": {"dist": "uniform", "value": 3, "low": 1, "high": 4}}]})
    assert "low (9) is above high (4)" in _error({"streams": [{"rate": 1, "output": {"dist": "uniform", "low": 9,
                                                                                      "high": 4}}]})
    assert "max (2) is below min (5)" in _error({"streams": [{"rate": 1, "prompt": {"value": 3, "min": 5,
                                                                                     "max": 2}}]})
    path = _workload(tmp_path, "[[streams]]\nrate = 1\nprompt = { dist = 'lognormal', median = 0, sigma = 1 }\n")
    with pytest.raises(LoadError, match=r"streams\[0\]\.prompt\.median: Input should be greater than 0"):
        load_workload(path)


def test_stream_shape_errors() -> None:
    assert "a unique stream has no shared prefix" in _error({"streams": [{"rate": 1, "unique": True,
                                                                          "shared_prefix_tokens": 64}]})
    assert "stop_s (5) must come after start_s (10)" in _error({"streams": [{"rate": 1, "start_s": 10,
                                                                             "stop_s": 5}]})
    assert "need shared_prefix_tokens" in _error({"streams": [{"rate": 1, "prefix_groups": 4}]})


def test_missing_and_broken_trace_files(tmp_path: Path) -> None:
    path = _workload(tmp_path, "[[streams]]\nrate = 1\nprompt = { dist = 'trace', trace = 'requests.jsonl' }\n")
    with pytest.raises(LoadError) as info:
        load_workload(path)
    assert str(info.value).startswith(f"{path}: streams[0].prompt: trace file ")
    assert str(tmp_path / "requests.jsonl") in str(info.value) and "does not exist" in str(info.value)
    (tmp_path / "requests.jsonl").write_text('{"prompt_tokens": 10}\n{"prompt_tokens": "many"}\n')
    with pytest.raises(LoadError, match=r"requests\.jsonl line 2: prompt_tokens"):
        load_workload(path)
    (tmp_path / "requests.jsonl").write_text('{"prompt_tokens": 10}\n')
    assert "no arrival_s to replay" in _error({"streams": [{"prompt": {"dist": "trace",
                                                                      "trace": str(tmp_path / "requests.jsonl")}}]})


def test_example_workload_loads() -> None:
    spec = load_workload(ROOT / "benchmarks" / "workloads" / "mixed.toml")
    tenants = {s.tenant: s for s in spec.streams}
    assert set(tenants) == {"chat-a", "chat-b", "rag", "noisy", "audit-log"}
    assert tenants["chat-a"].key == tenants["chat-b"].key
    assert tenants["audit-log"].unique and tenants["audit-log"].start_s == 30
    assert tenants["rag"].concurrency == 2 and tenants["noisy"].noise > 0


# --------------------------------------------------------------------------------------------- prompts


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder(load_tokenizer(), seed=0)


def test_prompt_parts_have_exact_token_counts(builder: PromptBuilder) -> None:
    rng = random.Random(7)
    for index in range(120):
        n, prefix = rng.randint(1, 700), rng.choice([0, 2, 3, 16, 64, 333])
        unique = builder.unique(index, n, rng)
        assert builder.count(unique) == n
        text = (builder.prefix("sys", index % 3, prefix) if prefix else "") + unique
        assert builder.count(text) == prefix + n
        assert normalize_prompt(text) == text  # clean text: noise is the only thing normalization removes


def _planner(builder: PromptBuilder, *streams: Stream, seed: int = 0) -> Runner:
    spec = LoadSpec(streams=list(streams), seed=seed)
    return Runner("http://unused", spec, builder, progress=False, stop=None)


def test_shared_prefixes_and_distinct_unique_parts(builder: PromptBuilder) -> None:
    runner = _planner(builder,
                      Stream(tenant="a", rate=1, shared_prefix_tokens=48, prefix_groups=2, prefix_key="docs",
                             prompt=24),
                      Stream(tenant="b", rate=1, shared_prefix_tokens=48, prefix_groups=2, prefix_key="docs",
                             prompt=24),
                      Stream(tenant="c", rate=1, unique=True, prompt=24))
    a, b, c = runner.states
    prompts = [runner.plan(s) for _ in range(40) for s in (a, b, c)]
    tokens = [builder.tokenizer(p.prompt).input_ids for p in prompts if p is not None]
    assert all(len(t) == (24 if i % 3 == 2 else 72) for i, t in enumerate(tokens))
    prefixes = {tuple(t[:48]) for i, t in enumerate(tokens) if i % 3 != 2}
    assert len(prefixes) == 2  # two groups, shared by both tenants through prefix_key
    a_first, b_first = {tuple(t[:48]) for t in tokens[0::3]}, {tuple(t[:48]) for t in tokens[1::3]}
    assert a_first == b_first == prefixes
    groups = list(prefixes)
    assert groups[0][0] != groups[1][0]  # different documents differ from their first token
    unique_starts = [t[48] for i, t in enumerate(tokens) if i % 3 != 2] + [t[0] for t in tokens[2::3]]
    assert len(set(unique_starts)) == len(unique_starts)  # no request shares a token past its prefix


def test_noise_only_changes_whitespace(builder: PromptBuilder) -> None:
    rng = random.Random(3)
    for index in range(200):
        clean = builder.prefix("sys", 0, 80) + builder.unique(index, rng.randint(1, 200), rng)
        noisy = add_noise(clean, rng)
        assert noisy != clean
        assert normalize_prompt(noisy) == clean
        assert noisy.split() == clean.split()
        # The noise starts in the first block, so a noisy prompt misses the cache from early on.
        assert builder.tokenizer(noisy).input_ids[:16] != builder.tokenizer(clean).input_ids[:16]


def test_noise_probability(builder: PromptBuilder) -> None:
    runner = _planner(builder, Stream(rate=1, shared_prefix_tokens=32, noise=0.3, prompt=8))
    state = runner.states[0]
    noisy = 0
    for _ in range(400):
        planned = runner.plan(state)
        assert planned is not None
        noisy += normalize_prompt(planned.prompt) != planned.prompt
    assert 90 <= noisy <= 150  # 120 expected; seeded


# -------------------------------------------------------------------------------------------- arrivals


def test_poisson_rate_within_tolerance() -> None:
    stream = Stream(rate=20.0)
    times = list(arrival_times(stream, 500.0, random.Random(0)))
    assert abs(len(times) - 10_000) < 400  # 4 sigma
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert abs(sum(gaps) / len(gaps) - 0.05) < 0.002
    assert sum(g < 0.05 for g in gaps) / len(gaps) == pytest.approx(0.632, abs=0.02)  # 1 - 1/e: exponential
    assert times == list(arrival_times(stream, 500.0, random.Random(0)))  # seeded


def test_fixed_spacing_windows_and_caps() -> None:
    assert list(arrival_times(Stream(rate=4, arrival="fixed"), 2.0, random.Random(0))) == \
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
    window = list(arrival_times(Stream(rate=4, arrival="fixed", start_s=1.0, stop_s=2.0), 10.0, random.Random(0)))
    assert window == [1.0, 1.25, 1.5, 1.75]
    late = list(arrival_times(Stream(rate=50, start_s=20.0), 25.0, random.Random(1)))
    assert late and all(20.0 <= t < 25.0 for t in late)
    assert list(arrival_times(Stream(rate=50, start_s=30.0), 25.0, random.Random(1))) == []
    assert len(list(arrival_times(Stream(rate=100, max_requests=7), 10.0, random.Random(0)))) == 7


def test_trace_replay(tmp_path: Path, builder: PromptBuilder) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [
        {"prompt_tokens": 30, "output_tokens": 5, "tenant": "late", "arrival_s": 0.5},
        {"prompt_tokens": 20, "output_tokens": 3, "tenant": "early", "arrival_s": 0.1, "id": "x"},
        {"prompt_tokens": 40, "arrival_s": 9.0},
    ]) + "\n")
    stream = Stream(tenant="t", prompt={"dist": "trace", "trace": str(trace)}, output=7, start_s=1.0)
    assert stream.replays_arrivals
    assert list(arrival_times(stream, 5.0, random.Random(0))) == [1.1, 1.5]
    runner = _planner(builder, stream)
    plans = [runner.plan(runner.states[0]) for _ in range(3)]
    assert [(p.tenant, builder.count(p.prompt)) for p in plans if p] == [("early", 20), ("late", 30), ("t", 40)]
    assert [p.max_tokens for p in plans if p] == [7, 7, 7]  # output given: it wins over the trace
    replayed = _planner(builder, Stream(prompt={"dist": "trace", "trace": str(trace)}))
    assert [p.max_tokens for p in (replayed.plan(replayed.states[0]) for _ in range(3)) if p] == [3, 5, 32]
    paced = Stream(rate=2, arrival="fixed", prompt={"dist": "trace", "trace": str(trace)})
    assert not paced.replays_arrivals and len(list(arrival_times(paced, 3.0, random.Random(0)))) == 6


# ---------------------------------------------------------------------------------------------- engine


@pytest.fixture
def engine(shared_engine: str) -> str:
    """A real `kvops engine serve` (64 MiB of KV): the session's (conftest.py)."""
    return shared_engine


def test_two_tenants_through_the_cli(engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = _workload(tmp_path, """
duration_s = 3
[[streams]]
tenant = "chat"
rate = 3
arrival = "fixed"
shared_prefix_tokens = 64
prompt = 16
output = 4

[[streams]]
tenant = "flood"
rate = 2
arrival = "fixed"
unique = true
prompt = 48
output = 4
""")
    out = tmp_path / "report.json"
    assert main(["--url", engine, "--workload", str(workload), "--json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    chat, flood = report["tenants"]["chat"], report["tenants"]["flood"]
    assert (chat["requests_sent"], chat["requests_finished"], chat["requests_failed"]) == (9, 9, 0)
    assert (flood["requests_sent"], flood["requests_finished"], flood["requests_failed"]) == (6, 6, 0)
    assert chat["prompt_tokens"] == 9 * 80 and flood["prompt_tokens"] == 6 * 48
    assert chat["hit_rate"] > 0.4  # every request after the first reads the 64-token prefix from the cache
    assert flood["hit_rate"] < 0.05
    assert chat["generated_tokens"] == 36 and report["total"]["generated_tokens"] == 60
    for stats in (chat, flood, report["total"]):
        for metric in ("ttft", "itl"):
            latency = stats[metric]
            assert latency["p50_ms"] > 0 and latency["p50_ms"] <= latency["p95_ms"] <= latency["p99_ms"]
        assert stats["e2e"]["p50_ms"] <= stats["e2e"]["p95_ms"]
    assert report["complete"] and report["total"]["throughput_tok_s"] > 0
    timeline = report["timeline"]
    assert sum(p["requests_finished"] for p in timeline) == 15
    assert sum(p["generated_tokens"] for p in timeline) == 60
    assert any(p["tenants"]["chat"]["hit_rate"] for p in timeline if "chat" in p["tenants"])
    saved = LoadReport.model_validate_json(out.read_text())
    assert saved.window(tenant="chat").requests_finished == 9
    assert saved.window(tenant="chat").hit_rate == chat["hit_rate"]
    assert saved.window(0, 2).requests_finished + saved.window(2).requests_finished == 15
    table = capsys.readouterr().out
    assert "chat" in table and "flood" in table and "TTFT p50/p95/p99 ms" in table


def test_closed_loop_keeps_n_in_flight(engine: str) -> None:
    spec = LoadSpec(streams=[Stream(tenant="batch", concurrency=3, prompt=32, output=12)], duration_s=2.5)
    run = start_load(engine, spec)
    samples = []
    while run.running:
        snapshot = run.snapshot()
        if 0.3 < snapshot.elapsed_s < 2.3:
            samples.append(snapshot.total.in_flight)
        time.sleep(0.1)
    report = run.join()
    assert samples and max(samples) == 3
    assert sum(s == 3 for s in samples) >= 0.8 * len(samples)
    stats = report.tenants["batch"]
    assert stats.peak_in_flight == 3 and stats.requests_failed == 0
    assert stats.requests_finished == stats.requests_sent >= 3


def test_stop_ends_a_run_early(engine: str) -> None:
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    started = time.monotonic()
    spec = LoadSpec(streams=[Stream(tenant="s", rate=4, prompt=24, output=64)], duration_s=60)
    report = run_load(engine, spec, stop=stop)
    assert time.monotonic() - started < 10
    assert report.stopped and not report.complete
    stats = report.tenants["s"]
    assert stats.requests_sent >= 1 and stats.in_flight == 0
    assert stats.requests_sent == stats.requests_finished + stats.requests_failed + stats.requests_cancelled


def test_wrong_model_and_unreachable_url(engine: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", engine, "--rate", "1", "--model", "gpt-9"]) == 2
    assert "serves 'SmolLM2-135M-Instruct', not 'gpt-9'" in capsys.readouterr().err
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert main(["--url", dead, "--rate", "1", "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the engine at {dead}" in err and "Traceback" not in err
    assert time.monotonic() - started < 5
    with pytest.raises(LoadError, match="cannot reach"):
        run_load(dead, LoadSpec(streams=[Stream(rate=1)]))


def test_cli_flag_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    url = "http://127.0.0.1:9"
    assert main(["--url", url, "--rate", "1", "--concurrency", "2"]) == 2
    assert "command line: give either rate" in capsys.readouterr().err
    assert main(["--url", url, "--rate", "1", "--prompt-dist", "lognormal", "--prompt-median", "200"]) == 2
    assert "prompt: dist = 'lognormal' needs sigma" in capsys.readouterr().err
    workload = _workload(tmp_path, "[[streams]]\nrate = 1\n")
    assert main(["--url", url, "--workload", str(workload), "--noise", "0.5"]) == 2
    assert "--noise describes a single stream" in capsys.readouterr().err
