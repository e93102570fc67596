"""Latency over its objective: time to first token and inter-token latency percentiles against the SLOs
a user sets.

The latency histograms (`Snapshot.ttft`, `Snapshot.itl`, cumulative since start) are diffed across the
window (`histogram_since`), so the percentile is the window's, not the run's. With no SLO set the rule
says nothing (doctor shows the percentiles anyway); with one, each metric over it is its own diagnosis
(subject "ttft" or "itl"), critical from `critical_factor` times the SLO.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field, field_validator

from kvops.history import EngineHistory
from kvops.rules.common import (
    WindowRuleSettings,
    covered_window,
    diagnosis,
    fresh_latest,
    rounded,
    run_span,
    window_histogram,
)
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.schema.snapshot import HISTOGRAM_PERCENTILES, Histogram, Snapshot

RULE_ID = "latency_slo"
TITLE = "Latency above its objective"
DESCRIPTION = "the window's TTFT or inter-token latency percentile is above the SLO set for it"

# Per metric: what it is and what usually brings it down.
ADVICE = {
    "ttft": ("time to first token", "TTFT is queueing plus prefill: see the queueing line (admit more requests "
             "or add replicas), keep chunked prefill on, shorten or share prompt prefixes"),
    "itl": ("inter-token latency", "each decode step serves the whole batch: fewer concurrent sequences "
            "(max_num_seqs) or a smaller prefill chunk per step (max_num_batched_tokens) shorten it; "
            "preemptions and swapping lengthen it"),
}


class Settings(WindowRuleSettings):
    ttft_slo_s: float | None = Field(None, gt=0, description="objective for the TTFT percentile (seconds); "
                                                             "None: not checked")
    itl_slo_s: float | None = Field(None, gt=0, description="objective for the inter-token latency percentile "
                                                            "(seconds); None: not checked")
    percentile: int = Field(95, description=f"the percentile held to the SLO, one of {HISTOGRAM_PERCENTILES}")
    min_requests: int = Field(10, ge=1, description="first tokens (requests) the window's TTFT needs")
    min_tokens: int = Field(100, ge=1, description="token gaps the window's inter-token latency needs")
    critical_factor: float = Field(2.0, gt=1, description="critical at this many times the SLO")

    @field_validator("percentile")
    @classmethod
    def _reported(cls, value: int) -> int:
        if value not in HISTOGRAM_PERCENTILES:
            raise ValueError(f"percentile must be one of {HISTOGRAM_PERCENTILES} (the ones histograms report)")
        return value


def _check(history: EngineHistory, settings: Settings, snaps: list[Snapshot], span: float, metric: str,
           slo: float | None, get: Callable[[Snapshot], Histogram | None], min_count: int) -> list[Diagnosis]:
    if slo is None:
        return []
    hist = window_histogram(snaps, get)
    if hist is None or hist.count < min_count:
        return []
    value = getattr(hist, f"p{settings.percentile}")
    if value is None or value <= slo:
        return []
    name, advice = ADVICE[metric]
    severity = Severity.CRITICAL if value >= settings.critical_factor * slo else Severity.WARNING
    summary = (f"{name} p{settings.percentile} is {value:.3g} s over the last {span:.0f} s ({hist.count} "
               f"observations), above the {slo:.3g} s objective")
    return [diagnosis(
        history, RULE_ID, TITLE, severity, summary,
        {
            f"{metric}_p50_s": rounded(hist.p50),
            f"{metric}_p95_s": rounded(hist.p95),
            f"{metric}_p99_s": rounded(hist.p99),
            f"{metric}_mean_s": round(hist.sum / hist.count, 4) if hist.count else None,
            "percentile": settings.percentile,
            "value_s": round(value, 4),
            "slo_s": slo,
            "count": hist.count,
            "window_s": round(span, 1),
        },
        fix=Fix(kind=FixKind.REPORT, action="advice", description=advice), subject=metric,
    )]


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    if settings.ttft_slo_s is None and settings.itl_slo_s is None:
        return []
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None:
        return []
    span = run_span(latest, settings.window_s)
    snaps = covered_window(history, span, settings)
    if not snaps:
        return []
    return [*_check(history, settings, snaps, span, "ttft", settings.ttft_slo_s, lambda s: s.ttft,
                    settings.min_requests),
            *_check(history, settings, snaps, span, "itl", settings.itl_slo_s, lambda s: s.itl, settings.min_tokens)]
