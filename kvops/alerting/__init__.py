"""Alerts from diagnoses: lifecycle, grouping, and durable delivery to webhooks and Alertmanager.

See docs/alerting.md. The supervisor uses `Alerter`, the config models and `receiver_problems` (what
`kvops run --check-config` warns about); the rest is internal.
"""

from kvops.alerting.alerter import Alerter
from kvops.alerting.config import (
    AlertingConfig,
    AlertingConfigError,
    ReceiverConfig,
    ReceiverProblem,
    receiver_problems,
    resolve_receivers,
)
from kvops.alerting.health import SELF_ENGINE, SELF_RULES, DeadLetter, DeliveryStats, ReceiverStats
from kvops.alerting.lifecycle import Alert, AlertState
from kvops.alerting.receivers import SIGNATURE_HEADER, verify_signature

__all__ = [
    "SELF_ENGINE",
    "SELF_RULES",
    "SIGNATURE_HEADER",
    "Alert",
    "AlertState",
    "Alerter",
    "AlertingConfig",
    "AlertingConfigError",
    "DeadLetter",
    "DeliveryStats",
    "ReceiverConfig",
    "ReceiverProblem",
    "ReceiverStats",
    "receiver_problems",
    "resolve_receivers",
    "verify_signature",
]
