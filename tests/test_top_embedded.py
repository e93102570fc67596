"""`kvops top` with nothing running: without --start / --demo it says so and starts nothing; the
embedded supervisor, the demo workload, and the app driven by a pilot against them — real processes
(`kvops top` itself, `kvops run`, its engine, the load generator), no fakes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from textual.widgets import DataTable

from kvops.processes import free_port
from kvops.top import demo, run_top
from kvops.top.app import KvopsTop
from kvops.top.client import SupervisorClient
from kvops.top.embedded import EmbeddedSupervisor, supervisor_answers
from kvops.top.screens import ConfirmScreen
from kvops.top.widgets.audit import AuditPanel
from kvops.top.widgets.common import Readout

pytestmark = pytest.mark.clock  # a live engine and load behind the screen (tests/helpers/clock_worker.py)


def test_supervisor_answers_only_when_one_is_there() -> None:
    assert not supervisor_answers(f"http://127.0.0.1:{free_port('127.0.0.1')}")


def test_the_live_view_needs_a_terminal(capsys: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))  # where an embedded supervisor would keep its log
    assert run_top(None, start=True) == 2  # pytest captures stdout: not a terminal, so nothing is started
    assert "--once or --json" in capsys.readouterr().err
    assert not (tmp_path / "kvops").exists()


def _top(args: list[str], tmp_path: Path, default_url: str | None = None) -> tuple[int, str, set[str]]:
    """`kvops top ARGS` as a real process on a terminal (a pty: the live view's path, not the pipe's):
    its exit code, its stderr and the command lines of every process it started, watched until it exits."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVOPS_TOP_URL", "KVOPS_ADMIN_TOKEN")}
    env["XDG_STATE_HOME"] = str(tmp_path)  # an embedded supervisor's state dir (and log) would be under it
    if default_url is not None:
        env["KVOPS_TOP_URL"] = default_url
    primary, secondary = pty.openpty()
    try:
        process = subprocess.Popen([sys.executable, "-m", "kvops", "top", *args], stdin=secondary, stdout=secondary,
                                   stderr=subprocess.PIPE, env=env, text=True)
        parent = psutil.Process(process.pid)
        spawned: set[str] = set()
        while process.poll() is None:
            with contextlib.suppress(psutil.Error):  # gone while it was looked at: `poll` says so next
                spawned |= {" ".join(child.cmdline()) for child in parent.children(recursive=True)}
            time.sleep(0.02)
        _, err = process.communicate(timeout=30)
    finally:
        os.close(primary)
        os.close(secondary)
    return process.returncode, err, spawned


