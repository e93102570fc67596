"""Fixes: decided by policy on the poll loop, run as jobs off it, judged by their outcome, undone when they
did not help.

Per rule the policy is `off` (ignore), `suggest` (record the proposal; a person applies it through the
supervisor API) or `auto`. `consider` (the poll loop) only decides and enqueues: the job's life itself — the
admin call or the managed restart, the windows, the verdict, the rollback — is `FixJobs`'s
(kvops.supervisor.fixes.jobs), run on the engine's worker thread, one job per engine at a time, then a cool-down
per (rule, subject). Pending jobs and each managed engine's last good settings are persisted
(kvops.supervisor.fixes.state) and resumed after a supervisor restart. Every step goes to the audit log
(kvops.supervisor.fixes.audit) with its numbers. A supervisor that does not hold the fix lease (`standby`, two
supervisors on one engine: kvops.supervisor.fixes.lease) proposes instead of applying, and refuses apply and revert
(NotHolder).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvops.adapters.engine_client import EngineUnreachable
from kvops.schema.admin import ADMIN_ACTIONS
from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind
from kvops.supervisor.fixes.audit import AuditLog
from kvops.supervisor.fixes.jobs import FixError, FixJobs, Judge, Target, real_judge

__all__ = ["FixError", "FixManager", "NotHolder", "RevertPending", "Target"]


class RevertPending(FixError):
    """The undo could not reach the engine: it is retried in the background (HTTP 503)."""


class NotHolder(FixError):
    """Another supervisor holds the fix lease (kvops.supervisor.fixes.lease): it applies and reverts (HTTP 409)."""


def _same_change(a: Fix | None, b: Fix | None) -> bool:
    """The same change (descriptions carry live numbers and differ from poll to poll)."""
    return a is not None and b is not None and (a.kind, a.action, a.params) == (b.kind, b.action, b.params)


class FixManager:
    """What to fix and when (the policy), and what people ask of the jobs (apply, revert, list); the jobs
    themselves, from queued to kept or rolled back, are `self.jobs`."""

    def __init__(self, audit: AuditLog, targets: Callable[[str], Target], verify_after_s: float,
                 state_path: Path | None = None, cooldown_s: float = 600.0, inconclusive: str = "rollback",
                 revert_retry_s: float = 10.0, judge: Judge = real_judge,
                 clock: Callable[[], float] = time.time) -> None:
        self.verify_after_s = verify_after_s  # a job's window: each job keeps the one it was queued with
        self.jobs = FixJobs(audit, targets, state_path, cooldown_s=cooldown_s, inconclusive=inconclusive,
                            revert_retry_s=revert_retry_s, judge=judge, clock=clock)
        self.proposed: set[tuple[str, str, str]] = set()  # suggestions already recorded (until resolved)
        # Why this supervisor applies nothing now ("" when it does): the supervisor's fix lease sets it. A job already
        # queued or running goes on to its end (a change is never left half-made); no new one starts.
        self.standby: Callable[[], str] = lambda: ""

    # The jobs' collaborators and outcomes, as the supervisor, its exporter and the tests reach them.
    @property
    def audit(self) -> AuditLog:
        return self.jobs.audit

    @property
    def clock(self) -> Callable[[], float]:
        return self.jobs.clock

    @property
    def counts(self) -> dict[tuple[str, str, str], int]:
        return self.jobs.counts

    @property
    def cooldown_until(self) -> dict[tuple[str, str, str], float]:
        return self.jobs.cooldown_until

    @property
    def judge(self) -> Judge:
        return self.jobs.judge

    @judge.setter
    def judge(self, judge: Judge) -> None:
        self.jobs.judge = judge

    @property
    def targets(self) -> Callable[[str], Target]:
        return self.jobs.targets

    @targets.setter
    def targets(self, targets: Callable[[str], Target]) -> None:
        self.jobs.targets = targets

    # ---------------------------------------------------------- lifecycle

    def resume(self, managed_args: dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], None]]]) -> None:
        """Before the managed engines start: load fix_jobs.json, put each managed engine on its last good settings
        (or on a verifying restart fix's), and queue the pending jobs again. `managed_args`: engine -> (its
        configured args, a setter for the args it starts with)."""
        jobs = self.jobs
        state = jobs.store.load()
        for engine, (configured, set_args) in managed_args.items():
            good = state.last_good.get(engine)
            if good is not None and good.config == configured:  # a changed config wins over what kvops chose
                jobs.good[engine] = good
                set_args(dict(good.args))
        for job in state.jobs:
            managed = job.engine in managed_args
            if job.state == "applying":  # caught mid-change: back to the last good settings
                if managed:  # the engine restarted with the supervisor, on the last good settings
                    jobs.adopt(job)
                    jobs.end(job, "failed", "interrupted while applying (the supervisor restarted): the engine "
                             "started again on its last good settings")
                    continue
                job.state, job.undo_action = "reverting", "failed"
                job.message = "interrupted while applying (the supervisor restarted)"
            elif job.state == "verifying" and (managed or job.fix.kind is FixKind.GATEWAY):
                job.reapply = True  # the engine restarted with the supervisor: re-establish, then a fresh window
                if job.fix.kind is FixKind.RESTART:
                    managed_args[job.engine][1](dict(job.after))
            elif job.state == "reverting" and managed and job.fix.kind is FixKind.RESTART:
                managed_args[job.engine][1](dict(jobs.last_good(job.engine) or job.before))
            jobs.adopt(job)
            jobs.runner.enqueue(job)
        jobs.save()

    def start(self) -> None:
        for engine in self.jobs.runner.engines():
            self.jobs.runner.wake(engine)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Workers stop at their next tick; a restart in progress finishes first (joined up to the timeout)."""
        self.jobs.runner.stop(timeout_s)

    # -------------------------------------------------------------- policy

    def consider(self, diagnoses: list[Diagnosis], policy: Callable[[str], str], standby: str = "") -> None:
        """One evaluation's diagnoses: propose, or enqueue by policy. Never waits for a fix. `standby`: why this
        supervisor applies nothing now (another holds the fix lease): `auto` fixes are then proposed, with it."""
        jobs = self.jobs
        with jobs.lock:
            active = {d.key: d for d in diagnoses}
            self.proposed &= set(active)  # a resolved diagnosis may be proposed again if it comes back
            jobs.settled = {key: fix for key, fix in jobs.settled.items() if key in active}
            now = self.clock()
            for diagnosis in diagnoses:
                rule_policy = policy(diagnosis.rule)
                if (diagnosis.fix is None or rule_policy == "off" or jobs.pending_for(diagnosis.engine, diagnosis.key)
                        or _same_change(jobs.settled.get(diagnosis.key), diagnosis.fix)):
                    continue
                if rule_policy == "auto" and diagnosis.fix.kind is not FixKind.REPORT and not standby:
                    if jobs.pending_for(diagnosis.engine) or jobs.cooldown_until.get(diagnosis.key, 0.0) > now:
                        continue  # one job per engine, or the verdicts get mixed up; then a cool-down
                    try:
                        self.apply(diagnosis)
                    except NotHolder:
                        continue  # the lease ran out since this evaluation renewed it: proposed at the next one
                    except FixError:
                        jobs.settled[diagnosis.key] = diagnosis.fix  # recorded as failed: not retried every poll
                elif diagnosis.key not in self.proposed:
                    self.proposed.add(diagnosis.key)
                    jobs.audited(engine=diagnosis.engine, rule=diagnosis.rule, subject=diagnosis.subject,
                                 action="proposed", fix=diagnosis.fix, evidence_before=dict(diagnosis.evidence),
                                 message=standby)

    def apply(self, diagnosis: Diagnosis) -> AuditEntry:
        """Queue a diagnosis's fix (policy auto, or a person through the API); returns the `queued` entry.
        FixError (recorded as failed) when kvops cannot apply it at all, or the engine has a job running."""
        jobs = self.jobs
        self.refuse_if_standby()
        with jobs.lock:
            if jobs.pending_for(diagnosis.engine):
                raise FixError(f"engine {diagnosis.engine!r} has a fix job running: one at a time (GET /api/fixes)")
            problem = self._cannot_apply(diagnosis)
            if problem:
                jobs.audited(action="failed", message=problem, engine=diagnosis.engine, rule=diagnosis.rule,
                             subject=diagnosis.subject, fix=diagnosis.fix, evidence_before=dict(diagnosis.evidence))
                raise FixError(problem)
            entry = jobs.queue(diagnosis, self.verify_after_s)
            self.proposed.discard(diagnosis.key)
        jobs.runner.wake(diagnosis.engine)
        return entry

    def refuse_if_standby(self) -> None:
        """NotHolder, naming the lease holder, while another supervisor holds the fix lease."""
        reason = self.standby()
        if reason:
            raise NotHolder(f"{reason}: send this request there (GET /api/fix-lease)")

    def _cannot_apply(self, diagnosis: Diagnosis) -> str:
        """Why kvops cannot apply this fix at all ("" when it can try): checked before anything is queued."""
        fix = diagnosis.fix
        if fix is None or fix.kind is FixKind.REPORT:
            return f"{diagnosis.rule} proposes no fix kvops can apply"
        target = self.targets(diagnosis.engine)
        if fix.kind is FixKind.GATEWAY:
            if target.gateway is None:
                return (f"{fix.action} changes a tenant's policy on the engine's gateway, and engine "
                        f"{diagnosis.engine!r} has none: put `kvops gateway` in front of it ([engines.gateway])")
            if target.gateway.admin_token is None:
                return (f"{fix.action} needs the gateway's admin token, and none is known (admin_token_env in "
                        "[engines.gateway])")
            return ""
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

    # -------------------------------------------------------------- people

    def revert(self, entry_id: int) -> AuditEntry:
        """Undo a fix on request (any of its audit entries' ids): first the undo, then the job is closed — so an
        undo that fails leaves the job tracked and retried (RevertPending), never dropped with the change in place."""
        jobs = self.jobs
        self.refuse_if_standby()
        with jobs.lock:
            job = next((j for j in jobs.tracked.values() if entry_id in j.entry_ids), None)
            if job is None or job.state in ("rolled_back", "failed", "reverted"):
                raise FixError(f"no applied fix awaiting its verdict or kept has audit id {entry_id}")
            if job.state == "queued":
                jobs.runner.dequeue(job)
                return jobs.end(job, "reverted", f"cancelled by request (audit entry {entry_id}) before it was applied")
            if job.state in ("applying", "reverting"):
                raise FixError(f"the fix is {job.state} ({job.progress(self.clock())}): revert once it is verifying")
        with jobs.runner.engine_lock(job.engine):  # the worker judges under it: no verdict in the middle of a revert
            if job.state not in ("verifying", "verified"):
                raise FixError(f"the fix is {job.state} now: nothing to revert")
            was_done = job.state == "verified"
            message = f"reverted by request (audit entry {entry_id})"
            try:
                restored = jobs.undo(job, self.targets(job.engine))
            except (EngineUnreachable, FixError) as exc:
                with jobs.lock:
                    if was_done:  # the worker let go of it: queue it again for the retries
                        jobs.done.remove(job.id)
                        jobs.runner.enqueue(job)
                    jobs.pend_undo(job, "reverted", message)
                jobs.runner.wake(job.engine)
                raise RevertPending(f"could not reach engine {job.engine!r} to revert: {exc}; kvops retries the "
                                    f"revert every {jobs.revert_retry_s:g} s (GET /api/fixes, the audit log)") from None
            with jobs.lock:
                if was_done:
                    jobs.done.remove(job.id)
                return jobs.end(job, "reverted", f"{message}: restored {restored}", job.verdict)

    def snapshot(self) -> list[dict[str, Any]]:
        return [json.loads(e.model_dump_json()) for e in self.audit.entries]

    def job_views(self) -> list[dict[str, Any]]:
        """GET /api/fixes: every pending job and the last finished ones, oldest first."""
        now = self.clock()
        with self.jobs.lock:
            return [job.view(now) for job in sorted(self.jobs.tracked.values(), key=lambda j: j.id)]
