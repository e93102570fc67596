"""--threads: a fixed torch thread count, or auto, which gives cores back while other processes keep them
busy and takes them again when they are free (kvops.engine.threads)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvops.engine.config import EngineConfig
from kvops.engine.threads import CpuReading, ThreadGovernor, choose_threads, others_busy_cpus, read_cpu, usable_cpus
from kvops.schema.errors import ConfigError


@pytest.mark.parametrize(("cpus", "others", "threads"), [
    (2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 5.0, 1), (8, 2.2, 6), (8, 2.6, 5), (1, 0.0, 1)])
def test_a_core_more_than_half_busy_elsewhere_counts_as_taken(cpus: int, others: float, threads: int):
    assert choose_threads(cpus, others) == threads


def test_others_busy_is_all_busy_time_minus_the_engines_own():
    before, after = CpuReading(10.0, 100.0, 20.0), CpuReading(12.0, 103.0, 21.0)
    assert others_busy_cpus(before, after) == pytest.approx(1.0)  # 3 CPU-s busy in 2 s, 1 of them ours
    assert others_busy_cpus(after, after) == 0.0


class _Machine:
    """Readings as the governor would take them, with the other processes' load set by the test."""

    def __init__(self) -> None:
        self.t, self.busy, self.own, self.others = 0.0, 0.0, 0.0, 0.0

    def advance(self, seconds: float = 1.0, own: float = 1.0) -> CpuReading:
        self.t += seconds
        self.own += own * seconds
        self.busy += (own + self.others) * seconds
        return CpuReading(self.t, self.busy, self.own)


def test_auto_needs_two_agreeing_readings_before_it_changes():
    applied: list[int] = []
    machine = _Machine()
    governor = ThreadGovernor("auto", cpus=2, read=lambda: None, apply=applied.append)
    governor.tick()
    assert applied == [2] and governor.mode == "auto"
    governor.observe(machine.advance())
    machine.others = 1.0
    governor.observe(machine.advance())  # the first reading with a busy core: not yet
    assert governor.threads == 2
    machine.others = 0.0
    governor.observe(machine.advance())  # the burst is over: nothing changes
    assert governor.threads == 2 and governor.changes == 0
    machine.others = 0.9
    governor.observe(machine.advance())
    governor.observe(machine.advance())
    assert governor.threads == 1 and applied == [2, 1] and governor.others_busy == pytest.approx(0.9)
    machine.others = 0.1
    governor.observe(machine.advance())
    governor.observe(machine.advance())
    assert governor.threads == 2 and applied == [2, 1, 2] and governor.changes == 2
    governor.observe(None)  # an unreadable /proc/stat keeps the count
    assert governor.threads == 2


def test_a_reading_after_an_idle_gap_starts_afresh():
    """Idle between requests, the engine takes no readings; what others did meanwhile says nothing of now."""
    machine = _Machine()
    governor = ThreadGovernor("auto", cpus=2, read=lambda: None, apply=lambda n: None)
    governor.observe(machine.advance())
    machine.others = 1.0
    governor.observe(machine.advance())  # one reading asks for 1 thread
    governor.observe(machine.advance(seconds=30))  # after a long idle gap: no comparison, no change
    assert governor.threads == 2
    governor.observe(machine.advance())
    assert governor.threads == 2  # the old proposal was dropped: a second fresh one is needed
    governor.observe(machine.advance())
    assert governor.threads == 1


def test_a_fixed_count_is_applied_once_and_never_changed():
    applied: list[int] = []
    governor = ThreadGovernor(3, cpus=2, read=lambda: pytest.fail("a fixed count reads nothing"),
                              apply=applied.append)
    for _ in range(3):
        governor.tick()
    assert applied == [3] and governor.mode == "fixed" and governor.threads == 3


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5"])
def test_a_bad_thread_count_says_what_to_write(value: str):
    with pytest.raises(ConfigError, match="--threads"):
        EngineConfig(threads=value)


@pytest.mark.skipif(read_cpu() is None or usable_cpus() < 2, reason="needs /proc/stat and 2 CPUs")
def test_auto_gives_a_core_back_to_a_busy_process_and_takes_it_again():
    """A real busy process beside the test: the governor reads /proc/stat and drops to one thread."""
    applied: list[int] = []
    governor = ThreadGovernor("auto", apply=applied.append, check_every_s=0.3)
    cpus = governor.cpus
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus - 1)]
    try:
        deadline = time.monotonic() + 15
        while governor.threads != 1 and time.monotonic() < deadline:
            governor.tick()
            time.sleep(0.05)
        assert governor.threads == 1, f"others kept {governor.others_busy:.2f} CPUs busy, still {governor.threads}"
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    deadline = time.monotonic() + 15
    while governor.threads != cpus and time.monotonic() < deadline:
        governor.tick()
        time.sleep(0.05)
    # Other tests' leftovers could keep a core busy; the count must at least have come back up.
    assert governor.threads > 1 or governor.others_busy > 0.5
    assert applied[0] == cpus and 1 in applied


def test_the_engine_reports_its_thread_count(llm):
    snapshot = llm.engine.snapshot(include_gpu=False)
    assert snapshot.process.torch_threads == llm.engine.threads.threads >= 1
    assert (snapshot.process.others_busy_cpus is None) is (llm.engine.threads.fixed is not None)
