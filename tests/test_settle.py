"""The wait for the compared servers to go idle (kvops/bench/settle.py): on a real process that burns a core for a
while after it starts, as vLLM-CPU does after each request, and on made-up readings for the edges."""

from __future__ import annotations

import subprocess
import sys

from kvops.bench import settle as settle_module
from kvops.bench.settle import Settle, tree_cpu_s


def test_it_waits_for_a_real_process_tree_to_stop_burning_cpu():
    # The child starts a grandchild that burns 1.5 s of CPU: the tree counts, not the parent alone. CPU time, not
    # wall time: in CI's idle background cgroup a 1.5 s wall-clock burn got 0.51 s of CPU beside the clock tests.
    burner = "import time\nwhile time.process_time() < 1.5: pass\n"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {burner!r}]).wait()\ntime.sleep(30)"])
    try:
        settle = Settle([parent.pid])
        settle()
        waited = settle.waits[0]
        assert waited >= 1.0 and settle.timeouts == 0, settle.summary()  # the burn, not two quiet windows
        assert tree_cpu_s(parent.pid) >= 1.0
        settle()
        assert settle.waits[1] < 1.0  # idle now: two windows
    finally:
        parent.kill()
        parent.wait()


def test_gone_processes_count_as_idle():
    assert tree_cpu_s(2**22 + 12345) == 0.0  # above pid_max's default: no such process
    settle = Settle([2**22 + 12345])
    settle()
    assert settle.timeouts == 0 and settle.waits[0] < 1.0


def _fake(busy: list[float]) -> Settle:
    """A Settle over made-up readings: `busy` gives the CPUs' worth of work in each window, then idle."""
    clock = [0.0]
    cpu = [0.0]
    windows = iter(busy)

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        cpu[0] += next(windows, 0.0) * seconds

    return Settle([1], read=lambda pid: cpu[0], sleep=sleep, clock=lambda: clock[0])


def test_an_idle_window_must_follow_another_and_a_busy_one_starts_over():
    settle = _fake([0.0, 1.0, 0.1, 0.0])  # idle, busy, idle, idle
    settle()
    assert settle.waits == [4 * settle_module.WINDOW_S] and settle.timeouts == 0


def test_a_server_that_never_goes_idle_is_timed_anyway_and_counted():
    settle = _fake([1.0] * 1000)
    settle()
    settle()
    assert settle.timeouts == 2 and settle.waits[0] >= settle_module.MAX_WAIT_S
    assert settle.summary() == {"calls": 2, "waited_s": round(sum(settle.waits), 1), "longest_s": settle.waits[0],
                                "timeouts": 2}
