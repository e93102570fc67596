"""Measures of a window of snapshots: what a fix's objectives and the judge's guards compare before and after.

A measure reads one window (the snapshots of it, oldest first) and gives its value over the whole window,
the same value over `parts` equal sub-windows (how much it moves by itself: the judge's noise estimate) and
the traffic (requests that ended in it: enough to judge?). Counters are cumulative, so a window's value
comes from deltas between consecutive snapshots; a pair spanning an engine restart is left out (the counters
restart from zero, and the run before had another config), and a counter that went down inside a run counts
from its reset, like Prometheus's `increase`.

Pure functions of snapshots, like the rules: the fix jobs (kvops.supervisor.fixes.jobs) and tests call them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvops.rules.common import blocks_for, median, recent_steps
from kvops.schema.snapshot import Snapshot


@dataclass(frozen=True, slots=True)
class Measurement:
    value: float | None  # over the whole window; None when not measurable (no traffic, not reported by the source)
    parts: tuple[float, ...]  # the same measure over `parts` equal sub-windows (noise estimate); empty: not measurable
    traffic: float  # requests that ended in the window (finished + aborted deltas)


Measure = Callable[[Sequence[Snapshot], str], Measurement]  # (the window's snapshots, oldest first; subject)
Value = Callable[[Sequence[Snapshot], str], float | None]  # a measure's value over one (sub-)window


# ------------------------------------------------------------------ counters over a window


def same_run(a: Snapshot, b: Snapshot) -> bool:
    """Whether two consecutive snapshots are of one engine run. A source that does not know the start time
    makes one up per snapshot (adapters.common.finish): then only a falling counter tells a restart."""
    if not (a.knows("uptime_s") and b.knows("uptime_s")):
        return True
    return abs(a.engine.started_at - b.engine.started_at) < 1e-3 and b.uptime_s >= a.uptime_s


def _pairs(snaps: Sequence[Snapshot]) -> list[tuple[Snapshot, Snapshot]]:
    return [(a, b) for a, b in itertools.pairwise(snaps) if same_run(a, b)]


def delta(snaps: Sequence[Snapshot], get: Callable[[Snapshot], float]) -> float:
    """A counter's increase over the window, summed per run (never across a restart)."""
    total = 0.0
    for a, b in _pairs(snaps):
        before, after = get(a), get(b)
        total += after - before if after >= before else after
    return total


def duration(snaps: Sequence[Snapshot]) -> float:
    """Seconds the window's counters cover: the gaps across a restart are not covered."""
    return sum(b.time - a.time for a, b in _pairs(snaps))


def traffic(snaps: Sequence[Snapshot]) -> float:
    return delta(snaps, lambda s: s.requests.finished_total + s.requests.aborted_total)


def _knows(snaps: Sequence[Snapshot], *paths: str) -> bool:
    return bool(snaps) and all(snap.knows(path) for snap in (snaps[0], snaps[-1]) for path in paths)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def rate(path: str, get: Callable[[Snapshot], float]) -> Value:
    """A counter's increase per second."""

    def value(snaps: Sequence[Snapshot], subject: str) -> float | None:
        if not _knows(snaps, path):
            return None
        return _ratio(delta(snaps, get), duration(snaps))

    return value


# ------------------------------------------------------------------ the measures' values


def _hit_rate(snaps: Sequence[Snapshot], subject: str) -> float | None:
    if not _knows(snaps, "prefix_cache.queries_total", "prefix_cache.hits_total"):
        return None
    queries = delta(snaps, lambda s: s.prefix_cache.queries_total)
    if queries > 0:
        return delta(snaps, lambda s: s.prefix_cache.hits_total) / queries
    # With caching off a server may look nothing up (vLLM counts no queries): every prompt token it
    # prefilled was computed, a hit rate of 0, which is what enabling caching is measured from.
    if not snaps[-1].engine.enable_prefix_caching and _knows(snaps, "requests.prompt_tokens_total"):
        return 0.0 if delta(snaps, lambda s: s.requests.prompt_tokens_total) > 0 else None
    return None


def _tenant_sum(field: str, keep: Callable[[str], bool]) -> Callable[[Snapshot], float]:
    """A per-tenant counter summed over the tenants `keep` accepts (a tenant not seen yet counts 0)."""
    return lambda snap: float(sum(getattr(stats, field) for name, stats in snap.tenants.items() if keep(name)))


def _victims_hit_rate(snaps: Sequence[Snapshot], subject: str) -> float | None:
    """The hit rate of every tenant but `subject` (the polluter): what its evictions cost the others."""
    if not _knows(snaps, "tenants"):
        return None

    def others(name: str) -> bool:
        return name != subject

    return _ratio(delta(snaps, _tenant_sum("hit_tokens_total", others)),
                  delta(snaps, _tenant_sum("prompt_tokens_total", others)))


