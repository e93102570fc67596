"""How the supervisor keeps its own pace: each poll cycle's duration, how late it started, and the time its rule
evaluations took. Exported on its `/metrics` as histograms (`kvops_supervisor_poll_duration_seconds`,
`kvops_supervisor_poll_lateness_seconds`, `kvops_supervisor_rule_evaluation_seconds`), which is how
`kvops bench fleet` and a fleet dashboard tell whether one supervisor still polls every engine within its interval.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# Seconds. A cycle is on time when it ends within the poll interval (0.5 s by default): the bounds bracket it.
BOUNDS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class Histogram:
    """Counts per bucket (not cumulative; the last is above every bound), their sum, and their count."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BOUNDS, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus's buckets: (le, cumulative count), +Inf last."""
        out, running = [], 0
        for bound, n in zip((*BOUNDS, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


@dataclass
class PollTiming:
    interval_s: float
    duration: Histogram = field(default_factory=Histogram)
    lateness: Histogram = field(default_factory=Histogram)  # how long after its due time a cycle started
    evaluation: Histogram = field(default_factory=Histogram)  # the rules over every engine, one evaluation
    late_total: int = 0  # cycles that did not end within the interval: the next one starts late
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cycle(self, duration_s: float, lateness_s: float) -> None:
        with self._lock:
            self.duration.observe(duration_s)
            self.lateness.observe(max(0.0, lateness_s))
            if duration_s > self.interval_s:
                self.late_total += 1

    def evaluated(self, seconds: float) -> None:
        with self._lock:
            self.evaluation.observe(seconds)
