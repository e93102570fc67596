"""Engine down: the last health checks all failed.

Reads the health samples only (a down engine sends no snapshots). One failed check is a blip;
`min_failures` in a row is an outage.
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.rules.common import RuleSettings, diagnosis
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity

RULE_ID = "engine_down"
TITLE = "Engine down: health checks failing"
# Back up means answering again: hold "down" only long enough that one lucky answer amid failures does not clear it.
CLEAR_FOR_S = 10.0
DESCRIPTION = "the last health checks of the engine all failed"


class Settings(RuleSettings):
    min_failures: int = Field(3, ge=1, description="consecutive failed health checks that make an outage")


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    samples = list(history.health)
    if len(samples) < settings.min_failures or any(s.up for s in samples[-settings.min_failures:]):
        return []
    failing = 0
    for sample in reversed(samples):
        if sample.up:
            break
        failing += 1
    first_failure = samples[-failing]
    last_up = samples[-failing - 1].t if failing < len(samples) else None
    last_error = samples[-1].error or "no error given"
    if history.managed:
        advice = "the engine manager restarts it with backoff; if it keeps failing, read its exits (crash_loop)"
    else:
        advice = "kvops does not manage this engine: check its process, host and network"
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.CRITICAL,
        f"{failing} health checks failed in a row, down for {now - first_failure.t:.0f} s: {last_error}",
        {
            "consecutive_failures": failing,
            "down_since": first_failure.t,
            "down_for_s": round(now - first_failure.t, 1),
            "last_up_at": last_up,
            "last_error": last_error,
            "managed": history.managed,
            "restarts_total": history.restarts_total,
        },
        fix=Fix(kind=FixKind.REPORT, action="advice", description=advice),
    )]