def _kvops_processes_under(tmp_path: Path) -> list[str]:
    """Every live process whose command line names `tmp_path`: an embedded supervisor (its --state-dir)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if str(tmp_path) in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.parametrize("how", ["default", "attach", "once", "json"])
def test_with_no_supervisor_it_says_what_to_do_and_starts_nothing(tmp_path: Path, how: str) -> None:
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    args = {"default": [], "attach": ["--attach", url], "once": ["--once", "--attach", url],
            "json": ["--json"]}[how]
    code, err, spawned = _top(args, tmp_path, default_url=url if how in ("default", "json") else None)
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith(f"kvops top: no kvops supervisor answers at {url} (connection refused).\n"), err
    for way in ("kvops run ", "kvops top --attach URL", "kvops top --demo", "kvops top --start"):
        assert way in err, (way, err)
    assert ("That address comes from $KVOPS_TOP_URL" in err) == (how in ("default", "json"))
    assert not spawned, spawned  # no `kvops run`, no engine: not even for a moment
    assert not (tmp_path / "kvops").exists()  # no embedded supervisor's state dir
    assert not _kvops_processes_under(tmp_path)


def test_start_cannot_be_combined_with_attach_or_once(tmp_path: Path) -> None:
    for args, message in [(["--start", "--attach", "http://127.0.0.1:9"], "drop --attach"),
                          (["--start", "--once"], "--start is for the live view"),
                          (["--demo", "--json"], "--demo is for the live view"),
                          (["--demo", "--start"], "drop --start")]:
        code, err, spawned = _top(args, tmp_path)
        assert code == 2 and message in err and not spawned, (args, err)


def _rows(app: KvopsTop, table: str, column: int = 0) -> list[str]:
    t = app.query_one(f"#{table}", DataTable)
    return [str(t.get_row_at(i)[column]) for i in range(t.row_count)]


async def _until(pilot: Any, what: str, condition: Any, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()
        if condition():
            return time.monotonic() - start
        await asyncio.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout_s:g} s")


def test_demo_under_an_embedded_supervisor_shows_diagnoses_and_applies_a_fix(tmp_path: Path) -> None:
    embedded = EmbeddedSupervisor(demo.RUN_ARGS, state_dir=tmp_path)
    embedded.start()
    load = demo.DemoLoad(embedded.url)
    load.start()
    engine_pids: list[int] = []

    async def main() -> None:
        with SupervisorClient(embedded.url, admin_token=embedded.admin_token) as client:
            app = KvopsTop(client, interval_s=0.5, starting=f"starting the demo (pid {embedded.pid})",
                           gone=embedded.exited)
            async with app.run_test(size=(160, 50)) as pilot:
                info = app.query_one("#engine-info", Readout)
                assert "starting" in str(info.render())  # the model takes seconds to load
                await _until(pilot, "engine up", lambda: app.engine is not None and app.engine.latest is not None,
                             120)
                engine_pids.append(app.engine.entry.pid)
                assert _rows(app, "engines") == ["demo"]
                assert "engine ready" in str(app.query_one("#log", Readout).render())
                # the mixed workload: every panel moves, the noisy tenant is diagnosed within a minute
                await _until(pilot, "demo tenants", lambda: {"chat-a", "chat-b", "support"} <= set(
                    app.engine.latest.tenants), 60)
                await _until(pilot, "prompt_variance diagnosis",
                             lambda: "prompt_variance" in _rows(app, "diagnoses", 2), 60)
                await pilot.press("tab", "tab")  # diagnoses
                table = app.query_one("#diagnoses", DataTable)
                table.move_cursor(row=_rows(app, "diagnoses", 2).index("prompt_variance"))
                await pilot.press("f")
                assert isinstance(app.screen, ConfirmScreen)
                await pilot.press("y")
                # the demo proposes fixes (suggest policy): a "proposed" prompt_variance entry is
                # there before `f`, so wait for the applied one (its job verifying it)
                await _until(pilot, "the fix in the audit log", lambda: any(
                    a.rule == "prompt_variance" and a.action == "verifying" for a in app.state.audit), 30)
                assert "verifying" in _rows(app, "audit", 2)
                # the running job's state and progress, on the audit panel's border
                panel = app.query_one(AuditPanel)
                await _until(pilot, "the job's progress", lambda: "prompt_variance on demo: verifying" in str(
                    panel.border_subtitle), 10)
                await _until(pilot, "normalization on",
                             lambda: app.engine.latest.prefix_cache.normalization == "on", 10)

    try:
        asyncio.run(main())
    finally:
        load.stop()
        embedded.stop()
    assert embedded.exited() is not None and not supervisor_answers(embedded.url)
    assert engine_pids and not psutil.pid_exists(engine_pids[0])  # the engine went with its supervisor


@pytest.mark.skipif(not hasattr(os, "getpgid"), reason="POSIX only")
def test_a_dead_embedded_supervisor_says_why(tmp_path: Path) -> None:
    embedded = EmbeddedSupervisor(["--config", str(tmp_path / "missing.toml")], state_dir=tmp_path)
    embedded.start()
    assert embedded.process is not None
    embedded.process.wait(timeout=60)
    message = embedded.exited()
    assert message is not None and "exited with code" in message and "missing.toml" in message
