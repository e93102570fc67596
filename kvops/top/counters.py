"""What `kvops top` reads from the running counters a server reports instead of kvops's own windowed fields.

A kvops engine's snapshot carries its prefix-cache hit rate over its own window and running TTFT / ITL sums.
vLLM (and the other servers read through /metrics) reports neither: only cumulative prefix-cache lookups and hits,
and TTFT / ITL histograms. Read as they were, those fields are zeros, and the trends showed a vLLM that served 80%
of its prompt tokens from cache at "hit rate 0%", with TTFT and ITL at "0 ms"."""

from __future__ import annotations

from collections.abc import Sequence

from kvops.schema.snapshot import Snapshot

# The hit rate of a server without a window of its own is taken over this many seconds of the history: a poll
# interval alone (0.5 s) often holds no lookup, or one request's.
HIT_RATE_WINDOW_S = 10.0


def has_window_hit_rate(s: Snapshot) -> bool:
    return s.knows("prefix_cache.window_hit_rate")


def hit_rates(history: Sequence[Snapshot]) -> list[float]:
    """One hit rate per snapshot, oldest first: the engine's own window where it reports one, else the share of the
    prompt tokens looked up over the last HIT_RATE_WINDOW_S that hit (the last value carried over a stretch with
    no lookup, 0 before the first; a counter that went back, a restarted server, starts the window again)."""
    rates: list[float] = []
    start = 0
    for i, s in enumerate(history):
        if has_window_hit_rate(s):
            rates.append(s.prefix_cache.window_hit_rate)
            continue
        while start < i and (history[start].time < s.time - HIT_RATE_WINDOW_S
                             or history[start].prefix_cache.queries_total > s.prefix_cache.queries_total):
            start += 1
        first = history[start]
        queries = s.prefix_cache.queries_total - first.prefix_cache.queries_total
        hits = s.prefix_cache.hits_total - first.prefix_cache.hits_total
        rates.append(hits / queries if queries > 0 and hits >= 0 else (rates[-1] if rates else 0.0))
    return rates


def hit_rate_now(s: Snapshot, history: Sequence[Snapshot] = ()) -> tuple[float, str]:
    """The summary line's hit rate and what it covers: the engine's window (""), else the last HIT_RATE_WINDOW_S of
    `history` when it saw lookups, else the share since the server started."""
    if has_window_hit_rate(s):
        return s.prefix_cache.window_hit_rate, ""
    recent = [h for h in history if h.time >= s.time - HIT_RATE_WINDOW_S and not has_window_hit_rate(h)]
    if len(recent) >= 2 and recent[-1].prefix_cache.queries_total > recent[0].prefix_cache.queries_total:
        return hit_rates(recent)[-1], f" (last {HIT_RATE_WINDOW_S:g} s)"
    return s.prefix_cache.hit_rate, " (since start)"


def latency_totals(s: Snapshot, field: str) -> tuple[float, int]:
    """Seconds and count of `field` ("ttft", "itl") so far: the engine's running sums, else its histogram's."""
    sum_s: float = getattr(s.requests, f"{field}_seconds_sum")
    count: int = getattr(s.requests, f"{field}_count")
    hist = getattr(s, field)
    if count == 0 and hist is not None and hist.count > 0:
        return hist.sum, hist.count
    return sum_s, count
