"""Wire formats: the Alertmanager webhook payload (version "4") and Alertmanager's postable alerts.

Both are what receivers already parse, so a kvops daemon can sit where an Alertmanager sits (for
webhook consumers) or feed a real Alertmanager (which then does its own grouping and routing).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

from kvops.alerting.grouping import GroupNotification
from kvops.alerting.lifecycle import Alert, AlertState

# Go's zero time.Time, which Alertmanager puts in endsAt while an alert fires
ZERO_TIME = "0001-01-01T00:00:00Z"
WEBHOOK_VERSION = "4"


def rfc3339(timestamp: float) -> str:
    moment = dt.datetime.fromtimestamp(timestamp, tz=dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def generator_url(external_url: str, alert: Alert) -> str:
    """Where the alert came from: the supervisor, with the diagnosis key as query parameters."""
    if not external_url:
        return ""
    rule, engine, subject = alert.key
    query = {"rule": rule, "engine": engine, **({"subject": subject} if subject else {})}
    return f"{external_url.rstrip('/')}/?{urlencode(query)}"


def _common(mappings: Sequence[dict[str, str]]) -> dict[str, str]:
    if not mappings:
        return {}
    first, *rest = mappings
    return {k: v for k, v in first.items() if all(m.get(k) == v for m in rest)}


def webhook_alert(alert: Alert, external_url: str) -> dict[str, Any]:
    resolved = alert.state is AlertState.RESOLVED and alert.resolved_at is not None
    return {
        "status": "resolved" if resolved else "firing",
        "labels": dict(alert.labels),
        "annotations": dict(alert.annotations),
        "startsAt": rfc3339(alert.active_at),
        "endsAt": rfc3339(alert.resolved_at) if resolved and alert.resolved_at is not None else ZERO_TIME,
        "generatorURL": generator_url(external_url, alert),
        "fingerprint": alert.fingerprint,
    }


def webhook_payload(notification: GroupNotification, receiver: str, external_url: str) -> dict[str, Any]:
    alerts = notification.alerts
    return {
        "version": WEBHOOK_VERSION,
        "groupKey": notification.group_key,
        "truncatedAlerts": 0,
        "status": notification.status,
        "receiver": receiver,
        "groupLabels": dict(notification.group_labels),
        "commonLabels": _common([a.labels for a in alerts]),
        "commonAnnotations": _common([a.annotations for a in alerts]),
        "externalURL": external_url,
        "alerts": [webhook_alert(a, external_url) for a in alerts],
    }


def postable_alerts(alerts: Sequence[Alert], external_url: str) -> list[dict[str, Any]]:
    """Alertmanager API v2 `PostableAlerts`.

    Firing alerts carry no endsAt: Alertmanager then keeps them for its `resolve_timeout` (5m by
    default), and the alerter re-pushes them more often than that. Resolved ones carry endsAt.
    """
    postable = []
    for alert in alerts:
        item: dict[str, Any] = {
            "labels": dict(alert.labels),
            "annotations": dict(alert.annotations),
            "startsAt": rfc3339(alert.active_at),
        }
        source = generator_url(external_url, alert)
        if source:  # Alertmanager validates it as a URI: leave it out rather than send ""
            item["generatorURL"] = source
        if alert.state is AlertState.RESOLVED and alert.resolved_at is not None:
            item["endsAt"] = rfc3339(alert.resolved_at)
        postable.append(item)
    return postable
