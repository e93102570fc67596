"""Alert delivery over real HTTP: a webhook receiver and a fake Alertmanager on 127.0.0.1 (stdlib
`http.server` in a thread), a real SQLite outbox, the real delivery thread and the real clock.

Backoffs and intervals are shortened through config, except in the one test that runs the default
backoff against a receiver that is down for several seconds.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from pydantic import BaseModel, ConfigDict

from kvops.alerting import SIGNATURE_HEADER, Alerter, AlertingConfig, verify_signature
from kvops.logs import configure_logging
from kvops.processes import free_port
from kvops.schema.diagnosis import Diagnosis, Severity
from tests.helpers.alerting_outbox import Receiver, outbox_rows, wait_for

EXTERNAL_URL = "http://kvops.example:9400"
BEARER = "bearer-7f3a9c1e5b"
HMAC_SECRET = "hmac-2d8e4f6a0c"


def diagnosis(engine: str = "e1", rule: str = "kv_oom_runtime", subject: str = "") -> Diagnosis:
    return Diagnosis(rule=rule, engine=engine, subject=subject, severity=Severity.WARNING, title="OOM risk at run time",
                     summary="free blocks run out in 42 s", evidence={"free_blocks": 12})


def fast_config(receivers: list[dict[str, Any]], **overrides: Any) -> AlertingConfig:
    settings: dict[str, Any] = {
        "receivers": [{"initial_backoff_s": 0.05, "max_backoff_s": 0.2, "timeout_s": 2.0, **r} for r in receivers],
        "group_wait_s": 0,
        "group_interval_s": 0.2,
        "default_for_s": 0,
        **overrides,
    }
    return AlertingConfig.model_validate(settings)


@pytest.fixture
def alerters() -> Iterator[list[Alerter]]:
    made: list[Alerter] = []
    yield made
    for alerter in made:
        alerter.stop(flush_timeout_s=0)


@pytest.fixture
def json_logs() -> Iterator[None]:
    saved = structlog.get_config()
    configure_logging("debug", json_logs=True)
    yield
    structlog.configure(**saved)


def test_webhook_bearer_hmac_and_no_secret_in_logs(
    tmp_path: Path, receivers: list[Receiver], alerters: list[Alerter], json_logs: None,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVOPS_TEST_HOOK_TOKEN", BEARER)
    hook = Receiver().start()
    receivers.append(hook)
    hook.script = [503, 401]  # answers that echo our headers back: neither may reach a log line
    cfg = fast_config([{"name": "ops", "url": f"{hook.url}/hook", "bearer_token_env": "KVOPS_TEST_HOOK_TOKEN",
                        "hmac_secret": HMAC_SECRET}])
    alerter = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerters.append(alerter)
    alerter.start()
    alerter.evaluate([diagnosis()])
    wait_for(lambda: len(hook.accepted) == 1, 10, "the notification")
    wait_for(lambda: alerter.stats().delivered["ops"] == 1, 5, "it marked delivered")  # just after the 2xx

    assert [r.status for r in hook.requests] == [503, 401, 200]
    (request,) = hook.accepted
    assert request.path == "/hook"
    assert request.headers["Authorization"] == f"Bearer {BEARER}"
    assert request.headers["Content-Type"] == "application/json"
    # the documented recipe, computed here independently of kvops' own helper
    fields = dict(part.split("=", 1) for part in request.headers[SIGNATURE_HEADER].split(","))
    signed = fields["t"].encode() + b"." + request.body
    assert hmac.compare_digest(fields["v1"], hmac.new(HMAC_SECRET.encode(), signed, hashlib.sha256).hexdigest())
    assert abs(int(fields["t"]) - time.time()) < 30
    assert verify_signature(request.body, request.headers[SIGNATURE_HEADER], HMAC_SECRET)
    assert not verify_signature(request.body, request.headers[SIGNATURE_HEADER], "wrong secret")
    payload = request.json()
    assert payload["version"] == "4" and payload["status"] == "firing" and payload["receiver"] == "ops"

    (row,) = outbox_rows(tmp_path)
    assert request.headers["Idempotency-Key"] == row.idempotency_key
    assert row.delivered_at is not None and row.attempts == 2
    stats = alerter.stats().receivers["ops"]
    assert (stats.delivered, stats.failed_attempts, stats.pending) == (1, 2, 0)
    assert alerter.stats().delivered == {"ops": 1} and alerter.stats().failed_attempts == {"ops": 2}
    assert stats.last_error is not None and "HTTP 401" in stats.last_error and "[redacted]" in stats.last_error
    alerter.stop(flush_timeout_s=1)

    logs = capsys.readouterr().err
    events = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    assert {"notification delivery failed; retrying", "receiver rejected a notification; retrying, check its URL "
            "and credentials", "notification delivered", "alert firing"} <= {e["event"] for e in events}
    for secret in (BEARER, HMAC_SECRET):
        assert secret not in logs
        assert secret not in (row.last_error or "")
    assert hook.url not in logs  # the URL can carry a token too: receivers are named by their config name


def test_receiver_down_then_up_each_notification_once_in_order(
    tmp_path: Path, receivers: list[Receiver], alerters: list[Alerter]
) -> None:
    port = free_port()  # nothing listens here yet
    cfg = fast_config([{"name": "ops", "url": f"http://127.0.0.1:{port}/hook"}])
    alerter = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerters.append(alerter)
    alerter.start()
    alerter.evaluate([diagnosis("e1"), diagnosis("e2")])
    alerter.evaluate([diagnosis("e2")])  # e1 resolves: queued at e1's next group tick
    wait_for(lambda: alerter.stats().pending == 3, 5, "three queued notifications")
    wait_for(lambda: alerter.stats().failed_attempts["ops"] >= 3, 5, "failed attempts against the closed port")
    assert "ConnectError" in (alerter.stats().receivers["ops"].last_error or "")

    hook = Receiver(port).start()
    receivers.append(hook)
    wait_for(lambda: len(hook.accepted) == 3, 5, "the backlog")
    wait_for(lambda: alerter.stats().pending == 0, 5, "the backlog marked delivered")
    time.sleep(0.5)  # anything sent twice would arrive now
    assert len(hook.requests) == 3
    keys = [r.headers["Idempotency-Key"] for r in hook.requests]
    assert len(set(keys)) == 3
    assert len({r.body for r in hook.requests}) == 3
    sent = [(r.json()["groupLabels"]["engine"], r.json()["status"]) for r in hook.requests]
    assert sent == [("e1", "firing"), ("e2", "firing"), ("e1", "resolved")]  # in queue order, per group too
    assert [r.idempotency_key for r in outbox_rows(tmp_path)] == keys
    assert all(r.delivered_at is not None for r in outbox_rows(tmp_path))
    assert alerter.stats().pending == 0


def test_receiver_down_with_default_backoff(tmp_path: Path, receivers: list[Receiver], alerters: list[Alerter]) -> None:
    """The real-time case: default 1 s backoff doubling; the receiver comes up after 5.5 s."""
    port = free_port()
    cfg = AlertingConfig.model_validate(
        {"receivers": [{"name": "ops", "url": f"http://127.0.0.1:{port}/"}], "group_wait_s": 0, "default_for_s": 0}
    )
    alerter = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerters.append(alerter)
    alerter.start()
    started = time.monotonic()
    alerter.evaluate([diagnosis()])
    time.sleep(5.5)  # attempts near 0, 1 and 3 s fail; the next is due near 7 s (±10%)
    assert alerter.stats().failed_attempts["ops"] == 3  # backing off, not hammering
    hook = Receiver(port).start()
    receivers.append(hook)
    wait_for(lambda: len(hook.accepted) == 1, 10, "delivery after the outage")
    elapsed = time.monotonic() - started
    assert elapsed < 9.5  # the attempt due near 7 s (±10%) got it through
    time.sleep(0.3)
    assert len(hook.requests) == 1


def test_restart_delivers_backlog_and_does_not_renotify(
    tmp_path: Path, receivers: list[Receiver], alerters: list[Alerter]
) -> None:
    hook = Receiver().start()
    receivers.append(hook)
    cfg = fast_config([{"name": "ops", "url": f"{hook.url}/hook"}])

    first = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerters.append(first)
    first.start()
    first.evaluate([diagnosis("e1")])
    wait_for(lambda: len(hook.accepted) == 1, 5, "e1 firing")
    hook.stop()  # the receiver goes away; e2 starts firing meanwhile
    first.evaluate([diagnosis("e1"), diagnosis("e2")])
    first.stop(flush_timeout_s=0.5)
    assert [r.delivered_at is None for r in outbox_rows(tmp_path)] == [False, True]

    hook.start()  # back on the same port, while the daemon restarts
    second = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerters.append(second)
    second.start()
    wait_for(lambda: len(hook.accepted) == 2, 5, "the backlog from before the restart")
    for _ in range(5):  # both still active: nothing new to say (repeat_interval is hours)
        second.evaluate([diagnosis("e1"), diagnosis("e2")])
        time.sleep(0.1)
    second.evaluate([diagnosis("e2")])
    wait_for(lambda: len(hook.accepted) == 3, 5, "e1 resolved")
    time.sleep(0.4)
    second.stop(flush_timeout_s=1)

    sent = [(r.json()["groupLabels"]["engine"], r.json()["status"]) for r in hook.requests]
    assert sent == [("e1", "firing"), ("e2", "firing"), ("e1", "resolved")]
    assert len({r.headers["Idempotency-Key"] for r in hook.requests}) == 3


def test_restart_resolves_alerts_whose_diagnosis_is_gone(
    tmp_path: Path, receivers: list[Receiver], alerters: list[Alerter]
) -> None:
    hook = Receiver().start()
    receivers.append(hook)
    cfg = fast_config([{"name": "ops", "url": hook.url}])
    first = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerters.append(first)
    first.evaluate([diagnosis("e1")])
    first.stop(flush_timeout_s=2)  # never started: stop() itself delivers what is pending
    assert [r.json()["status"] for r in hook.requests] == ["firing"]

    second = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerters.append(second)
    second.start()
    second.evaluate([])  # after the restart the problem is gone
    wait_for(lambda: len(hook.accepted) == 2, 5, "the resolution")
    resolved = hook.requests[1].json()
    assert resolved["status"] == "resolved"
    assert resolved["alerts"][0]["startsAt"] == hook.requests[0].json()["alerts"][0]["startsAt"]
    assert second.active_alerts() == []


class PostableAlert(BaseModel):
    """Alertmanager API v2 `postableAlert` (models/postable_alert.go): nothing else is accepted here."""

    model_config = ConfigDict(extra="forbid")

    labels: dict[str, str]
    annotations: dict[str, str] = {}
    startsAt: str | None = None
    endsAt: str | None = None
    generatorURL: str | None = None


def test_alertmanager_push(tmp_path: Path, receivers: list[Receiver], alerters: list[Alerter]) -> None:
    manager = Receiver().start()
    receivers.append(manager)
    cfg = fast_config([{"name": "am", "type": "alertmanager", "url": manager.url}], alertmanager_resend_s=0.3)
    alerter = Alerter(cfg, tmp_path, EXTERNAL_URL)
    alerters.append(alerter)
    alerter.start()
    alerter.evaluate([diagnosis("e1"), diagnosis("e1", rule="swap_storm")])
    wait_for(lambda: len(manager.accepted) >= 2, 5, "the push and one periodic re-push")
    alerter.evaluate([diagnosis("e1")])
    wait_for(lambda: any("endsAt" in a for r in manager.accepted for a in r.json()), 5, "the resolution push")
    alerter.stop(flush_timeout_s=1)

    for request in manager.requests:
        assert request.path == "/api/v2/alerts"
        assert request.headers["Content-Type"] == "application/json"
        assert isinstance(request.json(), list)
        for item in request.json():
            PostableAlert.model_validate(item)
    first = [PostableAlert.model_validate(a) for a in manager.requests[0].json()]
    assert sorted(a.labels["alertname"] for a in first) == ["kv_oom_runtime", "swap_storm"]
    assert all(a.endsAt is None and a.startsAt and a.startsAt.endswith("Z") for a in first)
    assert first[0].labels == {"alertname": "kv_oom_runtime", "engine": "e1", "severity": "warning"}
    assert first[0].generatorURL == f"{EXTERNAL_URL}/?rule=kv_oom_runtime&engine=e1"
    assert manager.requests[1].json() == manager.requests[0].json()  # the re-push: same alerts, same startsAt
    last = [PostableAlert.model_validate(a) for a in manager.requests[-1].json()]
    ended = [a for a in last if a.endsAt is not None]
    assert [a.labels["alertname"] for a in ended] == ["swap_storm"]
