"""Fixes: decided by policy on the poll loop, run as jobs off it, judged by their outcome, undone when they
did not help.

Per rule the policy is `off` (ignore), `suggest` (record the proposal; a person applies it through the
supervisor API) or `auto`. `consider` (the poll loop) only decides and enqueues: the job itself — the admin
call or the managed restart, the windows, the verdict, the rollback — runs on the engine's worker thread
(kvops.supervisor.fix_jobs), one job per engine at a time, then a cool-down per (rule, subject). Pending jobs
and each managed engine's last good settings are persisted (kvops.supervisor.fix_state) and resumed after a
supervisor restart. Every step goes to the audit log (kvops.supervisor.audit) with its numbers.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvops.schema.admin import ADMIN_ACTIONS
from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind
from kvops.schema.verdict import Verdict
from kvops.supervisor.audit import AuditLog
from kvops.supervisor.engine_client import EngineUnreachable
from kvops.supervisor.fix_jobs import FixError, JobRunner, Judge, Target, real_judge
from kvops.supervisor.fix_state import PENDING, FixJob, FixStateFile, FixStateStore, LastGood

__all__ = ["FixError", "FixManager", "RevertPending", "Target"]

DONE_KEPT = 50  # finished jobs kept for GET /api/fixes


class RevertPending(FixError):
    """The undo could not reach the engine: it is retried in the background (HTTP 503)."""


def _same_change(a: Fix | None, b: Fix | None) -> bool:
    """The same change (descriptions carry live numbers and differ from poll to poll)."""
    return a is not None and b is not None and (a.kind, a.action, a.params) == (b.kind, b.action, b.params)


class FixManager(JobRunner):
    def __init__(self, audit: AuditLog, targets: Callable[[str], Target], verify_after_s: float,
                 state_path: Path | None = None, cooldown_s: float = 600.0, inconclusive: str = "rollback",
                 revert_retry_s: float = 10.0, judge: Judge = real_judge,
                 clock: Callable[[], float] = time.time) -> None:
        self.audit = audit
        self.targets = targets
        self.verify_after_s = verify_after_s
        self.cooldown_s = cooldown_s
        self.inconclusive = inconclusive
        self.revert_retry_s = revert_retry_s
        self.judge = judge
        self.clock = clock
        self.store = FixStateStore(state_path)
        self.jobs: dict[int, FixJob] = {}  # pending ones, and the last DONE_KEPT finished
        self.done: deque[int] = deque()
        self.proposed: set[tuple[str, str, str]] = set()  # suggestions already recorded (until resolved)
        # Judged fixes, until their diagnosis resolves: a kept fix is not applied again and a rolled-back
        # one is not retried in a loop. A different fix for the same diagnosis may still be tried, after the cool-down.
        self.settled: dict[tuple[str, str, str], Fix] = {}
        self.cooldown_until: dict[tuple[str, str, str], float] = {}
        self.counts: dict[tuple[str, str, str], int] = {}  # (engine, rule, action) -> how many
        self.good: dict[str, LastGood] = {}
        self._lock = threading.RLock()
        self._queues: dict[str, deque[FixJob]] = {}
        self._workers: dict[str, threading.Thread] = {}
        self._engine_locks: dict[str, threading.Lock] = {}
        self._stop = threading.Event()

    # ---------------------------------------------------------- lifecycle

    def resume(self, managed_args: dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], None]]]) -> None:
        """Before the managed engines start: load fix_jobs.json, put each managed engine on its last good settings
        (or on a verifying restart fix's), and queue the pending jobs again. `managed_args`: engine -> (its
        configured args, a setter for the args it starts with)."""
        state = self.store.load()
        for engine, (configured, set_args) in managed_args.items():
            good = state.last_good.get(engine)
            if good is not None and good.config == configured:  # a changed config wins over what kvops chose
                self.good[engine] = good
                set_args(dict(good.args))
        for job in state.jobs:
            managed = job.engine in managed_args
            if job.state == "applying":  # caught mid-change: back to the last good settings
                if managed:  # the engine restarted with the supervisor, on the last good settings
                    self._adopt(job)
                    self.end(job, "failed", "interrupted while applying (the supervisor restarted): the engine "
                             "started again on its last good settings")
                    continue
                job.state, job.undo_action = "reverting", "failed"
                job.message = "interrupted while applying (the supervisor restarted)"
            elif job.state == "verifying" and managed:
                job.reapply = True  # the engine restarted with the supervisor: re-establish, then a fresh window
                if job.fix.kind is FixKind.RESTART:
                    managed_args[job.engine][1](dict(job.after))
            elif job.state == "reverting" and managed and job.fix.kind is FixKind.RESTART:
                managed_args[job.engine][1](dict(self.last_good(job.engine) or job.before))
            self._adopt(job)
            self._queues.setdefault(job.engine, deque()).append(job)
        self.save()

    def _adopt(self, job: FixJob) -> None:
        self.jobs[job.id] = job
        self._engine_locks.setdefault(job.engine, threading.Lock())

    def start(self) -> None:
        for engine in list(self._queues):
            self.wake(engine)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Workers stop at their next tick; a restart in progress finishes first (joined up to the timeout)."""
        self._stop.set()
        for worker in list(self._workers.values()):
            worker.join(timeout=timeout_s)

    # -------------------------------------------------------------- policy

    def consider(self, diagnoses: list[Diagnosis], policy: Callable[[str], str]) -> None:
        """One evaluation's diagnoses: propose, or enqueue by policy. Never waits for a fix."""
        with self._lock:
            active = {d.key: d for d in diagnoses}
            self.proposed &= set(active)  # a resolved diagnosis may be proposed again if it comes back
            self.settled = {key: fix for key, fix in self.settled.items() if key in active}
            now = self.clock()
            for diagnosis in diagnoses:
                rule_policy = policy(diagnosis.rule)
                if (diagnosis.fix is None or rule_policy == "off" or self._pending_for(diagnosis.engine, diagnosis.key)
                        or _same_change(self.settled.get(diagnosis.key), diagnosis.fix)):
                    continue
                if rule_policy == "auto" and diagnosis.fix.kind is not FixKind.REPORT:
                    if self._pending_for(diagnosis.engine) or self.cooldown_until.get(diagnosis.key, 0.0) > now:
                        continue  # one job per engine, or the verdicts get mixed up; then a cool-down
                    try:
                        self.apply(diagnosis)
                    except FixError:
                        self.settled[diagnosis.key] = diagnosis.fix  # recorded as failed: not retried every poll
                elif diagnosis.key not in self.proposed:
                    self.proposed.add(diagnosis.key)
                    self._count(self.audit.record(engine=diagnosis.engine, rule=diagnosis.rule,
                                                  subject=diagnosis.subject, action="proposed", fix=diagnosis.fix,
                                                  evidence_before=dict(diagnosis.evidence)))

    def _pending_for(self, engine: str, key: tuple[str, str, str] | None = None) -> bool:
        return any(j.state in PENDING and j.engine == engine and (key is None or j.key == key)
                   for j in self.jobs.values())

    def apply(self, diagnosis: Diagnosis) -> AuditEntry:
        """Queue a diagnosis's fix (policy auto, or a person through the API); returns the `queued` entry.
        FixError (recorded as failed) when kvops cannot apply it at all, or the engine has a job running."""
        fix = diagnosis.fix
        common = {"engine": diagnosis.engine, "rule": diagnosis.rule, "subject": diagnosis.subject, "fix": fix,
                  "evidence_before": dict(diagnosis.evidence)}
        with self._lock:
            if self._pending_for(diagnosis.engine):
                raise FixError(f"engine {diagnosis.engine!r} has a fix job running: one at a time (GET /api/fixes)")
            problem = self._cannot_apply(diagnosis)
            if problem:
                self._count(self.audit.record(action="failed", message=problem, **common))
                raise FixError(problem)
            entry = self._count(self.audit.record(action="queued", message=fix.description, **common))  # type: ignore[union-attr]
            job = FixJob(id=entry.id, engine=diagnosis.engine, rule=diagnosis.rule, subject=diagnosis.subject,
                         fix=fix, evidence_before=dict(diagnosis.evidence), queued_at=self.clock(),  # type: ignore[arg-type]
                         window_s=self.verify_after_s, entry_ids=[entry.id], message="queued")
            self._adopt(job)
            self.proposed.discard(diagnosis.key)
            self._queues.setdefault(job.engine, deque()).append(job)
            self.save()
        self.wake(job.engine)
        return entry

    def _cannot_apply(self, diagnosis: Diagnosis) -> str:
        """Why kvops cannot apply this fix at all ("" when it can try): checked before anything is queued."""
        fix = diagnosis.fix
        if fix is None or fix.kind is FixKind.REPORT:
            return f"{diagnosis.rule} proposes no fix kvops can apply"
        target = self.targets(diagnosis.engine)
        if fix.kind is FixKind.ADMIN:
            action = ADMIN_ACTIONS.get(fix.action)
            if action is None:
                return f"unknown admin action {fix.action!r}; known: {', '.join(ADMIN_ACTIONS)}"
            if target.client.admin_token is None:
                return f"{fix.action} needs the engine's admin token, and none is configured (admin_token_env)"
            return ""
        if target.managed is None:
            return ("this fix restarts the engine with new settings, and kvops does not manage this engine: "
                    f"apply it by hand ({fix.description})")
        try:
            target.managed.settings_with(fix.params)
        except ValueError as exc:
            return str(exc)
        return ""

    # ---------------------------------------------------- job bookkeeping (called by the workers)

    def record(self, job: FixJob, action: str, **fields: Any) -> AuditEntry:
        with self._lock:
            fields.setdefault("before", job.before)
            fields.setdefault("after", job.after)
            entry = self._count(self.audit.record(engine=job.engine, rule=job.rule, subject=job.subject, action=action,
                                                  fix=job.fix, evidence_before=job.evidence_before, **fields))
            job.entry_ids.append(entry.id)
            self.save()
            return entry

    def end(self, job: FixJob, state: str, message: str, verdict: Verdict | None = None) -> AuditEntry:
        with self._lock:
            job.state, job.message, job.verdict = state, message, verdict  # type: ignore[assignment]
            job.ended_at, job.phase = self.clock(), ""
            self.settled[job.key] = job.fix
            self.cooldown_until[job.key] = job.ended_at + self.cooldown_s
            self.done.append(job.id)
            while len(self.done) > DONE_KEPT:
                self.jobs.pop(self.done.popleft(), None)
            # A reverted job's "before" is what it undid (its after), as the audit always showed it.
            undone = state in ("rolled_back", "reverted") or (state == "failed" and job.effective_at is not None)
            before, after = (job.after, job.before) if undone else (job.before, job.after)
            return self.record(job, state, message=message, verdict=verdict, before=before, after=after)

    def save(self) -> None:
        with self._lock:
            pending = [j for j in self.jobs.values() if j.state in PENDING]
            self.store.save(FixStateFile(jobs=pending, last_good=self.good))

    def mark_good(self, engine: str, args: dict[str, Any]) -> None:
        target = self.targets(engine)
        configured = dict(target.managed.spec.args) if target.managed is not None else {}
        with self._lock:
            self.good[engine] = LastGood(config=configured, args=dict(args))

    def last_good(self, engine: str) -> dict[str, Any] | None:
        good = self.good.get(engine)
        return dict(good.args) if good is not None else None

    def _count(self, entry: AuditEntry) -> AuditEntry:
        key = (entry.engine, entry.rule, entry.action)
        self.counts[key] = self.counts.get(key, 0) + 1
        return entry

    # -------------------------------------------------------------- people

    def revert(self, entry_id: int) -> AuditEntry:
        """Undo a fix on request (any of its audit entries' ids): first the undo, then the job is closed — so an
        undo that fails leaves the job tracked and retried (RevertPending), never dropped with the change in place."""
        with self._lock:
            job = next((j for j in self.jobs.values() if entry_id in j.entry_ids), None)
            if job is None or job.state in ("rolled_back", "failed", "reverted"):
                raise FixError(f"no applied fix awaiting its verdict or kept has audit id {entry_id}")
            if job.state == "queued":
                self._queues.get(job.engine, deque()).remove(job)
                return self.end(job, "reverted", f"cancelled by request (audit entry {entry_id}) before it was applied")
            if job.state in ("applying", "reverting"):
                raise FixError(f"the fix is {job.state} ({job.progress(self.clock())}): revert once it is verifying")
        with self._engine_locks[job.engine]:  # the worker judges under it: no verdict in the middle of a revert
            if job.state not in ("verifying", "verified"):
                raise FixError(f"the fix is {job.state} now: nothing to revert")
            was_done = job.state == "verified"
            message = f"reverted by request (audit entry {entry_id})"
            try:
                restored = self.undo(job, self.targets(job.engine))
            except (EngineUnreachable, FixError) as exc:
                with self._lock:
                    if was_done:  # the worker let go of it: queue it again for the retries
                        self.done.remove(job.id)
                        self._queues.setdefault(job.engine, deque()).append(job)
                    self.pend_undo(job, "reverted", message)
                self.wake(job.engine)
                raise RevertPending(f"could not reach engine {job.engine!r} to revert: {exc}; kvops retries the "
                                    f"revert every {self.revert_retry_s:g} s (GET /api/fixes, the audit log)") from None
            with self._lock:
                if was_done:
                    self.done.remove(job.id)
                return self.end(job, "reverted", f"{message}: restored {restored}", job.verdict)

    def snapshot(self) -> list[dict[str, Any]]:
        return [json.loads(e.model_dump_json()) for e in self.audit.entries]

    def job_views(self) -> list[dict[str, Any]]:
        """GET /api/fixes: every pending job and the last finished ones, oldest first."""
        now = self.clock()
        with self._lock:
            return [job.view(now) for job in sorted(self.jobs.values(), key=lambda j: j.id)]

