"""What the supervisor remembers about one engine: the raw material of every rule.

Snapshots are kept at full rate for the recent past and downsampled (one per bucket) after
that, so a day of history costs a bounded amount of memory. Health checks, engine exits, the
on-demand profiles and the exits of the gateway kvops runs in front of the engine sit beside them.
Rules read an `EngineHistory` and never change it.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvops.schema.engines import EngineExit
from kvops.schema.reports import BlockSizeProfile, KVQuantProfile
from kvops.schema.snapshot import Snapshot, TenantStats

Getter = Callable[[Snapshot], float]


@dataclass(frozen=True)
class HealthSample:
    t: float  # unix seconds
    up: bool
    error: str = ""  # why the check failed


# What `kvops gateway` exits with when it refuses its configuration (kvops.cli: a ConfigError, a bad flag): its
# manager does not start it again, and gateway_down says to fix the configuration.
GATEWAY_CONFIG_ERROR_EXIT = 2


@dataclass
class GatewayRecord:
    """The `kvops gateway` kvops runs in front of the engine, as its manager (kvops.supervisor.managed_gateway)
    records it: how it exited, whether it is being started again. Beside the engine's own exits because a gateway
    that is down leaves the engine answering kvops while its clients get "connection refused"."""

    log: str  # its output file (gateway-<engine>.log): where the reason for an exit is written
    exits: deque[EngineExit] = field(default_factory=lambda: deque(maxlen=100))  # stderr_tail: its log's last lines
    stopped: str = ""  # why its manager stopped starting it again ("" while it runs or a restart is due)
    down_since: float | None = None  # unix s of the exit it has not been started again since

    def record_exit(self, event: EngineExit) -> None:
        self.exits.append(event)
        if self.down_since is None:
            self.down_since = event.t

    def exits_within(self, seconds: float, now: float) -> list[EngineExit]:
        return [e for e in self.exits if e.t >= now - seconds]


@dataclass
class EngineHistory:
    engine: str
    managed: bool = True
    full_rate_s: float = 300.0  # keep every snapshot this recent
    bucket_s: float = 10.0  # older ones: one per bucket
    max_age_s: float = 3600.0
    # Kept snapshots are at least this far apart, except the newest: a poller faster than that replaces the
    # newest instead of adding one, so the rules' windows hold as many snapshots at 10 Hz as at 2 Hz
    # (counters are cumulative, and each snapshot repeats the last 512 steps: nothing is lost but gauges
    # between samples). 0: keep every snapshot.
    resolution_s: float = 0.0
    _older: deque[Snapshot] = field(default_factory=deque, repr=False)  # downsampled: one per bucket
    _recent: deque[Snapshot] = field(default_factory=deque, repr=False)  # every snapshot of full_rate_s
    # Their times, kept beside them: the rules' windows are cut by time after every poll, and reading `.time` off
    # 600 snapshots scattered in memory took ~0.4 ms an engine where copying floats takes microseconds.
    _older_times: deque[float] = field(default_factory=deque, repr=False)
    _recent_times: deque[float] = field(default_factory=deque, repr=False)
    health: deque[HealthSample] = field(default_factory=lambda: deque(maxlen=1000))
    exits: deque[EngineExit] = field(default_factory=lambda: deque(maxlen=100))
    restarts_total: int = 0
    crash_loop: bool = False  # set by the engine manager when it stopped restarting
    gateway: GatewayRecord | None = None  # the gateway kvops runs in front of it, if it runs one
    kv_profile: KVQuantProfile | None = None
    block_size_profile: BlockSizeProfile | None = None
    # The kept snapshots and their times, oldest first, built once per change: the rules cut ~30 windows out of
    # each engine's history per evaluation, and scanning it whole for each grew with the fleet (docs/benchmarks.md).
    _sorted: tuple[list[float], list[Snapshot]] | None = field(default=None, repr=False, compare=False)
    # False once a snapshot came older than the one before it (an engine clock that stepped back): only then are
    # they sorted. Checked as each arrives: scanning the whole history for order at every poll was half of the
    # rules' time at 600 snapshots.
    _in_order: bool = field(default=True, repr=False, compare=False)

    # ----------------------------------------------------------- recording

    def add(self, snap: Snapshot) -> None:
        if self._recent and snap.time == self._recent[-1].time:
            return  # the same snapshot again: polled faster than the engine's /stats cache refreshes
        self._sorted = None
        latest = self.latest
        if latest is not None and snap.time < latest.time:
            self._in_order = False
        if len(self._recent) >= 2 and self._recent[-1].time - self._recent[-2].time < self.resolution_s:
            self._recent[-1] = snap  # the newest was too close to the one before: it was only the latest
            self._recent_times[-1] = snap.time
            return
        self._recent.append(snap)
        self._recent_times.append(snap.time)
        self._compact(snap.time)

    def record_health(self, sample: HealthSample) -> None:
        self.health.append(sample)

    def record_exit(self, event: EngineExit) -> None:
        self.exits.append(event)

    def _compact(self, now: float) -> None:
        """Move what left the full-rate span into the downsampled part (the first snapshot of each
        bucket stays) and drop what is older than max_age_s: per poll, only the snapshots that moved."""
        while self._recent and self._recent_times[0] < now - self.full_rate_s:
            snap, t = self._recent.popleft(), self._recent_times.popleft()
            if not self._older or int(t // self.bucket_s) != int(self._older_times[-1] // self.bucket_s):
                self._older.append(snap)
                self._older_times.append(t)
        for part, times in ((self._older, self._older_times), (self._recent, self._recent_times)):
            while part and times[0] < now - self.max_age_s:
                part.popleft()
                times.popleft()

    # ------------------------------------------------------------- reading

    @property
    def snapshots(self) -> list[Snapshot]:
        """Every snapshot kept, oldest first."""
        return list(self._kept()[1])

    def _kept(self) -> tuple[list[float], list[Snapshot]]:
        if self._sorted is None:
            snaps, times = [*self._older, *self._recent], [*self._older_times, *self._recent_times]
            if not self._in_order:  # an engine clock that stepped back: windows cut by time
                snaps.sort(key=lambda s: s.time)
                times = [s.time for s in snaps]
            self._sorted = (times, snaps)
        return self._sorted

    @property
    def latest(self) -> Snapshot | None:
        if self._recent:
            return self._recent[-1]
        return self._older[-1] if self._older else None

    @property
    def is_up(self) -> bool | None:
        """The last health check's verdict (None before the first one)."""
        return self.health[-1].up if self.health else None

    def window(self, seconds: float, now: float | None = None) -> list[Snapshot]:
        """Snapshots of the last `seconds` (ending at `now`, default the latest snapshot's time)."""
        latest = self.latest
        if latest is None:
            return []
        end = latest.time if now is None else now
        times, snaps = self._kept()
        return snaps[bisect.bisect_left(times, end - seconds):bisect.bisect_right(times, end)]

    def series(self, getter: Getter, seconds: float) -> list[tuple[float, float]]:
        return [(s.time, float(getter(s))) for s in self.window(seconds)]

    def delta(self, getter: Getter, seconds: float) -> float | None:
        """Increase of a counter over the window; a counter that went down (engine restart) counts
        from its reset, like Prometheus's `increase`."""
        points = self.series(getter, seconds)
        if len(points) < 2:
            return None
        total = 0.0
        for (_, before), (_, after) in itertools.pairwise(points):
            total += after - before if after >= before else after
        return total

    def rate(self, getter: Getter, seconds: float) -> float | None:
        """Per-second increase of a counter over the window."""
        points = self.series(getter, seconds)
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return None
        increase = self.delta(getter, seconds)
        return None if increase is None else increase / (points[-1][0] - points[0][0])

    def trend(self, getter: Getter, seconds: float) -> float | None:
        """Least-squares slope of a gauge over the window, per second."""
        points = self.series(getter, seconds)
        if len(points) < 3:
            return None
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_v = sum(v for _, v in points) / n
        var_t = sum((t - mean_t) ** 2 for t, _ in points)
        if var_t == 0:
            return None
        return sum((t - mean_t) * (v - mean_v) for t, v in points) / var_t

    def exits_within(self, seconds: float, now: float) -> list[EngineExit]:
        return [e for e in self.exits if e.t >= now - seconds]


