"""Alerts from diagnoses: lifecycle, grouping, and durable delivery to webhooks and Alertmanager.

See docs/alerting.md. The supervisor uses `Alerter` and the config models; the rest is internal.
"""

from kvops.alerting.alerter import Alerter, DeliveryStats, ReceiverStats
from kvops.alerting.config import AlertingConfig, AlertingConfigError, ReceiverConfig
from kvops.alerting.lifecycle import Alert, AlertState
from kvops.alerting.receivers import SIGNATURE_HEADER, verify_signature

__all__ = [
    "SIGNATURE_HEADER",
    "Alert",
    "AlertState",
    "Alerter",
    "AlertingConfig",
    "AlertingConfigError",
    "DeliveryStats",
    "ReceiverConfig",
    "ReceiverStats",
    "verify_signature",
]
