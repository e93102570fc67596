"""The block-size profile's schedule: never under load by default, on demand when asked, never while off; and a
poll that fails while a profile runs is the engine being busy, not down."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvops.history import EngineHistory
from kvops.supervisor.config import parse_config
from kvops.supervisor.probes import BlockSizeProfileSettings, ProbeRefused, Probes, idle_for
from kvops.supervisor.supervisor import Supervisor
from tests.helpers.synthetic import T0, snapshot


def _history(running: list[int], every: float = 1.0) -> EngineHistory:
    history = EngineHistory("e")
    for i, count in enumerate(running):
        history.add(snapshot(T0 - (len(running) - 1 - i) * every, requests={"running": count, "waiting": 0}))
    return history


def test_idle_means_no_request_running_or_waiting_for_the_whole_span():
    assert idle_for(_history([3] * 10 + [0] * 61), 60, T0)
    assert not idle_for(_history([3] * 10 + [0] * 59 + [1, 0]), 60, T0)  # one request a second ago
    assert not idle_for(_history([0] * 30), 60, T0)  # the history does not reach back 60 s: not known to be idle
    waiting = _history([0] * 70)
    waiting.add(snapshot(T0 + 1, requests={"running": 0, "waiting": 2}))
    assert not idle_for(waiting, 60, T0 + 1)


@pytest.mark.parametrize(("schedule", "running", "due"), [
    ("idle", [0] * 70, True),
    ("idle", [4] * 70, False),  # the default never runs under load
    ("on_demand", [0] * 70, False),
    ("off", [0] * 70, False),
])
def test_the_block_size_profile_is_due_only_when_its_schedule_says(schedule: str, running: list[int], due: bool):
    probes = Probes("e", _history(running), BlockSizeProfileSettings(schedule=schedule, idle_s=60))
    assert probes.due(quantized=False, finished=1000, now=T0) == (False, due)
    assert probes.due(quantized=False, finished=10, now=T0) == (False, False)  # too few requests to measure on


def test_on_demand_is_refused_when_off_without_a_token_or_while_running():
    probes = Probes("e", EngineHistory("e"), BlockSizeProfileSettings(schedule="off"))
    with pytest.raises(ProbeRefused, match="off"):
        probes.request_block_size("http://127.0.0.1:9", "token")
    probes.settings = BlockSizeProfileSettings(schedule="on_demand")
    with pytest.raises(ProbeRefused, match="admin token"):
        probes.request_block_size("http://127.0.0.1:9", None)
    probes.running = "kv"
    with pytest.raises(ProbeRefused, match="already running"):
        probes.request_block_size("http://127.0.0.1:9", "token")


def test_a_failed_poll_while_profiling_is_not_the_engine_down(tmp_path: Path):
    sup = Supervisor(parse_config({
        "supervisor": {"state_dir": str(tmp_path), "alert_warmup_s": 0},
        "engines": [{"name": "busy", "url": "http://127.0.0.1:9"}],  # nothing answers: as during a long profile
    }, "test"))
    state = sup.engines["busy"]
    state.probes.running = "block_size"
    for _ in range(5):
        sup.poll_once()
    assert not state.history.health and state.last_error.startswith("profiling (block-size)")
    assert not [d for d in sup.diagnoses if d.rule == "engine_down"]
    state.probes.running = ""  # the profile is over: failures count again
    for _ in range(5):
        sup.poll_once()
    assert [d for d in sup.diagnoses if d.rule == "engine_down"]
