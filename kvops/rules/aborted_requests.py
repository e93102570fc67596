"""Many requests end aborted: clients give up (time out, disconnect, cancel) before the answer is done.

Over the window (counter deltas), the share of aborted requests among those that ended, once at least
`min_requests` ended. Aborts are a symptom: clients usually give up because the first token takes too long,
i.e. requests queue (see the queueing and latency_slo lines), or because the answers are too slow to stream.
Where the server counts aborts (`requests.aborted_total` known), and where it does not count a client's hang-up
but its counters show it (`requests.abandoned_total`: vLLM's requests with a first token and no end, read by
kvops.kinds.vllm): abandoned requests are aborted ones the server did not count, and are named apart. vLLM's V0
engine counts no abort at all: there the estimate is all there is, and the summary says what it cannot see.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from kvops.history import EngineHistory
from kvops.rules.common import WindowRuleSettings, covered_window, diagnosis, fresh_latest, run_span
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity

RULE_ID = "aborted_requests"
TITLE = "Many requests are aborted: clients give up before the answer"
DESCRIPTION = "a large share of the requests that ended in the window were aborted"

class Settings(WindowRuleSettings):
    min_requests: int = Field(20, ge=1, description="requests that ended in the window (aborted or not)")
    warning_share: float = Field(0.10, gt=0, le=1, description="warning from this share of aborted requests")
    critical_share: float = Field(0.50, gt=0, le=1, description="critical from this share")

    @model_validator(mode="after")
    def _ordered(self) -> Settings:
        if self.critical_share < self.warning_share:
            raise ValueError("critical_share must be at least warning_share")
        return self


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None or not latest.knows("requests.finished_total"):
        return []
    counted, estimated = latest.knows("requests.aborted_total"), latest.requests.abandoned_total is not None
    if not counted and not estimated:
        return []
    span = run_span(latest, settings.window_s)
    if not covered_window(history, span, settings):
        return []
    counted_aborts = history.delta(lambda s: s.requests.aborted_total, span) or 0.0 if counted else 0.0
    abandoned = abandoned_in(history, span) if estimated else 0.0
    aborted = counted_aborts + abandoned
    finished = history.delta(lambda s: s.requests.finished_total, span) or 0.0
    ended = finished + aborted  # the snapshot counts the two apart, on every kind of server
    if ended < settings.min_requests or ended <= 0:
        return []
    share = aborted / ended
    if share < settings.warning_share:
        return []
    severity = Severity.CRITICAL if share >= settings.critical_share else Severity.WARNING
    uncounted = (f" ({abandoned:.0f} of them abandoned: a first token and no end, which {latest.source} does "
                 "not count as an abort)") if abandoned and counted else ""
    if not counted:  # vLLM's V0 engine: no abort counter, the estimate alone, blind before the first token
        uncounted = (f" (all abandoned: a first token and no end; {latest.source} counts no aborts, so requests "
                     "given up before their first token are not seen)")
    summary = (f"{aborted:.0f} of {ended:.0f} requests that ended in the last {span:.0f} s were aborted "
               f"({share:.0%}){uncounted}: clients time out or disconnect, usually because requests queue or the "
               f"first token is slow; check the queueing and latency lines")
    return [diagnosis(
        history, RULE_ID, TITLE, severity, summary,
        {
            "aborted": int(aborted),
            "finished": int(ended - aborted),
            "ended": int(ended),
            **({"abandoned": int(abandoned)} if estimated else {}),
            "aborted_share": round(share, 4),
            "waiting": latest.requests.waiting if latest.knows("requests.waiting") else None,
            "running": latest.requests.running if latest.knows("requests.running") else None,
            "window_s": round(span, 1),
        },
        fix=Fix(kind=FixKind.REPORT, action="advice",
                description="find why clients give up: if requests queue or TTFT is high, admit more requests or "
                            "add capacity; else raise the clients' timeouts or look at their logs"),
    )]


def abandoned_in(history: EngineHistory, span: float) -> float:
    """Requests abandoned over the window: the estimate's rise from the window's first snapshot to its last.
    Not a counter's increase: the estimate dips while new requests wait for their first token (it takes every
    live request off), and a dip is not a restart (the span is the current run's already)."""
    points = [s.requests.abandoned_total for s in history.window(span) if s.requests.abandoned_total is not None]
    return float(max(0, points[-1] - points[0])) if len(points) >= 2 else 0.0
