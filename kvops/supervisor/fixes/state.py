"""A fix job as the supervisor keeps it, and `state_dir/fix_jobs.json`, where pending jobs and each managed
engine's last good settings survive a supervisor restart.

The file is rewritten whole on every change of a job's state (not on progress ticks), atomically: a temp
file in the same folder, fsync, rename over the old one, fsync the folder, so a crash leaves the old file
or the new one, never half of each. A file that cannot be read is moved aside (`fix_jobs.json.corrupt-<time>`)
with a warning: the supervisor starts without its jobs rather than not at all.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, Field, ValidationError

from kvops.schema.diagnosis import Fix
from kvops.schema.snapshot import Snapshot
from kvops.schema.verdict import Verdict

log = structlog.get_logger("kvops.supervisor.fixes")

# queued -> applying -> verifying -> verified | rolled_back | failed; `reverting`: an undo (a revert by request,
# or a rollback) that could not reach the engine yet and is retried; `reverted`: undone by request.
JobState = Literal["queued", "applying", "verifying", "reverting", "verified", "rolled_back", "failed", "reverted"]
PENDING: frozenset[str] = frozenset({"queued", "applying", "verifying", "reverting"})
MAX_BEFORE_SNAPSHOTS = 600  # the before-window kept for the judge across a restart: 5 min at a 0.5 s poll


class FixJob(BaseModel):
    id: int  # the id of its `queued` audit entry
    engine: str
    rule: str
    subject: str = ""
    fix: Fix
    evidence_before: dict[str, Any] = Field(default_factory=dict)
    state: JobState = "queued"
    phase: str = ""  # what it is doing now, e.g. "restarting: waiting for health"
    phase_started: float = 0.0
    phase_total_s: float = 0.0  # how long the phase may take (0: open-ended)
    queued_at: float
    applied_at: float | None = None  # the change was sent: the before-window ends here
    effective_at: float | None = None  # the change took effect (a restarted engine answered): the after-window
    verify_until: float | None = None  # the after-window's end
    window_s: float
    extended: bool = False
    before: dict[str, Any] = Field(default_factory=dict)  # settings before the change (the audit's "before")
    after: dict[str, Any] = Field(default_factory=dict)
    sent: dict[str, Any] = Field(default_factory=dict)  # admin: the params sent (re-sent after a restart)
    undo: dict[str, Any] = Field(default_factory=dict)  # admin: the params that undo it
    before_snapshots: list[Snapshot] = Field(default_factory=list)
    reapply: bool = False  # resumed after a supervisor restart: re-establish the change, then a fresh window
    # A pending undo (state `reverting`): the action it records once done, and why.
    undo_action: Literal["reverted", "rolled_back", "failed"] = "reverted"
    undo_attempts: int = 0
    verdict: Verdict | None = None
    message: str = ""
    entry_ids: list[int] = Field(default_factory=list)  # its audit entries: a revert may name any of them
    ended_at: float | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.rule, self.engine, self.subject)

    def set_phase(self, text: str, now: float, total_s: float = 0.0) -> None:
        self.phase, self.phase_started, self.phase_total_s = text, now, total_s

    def progress(self, now: float) -> str:
        """One line for the API and `kvops top`, e.g. "verifying 40/60 s"."""
        if self.state == "verifying" and self.effective_at is not None and self.verify_until is not None:
            total = self.verify_until - self.effective_at
            done = min(max(0.0, now - self.effective_at), total)
            return f"verifying {done:.0f}/{total:.0f} s" + (" (extended once)" if self.extended else "")
        if self.state in PENDING and self.phase:
            elapsed = max(0.0, now - self.phase_started)
            return f"{self.phase} {elapsed:.0f}/{self.phase_total_s:.0f} s" if self.phase_total_s else \
                f"{self.phase} ({elapsed:.0f} s)"
        return self.message

    def view(self, now: float) -> dict[str, Any]:
        """GET /api/fixes's row: the job without its snapshots (their number instead)."""
        data = self.model_dump(mode="json", exclude={"before_snapshots", "phase_started", "phase_total_s"})
        data["progress"] = self.progress(now)
        data["before_snapshots"] = len(self.before_snapshots)
        return data


class LastGood(BaseModel):
    config: dict[str, Any]  # the engine's args in the config when recorded: a changed config wins over them
    args: dict[str, Any]


class FixStateFile(BaseModel):
    version: int = 1
    jobs: list[FixJob] = Field(default_factory=list)
    last_good: dict[str, LastGood] = Field(default_factory=dict)


class FixStateStore:
    def __init__(self, path: Path | None) -> None:
        self.path = path

    def load(self) -> FixStateFile:
        if self.path is None or not self.path.is_file():
            return FixStateFile()
        try:
            return FixStateFile.model_validate_json(self.path.read_bytes())
        except (ValidationError, ValueError, OSError) as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
            with contextlib.suppress(OSError):
                self.path.rename(aside)
            log.warning("fix job state unreadable: moved aside, starting without pending jobs",
                        path=str(self.path), moved_to=str(aside), error=str(exc)[:300])
            return FixStateFile()

    def save(self, state: FixStateFile) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with tmp.open("wb") as file:
            file.write(state.model_dump_json().encode())
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)  # the rename itself is durable once the folder is synced
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
