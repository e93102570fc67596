"""Alerting without the network: lifecycle, grouping and timing on a fake clock, the v4 payload,
config validation, and the SQLite state a restarted daemon resumes from.

The alerter is never started here, so nothing is sent: notifications are read back from the
outbox file, which is exactly what the delivery thread would send.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvops.alerting import Alerter, AlertingConfig, AlertState, ReceiverConfig, verify_signature
from kvops.alerting.config import receiver_problems, resolve_receivers
from kvops.alerting.delivery import backoff_s
from kvops.alerting.lifecycle import AlertLifecycle, alert_labels, fingerprint
from kvops.alerting.outbox import Outbox
from kvops.alerting.payloads import ZERO_TIME
from kvops.alerting.receivers import sign
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from tests.helpers.alerting_outbox import outbox_rows

EXTERNAL_URL = "http://kvops.example:9400"
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
T0 = 1_700_000_000.0


def diagnosis(
    rule: str = "kv_oom_runtime",
    engine: str = "e1",
    subject: str = "",
    severity: Severity = Severity.WARNING,
    summary: str = "free blocks run out in 42 s at the current rate",
) -> Diagnosis:
    return Diagnosis(
        rule=rule,
        engine=engine,
        subject=subject,
        severity=severity,
        title="OOM risk at run time",
        summary=summary,
        evidence={"free_blocks": 12, "seconds_to_exhaustion": 42.5, "preemptions_rising": True},
        fix=Fix(kind=FixKind.ADMIN, action="set_tenant_quota", description="cap concurrency at 8 sequences"),
    )


def config(**overrides: Any) -> AlertingConfig:
    settings: dict[str, Any] = {
        "receivers": [{"name": "ops", "url": "http://127.0.0.1:9/hook"}],
        "group_wait_s": 10,
        "group_interval_s": 60,
        "repeat_interval_s": 300,
        "default_for_s": 0,
    }
    settings.update(overrides)
    return AlertingConfig.model_validate(settings)


def payloads(state_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(r.payload) for r in outbox_rows(state_dir)]


@pytest.fixture
def make_alerter(tmp_path: Path):
    made: list[Alerter] = []

    def make(cfg: AlertingConfig | None = None, state_dir: Path | None = None) -> Alerter:
        alerter = Alerter(cfg or config(), state_dir or tmp_path, EXTERNAL_URL, clock=lambda: T0)
        made.append(alerter)
        return alerter

    yield make
    for alerter in made:
        alerter.stop(flush_timeout_s=0)  # nothing is sent: the receiver URL is never reached


# --- lifecycle -----------------------------------------------------------------------------------------


def test_pending_then_firing_after_for(make_alerter, tmp_path: Path) -> None:
    alerter = make_alerter(config(default_for_s=30, group_wait_s=0))
    alerter.evaluate([diagnosis()], now=T0)
    (alert,) = alerter.active_alerts()
    assert alert.state is AlertState.PENDING and alert.active_at == T0
    alerter.evaluate([diagnosis()], now=T0 + 29.9)
    assert alerter.active_alerts()[0].state is AlertState.PENDING
    assert outbox_rows(tmp_path) == []
    alerter.evaluate([diagnosis()], now=T0 + 30)
    (alert,) = alerter.active_alerts()
    assert alert.state is AlertState.FIRING and alert.fired_at == T0 + 30
    (payload,) = payloads(tmp_path)
    assert payload["status"] == "firing"
    assert payload["alerts"][0]["startsAt"] == "2023-11-14T22:13:20.000Z"  # startsAt is first seen, not fired_at


def test_for_per_rule_and_critical_default() -> None:
    cfg = config(default_for_s=30, critical_for_s=0, for_s={"swap_storm": 120})
    assert cfg.for_duration(diagnosis()) == 30
    assert cfg.for_duration(diagnosis(severity=Severity.CRITICAL)) == 0
    assert cfg.for_duration(diagnosis(rule="swap_storm", severity=Severity.CRITICAL)) == 120


def test_pending_alert_that_disappears_is_dropped_silently(make_alerter, tmp_path: Path) -> None:
    alerter = make_alerter(config(default_for_s=30, group_wait_s=0))
    alerter.evaluate([diagnosis()], now=T0)
    alerter.evaluate([], now=T0 + 20)
    alerter.evaluate([], now=T0 + 200)
    assert alerter.active_alerts() == []
    assert outbox_rows(tmp_path) == []


def test_resolved_with_ends_at_and_refire_is_a_new_alert(make_alerter, tmp_path: Path) -> None:
    alerter = make_alerter(config(group_wait_s=0, group_interval_s=10))
    alerter.evaluate([diagnosis()], now=T0)
    alerter.evaluate([], now=T0 + 5)
    assert alerter.active_alerts() == []
    alerter.evaluate([], now=T0 + 10)  # the group's next flush carries the resolution
    alerter.evaluate([diagnosis()], now=T0 + 100)  # back: a new alert, a new group (group_wait 0)
    firing, resolved, refired = payloads(tmp_path)
    assert firing["status"] == "firing" and firing["alerts"][0]["endsAt"] == ZERO_TIME
    assert resolved["status"] == "resolved"
    assert resolved["alerts"][0]["startsAt"] == "2023-11-14T22:13:20.000Z"
    assert resolved["alerts"][0]["endsAt"] == "2023-11-14T22:13:25.000Z"  # the evaluation that no longer saw it
    assert refired["status"] == "firing"
    assert refired["alerts"][0]["startsAt"] == "2023-11-14T22:15:00.000Z"
    assert refired["alerts"][0]["fingerprint"] == firing["alerts"][0]["fingerprint"]  # same labels, same print


def test_fingerprint_is_alertmanagers_and_depends_on_labels_only() -> None:
    # the vector from prometheus/common's signature tests: our fingerprints equal Alertmanager's
    assert fingerprint({"name": "garland, briggs", "fear": "love is not enough"}) == f"{5799056148416392346:016x}"
    assert fingerprint({}) == f"{14695981039346656037:016x}"
    a = alert_labels(diagnosis(summary="42 s left"))
    b = alert_labels(diagnosis(summary="7 s left"))
    assert fingerprint(a) == fingerprint(b) == fingerprint(dict(reversed(list(a.items()))))
    assert re.fullmatch(r"[0-9a-f]{16}", fingerprint(a))
    assert fingerprint(alert_labels(diagnosis(subject="tenant-a"))) != fingerprint(a)
    assert "subject" not in a  # empty subject: no label
    assert alert_labels(diagnosis(subject="tenant-a"))["subject"] == "tenant-a"


def test_severity_change_ends_one_alert_and_starts_another() -> None:
    lifecycle = AlertLifecycle(lambda d: 0.0, "https://runbooks.example")
    lifecycle.update([diagnosis()], now=T0)
    changes = lifecycle.update([diagnosis(severity=Severity.CRITICAL)], now=T0 + 1)
    assert [a.labels["severity"] for a in changes.resolved] == ["warning"]
    assert [a.labels["severity"] for a in changes.fired] == ["critical"]
    (alert,) = lifecycle.active()
    assert alert.active_at == T0 + 1


def test_annotations(make_alerter) -> None:
    alerter = make_alerter()
    alerter.evaluate([diagnosis()], now=T0)
    annotations = alerter.active_alerts()[0].annotations
    assert annotations["summary"] == "free blocks run out in 42 s at the current rate"
    assert annotations["description"] == (
        "OOM risk at run time: free_blocks=12, seconds_to_exhaustion=42.5, preemptions_rising=true. "
        "Fix: cap concurrency at 8 sequences"
    )
    assert annotations["fix"] == "cap concurrency at 8 sequences"
    assert annotations["runbook_url"] == "https://github.com/kvops/kvops/blob/main/docs/runbooks/kv_oom_runtime.md"


# --- grouping and timing -------------------------------------------------------------------------------


def test_same_rule_same_engine_grouped_after_group_wait(make_alerter, tmp_path: Path) -> None:
    alerter = make_alerter()
    tenants = [diagnosis(rule="tenant_pollution", subject="a"), diagnosis(rule="tenant_pollution", subject="b")]
    alerter.evaluate(tenants[:1], now=T0)
    alerter.evaluate(tenants, now=T0 + 3)
    alerter.evaluate([*tenants, diagnosis(engine="e2")], now=T0 + 9.9)
    assert outbox_rows(tmp_path) == []
    alerter.evaluate([*tenants, diagnosis(engine="e2")], now=T0 + 10)
    (notification,) = payloads(tmp_path)  # e2's group started at 9.9 and still waits
    assert [a["labels"]["subject"] for a in notification["alerts"]] == ["a", "b"]
    assert notification["groupLabels"] == {"alertname": "tenant_pollution", "engine": "e1"}
    assert notification["groupKey"] == '{}:{alertname="tenant_pollution", engine="e1"}'
    assert "subject" not in notification["commonLabels"]
    alerter.evaluate([*tenants, diagnosis(engine="e2")], now=T0 + 19.9)
    assert [p["groupLabels"]["engine"] for p in payloads(tmp_path)] == ["e1", "e2"]


def test_group_interval_batches_changes_and_repeat_interval_resends(make_alerter, tmp_path: Path) -> None:
    alerter = make_alerter()  # wait 10, interval 60, repeat 300
    a, b, c = (diagnosis(rule="tenant_pollution", subject=s) for s in "abc")
    alerter.evaluate([a], now=T0)
    alerter.evaluate([a], now=T0 + 10)  # first notification
    alerter.evaluate([a, b], now=T0 + 20)
    alerter.evaluate([a, b, c], now=T0 + 40)
    alerter.evaluate([a, b, c], now=T0 + 69)
    assert len(outbox_rows(tmp_path)) == 1  # changes wait for the group's interval
    alerter.evaluate([a, b, c], now=T0 + 70)
    assert [len(p["alerts"]) for p in payloads(tmp_path)] == [1, 3]  # both changes in one notification
    for t in range(71, 370, 10):  # unchanged: nothing until repeat_interval since the last notification
        alerter.evaluate([a, b, c], now=T0 + t)
    assert len(outbox_rows(tmp_path)) == 2
    alerter.evaluate([a, b, c], now=T0 + 371)  # the first group tick 300 s after the last notification
    assert [len(p["alerts"]) for p in payloads(tmp_path)] == [1, 3, 3]
    alerter.evaluate([b, c], now=T0 + 380)
    alerter.evaluate([b, c], now=T0 + 431)
    last = payloads(tmp_path)[-1]
    assert last["status"] == "firing"  # one resolved, two still firing
    assert [(x["labels"]["subject"], x["status"]) for x in last["alerts"]] == [
        ("b", "firing"), ("c", "firing"), ("a", "resolved")
    ]


def test_fired_and_resolved_before_group_wait_is_never_sent(make_alerter, tmp_path: Path) -> None:
    alerter = make_alerter()
    alerter.evaluate([diagnosis()], now=T0)
    alerter.evaluate([], now=T0 + 5)
    alerter.evaluate([], now=T0 + 11)
    assert outbox_rows(tmp_path) == []


def test_send_resolved_false_gets_firing_only(make_alerter, tmp_path: Path) -> None:
    receivers = [{"name": "ops", "url": "http://127.0.0.1:9/a"},
                 {"name": "pager", "url": "http://127.0.0.1:9/b", "send_resolved": False}]
    alerter = make_alerter(config(receivers=receivers, group_wait_s=0))
    alerter.evaluate([diagnosis()], now=T0)
    alerter.evaluate([], now=T0 + 60)
    assert [(r.receiver, json.loads(r.payload)["status"]) for r in outbox_rows(tmp_path)] == [
        ("ops", "firing"), ("pager", "firing"), ("ops", "resolved")
    ]


# --- payload -----------------------------------------------------------------------------------------


def test_webhook_payload_v4_fields(make_alerter, tmp_path: Path) -> None:
    alerter = make_alerter(config(group_wait_s=0, group_interval_s=1))
    pair = [diagnosis(subject="x"), diagnosis(subject="y", summary="other numbers")]
    alerter.evaluate(pair, now=T0 + 0.25)
    alerter.evaluate(pair[:1], now=T0 + 2)
    firing, mixed = payloads(tmp_path)
    for payload in (firing, mixed):
        assert set(payload) == {"version", "groupKey", "truncatedAlerts", "status", "receiver", "groupLabels",
                                "commonLabels", "commonAnnotations", "externalURL", "alerts"}
        assert payload["version"] == "4"
        assert payload["truncatedAlerts"] == 0
        assert payload["receiver"] == "ops"
        assert payload["externalURL"] == EXTERNAL_URL
        assert payload["status"] == "firing"  # mixed: one still fires
        assert payload["commonLabels"] == {"alertname": "kv_oom_runtime", "engine": "e1", "severity": "warning"}
        assert "summary" not in payload["commonAnnotations"]  # differs between the two
        assert payload["commonAnnotations"]["fix"] == "cap concurrency at 8 sequences"
        for alert in payload["alerts"]:
            assert set(alert) == {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL",
                                  "fingerprint"}
            assert RFC3339_UTC.match(alert["startsAt"]) and RFC3339_UTC.match(alert["endsAt"])
            assert re.fullmatch(r"[0-9a-f]{16}", alert["fingerprint"])
            assert alert["fingerprint"] == fingerprint(alert["labels"])
            assert alert["generatorURL"].startswith(EXTERNAL_URL + "/?rule=kv_oom_runtime&engine=e1&subject=")
            assert all(isinstance(v, str) for v in {**alert["labels"], **alert["annotations"]}.values())
    assert firing["alerts"][0]["startsAt"] == "2023-11-14T22:13:20.250Z"
    assert [a["endsAt"] for a in firing["alerts"]] == [ZERO_TIME, ZERO_TIME]
    assert [(a["labels"]["subject"], a["status"], a["endsAt"]) for a in mixed["alerts"]] == [
        ("x", "firing", ZERO_TIME), ("y", "resolved", "2023-11-14T22:13:22.000Z")
    ]


# --- durable state -------------------------------------------------------------------------------------


def test_restarted_alerter_resumes_without_renotifying(make_alerter, tmp_path: Path) -> None:
    first = make_alerter(config(default_for_s=30))
    first.evaluate([diagnosis(), diagnosis(engine="e2")], now=T0)
    first.evaluate([diagnosis(), diagnosis(engine="e2")], now=T0 + 30)  # firing; groups wait until 40
    first.evaluate([diagnosis(), diagnosis(engine="e2")], now=T0 + 40)
    first.evaluate([diagnosis(), diagnosis(engine="e2"), diagnosis(engine="e3")], now=T0 + 45)  # pending
    first.stop(flush_timeout_s=0)
    assert len(outbox_rows(tmp_path)) == 2

    second = make_alerter(config(default_for_s=30))
    assert [(a.labels["engine"], a.state) for a in second.active_alerts()] == [
        ("e1", AlertState.FIRING), ("e2", AlertState.FIRING), ("e3", AlertState.PENDING)
    ]
    second.evaluate([diagnosis(), diagnosis(engine="e2"), diagnosis(engine="e3")], now=T0 + 74)
    assert len(outbox_rows(tmp_path)) == 2  # not announced again; e3 kept its first-seen time (45)...
    second.evaluate([diagnosis(engine="e2"), diagnosis(engine="e3")], now=T0 + 100)  # ...so it fires now
    second.evaluate([diagnosis(engine="e2"), diagnosis(engine="e3")], now=T0 + 110)
    statuses = [(p["groupLabels"]["engine"], p["status"]) for p in payloads(tmp_path)]
    assert statuses == [("e1", "firing"), ("e2", "firing"), ("e1", "resolved"), ("e3", "firing")]


def test_failed_commit_rolls_memory_back_so_nothing_is_lost(
    make_alerter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alerter = make_alerter(config(group_wait_s=0))
    real_save = Outbox.save

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Outbox, "save", disk_full)
    with pytest.raises(sqlite3.OperationalError):
        alerter.evaluate([diagnosis()], now=T0)
    assert alerter.active_alerts() == []  # as on disk
    monkeypatch.setattr(Outbox, "save", real_save)
    alerter.evaluate([diagnosis()], now=T0 + 1)
    (payload,) = payloads(tmp_path)
    assert payload["status"] == "firing"


# --- config --------------------------------------------------------------------------------------------


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ValidationError, match="group_wait"):
        AlertingConfig.model_validate({"group_wait": 5})
    with pytest.raises(ValidationError, match=r"receivers\.0\.token"):
        AlertingConfig.model_validate({"receivers": [{"name": "a", "url": "http://x", "token": "t"}]})


def test_bad_urls_are_errors() -> None:
    for url in ("not a url", "ftp://example.com/hook", ""):
        with pytest.raises(ValidationError, match=r"receivers\.0\.url"):
            AlertingConfig.model_validate({"receivers": [{"name": "a", "url": url}]})
    with pytest.raises(ValidationError, match="runbook_base_url"):
        AlertingConfig.model_validate({"runbook_base_url": "docs/runbooks"})


def test_other_config_errors() -> None:
    with pytest.raises(ValidationError, match="not both"):
        ReceiverConfig(name="a", url="http://x", bearer_token="t", bearer_token_env="T")
    with pytest.raises(ValidationError, match="unique"):
        AlertingConfig.model_validate({"receivers": [{"name": "a", "url": "http://x"}] * 2})
    with pytest.raises(ValidationError, match="type"):
        ReceiverConfig(name="a", url="http://x", type="slack")
    with pytest.raises(ValidationError, match="for_s"):
        AlertingConfig(for_s={"kv_oom_runtime": -1})


def test_missing_env_var_disables_the_receiver_and_names_the_key(tmp_path: Path) -> None:
    cfg = AlertingConfig.model_validate(
        {"receivers": [{"name": "ops", "url": "http://x"},
                       {"name": "pager", "url": "http://y", "hmac_secret_env": "KVOPS_TEST_UNSET_SECRET"}]}
    )
    resolved, problems = resolve_receivers(cfg, {})
    assert [r.name for r in resolved] == ["ops"]
    (problem,) = problems
    message = problem.message
    assert "receivers[1]" in message and "'pager'" in message and "disabled" in message
    assert "hmac_secret_env" in message and "KVOPS_TEST_UNSET_SECRET" in message
    assert receiver_problems(cfg, {}) == problems  # what --check-config prints
    resolved, problems = resolve_receivers(cfg, {"KVOPS_TEST_UNSET_SECRET": "s3cr3t-value"})
    (pager,) = resolved[1:]
    assert problems == []
    assert pager.hmac_secret is not None and pager.hmac_secret.get_secret_value() == "s3cr3t-value"
    assert "s3cr3t-value" not in repr(pager)


def test_secrets_never_in_repr_or_dump() -> None:
    cfg = AlertingConfig.model_validate(
        {"receivers": [{"name": "a", "url": "http://x", "bearer_token": "tok-123456", "hmac_secret": "mac-654321"}]}
    )
    for text in (repr(cfg), str(cfg), cfg.model_dump_json(), repr(resolve_receivers(cfg))):
        assert "tok-123456" not in text and "mac-654321" not in text


def test_alertmanager_endpoint() -> None:
    cfg = AlertingConfig.model_validate(
        {"receivers": [{"name": "am", "type": "alertmanager", "url": "http://am:9093/"},
                       {"name": "am2", "type": "alertmanager", "url": "http://am:9093/api/v2/alerts"}]}
    )
    assert [r.endpoint for r in resolve_receivers(cfg)[0]] == ["http://am:9093/api/v2/alerts"] * 2


# --- backoff and signatures ----------------------------------------------------------------------------


def test_backoff_doubles_with_jitter_and_caps() -> None:
    rng = random.Random(7)
    for attempts, base in ((1, 1), (2, 2), (3, 4), (6, 32)):
        assert base * 0.9 <= backoff_s(attempts, 1.0, 300.0, rng) <= base * 1.1
    assert backoff_s(20, 1.0, 300.0, rng) <= 300.0
    assert backoff_s(10_000, 1.0, 300.0, rng) >= 270.0  # no overflow for a row that failed forever


def test_signature_verification() -> None:
    body = b'{"version":"4"}'
    header = sign(body, "secret", 1_700_000_000)
    assert verify_signature(body, header, "secret", now=1_700_000_100)
    assert not verify_signature(body + b" ", header, "secret", now=1_700_000_100)
    assert not verify_signature(body, header, "other", now=1_700_000_100)
    assert not verify_signature(body, header, "secret", now=1_700_001_000)  # stale: a replay
    assert not verify_signature(body, "garbage", "secret")


def test_state_file_of_the_previous_layout_is_upgraded_in_place(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "alerts.sqlite3")
    db.executescript("""
        CREATE TABLE outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, receiver TEXT NOT NULL, kind TEXT NOT NULL,
            group_key TEXT NOT NULL, payload TEXT NOT NULL, idempotency_key TEXT NOT NULL UNIQUE,
            created_at REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, next_attempt_at REAL NOT NULL,
            last_error TEXT, delivered_at REAL);
        CREATE INDEX outbox_undelivered ON outbox (receiver, id) WHERE delivered_at IS NULL;
        CREATE TABLE alerts (fingerprint TEXT PRIMARY KEY, alert TEXT NOT NULL);
        CREATE TABLE alert_groups (group_key TEXT PRIMARY KEY, alert_group TEXT NOT NULL);
        INSERT INTO outbox (receiver, kind, group_key, payload, idempotency_key, created_at, next_attempt_at)
            VALUES ('ops', 'webhook', 'g', '{}', 'k1', 1700000000, 1700000000);
        PRAGMA user_version = 1;
    """)
    db.close()
    alerter = Alerter(config(), tmp_path, EXTERNAL_URL, clock=lambda: T0)
    try:
        assert alerter.self_diagnoses(T0) == []  # an upgrade, not a reset
        assert alerter.stats(T0).receivers["ops"].pending == 1  # the waiting row is still to be sent
    finally:
        alerter.stop(flush_timeout_s=0)
    (row,) = outbox_rows(tmp_path)
    assert (row.idempotency_key, row.dead_at, row.rejections) == ("k1", None, 0)
