"""Fix jobs, run off the poll loop: one worker thread per engine takes that engine's jobs one at a time.

A job goes queued -> applying (an admin call, or a managed restart that may take minutes) -> verifying
(the after-window) -> verified (kept) / rolled_back / failed. The poll loop only enqueues (kvops.supervisor.fixes),
so polling and the other engines never wait for a fix. The verdict is kvops.supervisor.judge's, on the engine's
snapshots over equal windows before the change and after it took effect; inconclusive gets one more window, then
the `inconclusive` policy. The engine going down in the window, or a restart that does not come up, is `failed`:
back on the last good settings, started and health-checked. An undo that cannot reach the engine (a revert, a
rollback) is retried every `revert_retry_s` until it succeeds, by the same worker, so no new fix starts meanwhile.

`JobRunner` is the execution half of `FixManager` (a mixin): the manager owns the jobs, the audit log and the
persisted state; the runner's methods run on the worker threads.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from kvops.rules import engine_down
from kvops.schema.admin import ADMIN_ACTIONS
from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import FixKind, Objective
from kvops.schema.snapshot import Snapshot
from kvops.schema.verdict import Verdict, VerdictKind
from kvops.supervisor.engine_client import EngineClient, EngineUnreachable
from kvops.supervisor.fix_state import MAX_BEFORE_SNAPSHOTS, FixJob
from kvops.supervisor.history import EngineHistory
from kvops.supervisor.judge import DEFAULT_SETTINGS, JudgeSettings, judge
from kvops.supervisor.managed_engine import ManagedEngine

log = structlog.get_logger("kvops.supervisor.fixes")

TICK_S = 0.2  # how often a verifying job looks at the engine's health and for a revert
Judge = Callable[[Sequence[Objective], Sequence[Snapshot], Sequence[Snapshot]], Verdict]


@dataclass
class Target:
    client: EngineClient
    managed: ManagedEngine | None
    history: EngineHistory


class FixError(Exception):
    pass


def real_judge(objectives: Sequence[Objective], before: Sequence[Snapshot], after: Sequence[Snapshot],
               settings: JudgeSettings | None = None) -> Verdict:
    return judge(objectives, before, after, settings or DEFAULT_SETTINGS)


def between(history: EngineHistory, start: float, end: float) -> list[Snapshot]:
    return [s for s in history.snapshots if start <= s.time <= end]


class JobRunner:
    """The worker half of FixManager: what the attributes below are, FixManager.__init__ says."""

    targets: Callable[[str], Target]
    judge: Judge
    clock: Callable[[], float]
    inconclusive: str
    revert_retry_s: float
    _lock: threading.RLock
    _queues: dict[str, deque[FixJob]]
    _workers: dict[str, threading.Thread]
    _engine_locks: dict[str, threading.Lock]
    _stop: threading.Event

    def record(self, job: FixJob, action: str, **fields: Any) -> AuditEntry: ...  # FixManager's
    def end(self, job: FixJob, state: str, message: str, verdict: Verdict | None = None) -> AuditEntry: ...
    def save(self) -> None: ...
    def mark_good(self, engine: str, args: dict[str, Any]) -> None: ...
    def last_good(self, engine: str) -> dict[str, Any] | None: ...

    # ------------------------------------------------------------ threads

    def wake(self, engine: str) -> None:
        """Start the engine's worker if it is not running (it ends when its queue is empty)."""
        with self._lock:
            worker = self._workers.get(engine)
            if (worker is not None and worker.is_alive()) or self._stop.is_set():
                return
            worker = threading.Thread(target=self._work, args=(engine,), daemon=True, name=f"kvops-fix-{engine}")
            self._workers[engine] = worker
            worker.start()

    def _work(self, engine: str) -> None:
        while not self._stop.is_set():
            with self._lock:
                queue = self._queues.get(engine)
                if not queue:
                    self._workers.pop(engine, None)
                    return
                job = queue[0]
            try:
                self.run_job(job)
            except Exception as exc:  # a bug in one job must not stop the engine's later fixes
                log.exception("fix job failed", engine=engine, job=job.id)
                if job.state != "reverting":
                    self.end(job, "failed", f"internal error: {exc}")
            with self._lock:
                if queue and queue[0] is job and (job.state != "reverting" or self._stop.is_set()):
                    queue.popleft()

    def run_job(self, job: FixJob) -> None:
        if job.state in ("queued", "applying"):
            self._apply(job)
        if job.state == "verifying":
            self._verify(job)
        if job.state == "reverting":
            self._retry_undo(job)

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
            job.set_phase("calling the admin API", now)
        self.record(job, "applying", message=job.phase)
        try:
            if restart:
                self._restart(job, target)
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
        while not self._stop.wait(TICK_S):
            with self._engine_locks[job.engine]:  # a revert on the API thread takes the same lock
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
        then judge on a fresh window."""
        if target.managed is not None:
            job.set_phase("resuming: waiting for the engine", self.clock(), target.managed.spec.health_timeout_s)
            try:
                target.managed.wait_healthy()
                if job.fix.kind is FixKind.ADMIN:
                    target.client.admin(job.fix.action, job.sent)
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
        target.client.admin(job.fix.action, job.undo)
        return job.before

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
        while job.state == "reverting" and not self._stop.wait(self.revert_retry_s):
            with self._engine_locks[job.engine]:
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
