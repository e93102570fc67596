"""Python's cyclic garbage collector, run by the poll loop between cycles instead of by allocations.

A supervisor's history is hundreds of thousands of small objects that live for minutes (a vLLM snapshot is ~75 of
them; 100 engines keep ~600k after 40 s, millions after the five minutes kept at full rate). Left to its
allocation counts, the collector walks all of them in a full collection every few hundred cycles: 0.3 s pauses
at 600k objects inside a 0.5 s poll cycle, 15% of the supervisor's CPU at 100 engines (`kvops bench fleet`), and
longer pauses as the history grows. The poll loop makes almost no cyclic garbage (0 objects a cycle, measured over
80 cycles of 100 scraped vLLMs): what a cycle leaves is freed by reference counts.

So while the loop runs, the automatic collector is off; after each cycle the young generations are collected (the
objects made since the last cycle: a few milliseconds), and the whole heap once every `full_every_s`, right after
a cycle, so a long pause is one late cycle an hour rather than one every couple of minutes. Whatever else runs in
the process (the API, fix jobs) has its young garbage collected the same way, within a cycle.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

FULL_EVERY_S = 3600.0


class Collection:
    def __init__(self, full_every_s: float = FULL_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.full_every_s = full_every_s
        self.clock = clock
        self.full_collections = 0
        self.last_full_s = 0.0  # how long the last full collection took
        self._was_enabled = False
        self._last_full_at = 0.0

    def start(self) -> None:
        self._was_enabled = gc.isenabled()
        self._last_full_at = self.clock()
        gc.disable()

    def after_cycle(self) -> None:
        now = self.clock()
        if now - self._last_full_at >= self.full_every_s:
            gc.collect()
            self.full_collections += 1
            self.last_full_s = self.clock() - now
            self._last_full_at = now
        else:
            gc.collect(1)

    def stop(self) -> None:
        if self._was_enabled:
            gc.enable()
