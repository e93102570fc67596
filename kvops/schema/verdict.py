"""A fix's verdict: what its objectives and the guards measured before and after it, and what that means.

Written by the supervisor's fix jobs (kvops.supervisor.fixes.judge decides it) into the audit log, the API and
the persisted job state; read by `kvops top` and the scenarios.
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, Field


class VerdictKind(enum.StrEnum):
    IMPROVED = "improved"  # every objective moved the right way by more than its effect and the noise; guards held
    NO_EFFECT = "no_effect"  # an objective moved less than its smallest effect or the noise: rolled back
    WORSE = "worse"  # an objective or a guard moved the wrong way beyond the noise: rolled back
    INCONCLUSIVE = "inconclusive"  # too little traffic to tell, even after one extension: policy decides
    FAILED = "failed"  # the engine went down or did not start during the window: back to the last good settings


class Change(BaseModel):
    """One measure before and after a fix."""

    measure: str
    subject: str = ""
    better: Literal["lower", "higher"]
    before: float | None  # None: not measurable in that window (no traffic, not reported)
    after: float | None
    noise: float | None = None  # the before-window's own spread: a change within it is no change
    min_effect: float = 0.0  # relative (absolute when `before` is 0)
    ok: bool | None = None  # objective: improved enough; guard: not worse beyond the noise; None: not measured
    note: str = ""  # why a guard held although its measure moved beyond the tolerance (throughput: demand fell)


class Verdict(BaseModel):
    kind: VerdictKind
    objectives: list[Change] = Field(default_factory=list)
    guards: list[Change] = Field(default_factory=list)  # throughput, TTFT, errors: must not get worse
    before_window: tuple[float, float] = (0.0, 0.0)  # unix seconds, start and end
    after_window: tuple[float, float] = (0.0, 0.0)
    traffic_before: float = 0.0  # requests that ended in each window: enough to judge?
    traffic_after: float = 0.0
    extended: bool = False  # the after-window was extended once for lack of traffic
    message: str = ""  # one line with the numbers
