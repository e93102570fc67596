"""Two supervisors, one engine (docs/deployment.md, "Two supervisors, one engine"): two real `kvops run` processes
watch one vLLM (`--no-managed --engine-url`), each with its own state dir, sharing a fix lease file, and push their
alerts to a real Alertmanager (`prometheus-alertmanager`), which routes to a local webhook.

The vLLM is the real vLLM CPU build's /metrics under KV pressure, replayed (tests/test_prometheus_e2e.py's
CapturedVllm): `kv_oom_runtime` fires on it within seconds, and its policy here is `auto`. Its fix restarts the engine
with other flags, which kvops refuses for a vLLM it does not start, and no fix a watched vLLM without a gateway can
take is applied live; so "only one applies" shows in the audit logs as the holder's attempt (`failed`, refused for
that reason) against the standby's `proposed` (naming the holder), and in the API: the standby answers 409 to apply
and revert, naming the holder's URL.

Then the holder is killed with SIGKILL (no release): the standby takes the lease once it expires, within its TTL and
a few seconds, and not before. A new supervisor joins as the standby, and the holder is stopped with SIGTERM: it
releases the lease, and the standby takes it at once, long before the TTL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvops.processes import free_port
from tests.helpers.waiting import wait_for
from tests.test_prometheus_e2e import ALERTMANAGER, CapturedVllm, Webhook, _start, _stop

pytestmark = [pytest.mark.skipif(
    ALERTMANAGER is None,
    reason="needs Debian's `prometheus-alertmanager` (apt-get install prometheus-alertmanager); .ci/run installs it",
), pytest.mark.clock]  # fix leases expire and are taken over on the wall clock (tests/helpers/clock_worker.py)

TTL_S = 5.0  # the fix lease's: long enough to tell a takeover at expiry from one at once (evaluations: 0.2 s)
RULE = "kv_oom_runtime"
TOKEN = "ha-token"
ALERT_LABELS = {"alertname", "engine", "severity", "subject"}  # what kvops puts on an alert: nothing of its own


@dataclass
class Daemon:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str) -> Any:
        return httpx.get(f"{self.url}{path}", timeout=5).json()

    def role(self) -> str | None:
        return self.get("/api/fix-lease")["role"]

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)

    def metric(self, line_start: str) -> float | None:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)), None)

    def rule_audit(self) -> list[dict[str, Any]]:
        return [e for e in self.get("/api/audit") if e["rule"] == RULE]


@dataclass
class Setup:
    tmp: Path
    config: Path
    engine: str
    alertmanager: str
    webhook: Webhook
    started: list[Daemon]

    def supervisor(self, name: str) -> Daemon:
        """`kvops run` watching the engine alone, on its own port and state dir, with the shared config."""
        url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        log = self.tmp / f"{name}-{len(self.started)}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvops", "run", "--config", str(self.config), "--no-managed",
             "--engine-url", self.engine, "--listen", url.removeprefix("http://"),
             "--state-dir", str(self.tmp / f"state-{name}")],
            stdout=subprocess.DEVNULL, stderr=log.open("wb"), env={**os.environ, "KVOPS_ADMIN_TOKEN": TOKEN})
        daemon = Daemon(name, url, proc, log)
        self.started.append(daemon)
        return daemon


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    webhook, vllm = Webhook(), CapturedVllm()
    am_port = free_port("127.0.0.1")
    # Alertmanager: everything to the webhook quickly; a group is told once and not again for an hour unless it
    # changes, so a second copy of the alert would be a second notification.
    (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump({
        "route": {"receiver": "webhook", "group_by": ["alertname", "engine"], "group_wait": "1s",
                  "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "webhook", "webhook_configs": [{"url": webhook.url, "send_resolved": True}]}],
    }))
    alertmanager = _start([ALERTMANAGER, f"--config.file={tmp_path / 'alertmanager.yml'}",  # type: ignore[list-item]
                           f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                           "--cluster.listen-address=", "--log.level=warn"], tmp_path / "alertmanager.log")
    # One config for both supervisors, as two replicas of one deployment would have: fast polls and evaluations,
    # alerts at once, kv_oom_runtime on a 4 s window and on auto, alerts re-pushed every second (so Alertmanager
    # hears the same alert from both, over and over), and the shared lease.
    config = tmp_path / "kvops.toml"
    config.write_text(f"""
