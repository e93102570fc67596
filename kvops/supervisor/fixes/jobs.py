"""A fix job's life, in one place: queued -> applying (an admin call, or a managed restart that may take
minutes) -> verifying (the after-window) -> verified (kept) / rolled_back / failed.

The poll loop only enqueues (kvops.supervisor.fixes.manager decides what, by policy), so polling and the other engines
never wait for a fix: `FixJobs` owns a `JobRunner` (kvops.supervisor.fixes.runner), one worker thread per engine,
and hands it `run`, the life below. The verdict is kvops.supervisor.fixes.judge's, on the engine's snapshots over
equal windows before the change and after it took effect; inconclusive gets one more window, then the
`inconclusive` policy. The engine going down in the window, or a restart that does not come up, is `failed`:
back on the last good settings, started and health-checked. An undo that cannot reach the engine (a revert, a
rollback) is retried every `revert_retry_s` until it succeeds, by the same worker, so no new fix starts meanwhile.
Every step goes to the audit log (kvops.supervisor.fixes.audit) with its numbers; pending jobs and each managed
engine's last good settings are persisted on every change of state (kvops.supervisor.fixes.state).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from kvops.adapters.engine_client import EngineClient, EngineUnreachable
from kvops.history import EngineHistory
from kvops.rules import engine_down
from kvops.schema.admin import ADMIN_ACTIONS
from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective
from kvops.schema.snapshot import Snapshot
from kvops.schema.verdict import Verdict, VerdictKind
from kvops.supervisor.fixes.audit import AuditLog
from kvops.supervisor.fixes.gateway import GatewayAdmin
from kvops.supervisor.fixes.judge import DEFAULT_SETTINGS, JudgeSettings, judge
from kvops.supervisor.fixes.runner import JobRunner
from kvops.supervisor.fixes.state import MAX_BEFORE_SNAPSHOTS, PENDING, FixJob, FixStateFile, FixStateStore, LastGood
from kvops.supervisor.managed_engine import ManagedEngine

log = structlog.get_logger("kvops.supervisor.fixes")

TICK_S = 0.2  # how often a verifying job looks at the engine's health and for a revert
DONE_KEPT = 50  # finished jobs kept for GET /api/fixes
Judge = Callable[[Sequence[Objective], Sequence[Snapshot], Sequence[Snapshot]], Verdict]


@dataclass
class Target:
    client: EngineClient
    managed: ManagedEngine | None
    history: EngineHistory
    gateway: GatewayAdmin | None = None  # the `kvops gateway` in front of the engine, where there is one


class FixError(Exception):
    pass


def real_judge(objectives: Sequence[Objective], before: Sequence[Snapshot], after: Sequence[Snapshot],
               settings: JudgeSettings | None = None) -> Verdict:
    return judge(objectives, before, after, settings or DEFAULT_SETTINGS)


def between(history: EngineHistory, start: float, end: float) -> list[Snapshot]:
    return [s for s in history.snapshots if start <= s.time <= end]


class FixJobs:
    """Every fix job from its `queued` entry to its end, and the outcomes the policy reads: which fixes are
    settled (kept or rolled back, until their diagnosis resolves), the cool-downs, the counts per outcome."""

    def __init__(self, audit: AuditLog, targets: Callable[[str], Target], state_path: Path | None, cooldown_s: float,
                 inconclusive: str, revert_retry_s: float, judge: Judge, clock: Callable[[], float]) -> None:
        self.audit = audit
        self.targets = targets
        self.cooldown_s = cooldown_s
        self.inconclusive = inconclusive
        self.revert_retry_s = revert_retry_s
        self.judge = judge
        self.clock = clock
        self.store = FixStateStore(state_path)
        self.tracked: dict[int, FixJob] = {}  # pending ones, and the last DONE_KEPT finished
        self.done: deque[int] = deque()
        # Judged fixes, until their diagnosis resolves: a kept fix is not applied again and a rolled-back
        # one is not retried in a loop. A different fix for the same diagnosis may still be tried, after the cool-down.
        self.settled: dict[tuple[str, str, str], Fix] = {}
        self.cooldown_until: dict[tuple[str, str, str], float] = {}
        self.counts: dict[tuple[str, str, str], int] = {}  # (engine, rule, action) -> how many
        self.good: dict[str, LastGood] = {}
        self.lock = threading.RLock()
        self.runner = JobRunner(self.lock, self.run, self._crashed)

    # -------------------------------------------------------------- queue

    def adopt(self, job: FixJob) -> None:
        """Track a job (new, or resumed from the state file) without queueing it."""
        self.tracked[job.id] = job
        self.runner.track(job.engine)

    def queue(self, diagnosis: Diagnosis, window_s: float) -> AuditEntry:
        """A fix kvops can apply, on an engine with no job pending (the caller checked both, under the lock):
        its `queued` entry, then behind the engine's worker (the caller wakes it once the lock is let go)."""
        fix: Fix = diagnosis.fix  # type: ignore[assignment]
        entry = self.audited(action="queued", message=fix.description, engine=diagnosis.engine, rule=diagnosis.rule,
                             subject=diagnosis.subject, fix=fix, evidence_before=dict(diagnosis.evidence))
        job = FixJob(id=entry.id, engine=diagnosis.engine, rule=diagnosis.rule, subject=diagnosis.subject,
                     fix=fix, evidence_before=dict(diagnosis.evidence), queued_at=self.clock(),
                     window_s=window_s, entry_ids=[entry.id], message="queued")
        self.adopt(job)
        self.runner.enqueue(job)
        self.save()
        return entry

    def pending_for(self, engine: str, key: tuple[str, str, str] | None = None) -> bool:
        return any(j.state in PENDING and j.engine == engine and (key is None or j.key == key)
                   for j in self.tracked.values())

    def run(self, job: FixJob) -> None:
        """On the engine's worker: the job's life from where it stands (a resumed job may start midway)."""
        if job.state in ("queued", "applying"):
            self._apply(job)
        if job.state == "verifying":
            self._verify(job)
        if job.state == "reverting":
            self._retry_undo(job)

    def _crashed(self, job: FixJob, exc: Exception) -> None:
        if job.state != "reverting":
            self.end(job, "failed", f"internal error: {exc}")

    # -------------------------------------------------------------- apply

    def _apply(self, job: FixJob) -> None:
        target = self.targets(job.engine)
        now = self.clock()
        before = between(target.history, now - job.window_s, now)
        job.before_snapshots = before[-MAX_BEFORE_SNAPSHOTS:]
        job.state, job.applied_at = "applying", now
        restart = job.fix.kind is FixKind.RESTART
        if restart and target.managed is not None:
            job.set_phase("restarting: waiting for health", now,
                          target.managed.spec.drain_timeout_s + target.managed.spec.health_timeout_s)
        else:
            job.set_phase("calling the gateway's admin API" if job.fix.kind is FixKind.GATEWAY
                          else "calling the admin API", now)
        self.record(job, "applying", message=job.phase)
        try:
            if restart:
                self._restart(job, target)
            elif job.fix.kind is FixKind.GATEWAY:
                self._through_gateway(job, target.gateway)
            else:
                self._admin(job, target.client)
        except EngineUnreachable as exc:
            if restart and target.managed is not None:  # restart_with restored the old settings: wait for them
                self._restored_after_failed_start(job, target.managed, str(exc))
            else:
                self.end(job, "failed", f"the change was not made: {exc}",
                         Verdict(kind=VerdictKind.FAILED, message=str(exc)))
            return
        except (FixError, KeyError, ValueError) as exc:
            self.end(job, "failed", str(exc))
            return
        self._start_window(job)

    def _admin(self, job: FixJob, client: EngineClient) -> None:
        action = ADMIN_ACTIONS.get(job.fix.action)
        if action is None:
            raise FixError(f"unknown admin action {job.fix.action!r}; known: {', '.join(ADMIN_ACTIONS)}")
        change = action.plan(client.knobs(), job.fix.params)
        job.before, job.sent, job.undo = change.before, change.params, change.undo
        self.save()  # a crash between here and the answer: the undo is known
        after = client.admin(action.name, change.params)
        # The knobs the action changed as the engine reports them; for a tenant (no top-level knob) what was sent.
        job.after = {k: after.get(k) for k in after if k in change.before} or change.params

    def _through_gateway(self, job: FixJob, gateway: GatewayAdmin | None) -> None:
        """A tenant's policy changed on the gateway: the changed fields' values before it are the undo."""
        if gateway is None:
            raise FixError(f"this fix changes a tenant's policy on the engine's gateway, and engine {job.engine!r} has "
                           "none ([engines.gateway] in its config)")
        tenant = str(job.fix.params["tenant"])
        change = {k: v for k, v in job.fix.params.items() if k != "tenant"}
        policy = gateway.policy(tenant)
        job.before = {"tenant": tenant, **{k: policy.get(k) for k in change}}
        job.sent, job.undo = dict(job.fix.params), dict(job.before)
        self.save()  # a crash between here and the answer: the undo is known
        after = gateway.set_policy(tenant, change)
        job.after = {"tenant": tenant, **{k: after.get(k) for k in change}}

    def _restart(self, job: FixJob, target: Target) -> None:
        managed = target.managed
        if managed is None:
            raise FixError("this fix restarts the engine with new settings, and kvops does not manage this "
                           f"engine: apply it by hand ({job.fix.description})")
        job.before = dict(managed.args)
        job.after = managed.settings_with(job.fix.params)  # kvops setting names as this engine's (e.g. vLLM flags)
        self.save()
        managed.restart_with(job.after)

    def _restored_after_failed_start(self, job: FixJob, managed: ManagedEngine, why: str) -> None:
        job.set_phase("restoring the old settings: waiting for health", self.clock(), managed.spec.health_timeout_s)
        try:
            managed.wait_healthy()
            restored = f"back on the old settings {job.before}, healthy"
        except EngineUnreachable as exc:
            restored = f"the old settings did not come up either: {exc}"
        self.end(job, "failed", f"the new settings did not start: {why}; {restored}",
                 Verdict(kind=VerdictKind.FAILED, message=f"did not start with {job.after}"))

    def _start_window(self, job: FixJob) -> None:
        job.effective_at = self.clock()
        job.verify_until = job.effective_at + job.window_s
        job.state, job.reapply = "verifying", False
        self.record(job, "verifying", before=job.before, after=job.after,
                    message=f"applied; judging over {job.window_s:g} s")

    # ------------------------------------------------------------- verify

    def _verify(self, job: FixJob) -> None:
        target = self.targets(job.engine)
        if job.reapply and not self._reapply(job, target):
            return
        while not self.runner.stopping.wait(TICK_S):
            with self.runner.engine_lock(job.engine):  # a revert on the API thread takes the same lock
                if job.state != "verifying":
                    return
                down = went_down(job, target)
                if down:
                    self._fail(job, target, down)
                    return
                if self.clock() < (job.verify_until or 0.0):
                    continue
                verdict = self._judge(job, target)
                if verdict.kind is VerdictKind.INCONCLUSIVE and not job.extended and job.fix.objectives:
                    job.extended = True  # too little traffic: one more window of the same length
                    job.verify_until = (job.verify_until or 0.0) + job.window_s
                    self.save()
                    continue
                self._decide(job, target, verdict)
                return

    def _reapply(self, job: FixJob, target: Target) -> bool:
        """Resumed after a supervisor restart on a managed engine (it restarted with the supervisor): wait for it,
        re-send an admin change (a fresh process forgot it; a restart fix's settings are its args already),
        then judge on a fresh window. A gateway fix is sent again to the gateway, managed engine or not."""
        try:
            if target.managed is not None:
                job.set_phase("resuming: waiting for the engine", self.clock(), target.managed.spec.health_timeout_s)
                target.managed.wait_healthy()
                if job.fix.kind is FixKind.ADMIN:
                    target.client.admin(job.fix.action, job.sent)
            if job.fix.kind is FixKind.GATEWAY:  # a gateway started again forgot its live policy changes
                self._resend_to_gateway(job, target)
        except EngineUnreachable as exc:
            self._fail(job, target, f"could not resume after a supervisor restart: {exc}")
            return False
        self._start_window(job)
        return True

    def _judge(self, job: FixJob, target: Target) -> Verdict:
        start, end = job.effective_at or 0.0, job.verify_until or 0.0
        if not job.fix.objectives:
            verdict = Verdict(kind=VerdictKind.INCONCLUSIVE, message="no measurable objective")
        else:
            try:
                verdict = self.judge(job.fix.objectives, job.before_snapshots, between(target.history, start, end))
            except Exception as exc:
                log.exception("judging a fix failed", engine=job.engine, job=job.id)
                verdict = Verdict(kind=VerdictKind.INCONCLUSIVE, message=f"could not judge: {exc}")
        applied = job.applied_at or start
        return verdict.model_copy(update={"extended": job.extended, "before_window": (applied - job.window_s, applied),
                                          "after_window": (start, end)})

    def _decide(self, job: FixJob, target: Target, verdict: Verdict) -> None:
        keep = verdict.kind is VerdictKind.IMPROVED or (
            verdict.kind is VerdictKind.INCONCLUSIVE and self.inconclusive == "keep")
        if keep:
            note = "" if verdict.kind is VerdictKind.IMPROVED else \
                f" (inconclusive, kept by the inconclusive = \"keep\" policy: {verdict.message})"
            if job.fix.kind is FixKind.RESTART:
                self.mark_good(job.engine, job.after)
            self.end(job, "verified", (verdict.message or "improved") + note, verdict)
            return
        self._undo_or_retry(job, target, "rolled_back", f"{verdict.kind.value}: {verdict.message}", verdict)

    def _fail(self, job: FixJob, target: Target, why: str) -> None:
        """The engine went down in the window: back to the last good settings, started and health-checked."""
        self._undo_or_retry(job, target, "failed", f"the engine went down while verifying: {why}",
                            Verdict(kind=VerdictKind.FAILED, message=why))

    # --------------------------------------------------------------- undo

    def undo(self, job: FixJob, target: Target) -> dict[str, Any]:
        """Restore the settings from before the job (a restart fix: the last good ones); returns them."""
        if job.fix.kind is FixKind.RESTART:
            managed = target.managed
            if managed is None:
                raise FixError("the engine is no longer managed")
            good = self.last_good(job.engine) or job.before
            job.set_phase("restarting with the last good settings: waiting for health", self.clock(),
                          managed.spec.drain_timeout_s + managed.spec.health_timeout_s)
            if managed.args != good or managed.pid is None:
                managed.restart_with(good)
            else:
                managed.wait_healthy()  # already on them (resumed after a restart): only check it answers
            return good
        if target.managed is not None:  # a managed engine that died comes back (poll loop): wait for it
            job.set_phase("waiting for the engine to answer", self.clock(), target.managed.spec.health_timeout_s)
            target.managed.wait_healthy()
        if job.fix.kind is FixKind.GATEWAY:
            if target.gateway is None:
                raise FixError("the engine no longer has a gateway")
            undo = {k: v for k, v in job.undo.items() if k != "tenant"}
            target.gateway.set_policy(str(job.undo["tenant"]), undo)
            return job.before
        target.client.admin(job.fix.action, job.undo)
        return job.before

    @staticmethod
    def _resend_to_gateway(job: FixJob, target: Target) -> None:
        if target.gateway is None:
            raise EngineUnreachable("the engine no longer has a gateway")
        target.gateway.set_policy(str(job.sent["tenant"]), {k: v for k, v in job.sent.items() if k != "tenant"})

    def _undo_or_retry(self, job: FixJob, target: Target, action: str, message: str, verdict: Verdict | None) -> None:
        job.verdict, job.message = verdict, message
        try:
            restored = self.undo(job, target)
        except (EngineUnreachable, FixError) as exc:
            self.pend_undo(job, action, f"{message}; undo failed ({exc}), retrying every {self.revert_retry_s:g} s")
            return
        self.end(job, action, f"{message}; restored {restored}", verdict)

    def pend_undo(self, job: FixJob, action: str, message: str) -> None:
        """The undo could not reach the engine: the job waits in `reverting`, retried by the engine's worker."""
        job.state, job.undo_action, job.message = "reverting", action, message  # type: ignore[assignment]
        job.set_phase(f"undo pending, retrying every {self.revert_retry_s:g} s", self.clock())
        self.save()
        log.warning("fix undo failed; retrying", engine=job.engine, job=job.id, message=message)

    def _retry_undo(self, job: FixJob) -> None:
        target = self.targets(job.engine)
        while job.state == "reverting" and not self.runner.stopping.wait(self.revert_retry_s):
            with self.runner.engine_lock(job.engine):
                job.undo_attempts += 1
                try:
                    restored = self.undo(job, target)
                except (EngineUnreachable, FixError) as exc:
                    job.set_phase(f"undo pending (attempt {job.undo_attempts}: {exc}), retrying every "
                                  f"{self.revert_retry_s:g} s", self.clock())
                    continue
                self.end(job, job.undo_action, f"{job.message.split('; undo failed')[0]}; undone after "
                         f"{job.undo_attempts} retr{'y' if job.undo_attempts == 1 else 'ies'}: restored {restored}",
                         job.verdict)

    # ------------------------------------------------------- bookkeeping

    def record(self, job: FixJob, action: str, **fields: Any) -> AuditEntry:
        with self.lock:
            fields.setdefault("before", job.before)
            fields.setdefault("after", job.after)
            entry = self.audited(engine=job.engine, rule=job.rule, subject=job.subject, action=action, fix=job.fix,
                                 evidence_before=job.evidence_before, **fields)
            job.entry_ids.append(entry.id)
            self.save()
            return entry

    def end(self, job: FixJob, state: str, message: str, verdict: Verdict | None = None) -> AuditEntry:
        with self.lock:
            job.state, job.message, job.verdict = state, message, verdict  # type: ignore[assignment]
            job.ended_at, job.phase = self.clock(), ""
            self.settled[job.key] = job.fix
            self.cooldown_until[job.key] = job.ended_at + self.cooldown_s
            self.done.append(job.id)
            while len(self.done) > DONE_KEPT:
                self.tracked.pop(self.done.popleft(), None)
            # A reverted job's "before" is what it undid (its after), as the audit always showed it.
            undone = state in ("rolled_back", "reverted") or (state == "failed" and job.effective_at is not None)
            before, after = (job.after, job.before) if undone else (job.before, job.after)
            return self.record(job, state, message=message, verdict=verdict, before=before, after=after)

    def save(self) -> None:
        with self.lock:
            pending = [j for j in self.tracked.values() if j.state in PENDING]
            self.store.save(FixStateFile(jobs=pending, last_good=self.good))

    def mark_good(self, engine: str, args: dict[str, Any]) -> None:
        target = self.targets(engine)
        configured = dict(target.managed.spec.args) if target.managed is not None else {}
        with self.lock:
            self.good[engine] = LastGood(config=configured, args=dict(args))

    def last_good(self, engine: str) -> dict[str, Any] | None:
        good = self.good.get(engine)
        return dict(good.args) if good is not None else None

    def audited(self, **fields: Any) -> AuditEntry:
        """An audit entry, counted before it is written: whoever sees the entry (the API, a test polling the
        log) sees its count too."""
        key = (fields["engine"], fields["rule"], fields["action"])
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
        return self.audit.record(**fields)


def went_down(job: FixJob, target: Target) -> str:
    """Why the engine counts as down since the change took effect ("" when it did not)."""
    since = job.effective_at or 0.0
    history = target.history
    exits = [e for e in history.exits if e.t >= since]
    if exits:
        how = f"signal {exits[-1].signal}" if exits[-1].signal else f"exit code {exits[-1].exit_code}"
        return f"the engine exited ({how})"
    if target.managed is not None and target.managed.process is None and not target.managed.restarting:
        return "the engine process is gone"
    # An outage as the engine_down rule defines it: `min_failures` failed health checks in a row. One slow
    # answer (a profile pausing the engine for a moment) is not the engine going down.
    needed = engine_down.Settings().min_failures
    run: list[str] = []
    for sample in (h for h in history.health if h.t >= since):
        run = [] if sample.up else [*run, sample.error]
        if len(run) >= needed:
            return f"{needed} health checks failed in a row: {run[-1]}"
    return ""
