"""Fix jobs under injected faults: a fix that makes things worse, an engine killed in the verification
window, new settings that cannot start, the supervisor killed mid-verification, a slow restart (polling goes
on), and a revert while the engine is unreachable. Real engines where it matters (a managed `kvops engine
serve`, the in-process engine app); the judge's inputs are synthetic only in the first test."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvops.adapters.engine_client import EngineClient
from kvops.adapters.http_client import HttpClient
from kvops.engine.serving.app import build_app
from kvops.history import EngineHistory
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.verdict import Verdict, VerdictKind
from kvops.supervisor.api import build_supervisor_app
from kvops.supervisor.config import KvopsConfig
from kvops.supervisor.fixes.audit import AuditLog
from kvops.supervisor.fixes.manager import FixManager, Target
from kvops.supervisor.supervisor import Supervisor
from tests.helpers.synthetic import snapshot
from tests.helpers.waiting import wait_for
from tests.test_supervisor import Daemon, Receiver, _config

pytestmark = pytest.mark.clock  # fixes judged over real verification windows (tests/helpers/clock_worker.py)

NORMALIZE = Fix(kind=FixKind.ADMIN, action="set_normalization", params={"mode": "on"}, description="normalize",
                objectives=[Objective(measure="preemptions_per_s", better="lower")])


@pytest.fixture
def client(llm) -> Iterator[EngineClient]:
    with TestClient(build_app(llm.engine, admin_token="fix-token")) as http:
        client = EngineClient("http://testserver", "fix-token")
        client._http = http  # the real app, in process
        yield client
    llm.engine.set_normalization("off")


def _diagnosis(fix: Fix, engine: str = "default") -> Diagnosis:
    return Diagnosis(rule="prompt_variance", engine=engine, severity=Severity.WARNING, title="t", summary="s",
                     evidence={"x": 1.0}, fix=fix)


def _ended(entries: list[Any], job_id: int) -> Any:
    return next((e for e in entries if getattr(e, "action", None) in ("verified", "rolled_back", "failed", "reverted")
                 and e.id > job_id), None)


def test_a_fix_that_makes_its_objective_worse_is_rolled_back(tmp_path: Path, client: EngineClient):
    """The real judge on synthetic windows: preemptions 0.2/s before, 2/s after, steady traffic."""
    w, t0 = 2.0, time.time()
    history = EngineHistory("default")
    for i in range(9):  # before: t0-2 .. t0 ; after: t0+0.2 .. t0+1.8 (its times are in the future: already there)
        t = t0 - w + i * w / 8
        preempted = int(0.2 * (t - t0 + w) * 10)
        history.add(snapshot(t, requests={"finished_total": 1000 + 10 * i, "preemptions_total": preempted}))
    for i in range(9):
        t = t0 + 0.2 + i * 0.2
        history.add(snapshot(t, requests={"finished_total": 1100 + 10 * i, "preemptions_total": 10 + 4 * i}))
    fixes = FixManager(AuditLog(tmp_path / "audit.jsonl"), lambda e: Target(client, None, history), verify_after_s=w,
                       state_path=tmp_path / "fix_jobs.json", cooldown_s=0)
    fixes.start()
    queued = fixes.apply(_diagnosis(NORMALIZE))
    rolled = wait_for("the verdict", lambda: _ended(list(fixes.audit.entries), queued.id), 15, every_s=0.1)
    assert rolled.action == "rolled_back", rolled.message
    assert rolled.verdict.kind is VerdictKind.WORSE
    change = rolled.verdict.objectives[0]
    assert change.measure == "preemptions_per_s" and change.after > change.before and change.ok is False
    assert client.knobs()["normalize_prompts"] == "off"
    # Nothing pending is left on disk. The audit entry is written first and the state file right after it (a crash
    # between the two re-runs the job rather than losing its verdict), so the file may lag the entry a moment.
    wait_for("no pending job in the state file",
             lambda: not (tmp_path / "fix_jobs.json").read_text().count('"state"'), 5, every_s=0.05)


def test_revert_with_the_engine_unreachable_answers_503_then_retries(tmp_path: Path, client: EngineClient):
    history = EngineHistory("default")
    fixes = FixManager(AuditLog(tmp_path / "audit.jsonl"), lambda e: Target(client, None, history),
                       verify_after_s=60, state_path=tmp_path / "fix_jobs.json", revert_retry_s=0.3,
                       judge=lambda *a: Verdict(kind=VerdictKind.IMPROVED))
    fixes.start()
    queued = fixes.apply(_diagnosis(NORMALIZE))
    wait_for("verifying", lambda: fixes.job_views()[0]["state"] == "verifying", 10, every_s=0.05)
    sup = SimpleNamespace(fixes=fixes, admin_token="sup-token", engines={}, config=KvopsConfig())
    api = TestClient(build_supervisor_app(sup))  # type: ignore[arg-type]
    working = client._http
    client._http = HttpClient("http://127.0.0.1:9", timeout_s=0.5)  # nothing listens there
    started = time.monotonic()
    response = api.post(f"/api/fixes/{queued.id}/revert", headers={"Authorization": "Bearer sup-token"})
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert "could not reach engine 'default'" in message and "kvops retries the revert every 0.3 s" in message
    assert api.get("/api/fixes").json()[0]["state"] == "reverting"
    time.sleep(1.0)  # a few failed retries
    client._http = working  # the engine is back
    reverted = wait_for("the revert", lambda: _ended(list(fixes.audit.entries), queued.id), 10, every_s=0.1)
    assert reverted.action == "reverted" and "undone after" in reverted.message
    assert client.knobs()["normalize_prompts"] == "off"
    assert time.monotonic() - started < 8


# ------------------------------------------------------------------ a managed engine, in process


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    state = tmp_path_factory.mktemp("sup")
    config = KvopsConfig.model_validate({
        "supervisor": {"state_dir": str(state), "poll_interval_s": 0.25, "verify_after_s": 3, "fix_cooldown_s": 0,
                       "alert_warmup_s": 3600},
        "engines": [{"name": "default", "health_timeout_s": 60, "drain_timeout_s": 2,
                     "args": {"kv_cache_memory": "48MiB", "max_model_len": 512, "max_num_seqs": 16}}]})
    sup = Supervisor(config)
    sup.fixes.judge = lambda *a: Verdict(kind=VerdictKind.IMPROVED, message="improved")  # type: ignore[method-assign]
    sup.start()
    wait_for("the engine to be up", lambda: sup.engines["default"].history.is_up, 120)
    yield sup
    sup.stop()


def _restart_fix(params: dict[str, Any]) -> Diagnosis:
    fix = Fix(kind=FixKind.RESTART, action="restart_engine", params=params, description=f"restart with {params}",
              objectives=[Objective(measure="preemptions_per_s", better="lower")])
    return Diagnosis(rule="kv_oom_runtime", engine="default", severity=Severity.WARNING, title="t", summary="s",
                     evidence={}, fix=fix)


def _job(sup: Supervisor, job_id: int) -> dict[str, Any]:
    return next(j for j in sup.fixes.job_views() if j["id"] == job_id)


def test_polling_goes_on_during_a_restart_fix_and_a_kill_9_in_the_window_fails_it(supervisor: Supervisor):
    sup, managed = supervisor, supervisor.engines["default"].managed
    assert managed is not None
    queued = sup.fixes.apply(_restart_fix({"max_num_seqs": 8}))
    wait_for("applying", lambda: _job(sup, queued.id)["state"] == "applying", 10, every_s=0.05)
    polls = sup.polls_total
    progress = _job(sup, queued.id)["progress"]
    assert progress.startswith("restarting: waiting for health"), progress
    time.sleep(1.0)
    assert _job(sup, queued.id)["state"] == "applying" and sup.polls_total >= polls + 2  # the poll loop did not wait
    wait_for("verifying", lambda: _job(sup, queued.id)["state"] == "verifying", 60, every_s=0.1)
    assert managed.args["max_num_seqs"] == 8
    os.kill(managed.pid, signal.SIGKILL)  # type: ignore[arg-type]
    job = wait_for("the rollback", lambda: (j := _job(sup, queued.id))["state"] == "failed" and j, 90)
    assert job["verdict"]["kind"] == "failed" and "went down" in job["message"]
    assert managed.args["max_num_seqs"] == 16  # back on the old settings...
    time.sleep(1.0)  # still up a moment later: the engine outlives the worker thread that started it
    assert httpx.get(managed.url + "/health", timeout=5).status_code == 200  # ...and answering
    entries = [e for e in sup.fixes.audit.entries if e.id >= queued.id and e.rule == "kv_oom_runtime"]
    assert [e.action for e in entries] == ["queued", "applying", "verifying", "failed"]
    assert entries[-1].after["max_num_seqs"] == 16


def test_new_settings_that_cannot_start_are_replaced_by_the_old_ones(supervisor: Supervisor):
    sup, managed = supervisor, supervisor.engines["default"].managed
    assert managed is not None
    wait_for("the engine to be up", lambda: sup.engines["default"].history.is_up, 60)
    started = time.monotonic()
    queued = sup.fixes.apply(_restart_fix({"kv_cache_memory": "1MiB"}))
    job = wait_for("the verdict", lambda: (j := _job(sup, queued.id))["state"] == "failed" and j, 60)
    assert time.monotonic() - started < managed.spec.health_timeout_s
    assert "did not start" in job["message"] and "healthy" in job["message"]
    assert managed.args["kv_cache_memory"] == "48MiB"
    assert httpx.get(managed.url + "/health", timeout=5).status_code == 200


# ------------------------------------------------------------------ the supervisor killed


def test_the_supervisor_killed_mid_verification_still_delivers_the_verdict(tmp_path: Path):
    receiver = Receiver()
    config = _config(tmp_path, receiver, engine_args="enable_prefix_caching = false", extra="""
