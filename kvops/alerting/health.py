"""The alerter's view of its own health: delivery stats, dead letters, and diagnoses about itself.

An alerting path that fails quietly is worse than none, because people trust the silence. So the
alerter turns its own faults into diagnoses of engine "kvops", which travel the same way as every
other alert (lifecycle, grouping, outbox): whichever receivers still work say that one does not.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from pydantic import BaseModel

from kvops.alerting.config import AlertingConfig, ReceiverProblem
from kvops.alerting.outbox import DeadSummary, OutboxRow
from kvops.alerting.state_file import StateReset
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity

SELF_ENGINE = "kvops"  # the `engine` label of kvops's alerts about itself
STATE_RESET = "alert_state_reset"
DEAD_LETTERS = "alert_dead_letters"
RECEIVER_DISABLED = "alert_receiver_disabled"
OUTBOX_BACKLOG = "alert_outbox_backlog"
SELF_RULES = (STATE_RESET, DEAD_LETTERS, RECEIVER_DISABLED, OUTBOX_BACKLOG)


class ReceiverStats(BaseModel):
    name: str
    type: str
    enabled: bool = True
    disabled_reason: str | None = None  # why not, e.g. its secret's environment variable is unset
    delivered: int = 0  # rows delivered (2xx) since this process started
    failed_attempts: int = 0  # attempts that failed since this process started
    dead_letters: int = 0  # rows given up on (refused for good) since this process started
    pending: int = 0  # queued rows in the outbox now (neither delivered nor dead)
    oldest_pending_age_s: float | None = None
    last_error: str | None = None  # the most recent failure's reason, secrets blanked out
    last_delivered_at: float | None = None  # also from before a restart, within the outbox retention
    last_dead_letter_reason: str | None = None
    last_dead_letter_at: float | None = None


class DeliveryStats(BaseModel):
    """Shaped for /metrics: counters keyed by receiver name, and the outbox backlog."""

    delivered: dict[str, int]  # rows delivered (2xx) since this process started
    failed_attempts: dict[str, int]  # failed attempts since this process started (each is retried)
    dead_letters: dict[str, int]  # rows given up on since this process started
    pending: int  # queued rows in the outbox, over all configured receivers
    receivers: dict[str, ReceiverStats]  # all of it, per receiver, disabled ones included


class DeadLetter(BaseModel):
    """A notification a receiver refused for good, as GET /api/alerts/dead-letters lists it."""

    id: int
    receiver: str
    kind: str
    group: str  # the group key ("" for an Alertmanager push)
    status: int | None  # the HTTP status that killed it
    reason: str
    attempts: int
    created_at: float
    dead_at: float

    @classmethod
    def from_row(cls, row: OutboxRow) -> DeadLetter:
        return cls(id=row.id, receiver=row.receiver, kind=row.kind, group=row.group_key, status=row.dead_status,
                   reason=row.dead_reason or "", attempts=row.attempts, created_at=row.created_at,
                   dead_at=row.dead_at or 0.0)


def _when(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _report(description: str) -> Fix:
    return Fix(kind=FixKind.REPORT, action="advice", description=description)


def self_diagnoses(
    config: AlertingConfig,
    now: float,
    receivers: Mapping[str, ReceiverStats],
    recent_dead: Mapping[str, DeadSummary],
    problems: list[ReceiverProblem],
    reset: StateReset | None,
) -> list[Diagnosis]:
    """What is wrong with alerting itself at `now` (see docs/alerting.md, "When kvops itself fails")."""
    found: list[Diagnosis] = []
    hold = config.self_alert_hold_s
    if reset is not None and (not reset.durable or now - reset.at < hold):
        if reset.durable:
            summary = (f"the alert state file was unusable at {_when(reset.at)} and was replaced (the old one is "
                       f"kept at {reset.moved_to}); notifications queued in it were not sent")
        else:
            summary = (f"the alert state file could not be used at {_when(reset.at)} ({reset.reason}); alert "
                       "state is in memory only and is lost at the next restart")
        found.append(Diagnosis(
            rule=STATE_RESET, engine=SELF_ENGINE, severity=Severity.CRITICAL, title="Alert state was reset",
            summary=summary,
            evidence={"reset_at": reset.at, "moved_to": reset.moved_to, "reason": reset.reason,
                      "durable": reset.durable},
            fix=_report("open the old file with sqlite3 to see what was queued and tell those people; find why "
                        "it broke (disk full, a copy or restore over a running daemon, filesystem errors)"),
        ))
    for problem in problems:
        found.append(Diagnosis(
            rule=RECEIVER_DISABLED, engine=SELF_ENGINE, subject=problem.receiver, severity=Severity.WARNING,
            title="Alert receiver disabled",
            summary=f"receiver {problem.receiver} is disabled: {problem.key} names {problem.variable}, "
                    "which is not set; it gets no notifications",
            evidence={"receiver": problem.receiver, "key": problem.key, "variable": problem.variable},
            fix=_report(f"set {problem.variable} in the supervisor's environment and restart kvops"),
        ))
    for name, dead in sorted(recent_dead.items()):
        if name not in receivers or not receivers[name].enabled:
            continue  # a receiver no longer configured: nobody can act on it here
        found.append(Diagnosis(
            rule=DEAD_LETTERS, engine=SELF_ENGINE, subject=name, severity=Severity.WARNING,
            title="Alert notifications refused",
            summary=f"receiver {name} refused {dead.count} notification(s) for good in the last "
                    f"{hold / 60:.0f} min (latest: {dead.last_reason}); they were not delivered",
            evidence={"receiver": name, "dead_letters": dead.count, "last_reason": dead.last_reason,
                      "last_dead_at": dead.last_dead_at},
            fix=_report(f"check receiver {name}'s URL, token and signature secret; GET /api/alerts/dead-letters "
                        "lists what it missed"),
        ))
    for name, stats in sorted(receivers.items()):
        age = stats.oldest_pending_age_s
        if not stats.enabled or age is None or age < config.outbox_backlog_alert_s:
            continue
        found.append(Diagnosis(
            rule=OUTBOX_BACKLOG, engine=SELF_ENGINE, subject=name, severity=Severity.WARNING,
            title="Alert notifications not getting through",
            summary=f"receiver {name} has {stats.pending} notification(s) waiting, the oldest for {age:.0f} s "
                    f"(last error: {stats.last_error or 'none'})",
            evidence={"receiver": name, "pending": stats.pending, "oldest_pending_age_s": round(age, 1),
                      "last_error": stats.last_error},
            fix=_report(f"check that receiver {name} is up and reachable from the supervisor; the backlog is "
                        "delivered in order once it answers"),
        ))
    return found
