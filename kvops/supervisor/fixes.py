"""Fixes: applied by policy, verified against the evidence, rolled back when they did not help.

Per rule the policy is `off` (ignore), `suggest` (record the proposal; a person applies it
through the supervisor API) or `auto`. An admin fix changes a live knob through the engine's
admin API; a restart fix restarts a managed engine with changed settings (drained first). After
`verify_after_s` the diagnosis's evidence is compared with its value when the fix was applied:
if it moved the right way (or the diagnosis is gone), the fix is kept; otherwise the previous
setting is restored. Every step goes to the audit log (kvops.supervisor.audit), with before and
after values. What an admin action reads, sends and restores is kvops.schema.admin's table.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvops.schema.admin import ADMIN_ACTIONS
from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind
from kvops.supervisor.audit import AuditLog
from kvops.supervisor.engine_client import EngineClient, EngineUnreachable
from kvops.supervisor.managed_engine import ManagedEngine


@dataclass
class AppliedFix:
    entry: AuditEntry  # the "applied" entry
    diagnosis: Diagnosis
    undo: Callable[[], dict[str, Any]]  # restores the previous setting; returns it
    verify_at: float


class FixError(Exception):
    pass


def _same_change(a: Fix | None, b: Fix | None) -> bool:
    """The same change (descriptions carry live numbers and differ from poll to poll)."""
    return a is not None and b is not None and (a.kind, a.action, a.params) == (b.kind, b.action, b.params)


class FixManager:
    def __init__(self, audit: AuditLog, verify_after_s: float, clock: Callable[[], float] = time.time) -> None:
        self.audit = audit
        self.verify_after_s = verify_after_s
        self.clock = clock
        self.in_flight: dict[tuple[str, str, str], AppliedFix] = {}  # diagnosis key -> fix awaiting its verdict
        self.proposed: set[tuple[str, str, str]] = set()  # suggestions already recorded (until resolved)
        # Judged fixes, until their diagnosis resolves: a kept fix is not applied again and a rolled-back
        # one is not retried in a loop. A different fix for the same diagnosis (the rule sized it anew
        # from more data, or escalates) may still be tried.
        self.settled: dict[tuple[str, str, str], Fix] = {}
        self.counts: dict[tuple[str, str, str], int] = {}  # (engine, rule, action) -> how many
        self._lock = threading.RLock()

    def _count(self, entry: AuditEntry) -> AuditEntry:
        key = (entry.engine, entry.rule, entry.action)
        self.counts[key] = self.counts.get(key, 0) + 1
        return entry

    # ----------------------------------------------------------- policy

    def consider(self, diagnoses: list[Diagnosis], policy: Callable[[str], str],
                 targets: Callable[[str], tuple[EngineClient, ManagedEngine | None]]) -> None:
        """One evaluation's diagnoses: propose or apply fixes by policy, then judge due fixes."""
        with self._lock:
            active = {d.key: d for d in diagnoses}
            self.proposed &= set(active)  # a resolved diagnosis may be proposed again if it comes back
            self.settled = {key: fix for key, fix in self.settled.items() if key in active}
            for diagnosis in diagnoses:
                rule_policy = policy(diagnosis.rule)
                if (diagnosis.fix is None or rule_policy == "off" or diagnosis.key in self.in_flight
                        or _same_change(self.settled.get(diagnosis.key), diagnosis.fix)):
                    continue
                if rule_policy == "auto" and diagnosis.fix.kind is not FixKind.REPORT:
                    if any(f.diagnosis.engine == diagnosis.engine for f in self.in_flight.values()):
                        continue  # one fix at a time per engine, or the verdicts get mixed up
                    client, managed = targets(diagnosis.engine)
                    with contextlib.suppress(FixError):  # recorded as failed in the audit log
                        self.apply(diagnosis, client, managed)
                elif diagnosis.key not in self.proposed:
                    self.proposed.add(diagnosis.key)
                    self._count(self.audit.record(engine=diagnosis.engine, rule=diagnosis.rule,
                                                  subject=diagnosis.subject, action="proposed", fix=diagnosis.fix,
                                                  evidence_before=dict(diagnosis.evidence)))
            self.verify_due(active)

    # ------------------------------------------------------------ apply

    def apply(self, diagnosis: Diagnosis, client: EngineClient, managed: ManagedEngine | None) -> AuditEntry:
        fix = diagnosis.fix
        if fix is None or fix.kind is FixKind.REPORT:
            raise FixError(f"{diagnosis.rule} proposes no fix kvops can apply")
        common = {"engine": diagnosis.engine, "rule": diagnosis.rule, "subject": diagnosis.subject, "fix": fix,
                  "evidence_before": dict(diagnosis.evidence)}
        try:
            before, after, undo = self._change(fix, client, managed)
        except (EngineUnreachable, FixError, KeyError, ValueError) as exc:
            self._count(self.audit.record(action="failed", message=str(exc), **common))
            self.settled[diagnosis.key] = fix  # not retried every poll; again once the diagnosis resolves
            raise FixError(str(exc)) from None
        entry = self._count(self.audit.record(action="applied", before=before, after=after, **common))
        self.proposed.discard(diagnosis.key)
        if diagnosis.verification is None:
            self.settled[diagnosis.key] = fix
        else:
            # After a restart the rules start from an empty window: give them a second one before judging.
            wait = self.verify_after_s * (2 if fix.kind is FixKind.RESTART else 1)
            self.in_flight[diagnosis.key] = AppliedFix(entry, diagnosis, undo, self.clock() + wait)
        return entry

    def _change(self, fix: Fix, client: EngineClient,
                managed: ManagedEngine | None) -> tuple[dict[str, Any], dict[str, Any], Callable[[], dict[str, Any]]]:
        if fix.kind is FixKind.ADMIN:
            action = ADMIN_ACTIONS.get(fix.action)
            if action is None:
                raise FixError(f"unknown admin action {fix.action!r}; known: {', '.join(ADMIN_ACTIONS)}")
            change = action.plan(client.knobs(), fix.params)
            after = client.admin(action.name, change.params)

            def undo() -> dict[str, Any]:
                client.admin(action.name, change.undo)
                return change.before

            # The knobs the action changed as the engine reports them; for a tenant (no top-level knob) what was sent.
            return change.before, {k: after.get(k) for k in after if k in change.before} or change.params, undo
        if fix.kind is FixKind.RESTART:
            if managed is None:
                raise FixError("this fix restarts the engine with new settings, and kvops does not manage this "
                               f"engine: apply it by hand ({fix.description})")
            old_args = dict(managed.args)
            new_args = managed.settings_with(fix.params)  # kvops setting names as this engine's (e.g. vLLM flags)
            managed.restart_with(new_args)

            def undo_restart() -> dict[str, Any]:
                managed.restart_with(old_args)
                return old_args

            return old_args, new_args, undo_restart
        raise FixError(f"fix kind {fix.kind.value} cannot be applied")

    # ----------------------------------------------------------- verify

    def verify_due(self, active: dict[tuple[str, str, str], Diagnosis]) -> None:
        now = self.clock()
        for key, applied in list(self.in_flight.items()):
            if now < applied.verify_at:
                continue
            del self.in_flight[key]
            self.settled[key] = applied.diagnosis.fix  # type: ignore[assignment]
            verdict, message, evidence_after = self._judge(applied, active.get(key))
            common = {"engine": applied.diagnosis.engine, "rule": applied.diagnosis.rule,
                      "subject": applied.diagnosis.subject, "fix": applied.diagnosis.fix,
                      "evidence_before": dict(applied.diagnosis.evidence), "evidence_after": evidence_after}
            if verdict:
                self._count(self.audit.record(action="verified", message=message, before=applied.entry.before,
                                              after=applied.entry.after, **common))
                continue
            try:
                restored = applied.undo()
            except (EngineUnreachable, FixError) as exc:
                self._count(self.audit.record(action="failed", message=f"rollback failed: {exc}", **common))
                continue
            self._count(self.audit.record(action="rolled_back", message=message, before=applied.entry.after,
                                          after=restored, **common))

    @staticmethod
    def _judge(applied: AppliedFix, now: Diagnosis | None) -> tuple[bool, str, dict[str, Any]]:
        check = applied.diagnosis.verification
        assert check is not None
        if now is None:
            return True, "the diagnosis is gone", {}
        before = applied.diagnosis.evidence.get(check.evidence_key)
        after = now.evidence.get(check.evidence_key)
        if not isinstance(before, int | float) or not isinstance(after, int | float):
            return False, f"{check.evidence_key} is not measurable ({before!r} -> {after!r})", dict(now.evidence)
        change = (after - before) / abs(before) if before else (after - before)
        improved = change < -check.min_change if check.better == "lower" else change > check.min_change
        direction = "fell" if after < before else "rose"
        message = (f"{check.evidence_key} {direction} from {before:.4g} to {after:.4g} "
                   f"({change:+.1%}; {check.better} is better, needed {check.min_change:.0%})")
        return improved, message, dict(now.evidence)

    # ------------------------------------------------------------ people

    def revert(self, entry_id: int) -> AuditEntry:
        """Undo an applied fix on request (through the supervisor API)."""
        with self._lock:
            for key, applied in list(self.in_flight.items()):
                if applied.entry.id == entry_id:
                    del self.in_flight[key]
                    restored = applied.undo()
                    return self._count(self.audit.record(
                        action="reverted", engine=applied.diagnosis.engine, rule=applied.diagnosis.rule,
                        subject=applied.diagnosis.subject, fix=applied.diagnosis.fix, before=applied.entry.after,
                        after=restored, message=f"reverted by request (audit entry {entry_id})"))
            raise FixError(f"no applied fix awaiting verification has audit id {entry_id}")

    def snapshot(self) -> list[dict[str, Any]]:
        return [json.loads(e.model_dump_json()) for e in self.audit.entries]
