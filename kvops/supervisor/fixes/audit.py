"""The fix audit log: every step of every fix (proposed, applied, verified, rolled back, failed,
reverted), kept in memory for the API and `kvops top`, appended to `audit.jsonl` in the state
directory so it survives a supervisor restart, and logged. The entry model is
kvops.schema.audit.AuditEntry; what the steps mean is the fix jobs' business (kvops.supervisor.fixes.jobs).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import structlog

from kvops.schema.audit import AuditEntry

log = structlog.get_logger("kvops.supervisor.fixes")  # the name operators already filter on


class AuditLog:
    """Bounded in memory, appended to `audit.jsonl` in the state directory, and logged."""

    def __init__(self, path: Path | None, max_entries: int = 1000) -> None:
        self.path = path
        self.entries: deque[AuditEntry] = deque(maxlen=max_entries)
        self._ids = itertools.count(1)
        if path is not None and path.is_file():
            for line in path.read_text().splitlines()[-max_entries:]:
                try:
                    self.entries.append(AuditEntry.model_validate_json(line))
                except ValueError:
                    continue  # a line cut short by a crash mid-write: the others still load
            # Ids continue after the reloaded ones, so the API's revert-by-id stays unambiguous.
            self._ids = itertools.count(max((e.id for e in self.entries), default=0) + 1)

    def record(self, **fields: Any) -> AuditEntry:
        entry = AuditEntry(id=next(self._ids), time=time.time(), **fields)
        self.entries.append(entry)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as file:
                file.write(entry.model_dump_json() + "\n")
                file.flush()
                os.fsync(file.fileno())  # a verdict recorded is a verdict kept, even if the machine dies next
        log.info(f"fix {entry.action}", engine=entry.engine, rule=entry.rule, subject=entry.subject,
                 fix=entry.fix.description if entry.fix else None, before=entry.before, after=entry.after,
                 evidence_before=entry.evidence_before, evidence_after=entry.evidence_after, message=entry.message)
        return entry
