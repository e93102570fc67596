"""Waiting for the servers under comparison to go idle before timing the next one.

vLLM-CPU keeps a core busy for about a second after it answers a request: on the 2-vCPU AMD EPYC each vLLM's
process tree spent 0.5 CPU-seconds in each of the two half-seconds after a 64-token request, then nothing
(kvops: nothing). In a side-by-side run whichever server is timed right after a vLLM shares the machine with
that work, so before each timed request the run waits until every server's process tree is idle. A background
load the run sets up on purpose (the busy-core phase) is not one of the servers and is not waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from kvops.processes import process_tree

IDLE_BELOW = 0.2  # CPUs' worth of work in the servers' trees over a window that counts as idle
WINDOW_S = 0.25
IDLE_WINDOWS = 2  # in a row
MAX_WAIT_S = 15.0  # then time it anyway, and count it


def tree_cpu_s(pid: int) -> float:
    """CPU-seconds (user + system) of a process and its descendants now, with the children each has reaped (so
    a worker that exits does not take its time out of the sum); 0 for a tree that is gone."""
    total = 0.0
    for process in process_tree(pid):
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@dataclass
class Settle:
    """Called before each timed request: returns once the servers' trees (`pids`) are idle, or after MAX_WAIT_S."""

    pids: list[int]
    read: Callable[[int], float] = tree_cpu_s
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    waits: list[float] = field(default_factory=list)  # seconds waited, one a call
    timeouts: int = 0

    def __call__(self) -> None:
        started = self.clock()
        idle_windows = 0
        before = sum(self.read(pid) for pid in self.pids)
        while idle_windows < IDLE_WINDOWS:
            if self.clock() - started >= MAX_WAIT_S:
                self.timeouts += 1
                break
            self.sleep(WINDOW_S)
            after = sum(self.read(pid) for pid in self.pids)
            idle_windows = idle_windows + 1 if (after - before) / WINDOW_S < IDLE_BELOW else 0
            before = after
        self.waits.append(round(self.clock() - started, 2))

    def summary(self) -> dict[str, float | int]:
        """What the waits cost, for the report: calls, seconds in all, the longest, MAX_WAIT_S reached."""
        return {"calls": len(self.waits), "waited_s": round(sum(self.waits), 1),
                "longest_s": max(self.waits, default=0.0), "timeouts": self.timeouts}
