"""An audit entry: one step in a fix's life, as the supervisor records it in audit.jsonl and serves
it at GET /api/audit, and as `kvops top` and the scenarios read it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from kvops.schema.diagnosis import Fix
from kvops.schema.verdict import Verdict

# A fix's steps. `queued` / `applying` / `verifying`: its job's progress; `verified` (kept: improved, or
# inconclusive and kept by policy), `rolled_back` (no effect, worse, inconclusive), `failed` (the change
# or the engine failed: back on the last good settings), `reverted` (by request).
Action = Literal["proposed", "queued", "applying", "applied", "verifying", "verified", "rolled_back", "failed",
                 "reverted"]


class AuditEntry(BaseModel):
    id: int
    time: float
    engine: str
    rule: str
    subject: str = ""
    action: Action
    fix: Fix | None = None
    before: dict[str, Any] = Field(default_factory=dict)  # the settings before the fix
    after: dict[str, Any] = Field(default_factory=dict)  # ... and after it
    evidence_before: dict[str, Any] = Field(default_factory=dict)
    evidence_after: dict[str, Any] = Field(default_factory=dict)
    message: str = ""
    verdict: Verdict | None = None  # on verified / rolled_back / failed: the numbers behind the decision
