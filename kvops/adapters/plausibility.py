"""Data that cannot be right: metrics problems, reported apart from diagnoses.

A diagnosis says what the engine does wrong; these say the numbers it reports are wrong (a broken exporter,
buckets that do not fit, a proxy mixing two servers), so no diagnosis built on them can be trusted. The
adapters record values out of range as they read them (`Snapshot.data_problems`); the checks here need the
whole snapshot (histograms) or two of them (counters). Doctor and `kvops run` both use them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from kvops.schema.snapshot import Histogram, Snapshot

# A histogram with at least this many samples, every one in a first bucket no higher than the bound given
# here, is implausible: prompts of one token and first tokens within a millisecond are what a broken
# exporter reports, not a workload. A first bucket above the bound can legitimately hold everything (a fast
# GPU's inter-token latencies all under vLLM's first bound of 10 ms); generated lengths of 1 are a
# scoring workload, so they are not checked.
MIN_SAMPLES_FIRST_BUCKET = 20
HISTOGRAMS: dict[str, tuple[Callable[[Snapshot], Histogram | None], float]] = {
    "prompt_lengths": (lambda s: s.prompt_lengths, 1.0),
    "ttft": (lambda s: s.ttft, 0.001),
    "itl": (lambda s: s.itl, 0.0005),
}
COUNTERS: dict[str, Callable[[Snapshot], int]] = {
    "requests.finished_total": lambda s: s.requests.finished_total,
    "requests.aborted_total": lambda s: s.requests.aborted_total,
    "requests.preemptions_total": lambda s: s.requests.preemptions_total,
    "requests.prompt_tokens_total": lambda s: s.requests.prompt_tokens_total,
    "requests.generation_tokens_total": lambda s: s.requests.generation_tokens_total,
    "prefix_cache.queries_total": lambda s: s.prefix_cache.queries_total,
    "prefix_cache.hits_total": lambda s: s.prefix_cache.hits_total,
}
# Process start times within this many seconds are the same process (the servers round them differently).
SAME_START_S = 1.0


def _named(snap: Snapshot, field: str) -> str:
    names = snap.metrics_read.get(field)
    return f"{field} ({', '.join(names)})" if names else field


def snapshot_problems(snap: Snapshot) -> list[str]:
    """The problems one snapshot shows: what the adapter recorded, and histograms piled into their first bucket."""
    problems = list(snap.data_problems)
    for field, (get, highest_first_bound) in HISTOGRAMS.items():
        histogram = get(snap)
        if (histogram is None or not snap.knows(field) or not histogram.buckets
                or histogram.buckets[0] > highest_first_bound
                or histogram.count < MIN_SAMPLES_FIRST_BUCKET or histogram.counts[0] < histogram.count):
            continue
        problems.append(f"{_named(snap, field)}: all {histogram.count} samples in the first bucket "
                        f"(≤ {histogram.buckets[0]:g}): the server records 0, or its buckets do not fit the values")
    return problems


def backwards(before: Snapshot, after: Snapshot) -> dict[str, str]:
    """The counters that went backwards from one snapshot to the next of the same process (same start time), each
    with its problem: a counter resets only when its process restarts."""
    if not before.knows("uptime_s") or abs(after.engine.started_at - before.engine.started_at) > SAME_START_S:
        return {}
    return {field: f"{_named(after, field)} went backwards from {get(before)} to {get(after)} without a restart: "
                   "two servers behind one address, or a broken exporter"
            for field, get in COUNTERS.items()
            if before.knows(field) and after.knows(field) and get(after) < get(before)}


def history_problems(snaps: Sequence[Snapshot]) -> list[str]:
    """Counters that went backwards between consecutive snapshots of one process, the first time for each."""
    found: dict[str, str] = {}
    for before, after in itertools.pairwise(snaps):
        for field, problem in backwards(before, after).items():
            found.setdefault(field, problem)
    return list(found.values())


def problems(snaps: Sequence[Snapshot]) -> list[str]:
    """Every problem in a run of snapshots of one engine, the latest snapshot's first."""
    return snapshot_problems(snaps[-1]) + history_problems(snaps) if snaps else []
