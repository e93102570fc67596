"""`kvops top` with nothing running: the embedded supervisor, the demo workload, and the app driven
by a pilot against them — real processes (`kvops run`, its engine, the load generator), no fakes."""

from __future__ import annotations

import asyncio
import os
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


def test_supervisor_answers_only_when_one_is_there() -> None:
    assert not supervisor_answers(f"http://127.0.0.1:{free_port('127.0.0.1')}")


def test_the_live_view_needs_a_terminal(capsys: Any) -> None:
    assert run_top(None) == 2  # pytest captures stdout: not a terminal
    assert "--once or --json" in capsys.readouterr().err


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
