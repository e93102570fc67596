"""The supervisor's `/metrics`: its own health, the engines it watches, diagnoses, fixes, alerts.

Everything is read from the supervisor's state at scrape time (a custom collector), so the
exposition can never disagree with the supervisor API.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvops import __version__
from kvops.schema.diagnosis import Severity

if TYPE_CHECKING:
    from kvops.supervisor.supervisor import Supervisor

FIX_OUTCOMES = ("proposed", "applied", "verified", "rolled_back", "reverted", "failed")


class SupervisorCollector(Collector):
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterable[Metric]:
        sup = self.supervisor
        info = GaugeMetricFamily("kvops_supervisor_info", "Supervisor version; always 1.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield GaugeMetricFamily("kvops_supervisor_start_time_seconds", "Supervisor start time, unix seconds.",
                                value=sup.started_at)
        yield CounterMetricFamily("kvops_supervisor_polls", "Poll cycles completed.", value=sup.polls_total)
        yield GaugeMetricFamily("kvops_supervisor_last_poll_duration_seconds",
                                "Duration of the last poll cycle (all engines, rules, alerts, fixes).",
                                value=sup.last_poll_s)

        up = GaugeMetricFamily("kvops_engine_up", "1 when the engine answered its last poll.",
                               labels=["engine", "managed"])
        restarts = CounterMetricFamily("kvops_engine_restarts", "Restarts of a managed engine by the supervisor.",
                                       labels=["engine"])
        crash_loop = GaugeMetricFamily("kvops_engine_crash_loop", "1 when a managed engine is in a crash loop "
                                       "and no longer restarted.", labels=["engine"])
        errors = CounterMetricFamily("kvops_engine_poll_errors", "Polls that got no snapshot from the engine.",
                                     labels=["engine"])
        for name, state in sup.engines.items():
            up.add_metric([name, str(state.spec.managed).lower()], 1 if state.history.is_up else 0)
            restarts.add_metric([name], state.history.restarts_total)
            crash_loop.add_metric([name], 1 if state.history.crash_loop else 0)
            errors.add_metric([name], sup.poll_errors.get(name, 0))
        yield up
        yield restarts
        yield crash_loop
        yield errors

        active = GaugeMetricFamily("kvops_diagnosis_active", "Active diagnoses by rule, severity and engine "
                                   "(the value counts subjects, e.g. tenants, when a rule fires for several).",
                                   labels=["id", "severity", "engine"])
        counted: dict[tuple[str, str, str], int] = {}
        for diagnosis in sup.diagnoses:
            key = (diagnosis.rule, diagnosis.severity.value, diagnosis.engine)
            counted[key] = counted.get(key, 0) + 1
        for key, count in sorted(counted.items()):
            active.add_metric(list(key), count)
        yield active
        severities = GaugeMetricFamily("kvops_diagnoses_active", "Active diagnoses per severity, all engines.",
                                       labels=["severity"])
        for severity in Severity:
            severities.add_metric([severity.value], sum(1 for d in sup.diagnoses if d.severity is severity))
        yield severities

        fixes = CounterMetricFamily("kvops_fixes", "Fix actions by outcome: proposed, applied, verified, "
                                    "rolled_back, reverted, failed.", labels=["engine", "rule", "outcome"])
        for (engine, rule, outcome), count in sorted(sup.fixes.counts.items()):
            fixes.add_metric([engine, rule, outcome], count)
        yield fixes

        stats = sup.alerter.stats()
        deliveries = CounterMetricFamily("kvops_alert_deliveries", "Alert notifications delivered (2xx).",
                                         labels=["receiver"])
        failures = CounterMetricFamily("kvops_alert_delivery_failures", "Failed delivery attempts (retried).",
                                       labels=["receiver"])
        for receiver, count in sorted(stats.delivered.items()):
            deliveries.add_metric([receiver], count)
        for receiver, count in sorted(stats.failed_attempts.items()):
            failures.add_metric([receiver], count)
        yield deliveries
        yield failures
        yield GaugeMetricFamily("kvops_alert_outbox_pending", "Notifications waiting in the outbox.",
                                value=stats.pending)
        firing = GaugeMetricFamily("kvops_alerts", "Alerts by state.", labels=["state"])
        alerts = sup.alerter.active_alerts()
        for state in ("pending", "firing"):
            firing.add_metric([state], sum(1 for a in alerts if a.state == state))
        yield firing


def render(supervisor: Supervisor) -> tuple[bytes, str]:
    registry = CollectorRegistry()
    registry.register(SupervisorCollector(supervisor))
    return generate_latest(registry), CONTENT_TYPE_LATEST
