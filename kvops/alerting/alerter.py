"""The `Alerter`: the one object the supervisor talks to, and the thread that delivers.

`evaluate` runs in the supervisor's thread: it advances the alert lifecycle, flushes the groups
that are due, and commits state and new notifications to the outbox before returning. The
delivery thread sends outbox rows (per receiver strictly in order, so a group's "resolved" never
overtakes its "firing"), backs off on failures, and also flushes groups whose timers expire
between two evaluations. Both hold one lock around the alert state; HTTP happens outside it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import structlog

from kvops.alerting.config import AlertingConfig, ResolvedReceiver, resolve_receivers
from kvops.alerting.delivery import Courier, Outcome
from kvops.alerting.grouping import Group, Grouper, GroupNotification, group_key
from kvops.alerting.health import DeadLetter, DeliveryStats, ReceiverStats, self_diagnoses
from kvops.alerting.lifecycle import Alert, AlertLifecycle, AlertState, LifecycleChanges
from kvops.alerting.outbox import NewNotification, OutboxRow, PendingSummary
from kvops.alerting.payloads import postable_alerts, webhook_payload
from kvops.alerting.receivers import ReceiverClient
from kvops.alerting.state_file import StateReset, open_state
from kvops.schema.diagnosis import Diagnosis

log = structlog.get_logger("kvops.alerting")

STATE_FILE = "alerts.sqlite3"
_MAX_IDLE_S = 1.0  # the thread re-checks at least this often, so a stepped wall clock cannot stall it for long
_PRUNE_EVERY_S = 3600.0
DEAD_LETTERS_LISTED = 100  # the API lists this many by default; the outbox keeps them all


class Alerter:
    def __init__(
        self,
        config: AlertingConfig,
        state_dir: Path,
        external_url: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        # a receiver whose secret is missing is disabled, not fatal: the others still have to be told
        self._receivers: list[ResolvedReceiver]
        self._receivers, self._problems = resolve_receivers(config)
        for problem in self._problems:
            log.warning("alert receiver disabled", receiver=problem.receiver, problem=problem.message)
        self._external_url = external_url.rstrip("/")
        self._clock = clock
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        opened = open_state(state_dir / STATE_FILE, clock())
        self._outbox = opened.outbox
        self._reset: StateReset | None = opened.reset
        self._set_state(opened.alerts, opened.groups)
        self._http = httpx.Client(follow_redirects=False)
        self._clients = {r.name: ReceiverClient(r, self._http) for r in self._receivers}
        self._lock = threading.RLock()  # alert state, and the order of outbox writes
        counters = [ReceiverStats(name=r.name, type=r.type) for r in self._receivers]
        types = {r.name: r.type for r in config.receivers}
        counters += [ReceiverStats(name=p.receiver, type=types[p.receiver], enabled=False, disabled_reason=p.message)
                     for p in self._problems]
        last_delivered = self._outbox.last_delivered()  # so "last delivery" survives a restart
        for stats in counters:
            stats.last_delivered_at = last_delivered.get(stats.name)
        self._courier = Courier(self._outbox, clock, counters)
        self._catch_up_due: set[str] = set()  # receivers that refused rows for good: catch up when they accept
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._stop_deadline = 0.0  # time.monotonic() by which stop() wants the thread gone
        self._thread: threading.Thread | None = None
        self._closed = False
        self._final_pending: dict[str, PendingSummary] = {}
        # 0: the first pass pushes every firing alert, which also refreshes an Alertmanager after our restart
        self._alertmanager_push_at = 0.0
        self._prune_at = 0.0
        log.info(
            "alerting ready",
            receivers=[r.name for r in self._receivers],
            disabled=[p.receiver for p in self._problems],
            state=str(self._outbox.path),
            restored_alerts=len(self._lifecycle.active()),
            restored_groups=len(self._grouper.groups()),
        )

    def _load_state(self) -> None:
        self._set_state(*self._outbox.load_state())

    def _set_state(self, alerts: list[Alert], groups: list[Group]) -> None:
        config = self._config
        self._lifecycle = AlertLifecycle(config.for_duration, config.runbook_base_url, alerts)
        self._grouper = Grouper(
            config.group_by, config.group_wait_s, config.group_interval_s, config.repeat_interval_s, groups
        )

    # --- the supervisor's side -------------------------------------------------------------------------

    def start(self) -> None:
        if self._closed:
            raise RuntimeError("alerter is stopped")
        if self._thread is not None:
            return
        retried = self._outbox.retry_now(self._clock())
        pending = self._outbox.pending()
        disabled = {p.receiver for p in self._problems}
        orphaned = {name: p.count for name, p in pending.items() if name not in self._clients}
        if orphaned:
            log.warning("undelivered notifications for receivers no longer configured or disabled stay in the "
                        "outbox", receivers=orphaned, disabled=sorted(disabled & set(orphaned)))
        waiting = sum(p.count for name, p in pending.items() if name in self._clients)
        if waiting:
            log.info("outbox holds undelivered notifications; sending them now", pending=waiting, rescheduled=retried)
        # a restart is often how a refusing receiver gets fixed: tell it now what it missed
        for name in self._clients:
            try:
                self._catch_up(name, self._clock())
            except Exception:  # the state file refusing a write must not stop the supervisor from starting
                log.exception("could not queue the catch-up of a receiver", receiver=name)
        self._thread = threading.Thread(target=self._run, name="kvops-alert-delivery", daemon=True)
        self._thread.start()

    def evaluate(self, diagnoses: Sequence[Diagnosis], now: float | None = None) -> None:
        """Feed every diagnosis active now, across all engines: an alert whose diagnosis is absent resolves."""
        if self._closed:
            raise RuntimeError("alerter is stopped")
        now = self._clock() if now is None else now
        with self._lock:
            changes = self._lifecycle.update(diagnoses, now)
            _log_changes(changes)
            self._grouper.on_changes(changes, now)
            queued = self._advance(now, changes)
        if queued:
            self._wake.set()

    def active_alerts(self) -> list[Alert]:
        """Pending and firing alerts (copies), oldest first."""
        with self._lock:
            return [a.model_copy(deep=True) for a in self._lifecycle.active()]

    def stats(self, now: float | None = None) -> DeliveryStats:
        pending = self._final_pending if self._closed else self._outbox.pending()
        now = self._clock() if now is None else now
        receivers = self._courier.counters()
        for name, receiver in receivers.items():
            summary = pending.get(name)
            if summary is not None and receiver.enabled:
                receiver.pending = summary.count
                receiver.oldest_pending_age_s = max(0.0, now - summary.oldest_created_at)
        return DeliveryStats(
            delivered={name: r.delivered for name, r in receivers.items()},
            failed_attempts={name: r.failed_attempts for name, r in receivers.items()},
            dead_letters={name: r.dead_letters for name, r in receivers.items()},
            pending=sum(r.pending for r in receivers.values()),
            receivers=receivers,
        )

    def dead_letters(self, limit: int = DEAD_LETTERS_LISTED) -> list[DeadLetter]:
        """Notifications refused for good, most recent first (within the outbox retention)."""
        if self._closed:
            return []
        return [DeadLetter.from_row(row) for row in self._outbox.dead_letters(limit)]

    def self_diagnoses(self, now: float | None = None) -> list[Diagnosis]:
        """What is wrong with alerting itself, as diagnoses of engine "kvops": pass them to `evaluate`.

        Rules: alert_state_reset (critical), alert_dead_letters, alert_receiver_disabled,
        alert_outbox_backlog (warning). See docs/alerting.md, "When kvops itself fails".
        """
        now = self._clock() if now is None else now
        stats = self.stats(now)
        recent = {} if self._closed else self._outbox.dead_since(now - self._config.self_alert_hold_s)
        return self_diagnoses(self._config, now, stats.receivers, recent, self._problems, self._reset)

    def stop(self, flush_timeout_s: float = 5.0) -> None:
        """Deliver what is pending within `flush_timeout_s`, then stop; what is left stays in the outbox."""
        if self._closed:
            return
        deadline = time.monotonic() + flush_timeout_s
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._stop_deadline = deadline
            self._stopping.set()
            self._wake.set()
            # a send already under way may run for its receiver's timeout before the drain begins
            thread.join(flush_timeout_s + max((r.timeout_s for r in self._receivers), default=0.0) + 1.0)
            if thread.is_alive():
                log.error("alert delivery thread did not stop; leaving the outbox open")
                return
        else:
            self._final_pass(deadline)
        self._closed = True
        self._final_pending = self._outbox.pending()
        log.info("alerting stopped", undelivered={name: p.count for name, p in self._final_pending.items()})
        self._outbox.close()
        self._http.close()

    # --- notifications -----------------------------------------------------------------------------------

    def _advance(self, now: float, changes: LifecycleChanges | None = None) -> list[OutboxRow]:
        """Flush due groups and pushes, and commit them with the alert state. Caller holds the lock."""
        notifications, groups_changed = self._grouper.flush_due(now, self._lifecycle.firing())
        new = [row for n in notifications for row in self._webhook_notifications(n)]
        new += self._alertmanager_notifications(now, changes)
        if not (changes or groups_changed or new):
            return []
        try:
            rows = self._outbox.save(self._lifecycle.active(), self._grouper.groups(), new, now)
        except Exception:
            # memory must not run ahead of the file: it would believe these notifications queued and never
            # produce them again. Back to the last committed state; the next pass redoes the transitions.
            self._load_state()
            self._alertmanager_push_at = 0.0
            raise
        for row in rows:
            log.info("notification queued", receiver=row.receiver, id=row.id, kind=row.kind, group=row.group_key,
                     status=_payload_status(row))
        return rows

    def _webhook_notifications(self, notification: GroupNotification) -> list[NewNotification]:
        new = []
        for receiver in self._receivers:
            if receiver.type != "webhook":
                continue
            alerts = notification.alerts
            if not receiver.send_resolved:
                alerts = [a for a in alerts if a.state is AlertState.FIRING]
                if not alerts:
                    continue
            scoped = GroupNotification(notification.group_key, notification.group_labels, alerts)
            payload = webhook_payload(scoped, receiver.name, self._external_url)
            new.append(NewNotification(receiver.name, "webhook", notification.group_key, _dumps(payload)))
        return new

    def _alertmanager_notifications(self, now: float, changes: LifecycleChanges | None) -> list[NewNotification]:
        """Alertmanager groups by itself: push on every state change, and re-push firing alerts periodically."""
        targets = [r for r in self._receivers if r.type == "alertmanager"]
        changed = changes is not None and bool(changes.fired or changes.resolved)
        if not targets or not (changed or now >= self._alertmanager_push_at):
            return []
        self._alertmanager_push_at = now + self._config.alertmanager_resend_s
        alerts = self._lifecycle.firing() + (changes.resolved if changes is not None else [])
        if not alerts:
            return []
        payload = _dumps(postable_alerts(alerts, self._external_url))
        new = []
        for receiver in targets:
            # a push still queued already carries these firing alerts: stacking resends behind an outage only
            # makes the backlog longer
            if not changed and self._outbox.has_undelivered(receiver.name):
                continue
            new.append(NewNotification(receiver.name, "alertmanager", "", payload))
        return new

    # --- delivery ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            wait = _MAX_IDLE_S
            try:
                now = self._clock()
                with self._lock:
                    self._advance(now)
                self._prune(now)
                self._deliver_due()
                wait = self._idle_wait()
            except Exception:
                log.exception("alert delivery pass failed; trying again")
            self._wake.wait(wait)
        try:
            self._final_pass(self._stop_deadline)
        except Exception:
            log.exception("final alert delivery pass failed")

    def _final_pass(self, deadline: float) -> None:
        with self._lock:
            self._advance(self._clock())
        self._drain(deadline)

    def _deliver_due(self) -> None:
        for name, client in self._clients.items():
            while not self._stopping.is_set():
                row = self._outbox.head(name)
                if row is None or row.next_attempt_at > self._clock():
                    break
                if not self._attempt(client, row):
                    break

    def _drain(self, deadline: float) -> None:
        """At shutdown: one more try for every receiver, backoff ignored, until its first failure or the deadline."""
        for name, client in self._clients.items():
            while (remaining := deadline - time.monotonic()) > 0:
                row = self._outbox.head(name)
                if row is None or not self._attempt(client, row, timeout_s=remaining):
                    break

    def _attempt(self, client: ReceiverClient, row: OutboxRow, timeout_s: float | None = None) -> bool:
        """Send one row; True when the queue may move on (delivered, or given up on as a dead letter)."""
        name = client.receiver.name
        outcome = self._courier.attempt(client, row, timeout_s)
        if outcome is Outcome.DEAD and row.kind == "webhook":
            self._catch_up_due.add(name)
        if outcome is Outcome.DELIVERED and name in self._catch_up_due:
            # it accepts again: tell it what it missed while it refused
            self._catch_up_due.discard(name)
            self._catch_up(name, self._clock())
        return outcome is not Outcome.RETRY

    def _catch_up(self, name: str, now: float) -> None:
        """Send `name` the current state of each group whose latest notification to it is a dead letter.

        Only still-firing alerts: a resolution it missed is moot once the group is gone. Alertmanager
        receivers need none of this: the periodic re-push carries every firing alert.
        """
        receiver = next(r for r in self._receivers if r.name == name)
        if receiver.type != "webhook":
            return
        with self._lock:
            missed = set(self._outbox.dead_groups(name))
            if not missed:
                return
            firing: dict[str, list[Alert]] = {}
            for alert in self._lifecycle.firing():
                firing.setdefault(group_key(self._grouper.group_labels(alert)), []).append(alert)
            new = []
            for group in self._grouper.groups():
                # what the other receivers were told fires; the rest goes to everyone at the group's next tick
                told = [a for a in firing.get(group.key, []) if a.fingerprint in group.notified_firing]
                if group.key in missed and told:
                    notification = GroupNotification(group.key, dict(group.labels), told)
                    payload = webhook_payload(notification, name, self._external_url)
                    new.append(NewNotification(name, "webhook", group.key, _dumps(payload)))
            if not new:
                return
            rows = self._outbox.save(self._lifecycle.active(), self._grouper.groups(), new, now)
        for row in rows:
            log.info("notification queued", receiver=name, id=row.id, kind=row.kind, group=row.group_key,
                     status="firing", catch_up=True)
        self._wake.set()

    def _idle_wait(self) -> float:
        now = self._clock()
        due = []
        for name in self._clients:
            head = self._outbox.head(name)
            if head is not None:
                due.append(head.next_attempt_at)
        with self._lock:
            flush_at = self._grouper.next_flush_at()
            if flush_at is not None:
                due.append(flush_at)
            if any(r.type == "alertmanager" for r in self._receivers) and self._lifecycle.firing():
                due.append(self._alertmanager_push_at)
        if not due:
            return _MAX_IDLE_S
        return min(_MAX_IDLE_S, max(0.005, min(due) - now))

    def _prune(self, now: float) -> None:
        if now < self._prune_at:
            return
        self._prune_at = now + _PRUNE_EVERY_S
        removed = self._outbox.prune_delivered(now - self._config.outbox_retention_s)
        if removed:
            log.info("pruned delivered notifications", removed=removed)


def _dumps(payload: object) -> str:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def _payload_status(row: OutboxRow) -> str:
    if row.kind == "webhook":
        return str(json.loads(row.payload).get("status", ""))
    return "push"


def _log_changes(changes: LifecycleChanges) -> None:
    for event, alerts in (
        ("alert pending", changes.pending),
        ("alert firing", changes.fired),
        ("alert resolved", changes.resolved),
        ("alert dropped before firing", changes.dropped),
    ):
        for alert in alerts:
            log.info(event, alertname=alert.labels.get("alertname"), engine=alert.labels.get("engine"),
                     subject=alert.labels.get("subject", ""), severity=alert.labels.get("severity"),
                     fingerprint=alert.fingerprint)
