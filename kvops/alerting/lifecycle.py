"""The alert state machine: diagnoses in, pending / firing / resolved alerts out.

One alert per diagnosis key (rule, engine, subject). It is `pending` from the first evaluation
that sees the diagnosis, `firing` once the diagnosis has been present for the rule's `for`
duration, and `resolved` at the first evaluation that no longer sees it. A pending alert that
disappears is dropped without a word: `for` exists precisely to keep blips from paging anyone.
This module does no I/O; the alerter persists what it returns.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel

from kvops.schema.diagnosis import Diagnosis

_FNV64_OFFSET = 14695981039346656037
_FNV64_PRIME = 1099511628211
_LABEL_SEPARATOR = b"\xff"


class AlertState(enum.StrEnum):
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


class Alert(BaseModel):
    fingerprint: str
    labels: dict[str, str]
    annotations: dict[str, str]
    state: AlertState
    active_at: float  # first evaluation that saw the diagnosis: the alert's startsAt
    fired_at: float | None = None
    resolved_at: float | None = None  # the alert's endsAt

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.labels.get("alertname", ""), self.labels.get("engine", ""), self.labels.get("subject", ""))


def fingerprint(labels: dict[str, str]) -> str:
    """FNV-1a 64 over the sorted labels, exactly as Prometheus/Alertmanager compute it.

    Using their algorithm means the fingerprint in our webhook payloads is the one an
    Alertmanager shows for the same alert, so people can cross-reference the two.
    """
    value = _FNV64_OFFSET
    for name in sorted(labels):
        for part in (name.encode(), _LABEL_SEPARATOR, labels[name].encode(), _LABEL_SEPARATOR):
            for byte in part:
                value = ((value ^ byte) * _FNV64_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{value:016x}"


def alert_labels(diagnosis: Diagnosis) -> dict[str, str]:
    labels = {
        "alertname": diagnosis.rule,
        "engine": diagnosis.engine,
        "severity": diagnosis.severity.value,
        "subject": diagnosis.subject,
    }
    # Prometheus semantics: an empty label is an absent label (and Alertmanager rejects empty values)
    return {name: value for name, value in labels.items() if value}


def _evidence_value(value: float | int | str | bool | None) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format(value, ".6g")
    return "none" if value is None else str(value)


def alert_annotations(diagnosis: Diagnosis, runbook_base_url: str) -> dict[str, str]:
    evidence = ", ".join(f"{k}={_evidence_value(v)}" for k, v in diagnosis.evidence.items())
    description = diagnosis.title
    if evidence:
        description += f": {evidence}"
    annotations = {"summary": diagnosis.summary}
    if diagnosis.fix is not None:
        description += f". Fix: {diagnosis.fix.description}"
        annotations["fix"] = diagnosis.fix.description
    annotations["description"] = description
    annotations["runbook_url"] = f"{runbook_base_url.rstrip('/')}/{diagnosis.rule}.md"
    return annotations


@dataclass
class LifecycleChanges:
    pending: list[Alert] = field(default_factory=list)  # new alerts
    fired: list[Alert] = field(default_factory=list)
    resolved: list[Alert] = field(default_factory=list)
    dropped: list[Alert] = field(default_factory=list)  # pending alerts whose diagnosis went away

    def __bool__(self) -> bool:
        return bool(self.pending or self.fired or self.resolved or self.dropped)


class AlertLifecycle:
    def __init__(
        self,
        for_duration: Callable[[Diagnosis], float],
        runbook_base_url: str,
        alerts: Iterable[Alert] = (),
    ) -> None:
        self._for_duration = for_duration
        self._runbook_base_url = runbook_base_url
        self._active: dict[tuple[str, str, str], Alert] = {a.key: a for a in alerts}

    def update(self, diagnoses: Iterable[Diagnosis], now: float) -> LifecycleChanges:
        changes = LifecycleChanges()
        seen = {d.key: d for d in diagnoses}  # a rule repeating a key: the last one describes it
        for key, diagnosis in seen.items():
            labels = alert_labels(diagnosis)
            labels_fingerprint = fingerprint(labels)
            annotations = alert_annotations(diagnosis, self._runbook_base_url)
            alert = self._active.get(key)
            if alert is not None and alert.fingerprint != labels_fingerprint:
                # the labels moved (severity escalated): like two Prometheus rules, one alert ends, another begins
                self._end(key, now, changes)
                alert = None
            if alert is None:
                alert = Alert(fingerprint=labels_fingerprint, labels=labels, annotations=annotations,
                              state=AlertState.PENDING, active_at=now)
                self._active[key] = alert
                changes.pending.append(alert)
            else:
                alert.annotations = annotations  # the numbers in the summary move; the latest ones are sent
            if alert.state is AlertState.PENDING and now - alert.active_at >= self._for_duration(diagnosis):
                alert.state = AlertState.FIRING
                alert.fired_at = now
                changes.fired.append(alert)
        for key in [k for k in self._active if k not in seen]:
            self._end(key, now, changes)
        return changes

    def _end(self, key: tuple[str, str, str], now: float, changes: LifecycleChanges) -> None:
        alert = self._active.pop(key)
        if alert.state is AlertState.PENDING:
            changes.dropped.append(alert)
            return
        alert.state = AlertState.RESOLVED
        alert.resolved_at = now
        changes.resolved.append(alert)

    def active(self) -> list[Alert]:
        """Pending and firing alerts, oldest first."""
        return sorted(self._active.values(), key=lambda a: (a.active_at, a.fingerprint))

    def firing(self) -> list[Alert]:
        return [a for a in self.active() if a.state is AlertState.FIRING]
