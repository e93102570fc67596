"""Grouping and notification timing, after Alertmanager's aggregation groups.

Firing alerts with equal `group_by` labels share a group and travel in one notification. A new
group is first flushed `group_wait_s` after its first alert fired (so alerts that start together
arrive together), then re-examined every `group_interval_s`: it is notified again when an alert
started firing or one that was announced as firing resolved, or when `repeat_interval_s` passed
since the last notification. A group keeps the fingerprints it last announced as firing; that is
what makes a resolution worth sending (nobody is told about an alert that fired and resolved
between two flushes) and what stops a restarted daemon from announcing the same alerts twice.
No I/O here; the alerter persists the groups.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvops.alerting.lifecycle import Alert, AlertState, LifecycleChanges


@dataclass
class Group:
    key: str
    labels: dict[str, str]
    next_flush_at: float
    notified_firing: set[str] = field(default_factory=set)  # fingerprints announced as firing last time
    last_notified_at: float | None = None
    resolved: dict[str, Alert] = field(default_factory=dict)  # resolved since the last flush, by fingerprint


@dataclass(frozen=True)
class GroupNotification:
    group_key: str
    group_labels: dict[str, str]
    alerts: list[Alert]  # firing ones first, then resolved ones

    @property
    def status(self) -> str:
        return "firing" if any(a.state is AlertState.FIRING for a in self.alerts) else "resolved"


def group_key(group_labels: dict[str, str]) -> str:
    # Alertmanager's shape: route key ("{}" for the root route) and the group labels, sorted and quoted
    inner = ", ".join(f"{name}={json.dumps(group_labels[name])}" for name in sorted(group_labels))
    return f"{{}}:{{{inner}}}"


class Grouper:
    def __init__(
        self,
        group_by: Sequence[str],
        group_wait_s: float,
        group_interval_s: float,
        repeat_interval_s: float,
        groups: Iterable[Group] = (),
    ) -> None:
        self._group_by = list(group_by)
        self._group_wait_s = group_wait_s
        self._group_interval_s = group_interval_s
        self._repeat_interval_s = repeat_interval_s
        self._groups: dict[str, Group] = {g.key: g for g in groups}

    def group_labels(self, alert: Alert) -> dict[str, str]:
        return {name: alert.labels[name] for name in self._group_by if name in alert.labels}

    def _group_for(self, alert: Alert, now: float) -> Group:
        labels = self.group_labels(alert)
        key = group_key(labels)
        group = self._groups.get(key)
        if group is None:
            group = Group(key=key, labels=labels, next_flush_at=now + self._group_wait_s)
            self._groups[key] = group
        return group

    def on_changes(self, changes: LifecycleChanges, now: float) -> None:
        for alert in changes.fired:
            self._group_for(alert, now)
        for alert in changes.resolved:
            self._group_for(alert, now).resolved[alert.fingerprint] = alert

    def flush_due(self, now: float, firing: Iterable[Alert]) -> tuple[list[GroupNotification], bool]:
        """Notifications due at `now`, and whether any group's state changed (so it must be saved)."""
        firing_by_group: dict[str, list[Alert]] = {}
        for alert in firing:
            firing_by_group.setdefault(group_key(self.group_labels(alert)), []).append(alert)
        notifications = []
        changed = False
        for key in sorted(k for k, g in self._groups.items() if g.next_flush_at <= now):
            group = self._groups[key]
            changed = True
            firing_now = sorted(firing_by_group.get(key, []), key=lambda a: (a.active_at, a.fingerprint))
            firing_prints = {a.fingerprint for a in firing_now}
            # an alert that re-fired under the same fingerprint is reported by its firing instance only
            resolved = sorted(
                (a for a in group.resolved.values() if a.fingerprint in group.notified_firing - firing_prints),
                key=lambda a: (a.resolved_at or 0.0, a.fingerprint),
            )
            news = bool(firing_prints - group.notified_firing) or bool(resolved)
            repeat = (
                bool(firing_now)
                and group.last_notified_at is not None
                and now - group.last_notified_at >= self._repeat_interval_s
            )
            if news or repeat:
                notifications.append(GroupNotification(key, dict(group.labels), [*firing_now, *resolved]))
                group.notified_firing = firing_prints
                group.last_notified_at = now
            group.resolved.clear()
            if firing_now:
                group.next_flush_at = now + self._group_interval_s
            else:
                del self._groups[key]  # the next alert with these labels starts a fresh group (and waits again)
        return notifications, changed

    def next_flush_at(self) -> float | None:
        return min((g.next_flush_at for g in self._groups.values()), default=None)

    def groups(self) -> list[Group]:
        return list(self._groups.values())
