"""Requests queue while the KV cache has room: the engine is bound by its scheduler or its concurrency
cap, not by KV memory.

Over the window, requests wait in most snapshots (and enough of them on average) while the share of the
pool held by running sequences stays below a headroom threshold and preemptions are not rising. A full
pool, or a rising preemption rate, is KV-bound queueing: kv_oom_runtime's case, so this rule stays
silent there and the two never report one queue twice. What to raise is the engine's own concurrency
knob, in its kind's words (its profile's `Remedy.QUEUEING`); nothing is changed automatically (a report).
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.kinds import Remedy, profile_of
from kvops.rules.common import (
    Evidence,
    WindowRuleSettings,
    covered_window,
    diagnosis,
    earlier_and_recent,
    fresh_latest,
    rounded,
    run_span,
    window_histogram,
)
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.schema.snapshot import Snapshot

RULE_ID = "queueing"
TITLE = "Requests queue while the KV cache has room: scheduler- or concurrency-bound"
DESCRIPTION = "requests wait through the window while KV usage stays below the headroom and nothing is preempted"

# A kind whose profile does not word the knob: named by what it does, no kind's flag in another's mouth.
UNWORDED_KNOB = "raise the server's limit on running requests"


class Settings(WindowRuleSettings):
    window_s: float = Field(120.0, gt=0, description="waiting, usage and latency are read over this window")
    min_waiting_share: float = Field(0.75, gt=0, le=1, description="share of the window's snapshots with at least "
                                                                   "one request waiting")
    min_mean_waiting: float = Field(2.0, gt=0, description="mean requests waiting over the window")
    max_kv_usage: float = Field(0.8, gt=0, le=1, description="KV usage (share of the pool held by running "
                                                             "sequences) the window must stay below: above it the "
                                                             "queue is KV-bound (kv_oom_runtime's case)")
    critical_ttft_s: float = Field(30.0, gt=0, description="critical when TTFT (the larger of p95 and the "
                                                           "mean: a p95 past the last bucket reads low) reaches this")
    critical_waiting_ratio: float = Field(10.0, gt=0, description="critical when mean waiting reaches this many "
                                                                  "times mean running")


def _preemptions(snap: Snapshot) -> float:
    return snap.requests.preemptions_total


def _ttft(history: EngineHistory, snaps: list[Snapshot], span: float) -> Evidence:
    """TTFT over the window: percentiles from the histogram, else the mean from the cumulative sums."""
    hist = window_histogram(snaps, lambda s: s.ttft)
    if hist is not None and hist.count > 0:
        return {"ttft_p50_s": rounded(hist.p50, 3), "ttft_p95_s": rounded(hist.p95, 3),
                "ttft_p99_s": rounded(hist.p99, 3), "ttft_mean_s": round(hist.sum / hist.count, 3),
                "ttft_count": hist.count}
    count = history.delta(lambda s: s.requests.ttft_count, span) or 0.0
    total = history.delta(lambda s: s.requests.ttft_seconds_sum, span) or 0.0
    known = snaps[-1].knows("requests.ttft_count")
    return {"ttft_p50_s": None, "ttft_p95_s": None, "ttft_p99_s": None,
            "ttft_mean_s": round(total / count, 3) if known and count > 0 else None,
            "ttft_count": int(count) if known else None}


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    # Without the queue or the usage there is no telling scheduler-bound from KV-bound.
    if latest is None or not latest.knows("requests.waiting") or not latest.knows("blocks.usage"):
        return []
    span = run_span(latest, settings.window_s)
    snaps = covered_window(history, span, settings)
    if not snaps:
        return []
    n = len(snaps)
    waiting_share = sum(s.requests.waiting >= 1 for s in snaps) / n
    mean_waiting = sum(s.requests.waiting for s in snaps) / n
    mean_running = sum(s.requests.running for s in snaps) / n
    max_usage = max(s.blocks.usage for s in snaps)
    if waiting_share < settings.min_waiting_share or mean_waiting < settings.min_mean_waiting:
        return []
    if max_usage >= settings.max_kv_usage:
        return []  # the pool is (nearly) full: KV-bound, kv_oom_runtime's case
    halves = earlier_and_recent(history, _preemptions, span) if latest.knows("requests.preemptions_total") else None
    if halves is not None and halves[1] > 0 and halves[1] >= halves[0]:
        return []  # preempting and not calming down: the pool is what limits, whatever usage says

    ttft = _ttft(history, snaps, span)
    ttft_s = max((v for v in (ttft["ttft_p95_s"], ttft["ttft_mean_s"]) if isinstance(v, float)), default=None)
    cap = latest.engine.max_num_seqs if latest.knows("engine.max_num_seqs") and latest.engine.max_num_seqs > 0 \
        else None
    # At the cap in most of the window: the concurrency limit, not the scheduler's pace, holds the queue.
    at_cap = None if cap is None else sum(s.requests.running >= cap for s in snaps) / n >= settings.min_waiting_share
    critical = ((isinstance(ttft_s, float) and ttft_s >= settings.critical_ttft_s)
                or mean_waiting >= settings.critical_waiting_ratio * max(mean_running, 1.0))

    knob = profile_of(latest).remedy(Remedy.QUEUEING) or UNWORDED_KNOB
    bound = f"running is at max_num_seqs={cap}" if at_cap else "the scheduler admits slower than requests arrive"
    # A p95 above the histogram's last bound reads as that bound: the mean then tells how far above.
    parts = [f"{label} {ttft[key]:.1f} s" for label, key in (("p95", "ttft_p95_s"), ("mean", "ttft_mean_s"))
             if isinstance(ttft[key], float)]
    latency = f"; TTFT {', '.join(parts)}" if parts else ""
    summary = (f"{mean_waiting:.0f} requests waiting on average ({mean_running:.0f} running) over {span:.0f} s "
               f"while KV usage peaked at {max_usage:.0%}{latency}: {bound}, not KV memory; {knob}")
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.CRITICAL if critical else Severity.WARNING, summary,
        {
            "waiting": latest.requests.waiting,
            "running": latest.requests.running,
            "waiting_mean": round(mean_waiting, 1),
            "running_mean": round(mean_running, 1),
            "waiting_share": round(waiting_share, 3),
            "kv_usage": round(latest.blocks.usage, 4),
            "kv_usage_max": round(max_usage, 4),
            "preemptions": None if halves is None else int(sum(halves)),
            **ttft,
            "max_num_seqs": cap,
            "at_concurrency_cap": at_cap,
            "window_s": round(span, 1),
        },
        fix=Fix(kind=FixKind.REPORT, action="advice",
                description=f"{knob}: the KV pool has {1 - max_usage:.0%} free at the peak; if the GPU is already "
                            f"busy, add replicas instead"),
    )]
