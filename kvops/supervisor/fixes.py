"""Fixes: applied by policy, verified against the evidence, rolled back when they did not help.

Per rule the policy is `off` (ignore), `suggest` (record the proposal; a person applies it
through the supervisor API) or `auto`. An admin fix changes a live knob through the engine's
admin API; a restart fix restarts a managed engine with changed settings (drained first). After
`verify_after_s` the diagnosis's evidence is compared with its value when the fix was applied:
if it moved the right way (or the diagnosis is gone), the fix is kept; otherwise the previous
setting is restored. Every step goes to the audit log, with before and after values.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind
from kvops.supervisor.engine_client import EngineClient, EngineUnreachable
from kvops.supervisor.managed_engine import ManagedEngine

log = structlog.get_logger("kvops.supervisor.fixes")



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
                    continue
            self._ids = itertools.count(max((e.id for e in self.entries), default=0) + 1)

    def record(self, **fields: Any) -> AuditEntry:
        entry = AuditEntry(id=next(self._ids), time=time.time(), **fields)
        self.entries.append(entry)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as file:
                file.write(entry.model_dump_json() + "\n")
        log.info(f"fix {entry.action}", engine=entry.engine, rule=entry.rule, subject=entry.subject,
                 fix=entry.fix.description if entry.fix else None, before=entry.before, after=entry.after,
                 evidence_before=entry.evidence_before, evidence_after=entry.evidence_after, message=entry.message)
        return entry


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
            knobs = client.knobs()
            action, params = fix.action, dict(fix.params)
            if action == "set_normalization":
                undo_params: dict[str, Any] = {"mode": knobs["normalize_prompts"]}
                before = {"normalize_prompts": knobs["normalize_prompts"]}
            elif action == "set_prefix_caching":
                undo_params = {"enabled": knobs["enable_prefix_caching"]}
                before = {"enable_prefix_caching": knobs["enable_prefix_caching"]}
            elif action == "set_eviction_policy":
                undo_params = {"policy": knobs["eviction_policy"]}
                before = {"eviction_policy": knobs["eviction_policy"]}
            elif action == "set_tenant_quota":
                tenant = params["tenant"]
                salt = knobs["tenant_salts"].get(tenant)
                if salt is not None:
                    params["cache_salt"] = salt  # setting a quota must not reset the tenant's sharing
                undo_params = {"tenant": tenant, "quota_blocks": knobs["tenant_quotas"].get(tenant)}
                if salt is not None:
                    undo_params["cache_salt"] = salt
                before = {"tenant": tenant, "quota_blocks": knobs["tenant_quotas"].get(tenant)}
            else:
                raise FixError(f"unknown admin action {action!r}")
            after = client.admin(action, params)

            def undo() -> dict[str, Any]:
                client.admin(action, undo_params)
                return before

            return before, {k: after.get(k) for k in after if k in before} or params, undo
        if fix.kind is FixKind.RESTART:
            if managed is None:
                raise FixError("this fix restarts the engine with new settings, and kvops does not manage this "
                               f"engine: apply it by hand ({fix.description})")
            old_args = dict(managed.args)
            new_args = {**old_args, **fix.params}
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
