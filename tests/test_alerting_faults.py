"""Faults of the alert path itself: each is injected for real (HTTP receivers on 127.0.0.1 that
refuse, fail or hang; damaged state files on disk; unset secrets), and each test shows that kvops keeps
running, loses no alert, and tells someone: a dead letter, a self diagnosis delivered by the receivers
that still work, /metrics and the API.

Backoffs are shortened through config; the backlog test moves the alerter's clock instead of waiting.
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from fastapi.testclient import TestClient

from kvops.alerting import Alerter, AlertingConfig, receiver_problems
from kvops.alerting import outbox as outbox_module
from kvops.alerting.alerter import STATE_FILE
from kvops.logs import configure_logging
from kvops.processes import free_port
from kvops.schema.diagnosis import Diagnosis, FixKind, Severity
from kvops.supervisor import exporter
from kvops.supervisor.api import build_supervisor_app
from kvops.supervisor.config import load_config, parse_config
from kvops.supervisor.supervisor import Supervisor
from tests.helpers.alerting_outbox import Receiver, outbox_rows, wait_for

ROOT = Path(__file__).resolve().parent.parent
EXTERNAL_URL = "http://kvops.example:9400"


def diagnosis(engine: str = "e1", rule: str = "kv_oom_runtime") -> Diagnosis:
    return Diagnosis(rule=rule, engine=engine, severity=Severity.WARNING, title="OOM risk at run time",
                     summary="free blocks run out in 42 s", evidence={"free_blocks": 12})


def receiver(name: str, url: str, **settings: Any) -> dict[str, Any]:
    return {"name": name, "url": url, "initial_backoff_s": 0.05, "max_backoff_s": 0.2, "timeout_s": 2.0, **settings}


def alerting(*receivers: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    return {"receivers": list(receivers), "group_wait_s": 0, "group_interval_s": 0.2, "default_for_s": 0,
            **overrides}


def by_rule(diagnoses: list[Diagnosis]) -> dict[tuple[str, str], Diagnosis]:
    return {(d.rule, d.subject): d for d in diagnoses}


def metric_lines(sup: Supervisor) -> list[str]:
    return exporter.render(sup)[0].decode().splitlines()


def metric(sup: Supervisor, name: str, receiver: str) -> float:
    prefix = f'{name}{{receiver="{receiver}"}} '
    (line,) = [line for line in metric_lines(sup) if line.startswith(prefix)]
    return float(line[len(prefix):])


@pytest.fixture
def make_supervisor(tmp_path: Path) -> Iterator[Callable[..., Supervisor]]:
    """A real Supervisor (its Alerter, /metrics, API) watching nothing that answers; never polled."""
    made: list[Supervisor] = []

    def make(alerting_settings: dict[str, Any], clock: Callable[[], float] = time.time) -> Supervisor:
        config = parse_config({
            "supervisor": {"state_dir": str(tmp_path), "alert_warmup_s": 0},
            "engines": [{"name": "gone", "url": "http://127.0.0.1:9"}],
            "alerting": alerting_settings,
        }, "test")
        sup = Supervisor(config, clock=clock)
        made.append(sup)
        sup.alerter.start()
        return sup

    yield make
    for sup in made:
        sup.alerter.stop(flush_timeout_s=0)
        for state in sup.engines.values():
            state.client.close()


@pytest.fixture
def json_logs() -> Iterator[None]:
    saved = structlog.get_config()
    configure_logging("debug", json_logs=True)
    yield
    structlog.configure(**saved)


def log_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# --- a receiver that refuses for good ------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 403, 404])
def test_permanent_refusal_is_a_dead_letter_and_the_next_alert_gets_through(
    status: int, receivers: list[Receiver], make_supervisor: Callable[..., Supervisor], tmp_path: Path,
    json_logs: None, capsys: pytest.CaptureFixture[str],
) -> None:
    hook = Receiver().start()
    receivers.append(hook)
    hook.script = [status, status]  # the first notification, and its one retry; 200 after that
    sup = make_supervisor(alerting(receiver("ops", f"{hook.url}/hook")))
    alerter = sup.alerter
    alerter.evaluate([diagnosis("e1")])
    alerter.evaluate([diagnosis("e1"), diagnosis("e2")])  # queued behind e1's notification
    # e2 behind it, then (the receiver accepts again) the catch-up: e1 still fires, so it is sent again
    wait_for(lambda: len(hook.accepted) == 2, 5, "the notification behind the refused one, and the catch-up")
    wait_for(lambda: alerter.stats().delivered["ops"] == 2, 5, "both marked delivered")

    assert [r.status for r in hook.requests] == [status, status, 200, 200]  # one retry, then it moved on
    assert [r.json()["groupLabels"]["engine"] for r in hook.requests] == ["e1", "e1", "e2", "e1"]
    assert hook.requests[3].json()["status"] == "firing"
    dead, delivered, caught_up = outbox_rows(tmp_path)
    assert dead.dead_at is not None and dead.dead_status == status and dead.delivered_at is None
    assert dead.dead_reason is not None and dead.dead_reason.startswith(f"HTTP {status}")
    assert delivered.delivered_at is not None and delivered.dead_at is None
    assert caught_up.group_key == dead.group_key and caught_up.delivered_at is not None

    stats = alerter.stats()
    assert stats.dead_letters == {"ops": 1} and stats.pending == 0 and stats.delivered == {"ops": 2}
    ops = stats.receivers["ops"]
    assert ops.last_dead_letter_reason is not None and f"HTTP {status}" in ops.last_dead_letter_reason
    assert metric(sup, "kvops_alert_dead_letters_total", "ops") == 1.0
    assert metric(sup, "kvops_alert_receiver_pending", "ops") == 0.0
    assert metric(sup, "kvops_alert_last_delivery_timestamp_seconds", "ops") == pytest.approx(time.time(), abs=30)

    with TestClient(build_supervisor_app(sup)) as api:
        (listed,) = api.get("/api/alerts/dead-letters").json()
    assert listed["receiver"] == "ops" and listed["status"] == status and listed["id"] == dead.id
    assert listed["group"] == dead.group_key and 'engine="e1"' in listed["group"]
    assert listed["reason"].startswith(f"HTTP {status}") and listed["dead_at"] >= listed["created_at"]

    rules = by_rule(alerter.self_diagnoses())
    dead_letters = rules[("alert_dead_letters", "ops")]
    assert dead_letters.severity is Severity.WARNING and dead_letters.engine == "kvops"
    assert dead_letters.fix is not None and dead_letters.fix.kind is FixKind.REPORT
    warnings = [e for e in log_events(capsys.readouterr().err) if "dead letter" in e["event"]]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning" and warnings[0]["http_status"] == status


def test_dead_letter_alert_reaches_the_other_receivers_and_the_refusing_one_once_it_recovers(
    receivers: list[Receiver], tmp_path: Path
) -> None:
    good, bad = Receiver().start(), Receiver(status=403).start()
    receivers += [good, bad]
    cfg = AlertingConfig.model_validate(alerting(receiver("good", good.url), receiver("bad", bad.url)))
    alerter = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerter.start()
    try:
        alerter.evaluate([diagnosis("e1")])
        wait_for(lambda: alerter.stats().dead_letters["bad"] == 1, 5, "bad's dead letter")
        alerter.evaluate([diagnosis("e1"), *alerter.self_diagnoses()])  # what the supervisor does each poll
        wait_for(lambda: "alert_dead_letters" in good.alertnames(), 5, "the dead-letter alert at good")
        payload = next(r.json() for r in good.accepted if r.json()["groupLabels"]["alertname"] == "alert_dead_letters")
        (alert,) = payload["alerts"]
        assert alert["labels"] == {"alertname": "alert_dead_letters", "engine": "kvops", "severity": "warning",
                                   "subject": "bad"}
        assert alert["annotations"]["runbook_url"].endswith("/alert_dead_letters.md")
        wait_for(lambda: alerter.stats().dead_letters["bad"] == 2, 5, "bad refusing that one too")

        bad.status = 200  # someone fixed bad's side; the next notification gets through...
        alerter.evaluate([diagnosis("e1"), diagnosis("e2"), *alerter.self_diagnoses()])
        # ...and bad then catches up on what it missed that still fires
        wait_for(lambda: len(bad.accepted) == 3, 5, "e2 and the catch-up of both refused groups")
        assert sorted(bad.alertnames()) == ["alert_dead_letters", "kv_oom_runtime", "kv_oom_runtime"]
        assert bad.accepted[0].json()["groupLabels"]["engine"] == "e2"
        time.sleep(0.5)  # a catch-up is sent once
        assert len(bad.accepted) == 3
        assert sorted(good.alertnames()) == ["alert_dead_letters", "kv_oom_runtime", "kv_oom_runtime"]
    finally:
        alerter.stop(flush_timeout_s=0)


def test_a_restart_catches_a_fixed_receiver_up(receivers: list[Receiver], tmp_path: Path) -> None:
    hook = Receiver(status=401).start()
    receivers.append(hook)
    cfg = AlertingConfig.model_validate(alerting(receiver("ops", hook.url)))
    first = Alerter(cfg, tmp_path, EXTERNAL_URL)
    first.start()
    first.evaluate([diagnosis("e1")])
    wait_for(lambda: first.stats().dead_letters["ops"] == 1, 5, "the dead letter")
    first.stop(flush_timeout_s=0)

    hook.status = 200  # fixed (a new token, say), and kvops restarted to pick it up
    second = Alerter(cfg, tmp_path, EXTERNAL_URL)
    second.start()
    try:
        wait_for(lambda: len(hook.accepted) == 1, 5, "the catch-up at start")
        (payload,) = [r.json() for r in hook.accepted]
        assert payload["status"] == "firing" and payload["groupLabels"]["engine"] == "e1"
        assert len(second.dead_letters()) == 1  # still listed: a person may want to know it happened
    finally:
        second.stop(flush_timeout_s=0)


@pytest.mark.parametrize("script", [[503, 503], [500, 502], [429, 429, 429], [408]])
def test_transient_failures_are_retried_with_backoff(script: list[int], receivers: list[Receiver],
                                                     tmp_path: Path) -> None:
    hook = Receiver().start()
    receivers.append(hook)
    hook.script = list(script)
    cfg = AlertingConfig.model_validate(
        alerting(receiver("ops", hook.url, initial_backoff_s=0.2, max_backoff_s=2.0)))
    alerter = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerter.start()
    try:
        alerter.evaluate([diagnosis("e1")])
        wait_for(lambda: alerter.stats().delivered["ops"] == 1, 10, "delivery after the failures")
        assert [r.status for r in hook.requests] == [*script, 200]
        stats = alerter.stats()
        assert stats.dead_letters == {"ops": 0} and stats.failed_attempts == {"ops": len(script)}
        (row,) = outbox_rows(tmp_path)
        assert row.delivered_at is not None and row.dead_at is None and row.attempts == len(script)
        gaps = [b.at - a.at for a, b in itertools.pairwise(hook.requests)]
        # backing off, doubling from 0.2 s (±10% jitter): never sooner than that, however busy the machine
        assert all(gap >= 0.85 * 0.2 * 2**k for k, gap in enumerate(gaps)), gaps
    finally:
        alerter.stop(flush_timeout_s=0)


def test_timeouts_are_retried(receivers: list[Receiver], tmp_path: Path) -> None:
    hook = Receiver().start()
    receivers.append(hook)
    hook.hang_s = [1.0, 1.0]  # twice longer than the client waits
    cfg = AlertingConfig.model_validate(alerting(receiver("ops", hook.url, timeout_s=0.3)))
    alerter = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerter.start()
    try:
        alerter.evaluate([diagnosis("e1")])
        wait_for(lambda: alerter.stats().delivered["ops"] == 1, 10, "delivery after two timeouts")
        stats = alerter.stats()
        assert stats.failed_attempts == {"ops": 2} and stats.dead_letters == {"ops": 0}
        assert "Timeout" in (stats.receivers["ops"].last_error or "")
    finally:
        alerter.stop(flush_timeout_s=0)


# --- a damaged state file ------------------------------------------------------------------------------


def _real_state_file(path: Path) -> bytes:
    alerter = Alerter(AlertingConfig(), path.parent, EXTERNAL_URL)
    alerter.evaluate([diagnosis(f"e{i}") for i in range(40)], now=1_700_000_000.0)
    alerter.stop(flush_timeout_s=0)
    return path.read_bytes()


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(8192))


def _truncated(path: Path) -> None:
    whole = _real_state_file(path)
    path.write_bytes(whole[: len(whole) // 2])  # a copy cut short: the header says more pages than there are


def _newer_schema(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE outbox (id INTEGER PRIMARY KEY, everything_else TEXT)")
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "left-here-by-mistake.txt").write_text("a person's file\n")


@pytest.mark.parametrize("damage", [_garbage, _truncated, _newer_schema, _directory])
def test_unusable_state_file_is_moved_aside_and_a_critical_alert_goes_out(
    damage: Callable[[Path], None], receivers: list[Receiver], make_supervisor: Callable[..., Supervisor],
    tmp_path: Path, json_logs: None, capsys: pytest.CaptureFixture[str],
) -> None:
    state = tmp_path / STATE_FILE
    damage(state)
    before = sorted(p.relative_to(state).as_posix() for p in state.rglob("*")) if state.is_dir() else None
    old_bytes = None if state.is_dir() else state.read_bytes()
    hook = Receiver().start()
    receivers.append(hook)

    sup = make_supervisor(alerting(receiver("ops", hook.url)))  # `kvops run` builds this: it must not raise

    (moved,) = list(tmp_path.glob(f"{STATE_FILE}.corrupt-*"))
    if old_bytes is not None:
        assert moved.read_bytes() == old_bytes  # kept for a person, byte for byte
    else:
        assert sorted(p.relative_to(moved).as_posix() for p in moved.rglob("*")) == before
    assert state.is_file() and outbox_rows(tmp_path) == []  # a fresh store
    errors = [e for e in log_events(capsys.readouterr().err) if e["event"].startswith("alert state file unusable")]
    assert len(errors) == 1 and errors[0]["level"] == "error" and errors[0]["moved_to"] == str(moved)

    (reset,) = [d for d in sup.alerter.self_diagnoses() if d.rule == "alert_state_reset"]
    assert reset.severity is Severity.CRITICAL and reset.engine == "kvops"
    assert reset.evidence["moved_to"] == str(moved)
    sup.alerter.evaluate([diagnosis("e1"), *sup.alerter.self_diagnoses()])
    wait_for(lambda: "alert_state_reset" in hook.alertnames(), 5, "the state-reset alert")
    payload = next(r.json() for r in hook.accepted if r.json()["groupLabels"]["alertname"] == "alert_state_reset")
    assert payload["alerts"][0]["labels"]["severity"] == "critical"
    assert str(moved) in payload["alerts"][0]["annotations"]["summary"]
    wait_for(lambda: "kv_oom_runtime" in hook.alertnames(), 5, "the engine's alert, too")


def test_state_reset_alert_survives_a_restart_and_ends_after_the_hold(tmp_path: Path) -> None:
    _garbage(tmp_path / STATE_FILE)
    now = [1_800_000_000.0]
    cfg = AlertingConfig(self_alert_hold_s=3600)
    first = Alerter(cfg, tmp_path, EXTERNAL_URL, clock=lambda: now[0])
    first.stop(flush_timeout_s=0)
    now[0] += 600
    second = Alerter(cfg, tmp_path, EXTERNAL_URL, clock=lambda: now[0])  # the fresh file opens fine
    try:
        assert [d.rule for d in second.self_diagnoses()] == ["alert_state_reset"]
        now[0] += 3001
        assert second.self_diagnoses() == []
    finally:
        second.stop(flush_timeout_s=0)
    assert len(list(tmp_path.glob(f"{STATE_FILE}.corrupt-*"))) == 1


def test_a_locked_state_file_is_left_in_place_and_alerting_runs_on_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outbox_module, "BUSY_TIMEOUT_S", 0.2)
    Alerter(AlertingConfig(), tmp_path, EXTERNAL_URL).stop(flush_timeout_s=0)
    other = sqlite3.connect(tmp_path / STATE_FILE, isolation_level=None)  # another process, say, holding it
    other.execute("PRAGMA locking_mode=EXCLUSIVE")
    other.execute("BEGIN EXCLUSIVE")
    try:
        alerter = Alerter(AlertingConfig(), tmp_path, EXTERNAL_URL)
        try:
            (reset,) = alerter.self_diagnoses()
            assert reset.rule == "alert_state_reset" and reset.evidence["durable"] is False
            assert "in memory only" in reset.summary
            alerter.evaluate([diagnosis()])  # works, on memory
            assert len(alerter.active_alerts()) == 1
        finally:
            alerter.stop(flush_timeout_s=0)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert list(tmp_path.glob(f"{STATE_FILE}.corrupt-*")) == []  # a good file is never moved aside


def test_empty_state_file_is_a_new_store_not_a_reset(tmp_path: Path) -> None:
    # SQLite's own reading of a 0-byte file: an empty database; nothing was in it to lose or to keep
    (tmp_path / STATE_FILE).write_bytes(b"")
    alerter = Alerter(AlertingConfig(), tmp_path, EXTERNAL_URL)
    try:
        assert alerter.self_diagnoses() == []
        assert list(tmp_path.glob(f"{STATE_FILE}.corrupt-*")) == []
        alerter.evaluate([diagnosis()], now=1_700_000_000.0)
        assert [a.labels["engine"] for a in alerter.active_alerts()] == ["e1"]
    finally:
        alerter.stop(flush_timeout_s=0)


# --- a missing secret ----------------------------------------------------------------------------------


def test_missing_secret_disables_that_receiver_only_and_says_so(
    receivers: list[Receiver], make_supervisor: Callable[..., Supervisor], monkeypatch: pytest.MonkeyPatch,
    json_logs: None, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("KVOPS_TEST_UNSET_HMAC", raising=False)
    ops, signed = Receiver().start(), Receiver().start()
    receivers += [ops, signed]
    settings = alerting(receiver("ops", ops.url),
                        receiver("signed", signed.url, hmac_secret_env="KVOPS_TEST_UNSET_HMAC"))
    (problem,) = receiver_problems(AlertingConfig.model_validate(settings))  # what --check-config prints
    assert problem.receiver == "signed" and "KVOPS_TEST_UNSET_HMAC" in problem.message

    sup = make_supervisor(settings)
    warnings = [e for e in log_events(capsys.readouterr().err) if e["event"] == "alert receiver disabled"]
    assert [(w["level"], w["receiver"], w["problem"]) for w in warnings] == [("warning", "signed", problem.message)]
    stats = sup.alerter.stats().receivers
    assert (stats["ops"].enabled, stats["signed"].enabled) == (True, False)
    assert stats["signed"].disabled_reason == problem.message
    assert metric(sup, "kvops_alert_receiver_enabled", "signed") == 0.0
    assert metric(sup, "kvops_alert_receiver_enabled", "ops") == 1.0

    (disabled,) = [d for d in sup.alerter.self_diagnoses() if d.rule == "alert_receiver_disabled"]
    assert disabled.subject == "signed" and disabled.severity is Severity.WARNING
    sup.alerter.evaluate([diagnosis("e1"), *sup.alerter.self_diagnoses()])
    wait_for(lambda: sorted(ops.alertnames()) == ["alert_receiver_disabled", "kv_oom_runtime"], 5,
             "both alerts at ops")
    time.sleep(0.3)
    assert signed.requests == []  # never sent unsigned


def test_example_config_starts_without_its_webhook_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVOPS_WEBHOOK_SECRET", raising=False)
    config = load_config(ROOT / "kvops.example.toml", [f"supervisor.state_dir={tmp_path}"])
    (problem,) = receiver_problems(config.alerting)
    assert "KVOPS_WEBHOOK_SECRET" in problem.message
    alerter = Alerter(config.alerting, tmp_path, EXTERNAL_URL)
    try:
        enabled = {name: r.enabled for name, r in alerter.stats().receivers.items()}
        assert enabled[problem.receiver] is False and sum(enabled.values()) == len(enabled) - 1
    finally:
        alerter.stop(flush_timeout_s=0)


# --- a receiver that is down -------------------------------------------------------------------------


def test_backlog_is_alerted_and_delivered_in_order_when_the_receiver_is_back(
    receivers: list[Receiver], make_supervisor: Callable[..., Supervisor]
) -> None:
    offset = [0.0]  # the alerter's clock runs with real time, and jumps when the test says so

    def clock() -> float:
        return time.time() + offset[0]

    port = free_port()  # nothing listens here yet
    good = Receiver().start()
    receivers.append(good)
    sup = make_supervisor(alerting(receiver("down", f"http://127.0.0.1:{port}/"), receiver("good", good.url),
                                   outbox_backlog_alert_s=300), clock=clock)
    alerter = sup.alerter
    alerter.evaluate([diagnosis("e1"), diagnosis("e2")])
    alerter.evaluate([diagnosis("e2")])  # e1 resolves
    wait_for(lambda: alerter.stats().receivers["down"].pending == 3, 5, "three queued notifications")
    wait_for(lambda: alerter.stats().failed_attempts["down"] >= 2, 5, "failed attempts")
    wait_for(lambda: alerter.stats().receivers["good"].delivered == 3, 5, "good, unaffected, has everything")
    assert [d.rule for d in alerter.self_diagnoses()] == []  # young backlog: no alert yet

    offset[0] += 400
    down = alerter.stats().receivers["down"]
    assert down.oldest_pending_age_s is not None and down.oldest_pending_age_s >= 400
    assert metric(sup, "kvops_alert_outbox_oldest_pending_age_seconds", "down") >= 400
    assert metric(sup, "kvops_alert_outbox_oldest_pending_age_seconds", "good") == 0.0
    assert metric(sup, "kvops_alert_receiver_pending", "down") == 3.0
    (backlog,) = alerter.self_diagnoses()
    assert (backlog.rule, backlog.subject, backlog.severity) == ("alert_outbox_backlog", "down", Severity.WARNING)
    assert backlog.evidence["pending"] == 3

    alerter.evaluate([diagnosis("e2"), *alerter.self_diagnoses()])
    wait_for(lambda: "alert_outbox_backlog" in good.alertnames(), 5, "the backlog alert at good")

    back = Receiver(port).start()
    receivers.append(back)
    wait_for(lambda: len(back.accepted) == 4, 10, "the whole backlog, the backlog alert included")
    sent = [(r.json()["groupLabels"]["alertname"], r.json()["groupLabels"]["engine"], r.json()["status"])
            for r in back.accepted]
    assert sent == [("kv_oom_runtime", "e1", "firing"), ("kv_oom_runtime", "e2", "firing"),
                    ("kv_oom_runtime", "e1", "resolved"), ("alert_outbox_backlog", "kvops", "firing")]
    wait_for(lambda: alerter.stats().receivers["down"].pending == 0, 5, "all marked delivered")
    assert alerter.self_diagnoses() == []
    assert metric(sup, "kvops_alert_last_delivery_timestamp_seconds", "down") >= time.time() + 300
