"""What doctor found: one `Check` per line, grouped in sections, and the exit code they add up to."""

from __future__ import annotations

import enum

from pydantic import BaseModel, Field

FLEET = "Fleet"  # `kvops doctor --prometheus`: the heading of a report of its own (kvops.doctor.fleet), no validator's
SECTIONS = ("Environment", "Configuration", "Liveness", "Metrics data", "Cache health", "KV cache events",
            "Traffic", FLEET)


class Status(enum.StrEnum):
    OK = "ok"  # checked, fine
    INFO = "info"  # a fact worth knowing that is not a problem (no GPU on a CPU deployment, overcommit)
    WARN = "warn"  # works, but something should change
    FAIL = "fail"  # broken
    SKIPPED = "skipped"  # could not be checked here; the evidence says why and what would make it checkable


PROBLEMS = (Status.WARN, Status.FAIL)


class Check(BaseModel):
    section: str  # one of SECTIONS
    title: str  # what was checked, short
    status: Status
    evidence: str  # one line with the numbers
    remedy: str = ""  # what to change: the flag and the value
    detail: list[str] = Field(default_factory=list)  # shown with -v
    rule: str | None = None  # the rule whose diagnosis this line reports, if any
    metrics: list[str] = Field(default_factory=list)  # the server's metrics this line read (shown with -v)


class Report(BaseModel):
    target: str  # what was examined, in words
    # The engine's kind (kvops.kinds), when one was read; "flavour" in the JSON, the key scripts already read.
    kind: str | None = Field(default=None, serialization_alias="flavour")
    checks: list[Check] = Field(default_factory=list)
    could_not_check: str = ""  # why doctor could not examine the target at all (exit code 2)
    duration_s: float = 0.0

    def add(self, check: Check) -> None:
        self.checks.append(check)

    @property
    def problems(self) -> list[Check]:
        return [c for c in self.checks if c.status in PROBLEMS]

    @property
    def exit_code(self) -> int:
        """0 clean, 1 problems found, 2 could not check."""
        if self.could_not_check:
            return 2
        return 1 if self.problems else 0