def _evictions_caused(snaps: Sequence[Snapshot], subject: str) -> float | None:
    """Cross-tenant evictions `subject` caused per second (every tenant's when no subject is given)."""
    if not _knows(snaps, "tenants"):
        return None

    def mine(name: str) -> bool:
        return name == subject or not subject

    return _ratio(delta(snaps, _tenant_sum("evictions_caused", mine)), duration(snaps))


def _tenant_hit_rate(snaps: Sequence[Snapshot], subject: str) -> float | None:
    """One tenant's hit rate: its cached prompt tokens over its prompt tokens (a kvops engine's tenants, or a
    gateway's, whose numbers are the engine's own usage answers)."""
    if not _knows(snaps, "tenants"):
        return None

    def mine(name: str) -> bool:
        return name == subject

    return _ratio(delta(snaps, _tenant_sum("hit_tokens_total", mine)),
                  delta(snaps, _tenant_sum("prompt_tokens_total", mine)))


def _events_pairs(snaps: Sequence[Snapshot]) -> list[tuple[Snapshot, Snapshot]]:
    """Consecutive snapshots that both carry the KV event view (one without it would read as a counter reset)."""
    return [(a, b) for a, b in _pairs(snaps) if a.kv_events is not None and b.kv_events is not None]


def _events_evictions_caused(snaps: Sequence[Snapshot], subject: str) -> float | None:
    """Removals of other tenants' blocks per second in the KV event batches where `subject` (an events tenant: a
    cache salt) stored: what its traffic pushes out of the others' cache."""
    pairs = _events_pairs(snaps)
    if not pairs:
        return None

    def caused(snap: Snapshot) -> int:
        events = snap.kv_events
        tenant = events.tenants.get(subject) if events is not None else None
        return tenant.evicted_others_total if tenant is not None else 0

    total = 0.0
    for a, b in pairs:
        before, after = caused(a), caused(b)
        total += after - before if after >= before else after
    return _ratio(total, sum(b.time - a.time for a, b in pairs))


def _restore_share(snaps: Sequence[Snapshot], subject: str) -> float | None:
    """Blocks stored again after their eviction over blocks stored (the KV events, `Snapshot.kv_events`): the
    share of cached work recomputed. Only intervals whose two snapshots both carry the events count (one
    without them would read as a counter reset)."""
    stores = restores = 0.0
    for a, b in _events_pairs(snaps):
        before, after = a.kv_events, b.kv_events
        assert before is not None and after is not None  # _events_pairs keeps only those
        stored = after.stores_total - before.stores_total
        restored = after.restores_total - before.restores_total
        # kvops restarted its reading in between (the counters start again): count from zero, like `delta`.
        stores += stored if stored >= 0 else after.stores_total
        restores += restored if restored >= 0 and stored >= 0 else after.restores_total
    return _ratio(restores, stores)


def _latency_mean(field: str) -> Value:
    """Mean seconds of `field` ("ttft", "itl") over the window: from the engine's running sum and count
    (`requests.<field>_seconds_sum`, `_count`), or from its latency histogram where the server reports that
    instead (vLLM, SGLang)."""

    def value(snaps: Sequence[Snapshot], subject: str) -> float | None:
        sum_path, count_path = f"requests.{field}_seconds_sum", f"requests.{field}_count"
        if _knows(snaps, sum_path, count_path):
            mean = _ratio(delta(snaps, lambda s: getattr(s.requests, f"{field}_seconds_sum")),
                          delta(snaps, lambda s: getattr(s.requests, f"{field}_count")))
            if mean is not None:
                return mean
        if not _knows(snaps, field) or any(getattr(s, field) is None for s in (snaps[0], snaps[-1])):
            return None

        def histogram(attribute: str) -> Callable[[Snapshot], float]:
            return lambda s: getattr(getattr(s, field), attribute) if getattr(s, field) is not None else 0.0

        return _ratio(delta(snaps, histogram("sum")), delta(snaps, histogram("count")))

    return value


def _waiting_mean(snaps: Sequence[Snapshot], subject: str) -> float | None:
    """Requests waiting to be scheduled, averaged over the window's snapshots: under one, the engine kept up
    with what arrived (a request sampled in the moment between its arrival and the next step aside)."""
    if not _knows(snaps, "requests.waiting"):  # False for an empty window too
        return None
    return sum(s.requests.waiting for s in snaps) / len(snaps)


def _error_share(snaps: Sequence[Snapshot], subject: str) -> float | None:
    if not _knows(snaps, "requests.aborted_total", "requests.finished_total"):
        return None
    return _ratio(delta(snaps, lambda s: s.requests.aborted_total), traffic(snaps))


def _decode_step_ms(snaps: Sequence[Snapshot], subject: str) -> float | None:
    """Median decode-only step of the window, in ms: steps are samples, not counters (no restart issue)."""
    if not _knows(snaps, "steps") or len(snaps) < 2:
        return None
    durations = [step.duration_s * 1000 for step in recent_steps(snaps, snaps[0].time) if step.decode_only]
    return median(durations) if durations else None