[rules.prefix_caching_off]
policy = "auto"
[rules.prefix_caching_off.settings]
window_s = 3
min_queried_tokens = 300
""")
    config.write_text(config.read_text().replace("verify_after_s = 3", "verify_after_s = 4"))
    daemon = Daemon(config)
    try:
        daemon.wait_engine_up()
        shared = "You are a support assistant for a bakery. " * 12
        with httpx.Client(base_url=daemon.engine()["url"], timeout=120) as http:
            for i in range(6):
                http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "max_tokens": 2,
                                                   "prompt": shared + f"Question {i}: what is fresh today?"})
        verifying = daemon.wait("the fix to be verifying", lambda: [
            e for e in daemon.get("/api/audit") if e["action"] == "verifying"])[0]
        assert (tmp_path / "state" / "fix_jobs.json").read_text().count('"verifying"') == 1
        daemon.proc.kill()  # mid-verification
        daemon.proc.wait()
        daemon = Daemon(config)  # the same state_dir
        verdict = daemon.wait("the verdict", lambda: [
            e for e in daemon.get("/api/audit") if e["id"] > verifying["id"]
            and e["action"] in ("verified", "rolled_back", "failed")], timeout_s=90)[0]
        assert verdict["verdict"] is not None and verdict["rule"] == "prefix_caching_off"
        assert '"verifying"' not in (tmp_path / "state" / "fix_jobs.json").read_text()
        assert daemon.stop() == 0
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()


def test_a_corrupt_state_file_is_moved_aside_not_a_crash(tmp_path: Path):
    from kvops.supervisor.fixes.state import FixStateStore

    path = tmp_path / "fix_jobs.json"
    path.write_text('{"version": 1, "jobs": [{"id": ')  # cut short by a crash of the disk, not of ours
    assert FixStateStore(path).load().jobs == []
    assert not path.exists() and len(list(tmp_path.glob("fix_jobs.json.corrupt-*"))) == 1
