"""`kvops top`: the block-map layout (pure), the text renderings, and the Textual app driven by a pilot.

The app tests run against `FakeSupervisor`, a small in-process object with the same interface as
`kvops.top.client.SupervisorClient`, fed with `tests/synthetic.py` snapshots. It stands in for the
supervisor's HTTP API, which test_supervisor.py covers end to end; here only the app's behaviour
is under test (navigation, filter, sort, applying and reverting fixes, the lost-supervisor banner).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from synthetic import T0, snapshot
from textual.widgets import DataTable, Input, Static

from kvops.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.fixes import AuditEntry
from kvops.snapshot import Snapshot, decode_block_map
from kvops.top.app import ConfirmScreen, KvopsTop
from kvops.top.bench import synthetic_codes
from kvops.top.block_map import aggregate, layout, render_rows
from kvops.top.client import EngineEntry, Poller, SupervisorRefused, SupervisorUnreachable
from kvops.top.render import histogram_lines, render_json, render_once, series

TENANTS = {
    "alice": {"blocks_held": 300, "blocks_owned": 320, "quota_blocks": 400, "hit_rate": 0.9,
              "evictions_caused": 1, "evictions_suffered": 50},
    "bob": {"blocks_held": 100, "blocks_owned": 100, "quota_blocks": None, "hit_rate": 0.2,
            "evictions_caused": 70, "evictions_suffered": 0},
    "carol": {"blocks_held": 200, "blocks_owned": 210, "quota_blocks": 250, "hit_rate": 0.5,
              "evictions_caused": 5, "evictions_suffered": 5},
}


class FakeSupervisor:
    """The SupervisorClient interface over synthetic snapshots; `down` makes every call fail."""

    url = "http://fake-supervisor"

    def __init__(self, admin_token: str | None = "secret") -> None:
        self.admin_token = admin_token
        self.down = False
        self.applied: list[tuple[str, str, str]] = []
        self.reverted: list[int] = []
        self.snaps = {
            "gpu-a": [snapshot(T0 - 10 + i, tenants=TENANTS,
                               requests={"generation_tokens_total": 64_000 + 100 * i}) for i in range(11)],
            "gpu-b": [snapshot(T0 - 10 + i, engine={"model": "Other-Model", "block_size": 32}) for i in range(11)],
        }
        fix = Fix(kind=FixKind.ADMIN, action="set_tenant_quota", params={"tenant": "bob", "blocks": 200},
                  description="cap bob at 200 blocks")
        self.diags = [
            Diagnosis(rule="noisy_tenant", engine="gpu-a", subject="bob", severity=Severity.WARNING,
                      title="A tenant evicts the others", summary="bob caused 70 evictions",
                      evidence={"evictions_caused": 70}, fix=fix),
            Diagnosis(rule="low_hit_rate", engine="gpu-b", severity=Severity.INFO, title="Low hit rate",
                      summary="hit rate 20%", evidence={"hit_rate": 0.2}),
        ]
        self.entries = [AuditEntry(id=7, time=T0 - 5, engine="gpu-a", rule="noisy_tenant", subject="bob",
                                   action="applied", fix=fix, message="quota set")]

    def _check(self) -> None:
        if self.down:
            raise SupervisorUnreachable(f"supervisor at {self.url} unreachable: ConnectError: refused")

    def engines(self) -> list[EngineEntry]:
        self._check()
        return [EngineEntry(name=name, url=f"http://{name}", up=True, pid=1) for name in self.snaps]

    def snapshot(self, name: str) -> Snapshot:
        self._check()
        if name not in self.snaps:
            raise SupervisorRefused(f"GET /api/engines/{name}/snapshot: HTTP 404: no engine", 404)
        return self.snaps[name][-1]

    def history(self, name: str, seconds: float = 60.0) -> list[Snapshot]:
        self._check()
        return list(self.snaps[name][:-1])

    def diagnoses(self) -> list[Diagnosis]:
        self._check()
        return list(self.diags)

    def audit(self) -> list[AuditEntry]:
        self._check()
        return list(self.entries)

    def apply_fix(self, engine: str, rule: str, subject: str = "") -> AuditEntry:
        self._check()
        self.applied.append((engine, rule, subject))
        return AuditEntry(id=8, time=T0, engine=engine, rule=rule, subject=subject, action="applied")

    def revert_fix(self, entry_id: int) -> AuditEntry:
        self._check()
        self.reverted.append(entry_id)
        return AuditEntry(id=9, time=T0, engine="gpu-a", rule="noisy_tenant", action="reverted")


# ----------------------------------------------------------------- block map (pure)


def test_aggregate_picks_the_most_interesting_state() -> None:
    assert aggregate("....", 1) == "...."
    assert aggregate("...F", 4) == "F"
    assert aggregate("FFcs", 4) == "s"  # swapped beats everything
    assert aggregate("fFFF....", 4) == "f."  # filling beats full
    assert aggregate("cccp" + "cccc" + "..", 4) == "pc."  # last, short cell still counts
    assert aggregate("..x.c", 5) == "c"  # unknown codes count as the dullest state


def test_layout_fits_the_panel_and_reports_the_scale() -> None:
    small = layout("F" * 10 + "." * 5, width=10, height=4)
    assert small.rows == ["F" * 10, "....."] and small.blocks_per_cell == 1 and small.scale == "1 cell = 1 block"
    codes = synthetic_codes(16_384)
    grid = layout(codes, width=120, height=20)
    assert grid.blocks_per_cell == 7  # ceil(16384 / 2400)
    assert grid.scale == "1 cell = 7 blocks" and grid.total_blocks == 16_384
    assert len(grid.rows) <= 20 and all(len(row) <= 120 for row in grid.rows)
    assert sum(map(len, grid.rows)) == -(-16_384 // 7)
    assert render_rows(grid.rows).plain.count("\n") == len(grid.rows) - 1


def test_layout_of_a_synthetic_snapshot() -> None:
    s = snapshot(T0)
    codes = decode_block_map(s.blocks.state_map)
    assert len(codes) == s.engine.num_blocks
    grid = layout(codes, width=32, height=8)  # 256 cells, 4 blocks each
    assert grid.blocks_per_cell == 4 and len(grid.rows) == 8
    assert grid.rows[0].startswith("FFFFFFFFFF")  # 40 full blocks first


# ----------------------------------------------------------------- text renderings


def test_series_and_histogram() -> None:
    fake = FakeSupervisor()
    data = series(fake.snaps["gpu-a"])
    assert data["throughput"] == [100.0] * 10
    assert len(data["kv_usage"]) == 11 and data["hit_rate"][0] == 0.5
    lines = histogram_lines(fake.snaps["gpu-a"][-1].prompt_lengths, width=10)
    assert lines[1].strip().startswith("≤64") and "██████████ 600" in lines[1]
    assert lines[-1] == "p50 64  p95 256  p99 1024  (n=1000)"


def test_poller_keeps_the_history_window() -> None:
    fake = FakeSupervisor()
    poller = Poller(fake, history_s=60)
    state = poller.poll()
    assert [len(v.history) for v in state.engines] == [11, 11]
    fake.snaps["gpu-a"].append(snapshot(T0 + 1))
    state = poller.poll()
    assert len(state.engines[0].history) == 12 and state.engines[0].latest.time == T0 + 1


def test_render_once_and_json() -> None:
    fake = FakeSupervisor()
    text = render_once(fake)
    assert "gpu-a  [up]" in text and "model Other-Model  block 32" in text
    assert "tenant bob: held 100 quota -" in text and "noisy_tenant [bob]: bob caused 70 evictions" in text
    assert "#7" in text and "applied" in text
    data = json.loads(render_json(fake))
    assert set(data) == {"gpu-a", "gpu-b"}
    assert Snapshot.model_validate(data["gpu-b"]).engine.block_size == 32


# ----------------------------------------------------------------- the app


def run_app(body: Callable[[Any, KvopsTop, FakeSupervisor], Awaitable[None]], size: tuple[int, int] = (160, 50),
            fake: FakeSupervisor | None = None) -> None:
    fake = fake or FakeSupervisor()

    async def main() -> None:
        app = KvopsTop(fake, interval_s=60)  # polls on mount; tests poll explicitly after that
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            await body(pilot, app, fake)

    asyncio.run(main())


async def settle(pilot: Any) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def rows(app: KvopsTop, table: str, column: int = 0) -> list[str]:
    t = app.query_one(f"#{table}", DataTable)
    return [str(t.get_row_at(i)[column]) for i in range(t.row_count)]


def test_app_shows_engines_and_tab_moves_between_panels() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        assert rows(app, "engines") == ["gpu-a", "gpu-b"]
        assert "1 cell = 1 block" in str(app.query_one("#map-legend", Static).render())
        assert rows(app, "tenants") == ["alice", "carol", "bob"]  # by blocks held
        assert app.focused.id == "engines"
        focus = []
        for _ in range(3):
            await pilot.press("tab")
            focus.append(app.focused.id)
        assert focus == ["tenants", "diagnoses", "audit"]
        await pilot.press("shift+tab", "shift+tab", "shift+tab", "down")  # engines: pick gpu-b
        assert app.selected_engine == "gpu-b" and rows(app, "tenants") == []
        assert "block size 32" in str(app.query_one("#engine-info", Static).render())

    run_app(body)


def test_filter_and_sort() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("s")  # quota
        assert rows(app, "tenants") == ["alice", "carol", "bob"]
        await pilot.press("s")  # hit rate
        assert rows(app, "tenants") == ["alice", "carol", "bob"]
        await pilot.press("s")  # evictions caused
        assert rows(app, "tenants") == ["bob", "carol", "alice"]
        assert "evictions caused" in app.query_one("#tenants-panel").border_title
        await pilot.press("slash", "b", "o")
        assert app.query_one("#filter", Input).has_focus
        assert rows(app, "tenants") == ["bob"] and rows(app, "diagnoses", 2) == ["noisy_tenant"]
        await pilot.press("escape")
        assert not app.query_one("#filter", Input).has_focus and "filter: bo" in app.query_one(
            "#diagnoses-panel").border_title
        await pilot.press("slash", "backspace", "backspace", "enter")
        assert len(rows(app, "tenants")) == 3 and len(rows(app, "diagnoses")) == 2

    run_app(body)


def test_apply_fix_asks_first_then_calls_the_supervisor() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("tab", "tab")  # diagnoses
        assert "cap bob at 200 blocks" in str(app.query_one("#diagnosis-detail", Static).render())
        await pilot.press("f")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        await settle(pilot)
        assert fake.applied == []
        await pilot.press("f", "y")
        await settle(pilot)
        assert fake.applied == [("gpu-a", "noisy_tenant", "bob")]
        await pilot.press("down", "f")  # low_hit_rate proposes no fix: nothing to confirm
        assert not isinstance(app.screen, ConfirmScreen)

    run_app(body)


def test_revert_from_the_audit_panel() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("tab", "tab", "tab", "r")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await settle(pilot)
        assert fake.reverted == [7]

    run_app(body)


def test_fixes_need_the_admin_token() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("tab", "tab", "f")
        assert not isinstance(app.screen, ConfirmScreen) and fake.applied == []
        assert any("admin token" in n.message for n in app._notifications)

    run_app(body, fake=FakeSupervisor(admin_token=None))


def test_lost_supervisor_banner_appears_and_clears() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        banner = app.query_one("#banner", Static)
        assert not banner.has_class("lost")
        fake.down = True
        app.action_refresh()
        await settle(pilot)
        assert banner.has_class("lost") and banner.display
        assert "unreachable" in str(banner.render()) and rows(app, "engines") == ["gpu-a", "gpu-b"]  # old data kept
        fake.down = False
        app.action_refresh()
        await settle(pilot)
        assert not banner.has_class("lost") and not banner.display

    run_app(body)


def test_too_small_terminal_says_so() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        assert app.screen.has_class("too-small")
        assert "terminal too small: 60×20" in str(app.query_one("#too-small", Static).render())

    run_app(body, size=(60, 20))


def test_client_turns_network_errors_into_supervisor_unreachable(capsys: Any) -> None:
    from kvops.top import run_top
    from kvops.top.client import SupervisorClient

    client = SupervisorClient("127.0.0.1:9", timeout_s=0.5)  # discard port: nothing listens
    try:
        client.engines()
    except SupervisorUnreachable as exc:
        assert "supervisor at http://127.0.0.1:9 unreachable (GET /api/engines)" in str(exc)
    else:
        raise AssertionError("no SupervisorUnreachable")
    try:
        client.apply_fix("e", "r")
    except SupervisorRefused as exc:
        assert exc.status == 401 and "admin token" in str(exc)
    assert run_top("http://127.0.0.1:9", once=True) == 1
    assert "kvops top: supervisor at" in capsys.readouterr().err