def _slot_efficiency(snaps: Sequence[Snapshot], subject: str) -> float | None:
    """Used / allocated KV slots, averaged over the window: how much of what requests hold they use."""
    if not _knows(snaps, "blocks.used_slots", "blocks.allocated_slots"):
        return None
    samples = [s.blocks.used_slots / s.blocks.allocated_slots for s in snaps if s.blocks.allocated_slots > 0]
    return sum(samples) / len(samples) if samples else None


def _kv_slots_per_request(snaps: Sequence[Snapshot], subject: str) -> float | None:
    """KV slots held per running request (the pool's slots in use over the requests running), averaged over
    the window's busy snapshots: what a server that reports no slot fill level (vLLM) shows of a block size."""
    if not _knows(snaps, "blocks.usage", "engine.num_blocks", "engine.block_size", "requests.running"):
        return None
    samples = [s.blocks.usage * s.engine.num_blocks * s.engine.block_size / s.requests.running
               for s in snaps if s.requests.running > 0]
    return sum(samples) / len(samples) if samples else None


def _kv_usage_max(snaps: Sequence[Snapshot], subject: str) -> float | None:
    if not _knows(snaps, "blocks.usage"):
        return None
    return max(s.blocks.usage for s in snaps)


def _overcommit(snaps: Sequence[Snapshot], subject: str) -> float | None:
    """kv_oom_start's overcommit of the window's latest configuration: blocks that max_num_seqs requests of
    max_model_len need over the pool's blocks."""
    paths = ("engine.num_blocks", "engine.block_size", "engine.max_model_len", "engine.max_num_seqs")
    if not _knows(snaps, *paths):
        return None
    engine = snaps[-1].engine
    if engine.num_blocks <= 0 or engine.block_size <= 0 or engine.max_num_seqs <= 0:
        return None
    return engine.max_num_seqs * blocks_for(engine.max_model_len, engine.block_size) / engine.num_blocks


VALUES: dict[str, Value] = {
    "hit_rate": _hit_rate,
    "preemptions_per_s": rate("requests.preemptions_total", lambda s: s.requests.preemptions_total),
    "swap_out_per_s": rate("swap.swap_out_total", lambda s: s.swap.swap_out_total),
    "victims_hit_rate": _victims_hit_rate,
    "evictions_caused_per_s": _evictions_caused,
    "throughput_tokens_per_s": rate("requests.generation_tokens_total", lambda s: s.requests.generation_tokens_total),
    "ttft_mean_s": _latency_mean("ttft"),
    "itl_mean_s": _latency_mean("itl"),
    "waiting_mean": _waiting_mean,
    "error_share": _error_share,
    "decode_step_ms": _decode_step_ms,
    "slot_efficiency": _slot_efficiency,
    "kv_slots_per_request": _kv_slots_per_request,
    "kv_usage_max": _kv_usage_max,
    "overcommit": _overcommit,
    "kv_restore_share": _restore_share,
    "tenant_hit_rate": _tenant_hit_rate,
    "events_evictions_caused_per_s": _events_evictions_caused,
}


# ------------------------------------------------------------------ windows and parts


def split(snaps: Sequence[Snapshot], parts: int) -> list[Sequence[Snapshot]]:
    """`parts` sub-windows of equal duration, neighbours sharing their boundary snapshot (the one nearest
    to the boundary time) so that every pair of consecutive snapshots lies in exactly one of them."""
    if len(snaps) < 2 or parts < 1:
        return []
    start, end = snaps[0].time, snaps[-1].time
    times = [snap.time for snap in snaps]
    cuts = [0]
    for k in range(1, parts):
        boundary = start + (end - start) * k / parts
        cuts.append(min(range(len(times)), key=lambda i: abs(times[i] - boundary)))
    cuts.append(len(snaps) - 1)
    return [snaps[lo:hi + 1] for lo, hi in itertools.pairwise(cuts) if hi > lo]


def measure_with(value: Value, snaps: Sequence[Snapshot], subject: str = "", parts: int = 4) -> Measurement:
    whole = value(snaps, subject)
    if whole is None or not math.isfinite(whole):
        return Measurement(None, (), traffic(snaps))
    pieces = (value(piece, subject) for piece in split(snaps, parts))
    return Measurement(whole, tuple(v for v in pieces if v is not None and math.isfinite(v)), traffic(snaps))


def _measure(name: str) -> Measure:
    return lambda snaps, subject: measure_with(VALUES[name], snaps, subject)


MEASURES: dict[str, Measure] = {name: _measure(name) for name in VALUES}


def measure(name: str, snaps: Sequence[Snapshot], subject: str = "", parts: int = 4) -> Measurement:
    """The measure `name` of a window (its snapshots, oldest first); KeyError for an unknown name."""
    return measure_with(VALUES[name], snaps, subject, parts)
