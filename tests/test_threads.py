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


def _idle_spell(governor: ThreadGovernor, machine: _Machine, seconds: float, every: float = 0.5) -> None:
    """The serving loop with no request: a reading each poll, the engine's own work nil."""
    for _ in range(round(seconds / every)):
        governor.idle(machine.advance(every, own=0.0))


def test_the_first_step_after_idle_time_takes_its_count_from_the_half_second_before_it():
    # Seen in a busy-core benchmark: the burner started while kvops waited, and its first request ran ~2 s on two
    # threads beside it (one stream's first round 9.8 tok/s, the next two 29-31) before two readings agreed.
    applied: list[int] = []
    machine = _Machine()
    governor = ThreadGovernor("auto", cpus=2, read=lambda: None, apply=applied.append)
    governor.observe(machine.advance())
    machine.others = 1.0
    _idle_spell(governor, machine, 3.0)
    governor.observe(machine.advance(0.05))  # the request's first step: one reading decides
    assert governor.threads == 1 and applied == [1] and governor.others_busy == pytest.approx(1.0, abs=0.05)
    machine.others = 0.0
    governor.observe(machine.advance())  # serving again: one quiet reading alone changes nothing
    assert governor.threads == 1
    governor.observe(machine.advance())
    assert governor.threads == 2 and governor.changes == 2


def test_a_neighbour_that_served_while_the_engine_waited_and_stopped_before_the_request_changes_nothing():
    # Two vLLMs serving in turns beside an idle kvops (a side-by-side run): re-choosing in idle time flipped it to one
    # thread, and the next request, with them idle again, ran its first two seconds on one (19 for 47 tok/s).
    machine = _Machine()
    governor = ThreadGovernor("auto", cpus=2, read=lambda: None, apply=lambda n: None)
    governor.observe(machine.advance())
    machine.others = 1.0
    _idle_spell(governor, machine, 5.0)
    assert governor.threads == 2  # idle readings are kept, never acted on while idle
    machine.others = 0.0
    _idle_spell(governor, machine, 1.0)  # the benchmark waits for every server to be idle before timing one
    governor.observe(machine.advance(0.05))
    assert governor.threads == 2 and governor.others_busy < 0.5


def test_an_idle_spell_too_short_to_read_leaves_the_choice_to_agreeing_readings():
    machine = _Machine()
    governor = ThreadGovernor("auto", cpus=2, read=lambda: None, apply=lambda n: None)
    governor.observe(machine.advance())
    machine.others = 1.0
    governor.idle(machine.advance(0.1, own=0.0))  # back-to-back requests: 0.1 s idle
    governor.observe(machine.advance(0.05))
    assert governor.threads == 2  # one reading, as while serving
    governor.observe(machine.advance())
    assert governor.threads == 1


def test_idle_readings_say_what_others_kept_busy_since_the_last_one():
    machine = _Machine()
    governor = ThreadGovernor("auto", cpus=2, read=lambda: None, apply=lambda n: None)
    assert governor.idle(None) is None and governor.idle(machine.advance(own=0.0)) is None  # nothing to compare
    machine.others = 1.5
    assert governor.idle(machine.advance(0.5, own=0.0)) == pytest.approx(1.5)
    assert governor.idle(machine.advance(0.02, own=0.0)) == pytest.approx(1.5)  # a slice later: still measured
    assert governor.idle(machine.advance(10.0, own=0.0)) is None  # too long ago to describe now


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


@pytest.mark.clock  # both CPUs, and no other test busy on one (tests/helpers/clock_worker.py)
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


@pytest.mark.clock  # both CPUs, and no other test busy on one (tests/helpers/clock_worker.py)
@pytest.mark.skipif(read_cpu() is None or usable_cpus() < 2, reason="needs /proc/stat and 2 CPUs")
def test_a_process_that_got_busy_while_the_engine_waited_sets_the_first_steps_count():
    """A real busy process started during idle time: the first tick after it gives the cores back at once."""
    applied: list[int] = []
    governor = ThreadGovernor("auto", apply=applied.append)
    governor.tick()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(governor.cpus - 1)]
    try:
        time.sleep(0.5)  # the burners up and running
        for _ in range(10):
            governor.idle(read_cpu())
            time.sleep(0.1)
        governor.tick()
        assert governor.threads == 1, f"others kept {governor.others_busy:.2f} CPUs busy, still {governor.threads}"
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def test_the_engine_reports_its_thread_count(llm):
    snapshot = llm.engine.snapshot(include_gpu=False)
    assert snapshot.process.torch_threads == llm.engine.threads.threads >= 1
    assert (snapshot.process.others_busy_cpus is None) is (llm.engine.threads.fixed is not None)
