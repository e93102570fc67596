"""One profile per engine kind (kvops.kinds): a kind registered in one place is recognised, read and advised on
with no other change; the rules and doctor never name a kind; a kind kvops does not know gets nothing claimed."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvops.adapters import common
from kvops.adapters.names import MetricSource, Reader, table
from kvops.adapters.prometheus import Scrape
from kvops.cli import main
from kvops.doctor.liveness import not_a_server_remedy
from kvops.history import EngineHistory
from kvops.kinds import (
    AUTO,
    PROFILES,
    Capability,
    EngineProfile,
    Recognition,
    Remedy,
    detect,
    kinds,
    managed_kinds,
    profile,
    profile_of,
    register,
    snapshot_from_scrape,
    unrecognised,
    unregister,
)
from kvops.rules import block_size_waste, queueing
from kvops.schema.snapshot import Snapshot
from kvops.supervisor.launchers import MANAGED, managed_kind
from tests.helpers.synthetic import T0

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ a throwaway kind, in this one place

TOY = "toy"
TOY_METRICS = table(
    MetricSource("requests.running", ("toy:running",), "every toy server"),
    MetricSource("requests.waiting", ("toy:waiting",), "every toy server"),
    MetricSource("blocks.usage", ("toy:kv_used_ratio",), "every toy server"),
    MetricSource("requests.preemptions_total", ("toy:evicted_total",), "toy 2 and later"),
)
TOY_KNOB = "raise toy's --lanes"
# What a toy server does not export: neutral in its snapshot, "not checked" in doctor.
TOY_UNKNOWN = ("prefix_cache", "requests.finished_total", "requests.aborted_total", "requests.prompt_tokens_total",
               "requests.generation_tokens_total", "prompt_lengths", "engine.max_model_len", "engine.max_num_seqs",
               "swap", "tenants", "steps")


def read_toy(scrape: Scrape, t: float, model_card: dict[str, Any] | None, started_at: float | None) -> Snapshot:
    data = common.neutral_for(TOY, scrape, t, model_card, "toy:running")
    read = Reader(scrape, data, TOY_METRICS)
    common.fill_blocks(data, read.value("blocks.usage", mean=True), None, 16)
    for field in ("requests.running", "requests.waiting", "requests.preemptions_total"):
        value = read.value(field)
        if value is not None:
            data["requests"][field.split(".")[1]] = round(value)
    data["unknown"].extend(TOY_UNKNOWN)
    return common.finish(data, started_at)


PROFILE = EngineProfile(
    kind=TOY,
    title="Toy",
    recognition=Recognition(metric_prefixes=("toy:",), owned_by=("toyco",)),
    read_scrape=read_toy,
    metrics=TOY_METRICS,
    flags={"block_size": "--toy-block"},
    remedies={Remedy.QUEUEING: TOY_KNOB},
    block_sizes=(16, 64),
)


def toy_scrape(waiting: int) -> Scrape:
    return Scrape.parse(f"toy:running{{model_name=\"tiny\"}} 4\ntoy:waiting {waiting}\ntoy:kv_used_ratio 0.1\n"
                        "toy:evicted_total 0\n")


@pytest.fixture
def toy() -> Iterator[EngineProfile]:
    register(PROFILE)
    yield PROFILE
    unregister(TOY)


def toy_history(n: int = 61, every: float = 5.0) -> EngineHistory:
    """A toy server read from its scrapes for five minutes: 30 requests always waiting, the pool 10% full."""
    history = EngineHistory(engine="toy-0")
    for i in range(n):
        t = T0 - (n - 1 - i) * every
        history.add(snapshot_from_scrape(TOY, toy_scrape(30), t, started_at=T0 - 3600))
    return history


def test_a_kind_registered_in_one_place_is_recognised_read_and_advised_in_its_own_words(toy):
    assert TOY in kinds()
    assert detect(toy_scrape(30)) is toy  # by its metric names
    assert detect(Scrape(), {"data": [{"id": "m", "owned_by": "ToyCo"}]}) is toy  # by /v1/models
    snap = snapshot_from_scrape(TOY, toy_scrape(30), T0, {"data": [{"id": "tiny-chat"}]}, T0 - 60)
    assert snap.source == TOY and profile_of(snap) is toy
    assert snap.requests.waiting == 30 and snap.requests.running == 4 and snap.blocks.usage == pytest.approx(0.1)
    assert snap.engine.model == "tiny-chat" and snap.metrics_read["requests.waiting"] == ["toy:waiting"]

    (diagnosis,) = queueing.evaluate(toy_history(), queueing.Settings(), T0)
    assert diagnosis.summary.endswith(f"not KV memory; {TOY_KNOB}")
    assert diagnosis.fix is not None and diagnosis.fix.description.startswith(f"{TOY_KNOB}: ")
    assert block_size_waste.candidate_block_sizes(snap) == (16, 64)
    assert toy.flag("block_size", 64) == "--toy-block 64"


def test_doctor_reads_a_kind_registered_in_one_place(toy, tmp_path, capsys):
    scrape = tmp_path / "toy.txt"
    scrape.write_text("toy:running{model_name=\"tiny\"} 4\ntoy:waiting 30\ntoy:kv_used_ratio 0.1\n")
    assert main(["doctor", "--metrics-file", str(scrape)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"kvops doctor: scrape {scrape} (toy)")
    assert f"not KV memory; {TOY_KNOB}" in out and f"→ {TOY_KNOB}: the KV pool has 90% free" in out


def test_an_unregistered_kind_gets_no_other_kinds_words(toy):
    history = toy_history()
    unregister(TOY)
    assert detect(toy_scrape(30)) is None
    (diagnosis,) = queueing.evaluate(history, queueing.Settings(), T0)
    assert diagnosis.summary.endswith(f"not KV memory; {queueing.UNWORDED_KNOB}")
    assert "max_num_seqs" not in diagnosis.summary  # not kvops's own knob
    assert block_size_waste.candidate_block_sizes(history.latest) == ()


def test_the_kind_with_most_series_wins_and_a_borrower_is_told_apart():
    vllm_with_a_few_kvops = Scrape.parse("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nkvops_x 1\n")
    assert detect(vllm_with_a_few_kvops) is PROFILES["vllm"]
    borrower = EngineProfile(kind="borrower", title="Borrower", read_scrape=None,
                             recognition=Recognition(("borrower_",), borrowed_markers=("borrower_build_info",)))
    register(borrower)
    try:
        assert detect(Scrape.parse("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")) is PROFILES["vllm"]
        borrowed = Scrape.parse("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nborrower_build_info 1\n")
        assert detect(borrowed) is borrower
    finally:
        unregister("borrower")


# ------------------------------------------------------------------ the registry's fallback


def test_an_unknown_kind_gets_a_neutral_profile_not_a_key_error():
    unknown = profile("no-such-server")
    assert unknown.kind == "no-such-server" and unknown.title == "no-such-server"
    assert unknown.capabilities == frozenset() and not unknown.can(Capability.ADMIN_API)
    assert dict(unknown.flags) == {} and dict(unknown.remedies) == {} and dict(unknown.metrics) == {}
    assert unknown.remedy(Remedy.QUEUEING) == "" and unknown.missing_metric("requests.waiting") == ""
    assert unknown.flag("block_size", 32) == "block_size=32" and unknown.block_sizes_on("cuda:0") == ()
    assert not unknown.can(Capability.MANAGED) and unknown.read_scrape is None and managed_kind(unknown.kind) is None
    assert "no-such-server" not in kinds()
    with pytest.raises(ValueError, match="no /metrics of a no-such-server server"):
        snapshot_from_scrape("no-such-server", Scrape(), T0)


def test_what_kvops_manages_and_what_the_kinds_say_of_themselves():
    assert kinds()[:3] == ("kvops", "vllm", "sglang")
    assert managed_kinds() == (AUTO, "kvops", "vllm")
    # A kind whose profile says kvops manages it has a launcher, and only such a kind.
    assert sorted(MANAGED) == sorted(kind for kind in managed_kinds() if kind != AUTO)
    assert managed_kind(AUTO) is MANAGED["kvops"] and managed_kind("sglang") is None
    assert profile("vllm").block_sizes_on("cpu") == (32, 64, 128, 256)
    assert profile("vllm").block_sizes_on("") == (32,) and profile("sglang").block_sizes_on("cpu") == ()
    assert profile("vllm").flag("block_size", 16) == "--block-size 16"
    assert profile("kvops").flag("block_size", 16) == "block_size=16"
    assert profile("sglang").flag("enable_prefix_caching") == "enable_prefix_caching"  # as kvops has said so far
    assert unrecognised("http://h:1").startswith("http://h:1 answers, but neither /metrics nor /v1/models looks "
                                                 "like a kvops, vLLM, SGLang")
    # One note per kind says how to turn its /metrics on; the watcher's error and doctor's remedy both word it.
    assert "SGLang's --enable-metrics; llama.cpp's --metrics" in unrecognised("http://h:1")
    assert not_a_server_remedy().endswith("for SGLang start it with --enable-metrics, and for llama.cpp start it "
                                           "with --metrics")


# ------------------------------------------------------------------ rules and doctor never name a kind


def kind_names_in(folder: str) -> list[str]:
    """`file:line: "name"` for every string constant equal to a registered kind's name."""
    found = []
    for path in sorted((ROOT / "kvops" / folder).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in PROFILES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("folder", ["rules", "doctor"])
def test_no_kind_is_named_in_the_rules_or_doctor(folder):
    assert kind_names_in(folder) == []