[supervisor]
poll_interval_s = 0.2
evaluation_interval_s = 0.2
alert_warmup_s = 0
fix_lease = "{tmp_path / 'shared' / 'fix-lease.json'}"
fix_lease_ttl_s = {TTL_S}

[rules.{RULE}]
policy = "auto"
settings = {{ window_s = 4 }}

[alerting]
default_for_s = 0
alertmanager_resend_s = 1

[[alerting.receivers]]
name = "alertmanager"
type = "alertmanager"
url = "http://127.0.0.1:{am_port}"
initial_backoff_s = 0.5
max_backoff_s = 2
""")
    s = Setup(tmp_path, config, vllm.url, f"http://127.0.0.1:{am_port}", webhook, [])
    try:
        wait_for("Alertmanager ready", lambda: httpx.get(f"{s.alertmanager}/-/ready", timeout=2).status_code == 200,
                 30, (alertmanager,))
        yield s
    finally:
        for daemon in s.started:
            _stop(daemon.proc)
        _stop(alertmanager)
        webhook.close()
        vllm.close()
        for log in [*(d.log for d in s.started), tmp_path / "alertmanager.log"]:
            if log.exists() and log.stat().st_size:
                sys.stderr.write(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-1500:]}\n")


def _firing(daemon: Daemon) -> dict[str, Any] | None:
    return next((a for a in daemon.get("/api/alerts") if a["labels"].get("alertname") == RULE
                 and a["state"] == "firing"), None)


def _pushed_since_it_fired(daemon: Daemon) -> bool:
    """The supervisor delivered a push to Alertmanager after its alert fired (every push carries every firing
    alert), and has nothing left to deliver."""
    alert = _firing(daemon)
    last = daemon.metric('kvops_alert_last_delivery_timestamp_seconds{receiver="alertmanager"}')
    pending = daemon.metric('kvops_alert_receiver_pending{receiver="alertmanager"}')
    return alert is not None and last is not None and last >= alert["fired_at"] and pending == 0


def _am_alerts(s: Setup) -> list[dict[str, Any]]:
    return [a for a in httpx.get(f"{s.alertmanager}/api/v2/alerts", timeout=5).json()
            if a["labels"].get("alertname") == RULE]


# Long: one story, from two supervisors starting to the takeovers after a kill and a clean stop, each step on the last
def test_two_supervisors_one_engine(setup: Setup):
    s = setup
    begun = time.monotonic()
    first, second = s.supervisor("a"), s.supervisor("b")  # started together: the lock decides who holds the lease
    both = (first.proc, second.proc)
    wait_for("both supervisors to take a role", lambda: {first.role(), second.role()} <= {"holder", "standby"},
             60, both)
    roles = {first.role(), second.role()}
    assert roles == {"holder", "standby"}, roles  # exactly one holds it
    holder, standby = (first, second) if first.role() == "holder" else (second, first)
    assert standby.get("/api/fix-lease")["holder_url"] == holder.url
    assert holder.get("/api/fix-lease")["holder_url"] == holder.url
    assert (holder.metric("kvops_supervisor_fix_lease_held"), standby.metric("kvops_supervisor_fix_lease_held")) \
        == (1.0, 0.0)

    # Both diagnose and alert, with the same labels (nothing of the supervisor's own), and both push to Alertmanager.
    wait_for("both supervisors to push the firing alert", lambda: all(map(_pushed_since_it_fired, (holder, standby))),
             60, both)
    alerts = [_firing(holder), _firing(standby)]
    assert alerts[0] is not None and alerts[1] is not None
    assert alerts[0]["labels"] == alerts[1]["labels"] and set(alerts[0]["labels"]) <= ALERT_LABELS
    assert alerts[0]["fingerprint"] == alerts[1]["fingerprint"]
    took_alert = time.monotonic() - begun

    # Alertmanager deduplicates them: one alert, one notification, while both keep pushing it every second.
    wait_for("the webhook to be told", lambda: s.webhook.alerts(RULE, "firing"), 30, both)
    time.sleep(4)  # four more pushes from each, and four group intervals in which a second copy would be sent
    told = s.webhook.alerts(RULE, "firing")
    assert len(told) == 1, told
    assert told[0][1]["labels"] == alerts[0]["labels"]
    in_am = _am_alerts(s)
    assert len(in_am) == 1 and in_am[0]["fingerprint"] == alerts[0]["fingerprint"], in_am

    # Only the holder acts on the auto policy: it tried (and kvops refused to restart a vLLM it does not start);
    # the standby only proposed it, naming the holder, and tried nothing.
    tried = wait_for("the holder's attempt", lambda: [e for e in holder.rule_audit() if e["action"] == "failed"], 10,
                     both)
    assert "kvops does not manage this engine" in tried[0]["message"]
    assert not [e for e in holder.rule_audit() if e["action"] == "proposed"]
    proposed = wait_for("the standby's proposal", standby.rule_audit, 10, both)
    assert {e["action"] for e in proposed} == {"proposed"}, proposed  # once per occurrence; never tried
    assert "this supervisor is the standby" in proposed[0]["message"] and holder.url in proposed[0]["message"]

    # A person who asks the standby is sent to the holder; the holder answers for itself.
    body = {"engine": "watched-0", "rule": RULE, "subject": ""}
    for response in (standby.post("/api/fixes/apply", body), standby.post(f"/api/fixes/{proposed[0]['id']}/revert")):
        assert response.status_code == 409, response.text
        message = response.json()["error"]["message"]
        assert "this supervisor is the standby" in message and f"at {holder.url}" in message, message
    answer = holder.post("/api/fixes/apply", body)
    assert answer.status_code == 409 and "standby" not in answer.json()["error"]["message"], answer.text
    assert holder.post("/api/fixes/999999/revert").status_code == 404
    assert {e["action"] for e in standby.rule_audit()} == {"proposed"}  # the refusals changed nothing

    # SIGKILL: no release. The standby takes the lease when it expires: after the TTL, within a few seconds of it.
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait()
    killed = time.monotonic()
    wait_for("the standby to take the lease", lambda: standby.role() == "holder", TTL_S + 10, (standby.proc,),
             every_s=0.05)
    took_over = time.monotonic() - killed
    # Not before: the last renewal was at most one (maybe slow) evaluation before the kill.
    assert TTL_S - 1.5 <= took_over <= TTL_S + 3.0, took_over
    assert standby.metric("kvops_supervisor_fix_lease_held") == 1.0
    # ... and, holding it, applies by policy: its own attempt at the fix it had only proposed
    wait_for("the new holder's attempt", lambda: [e for e in standby.rule_audit() if e["action"] == "failed"], 10,
             (standby.proc,))
    assert "fix lease taken over" in standby.log.read_text()

    # A new supervisor joins as the standby; the holder stops cleanly and releases: the standby takes it at once.
    joined = s.supervisor("c")
    wait_for("the new supervisor to stand by", lambda: joined.role() == "standby", 60, (joined.proc, standby.proc))
    assert joined.get("/api/fix-lease")["holder_url"] == standby.url
    standby.proc.send_signal(signal.SIGTERM)
    assert standby.proc.wait(timeout=60) == 0
    stopped = time.monotonic()
    wait_for("the joined supervisor to take the lease", lambda: joined.role() == "holder", TTL_S + 10,
             (joined.proc,), every_s=0.05)
    after_exit = time.monotonic() - stopped
    # Without the release it would wait out the TTL from the last renewal (the stop takes well under a second).
    assert after_exit <= 2.0, after_exit
    assert "fix lease released" in standby.log.read_text()
    sys.stderr.write(f"\nHA timings: first alert pushed by both {took_alert:.1f} s, takeover after SIGKILL "
                     f"{took_over:.2f} s (TTL {TTL_S:g} s), after SIGTERM {after_exit:.2f} s from the exit\n")
