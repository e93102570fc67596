"""A diagnosis: what a rule found, the numbers behind it, and the fix it proposes.

Diagnoses cross process boundaries (the supervisor API, `kvops top`, alert payloads), so they
are pydantic models. A diagnosis is identified by (rule id, engine, subject): the same problem
seen on the next evaluation is the same diagnosis, which is what alert deduplication and fix
verification key on.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, Field


class Severity(enum.StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class FixKind(enum.StrEnum):
    ADMIN = "admin"  # a live change through the engine's admin API
    RESTART = "restart"  # a managed restart with a changed engine config (drained first)
    REPORT = "report"  # nothing kvops can change itself: the fix text is advice for a person
    GATEWAY = "gateway"  # a live change of a tenant's policy through the `kvops gateway` in front of the engine


class Objective(BaseModel):
    """What a fix must move, measured on the engine's snapshots (a measure of kvops.supervisor.fixes.measures) over
    equal windows before and after the fix: which way, and the smallest effect that counts."""

    measure: str  # a key of kvops.supervisor.fixes.measures.MEASURES, e.g. "hit_rate", "preemptions_per_s"
    better: Literal["lower", "higher"]
    min_effect: float = Field(0.1, ge=0)  # relative to the value before (0.1 = 10%); absolute when that is 0
    subject: str = ""  # whose measure, for per-tenant ones (e.g. the tenant polluting the others' cache)


class Fix(BaseModel):
    """What to change. `action` names an admin call or the engine settings to restart with."""

    kind: FixKind
    action: str  # admin: set_normalization | set_prefix_caching | set_eviction_policy | set_tenant_quota;
    # restart: restart_engine; gateway: set_gateway_policy; report: advice
    params: dict[str, Any] = Field(default_factory=dict)  # e.g. {"mode": "on"}, {"block_size": 32}
    description: str  # one sentence a person can act on, with the numbers
    # What it must move for kvops to keep it: every objective must improve (and the guards of
    # kvops.supervisor.fixes.judge must hold). Empty for a report, or a change kvops cannot measure (then kept
    # or rolled back by policy, with a note).
    objectives: list[Objective] = Field(default_factory=list)


class Diagnosis(BaseModel):
    rule: str  # stable rule id, e.g. "kv_oom_runtime"
    engine: str  # the engine's name in the supervisor config
    subject: str = ""  # what inside the engine, when a rule can fire several times (a tenant, a layer)
    severity: Severity
    title: str  # short, fixed per rule
    summary: str  # one line with the numbers, e.g. "free blocks run out in 42 s at the current rate"
    evidence: dict[str, float | int | str | bool | None]
    fix: Fix | None = None
    # Set while the supervisor holds a diagnosis its rule no longer raises (kvops.supervisor.hysteresis): when
    # the rule last raised it. It clears once the rule has stayed quiet for its clear_for_s.
    clearing_since: float | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.rule, self.engine, self.subject)
