"""The `Alerter`: the one object the supervisor talks to, and the thread that delivers.

`evaluate` runs in the supervisor's thread: it advances the alert lifecycle, flushes the groups
that are due, and commits state and new notifications to the outbox before returning. The
delivery thread sends outbox rows (per receiver strictly in order, so a group's "resolved" never
overtakes its "firing"), backs off on failures, and also flushes groups whose timers expire
between two evaluations. Both hold one lock around the alert state; HTTP happens outside it.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import structlog
from pydantic import BaseModel

from kvops.alerting.config import AlertingConfig, ResolvedReceiver, resolve_receivers
from kvops.alerting.grouping import Grouper, GroupNotification
from kvops.alerting.lifecycle import Alert, AlertLifecycle, AlertState, LifecycleChanges
from kvops.alerting.outbox import NewNotification, Outbox, OutboxRow, PendingSummary
from kvops.alerting.payloads import postable_alerts, webhook_payload
from kvops.alerting.receivers import ReceiverClient
from kvops.schema.diagnosis import Diagnosis

log = structlog.get_logger("kvops.alerting")

STATE_FILE = "alerts.sqlite3"
_MAX_IDLE_S = 1.0  # the thread re-checks at least this often, so a stepped wall clock cannot stall it for long
_PRUNE_EVERY_S = 3600.0


class ReceiverStats(BaseModel):
    name: str
    type: str
    delivered: int = 0  # rows delivered (2xx) since this process started
    failed_attempts: int = 0  # attempts that failed since this process started
    pending: int = 0  # undelivered rows in the outbox now
    oldest_pending_age_s: float | None = None
    last_error: str | None = None  # the most recent failure's reason, secrets blanked out
    last_delivered_at: float | None = None


class DeliveryStats(BaseModel):
    """Shaped for /metrics: counters keyed by receiver name, and the outbox backlog."""

    delivered: dict[str, int]  # rows delivered (2xx) since this process started
    failed_attempts: dict[str, int]  # failed attempts since this process started (each is retried)
    pending: int  # undelivered rows in the outbox, over all configured receivers
    receivers: dict[str, ReceiverStats]  # all of it, per receiver


def backoff_s(attempts: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Delay after the `attempts`-th failure: initial, doubling, capped, ±10% so receivers are not hit in step."""
    base = min(max_s, initial_s * 2.0 ** min(attempts - 1, 62))
    return min(max_s, base * rng.uniform(0.9, 1.1))


class Alerter:
    def __init__(
        self,
        config: AlertingConfig,
        state_dir: Path,
        external_url: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._receivers: list[ResolvedReceiver] = resolve_receivers(config)  # AlertingConfigError on an unset *_env
        self._external_url = external_url.rstrip("/")
        self._clock = clock
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self._outbox = Outbox(state_dir / STATE_FILE)
        self._load_state()
        self._http = httpx.Client(follow_redirects=False)
        self._clients = {r.name: ReceiverClient(r, self._http) for r in self._receivers}
        self._lock = threading.RLock()  # alert state, and the order of outbox writes
        self._stats_lock = threading.Lock()
        self._counters = {r.name: ReceiverStats(name=r.name, type=r.type) for r in self._receivers}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._stop_deadline = 0.0  # time.monotonic() by which stop() wants the thread gone
        self._thread: threading.Thread | None = None
        self._closed = False
        self._final_pending: dict[str, PendingSummary] = {}
        # 0: the first pass pushes every firing alert, which also refreshes an Alertmanager after our restart
        self._alertmanager_push_at = 0.0
        self._prune_at = 0.0
        self._rng = random.Random()
        log.info(
            "alerting ready",
            receivers=[r.name for r in self._receivers],
            state=str(self._outbox.path),
            restored_alerts=len(self._lifecycle.active()),
            restored_groups=len(self._grouper.groups()),
        )

    def _load_state(self) -> None:
        config = self._config
        alerts, groups = self._outbox.load_state()
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
        orphaned = {name: p.count for name, p in pending.items() if name not in self._clients}
        if orphaned:
            log.warning("undelivered notifications for receivers no longer configured stay in the outbox",
                        receivers=orphaned)
        waiting = sum(p.count for name, p in pending.items() if name in self._clients)
        if waiting:
            log.info("outbox holds undelivered notifications; sending them now", pending=waiting, rescheduled=retried)
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

    def stats(self) -> DeliveryStats:
        pending = self._final_pending if self._closed else self._outbox.pending()
        now = self._clock()
        with self._stats_lock:
            receivers = {name: s.model_copy() for name, s in self._counters.items()}
        for name, receiver in receivers.items():
            summary = pending.get(name)
            if summary is not None:
                receiver.pending = summary.count
                receiver.oldest_pending_age_s = max(0.0, now - summary.oldest_created_at)
        return DeliveryStats(
            delivered={name: r.delivered for name, r in receivers.items()},
            failed_attempts={name: r.failed_attempts for name, r in receivers.items()},
            pending=sum(r.pending for r in receivers.values()),
            receivers=receivers,
        )

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
        receiver = client.receiver
        result = client.send(row.payload.encode(), row.idempotency_key, timeout_s)
        now = self._clock()
        attempts = row.attempts + 1
        if result.ok:
            self._outbox.mark_delivered(row.id, now)
            with self._stats_lock:
                counters = self._counters[receiver.name]
                counters.delivered += 1
                counters.last_delivered_at = now
            log.info("notification delivered", receiver=receiver.name, id=row.id, kind=row.kind, group=row.group_key,
                     attempts=attempts, http_status=result.status_code, queued_s=round(now - row.created_at, 3))
            return True
        delay = backoff_s(attempts, receiver.initial_backoff_s, receiver.max_backoff_s, self._rng)
        error = result.error or "unknown error"
        self._outbox.mark_failed(row.id, attempts, error, now + delay)
        with self._stats_lock:
            counters = self._counters[receiver.name]
            counters.failed_attempts += 1
            counters.last_error = error
        fields = {"receiver": receiver.name, "id": row.id, "attempts": attempts, "error": error,
                  "retry_in_s": round(delay, 3)}
        if result.rejected:
            log.error("receiver rejected a notification; retrying, check its URL and credentials", **fields)
        else:
            log.warning("notification delivery failed; retrying", **fields)
        return False

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
