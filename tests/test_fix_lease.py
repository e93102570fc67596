"""The fix lease (kvops/supervisor/fixes/lease.py) on its own, with an injected clock: acquire, renew, takeover once
the holder's lease expired (not before), a corrupt or unreadable file, release, a lock that stays taken; its
settings; and a supervisor in process that does not hold it (auto fixes proposed, apply and revert refused with the
holder named, the role on the API and /metrics). Two real supervisors and a real Alertmanager:
tests/test_high_availability.py."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
import structlog
from fastapi.testclient import TestClient

from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.schema.errors import ConfigError
from kvops.supervisor import exporter
from kvops.supervisor.api import build_supervisor_app
from kvops.supervisor.config import load_config, parse_config
from kvops.supervisor.fixes.lease import FixLease, LeaseRecord, lock_path
from kvops.supervisor.supervisor import Supervisor

TTL = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_750_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _lease(tmp_path: Path, clock: Clock, name: str, **kwargs: float) -> FixLease:
    return FixLease(tmp_path / "shared" / "fix-lease.json", TTL, f"http://{name}:9400", holder=name, clock=clock,
                    **kwargs)


def _on_disk(tmp_path: Path) -> LeaseRecord:
    return LeaseRecord.model_validate_json((tmp_path / "shared" / "fix-lease.json").read_text())


def test_the_first_supervisor_acquires_the_other_stands_by(tmp_path: Path, clock: Clock):
    a, b = _lease(tmp_path, clock, "a"), _lease(tmp_path, clock, "b")
    assert a.renew() is True and a.held()
    assert b.renew() is False and not b.held()
    record = _on_disk(tmp_path)
    assert (record.holder, record.url, record.renewed_at, record.expires_at) == ("a", "http://a:9400", clock.now,
                                                                                 clock.now + TTL)
    view = b.view()
    assert (view.role, view.holder, view.holder_url, view.this_supervisor) == ("standby", "a", "http://a:9400", "b")
    assert a.view().role == "holder"


def test_renewal_keeps_the_lease_past_its_first_expiry(tmp_path: Path, clock: Clock):
    a, b = _lease(tmp_path, clock, "a"), _lease(tmp_path, clock, "b")
    a.renew()
    for _ in range(5):  # 5 x 0.6 TTL: well past the first expiry, renewed each time
        clock.now += 0.6 * TTL
        assert a.renew() is True
        assert b.renew() is False
    assert _on_disk(tmp_path).expires_at == clock.now + TTL


def test_the_standby_takes_an_expired_lease_and_not_before(tmp_path: Path, clock: Clock):
    a, b = _lease(tmp_path, clock, "a"), _lease(tmp_path, clock, "b")
    a.renew()
    b.renew()
    clock.now += TTL - 0.01  # a stopped renewing (killed): still its lease for 10 ms
    assert b.renew() is False
    assert a.held()
    clock.now += 0.02
    assert not a.held()  # a holder that could not renew stops applying fixes at its own expiry
    with structlog.testing.capture_logs() as logs:
        assert b.renew() is True
    assert _on_disk(tmp_path).holder == "b"
    took = next(e for e in logs if e["event"].startswith("fix lease taken over"))
    assert took["previous_holder"] == "a" and took["log_level"] == "warning"
    assert any(e["event"].startswith("fix lease acquired") for e in logs)
    # a comes back (it was only stalled): it is the standby now, and says it lost the lease
    with structlog.testing.capture_logs() as logs:
        assert a.renew() is False
    assert [e["event"] for e in logs] == ["fix lease lost: standby, fixes are only proposed here"]
    assert a.view().holder_url == "http://b:9400"


@pytest.mark.parametrize("content", [b"{not json", b'{"holder": "a"}', b"\xff\xfe\x00 binary", b""])
def test_a_damaged_file_is_logged_and_rewritten_never_raised(tmp_path: Path, clock: Clock, content: bytes):
    a, b = _lease(tmp_path, clock, "a"), _lease(tmp_path, clock, "b")
    a.renew()
    b.renew()
    path = tmp_path / "shared" / "fix-lease.json"
    path.write_bytes(content)
    # The standby does not take it at once: a live holder rewrites it at its next renewal.
    with structlog.testing.capture_logs() as logs:
        assert b.renew() is False
    assert logs and "fix lease file" in logs[0]["event"] and logs[0]["log_level"] == "warning"
    assert ("corrupt" in logs[0]["event"]) or ("unreadable" in logs[0]["event"])
    with structlog.testing.capture_logs() as logs:
        assert a.renew() is True  # its own lease: rewritten at once
    assert "rewritten by its holder" in logs[0]["event"]
    assert _on_disk(tmp_path).holder == "a"
    assert b.renew() is False


def test_a_damaged_file_nobody_rewrites_is_taken_after_the_ttl(tmp_path: Path, clock: Clock):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "fix-lease.json").write_text("garbage left by a crash")
    b = _lease(tmp_path, clock, "b")
    assert b.renew() is False
    clock.now += TTL / 2
    assert b.renew() is False
    clock.now += TTL / 2
    with structlog.testing.capture_logs() as logs:
        assert b.renew() is True
    assert any("nobody rewrote it" in e["event"] for e in logs)
    assert _on_disk(tmp_path).holder == "b"


def test_release_lets_the_standby_take_it_at_once(tmp_path: Path, clock: Clock):
    a, b = _lease(tmp_path, clock, "a"), _lease(tmp_path, clock, "b")
    a.renew()
    b.renew()
    b.release()  # not the holder's: nothing happens to a's lease
    assert _on_disk(tmp_path).holder == "a"
    a.release()
    assert not a.held() and not (tmp_path / "shared" / "fix-lease.json").exists()
    assert b.renew() is True  # same instant: no TTL to wait
    assert _on_disk(tmp_path).holder == "b"


def test_a_lock_that_stays_taken_is_a_log_line_and_the_lease_runs_out(tmp_path: Path, clock: Clock):
    a = _lease(tmp_path, clock, "a", lock_wait_s=0.05)
    a.renew()
    fd = os.open(lock_path(tmp_path / "shared" / "fix-lease.json"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process stuck holding the lock (a hung volume)
    try:
        clock.now += TTL / 2
        with structlog.testing.capture_logs() as logs:
            assert a.renew() is True  # still its lease until it expires
            assert a.renew() is True
        assert len([e for e in logs if e["event"].startswith("fix lease not renewed")]) == 1  # logged once
        clock.now += TTL / 2
        assert a.renew() is False  # not renewed: expired, it stops applying fixes
    finally:
        os.close(fd)
    with structlog.testing.capture_logs() as logs:
        assert a.renew() is True
    assert any(e["event"] == "fix lease readable again" for e in logs)


def test_a_lease_that_cannot_be_created_is_a_start_error(tmp_path: Path, clock: Clock):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"supervisor.fix_lease: cannot create .*fix-lease.json.lock"):
        FixLease(tmp_path / "file" / "fix-lease.json", TTL, "http://a", clock=clock)


# ------------------------------------------------------------------------------------------------- settings


def _config(tmp_path: Path, **supervisor: object) -> dict[str, object]:
    return {"supervisor": {"state_dir": str(tmp_path / "state"), **supervisor},
            "engines": [{"name": "vllm", "url": "http://127.0.0.1:9"}]}


def test_settings_a_relative_lease_is_in_the_state_dir(tmp_path: Path):
    assert parse_config(_config(tmp_path), "t").supervisor.fix_lease_path is None  # default: alone, as before
    relative = parse_config(_config(tmp_path, fix_lease="ha/lease.json"), "t").supervisor
    assert relative.fix_lease_path == tmp_path / "state" / "ha" / "lease.json"
    assert relative.fix_lease_ttl_s == 15
    absolute = parse_config(_config(tmp_path, fix_lease=str(tmp_path / "shared.json")), "t").supervisor
    assert absolute.fix_lease_path == tmp_path / "shared.json"


@pytest.mark.parametrize(("settings", "message"), [
    ({"fix_lease": "l.json", "fix_lease_ttl_s": 1.0},
     r"t: supervisor.fix_lease_ttl_s: the lease must last at least 3 evaluations \(3 x 0.5 s = 1.5 s\)"),
    ({"fix_lease": "l.json", "poll_interval_s": 6, "evaluation_interval_s": 0.5},  # evaluations every poll: 6 s
     r"supervisor.fix_lease_ttl_s: the lease must last at least 3 evaluations \(3 x 6 s = 18 s\).*\(got 15.0\)"),
    ({"fix_lease": "l.json", "fix_lease_ttl_s": 0}, r"supervisor.fix_lease_ttl_s: Input should be greater than 0"),
    ({"fix_lease": "{tmp}/a-file/lease.json"}, r"supervisor.fix_lease: .*a-file is not a folder, so"),
    ({"fix_lease": "{tmp}"}, r"supervisor.fix_lease: .* is a folder: give the path of a file"),
])
def test_settings_refused_with_the_key_and_why(tmp_path: Path, settings: dict[str, object], message: str):
    (tmp_path / "a-file").write_text("")
    settings = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in settings.items()}
    with pytest.raises(ConfigError, match=message):
        parse_config(_config(tmp_path, **settings), "t")


def test_the_example_config_takes_a_lease_and_the_docs_list_its_gauge(tmp_path: Path):
    root = Path(__file__).resolve().parent.parent
    config = load_config(root / "kvops.example.toml", [f"supervisor.state_dir={str(tmp_path)!r}",
                                                       "supervisor.fix_lease='ha/engine.lease'"])
    assert config.supervisor.fix_lease_path == tmp_path / "ha" / "engine.lease"
    assert "# fix_lease = " in (root / "kvops.example.toml").read_text()
    assert "| `kvops_supervisor_fix_lease_held` | gauge |" in (root / "docs" / "supervisor.md").read_text()
    assert "## Two supervisors, one engine" in (root / "docs" / "deployment.md").read_text()


def test_a_long_ttl_is_not_checked_without_a_lease(tmp_path: Path):
    config = parse_config(_config(tmp_path, poll_interval_s=30, evaluation_interval_s=30), "t")
    assert config.supervisor.fix_lease is None


# ------------------------------------------------------------------------------- a supervisor, standing by


KV_FIX = Fix(kind=FixKind.RESTART, action="restart_engine", params={"max_num_seqs": 8}, description="fewer seqs")


def _diagnosis() -> Diagnosis:
    return Diagnosis(rule="kv_oom_runtime", engine="vllm", severity=Severity.CRITICAL, title="t", summary="s",
                     evidence={"x": 1.0}, fix=KV_FIX)


def _supervisor(tmp_path: Path, name: str, lease: bool = True) -> Supervisor:
    config = parse_config({
        "supervisor": {"state_dir": str(tmp_path / name), "listen": f"127.0.0.1:{9400 + len(name)}",
                       "external_url": f"http://{name}.example:9400",
                       **({"fix_lease": str(tmp_path / "fix-lease.json")} if lease else {})},
        "engines": [{"name": "vllm", "url": "http://127.0.0.1:9", "kind": "vllm"}],
        "rules": {"kv_oom_runtime": {"policy": "auto"}}}, "t")
    return Supervisor(config, admin_token="token")


def _auth() -> dict[str, str]:
    return {"Authorization": "Bearer token"}


def test_a_standby_proposes_auto_fixes_and_refuses_changes_naming_the_holder(tmp_path: Path):
    holder, standby = _supervisor(tmp_path, "first"), _supervisor(tmp_path, "second")
    assert holder.fix_lease is not None and standby.fix_lease is not None
    assert holder.fix_lease.renew() and not standby.fix_lease.renew()
    for sup in (holder, standby):
        sup.engines["vllm"].diagnoses = [_diagnosis()]
        sup.fixes.consider([_diagnosis()], sup.config.policy, standby=sup.standby_reason(renew=True))
    # The holder tried to apply it (refused: kvops does not restart an engine it does not manage); the standby
    # only proposed it, saying who applies fixes.
    assert [(e.action, e.rule) for e in holder.fixes.audit.entries] == [("failed", "kv_oom_runtime")]
    proposed = list(standby.fixes.audit.entries)
    assert [e.action for e in proposed] == ["proposed"]
    assert "standby" in proposed[0].message and "http://first.example:9400" in proposed[0].message

    api = TestClient(build_supervisor_app(standby))
    body = {"engine": "vllm", "rule": "kv_oom_runtime", "subject": ""}
    for response in (api.post("/api/fixes/apply", json=body, headers=_auth()),
                     api.post("/api/fixes/1/revert", headers=_auth())):
        assert response.status_code == 409, response.text
        message = response.json()["error"]["message"]
        assert "this supervisor is the standby" in message and "at http://first.example:9400" in message
    assert api.post("/api/fixes/apply", json=body).status_code == 401  # the token is still asked first
    lease = api.get("/api/fix-lease").json()
    assert (lease["role"], lease["holder_url"], lease["ttl_s"]) == ("standby", "http://first.example:9400", 15.0)
    assert api.get("/health").json()["fix_lease"] == "standby"
    assert "kvops_supervisor_fix_lease_held 0.0" in exporter.render(standby)[0].decode()

    holder_api = TestClient(build_supervisor_app(holder))
    assert holder_api.get("/api/fix-lease").json()["role"] == "holder"
    assert "kvops_supervisor_fix_lease_held 1.0" in exporter.render(holder)[0].decode()
    refused = holder_api.post("/api/fixes/apply", json=body, headers=_auth())
    assert refused.status_code == 409 and "standby" not in refused.json()["error"]["message"]  # its own reason
    assert holder_api.post("/api/fixes/1/revert", headers=_auth()).status_code == 404  # no such job, not a standby

    # The holder stops cleanly: the standby holds the lease at its next evaluation, and applies.
    holder.stop()
    assert standby.standby_reason(renew=True) == ""
    standby.fixes.consider([_diagnosis()], standby.config.policy, standby="")
    assert [e.action for e in standby.fixes.audit.entries] == ["proposed", "failed"]
    assert api.get("/api/fix-lease").json()["role"] == "holder"
    standby.stop()
    assert not (tmp_path / "fix-lease.json").exists()


def test_without_a_lease_the_supervisor_applies_alone_and_has_no_gauge(tmp_path: Path):
    sup = _supervisor(tmp_path, "alone", lease=False)
    api = TestClient(build_supervisor_app(sup))
    assert api.get("/api/fix-lease").json() == {"role": "alone", "this_supervisor": None, "holder": None,
                                                "holder_url": None, "expires_at": None, "path": None, "ttl_s": None}
    assert api.get("/health").json()["fix_lease"] == "alone"
    assert "kvops_supervisor_fix_lease_held" not in exporter.render(sup)[0].decode()
    assert sup.standby_reason(renew=True) == ""
    sup.stop()


def test_the_lease_file_is_plain_json(tmp_path: Path, clock: Clock):
    _lease(tmp_path, clock, "a").renew()
    assert set(json.loads((tmp_path / "shared" / "fix-lease.json").read_text())) == {
        "holder", "url", "renewed_at", "expires_at"}
