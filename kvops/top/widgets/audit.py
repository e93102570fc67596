"""The audit panel: the supervisor's fix audit log, newest first, each action once.

The supervisor records a step every time it happens: with the `suggest` policy a diagnosis that
resolves and comes back (a flapping one) gets a new "proposed" entry each time, so the raw log
repeats itself. The panel shows one row per (engine, rule, subject, action, fix change), with the
number of times (`×3`) and the latest time; `enter` lists every occurrence.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.app import ComposeResult

from kvops.row_table import RowTable
from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Fix
from kvops.top.widgets.common import Detail, TablePanel

AUDIT_COLOURS = {"queued": "cyan", "applying": "yellow", "verifying": "yellow", "applied": "yellow",
                 "verified": "green", "rolled_back": "red", "failed": "bold red", "reverted": "magenta"}
PENDING_JOBS = ("queued", "applying", "verifying", "reverting")  # a job in one of these shows its progress


@dataclass(frozen=True)
class AuditRow:
    """Repeats of one step: `entries` newest first, so `entries[0]` is the one the row shows."""

    entries: tuple[AuditEntry, ...]

    @property
    def latest(self) -> AuditEntry:
        return self.entries[0]

    @property
    def count(self) -> int:
        return len(self.entries)


def fix_change(fix: Fix | None) -> str:
    """What a fix changes, comparable across entries: its kind, action and parameters. The
    description is left out: it is prose around the same numbers."""
    if fix is None:
        return ""
    return json.dumps([fix.kind.value, fix.action, fix.params], sort_keys=True, default=str)


def collapse(entries: list[AuditEntry]) -> list[AuditRow]:
    """The audit log (oldest first, as the supervisor serves it) as rows, newest first: the entries
    with the same engine, rule, subject, action and fix change become one row, placed where its
    latest entry is."""
    groups: dict[tuple[str, str, str, str, str], list[AuditEntry]] = {}
    for entry in reversed(entries):
        key = (entry.engine, entry.rule, entry.subject, entry.action, fix_change(entry.fix))
        groups.setdefault(key, []).append(entry)
    return [AuditRow(tuple(group)) for group in groups.values()]


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


class AuditPanel(TablePanel):
    def __init__(self) -> None:
        super().__init__("audit", id="audit-panel")
        self.rows: list[AuditRow] = []

    def compose(self) -> ComposeResult:
        yield RowTable(id="audit")

    def on_mount(self) -> None:
        self.query_one(RowTable).add_columns("#", "time", "action", "engine", "rule", "message")

    def show_audit(self, entries: list[AuditEntry]) -> None:
        self.rows = collapse(entries)
        table_rows = []
        for row in self.rows:
            a = row.latest
            action = Text(a.action if row.count == 1 else f"{a.action} ×{row.count}",
                          style=AUDIT_COLOURS.get(a.action, ""))
            table_rows.append((str(a.id), (str(a.id), clock(a.time), action, a.engine, a.rule, a.message)))
        self.query_one(RowTable).fill(table_rows)

    def show_jobs(self, jobs: list[dict[str, Any]]) -> None:
        """The running fix jobs' state and progress on the panel's bottom border, e.g.
        "prefix_caching_off on gpu-0: verifying 40/60 s"; nothing when none runs. On a border too short for that
        the engine, then the rule, are left out: the progress is what the border is for (at 100 columns it was
        cut to "tenant_pollution on vllm-0:…")."""
        running = [j for j in jobs if j.get("state") in PENDING_JOBS]
        room = self.size.width - 6  # the corners and the ellipsis Textual draws when a title is cut
        for form in ("{rule} on {engine}: {progress}", "{rule}: {progress}", "{progress}"):
            subtitle = "  ·  ".join(form.format(rule=j.get("rule"), engine=j.get("engine"),
                                                progress=j.get("progress") or j.get("state")) for j in running)
            if not self.size.width or len(subtitle) <= room:  # no size yet (before the first layout): all of it
                break
        self.border_subtitle = subtitle

    def row(self, key: str | None) -> AuditRow | None:
        return next((row for row in self.rows if str(row.latest.id) == key), None)

    @property
    def selected(self) -> AuditEntry | None:
        """The latest entry of the highlighted row (what `r` reverts)."""
        row = self.row(self.query_one(RowTable).selected_key())
        return None if row is None else row.latest

    def detail(self, key: str) -> Detail | None:
        row = self.row(key)
        if row is None:
            return None
        a = row.latest
        text = audit_detail(a)
        if row.count > 1:
            text.append(f"\nrecorded {row.count} times: " + ", ".join(f"#{e.id} {clock(e.time)}" for e in row.entries))
        return f"audit #{a.id}: {a.action}", text


def audit_detail(a: AuditEntry) -> Text:
    text = Text()
    text.append(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(a.time))}  {a.engine}  {a.rule}"
                f"{' [' + a.subject + ']' if a.subject else ''}\n")
    text.append(f"{a.action}", style=AUDIT_COLOURS.get(a.action, ""))
    text.append(f": {a.message}\n")
    if a.fix is not None:
        text.append(f"fix ({a.fix.kind.value}): {a.fix.description}\n")
    for label, value in (("settings before", a.before), ("settings after", a.after),
                         ("evidence before", a.evidence_before), ("evidence after", a.evidence_after)):
        if value:
            text.append(f"{label}: {value}\n")
    if a.verdict is not None:
        text.append(f"verdict: {a.verdict.kind.value}: {a.verdict.message}\n")
        for change in [*a.verdict.objectives, *a.verdict.guards]:
            text.append(f"  {change.measure}{' [' + change.subject + ']' if change.subject else ''}: "
                        f"{change.before} -> {change.after} ({change.better} is better)\n")
    return text