def at_start(first: Snapshot) -> Snapshot:
    """The engine at its start, from its first snapshot seen later: every cumulative counter zero (and the
    cumulative histograms empty), gauges as first seen. Doctor, and `kvops run` joining a server that was
    already running, put it first in the history, so counter deltas cover the run since the start."""
    data = first.model_dump()
    data["time"] = first.time - first.uptime_s
    data["uptime_s"] = 0.0
    prefix = data["prefix_cache"]
    for key in ("queries_total", "hits_total", "evictions_total", "shadow_queries_total", "shadow_hits_total",
                "potential_queries_total", "potential_hits_total"):
        prefix[key] = 0
    for key in ("finished_total", "aborted_total", "preemptions_total", "prompt_tokens_total",
                "generation_tokens_total", "ttft_seconds_sum", "ttft_count", "itl_seconds_sum", "itl_count"):
        data["requests"][key] = 0
    if data["requests"]["abandoned_total"] is not None:  # an estimate of a count since the start: 0 there too
        data["requests"]["abandoned_total"] = 0
    for key in ("swap_out_total", "swap_in_total", "swap_in_reused_total", "swap_preemptions_total",
                "swap_fallbacks_total"):
        data["swap"][key] = 0
    data["tenants"] = {
        name: TenantStats(blocks_held=t["blocks_held"], quota_blocks=t["quota_blocks"],
                          cache_salt=t["cache_salt"]).model_dump()
        for name, t in data["tenants"].items()}
    for name in ("ttft", "itl", "generation_lengths"):  # cumulative histograms: empty at the start
        if data.get(name):
            data[name].update(counts=[0] * len(data[name]["counts"]), sum=0.0, count=0,
                              **{key: None for key in data[name] if key.startswith("p") and key[1:].isdigit()})
    data["steps"] = []
    data["data_problems"] = []
    return Snapshot.model_validate(data)
