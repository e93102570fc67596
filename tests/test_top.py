"""`kvops top`: the block-map layout (pure), the text renderings, and the Textual app driven by a pilot.

The app tests run against `FakeSupervisor` (tests/helpers/fake_supervisor.py), a small in-process object
with the same interface as `kvops.top.client.SupervisorClient`, fed with `tests/helpers/synthetic.py`
snapshots. It stands in for the supervisor's HTTP API, which test_supervisor.py and
test_top_embedded.py cover end to end; here only the app's behaviour is under test (navigation,
filter, sort, details, applying and reverting fixes, the lost-supervisor banner).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from textual.widgets import DataTable, Input, Static

from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Fix, FixKind
from kvops.schema.engines import EngineEntry
from kvops.schema.snapshot import Snapshot, decode_block_map, encode_owner_map
from kvops.top.app import KvopsTop
from kvops.top.bench import synthetic_codes
from kvops.top.block_grid import aggregate, aggregate_owners, layout, layout_owners, render_rows
from kvops.top.client import Poller, SupervisorRefused, SupervisorUnreachable
from kvops.top.render import histogram_lines, render_json, render_once, series
from kvops.top.screens import ConfirmScreen, DetailScreen
from kvops.top.widgets.audit import collapse
from kvops.top.widgets.common import Readout
from kvops.top.widgets.log import LogPanel
from tests.helpers.fake_supervisor import FakeSupervisor
from tests.helpers.synthetic import T0, on_gpu, snapshot

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
        assert "1 cell = 1 block" in str(app.query_one("#map-legend", Readout).render())
        assert rows(app, "tenants") == ["alice", "carol", "bob"]  # by blocks held
        assert app.focused.id == "engines"
        focus = []
        for _ in range(3):
            await pilot.press("tab")
            focus.append(app.focused.id)
        assert focus == ["tenants", "diagnoses", "audit"]
        await pilot.press("shift+tab", "shift+tab", "shift+tab", "down")  # engines: pick gpu-b
        assert app.selected_engine == "gpu-b" and rows(app, "tenants") == []
        assert "block size 32" in str(app.query_one("#engine-info", Readout).render())

    run_app(body)


def test_filter_and_sort() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("s", "s")  # blocks owned, then quota
        assert rows(app, "tenants") == ["alice", "carol", "bob"]
        await pilot.press("s")  # hit rate
        assert rows(app, "tenants") == ["alice", "carol", "bob"]
        await pilot.press("s")  # evictions caused
        assert rows(app, "tenants") == ["bob", "carol", "alice"]
        assert "evictions caused ↓" in app.query_one("#tenants-panel").border_title
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
        assert "cap bob at 200 blocks" in str(app.query_one("#diagnosis-detail", Readout).render())
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
    assert run_top("http://127.0.0.1:9", once=True) == 2  # nothing answers: what to do instead, exit 2
    assert "kvops top: no kvops supervisor answers at http://127.0.0.1:9 (connection refused)" in \
        capsys.readouterr().err


def test_clicking_a_column_header_sorts_and_a_second_click_reverses() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        table = app.query_one("#tenants", DataTable)
        suffered = list(table.columns)[6]
        table.post_message(DataTable.HeaderSelected(table, suffered, 6, table.columns[suffered].label))
        await pilot.pause()
        assert rows(app, "tenants") == ["alice", "carol", "bob"]  # 50, 5, 0 suffered
        await pilot.click("#tenants", offset=(2, 0))  # the "tenant" header: by name, A to Z
        assert rows(app, "tenants") == ["alice", "bob", "carol"]
        await pilot.click("#tenants", offset=(2, 0))
        assert rows(app, "tenants") == ["carol", "bob", "alice"]
        assert "name Z-A" in app.query_one("#tenants-panel").border_title

    run_app(body)


def test_enter_shows_the_detail_of_the_selected_row() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("tab", "tab", "enter")  # diagnoses: noisy_tenant
        assert isinstance(app.screen, DetailScreen)
        body_text = str(app.screen.query_one("#detail-body", Static).render())
        assert "evictions_caused: 70" in body_text and "set_tenant_quota" in body_text
        await pilot.press("escape")
        assert not isinstance(app.screen, DetailScreen)
        await pilot.press("shift+tab", "enter")  # tenants: alice, by blocks held
        assert "quota 400 blocks" in str(app.screen.query_one("#detail-body", Static).render())
        await pilot.press("escape", "shift+tab", "enter")  # engines: gpu-a
        assert "block size 16" in str(app.screen.query_one("#detail-body", Static).render())

    run_app(body)


def test_tenant_view_of_the_block_map() -> None:
    fake = FakeSupervisor()
    owners = ["alice"] * 30 + ["bob"] * 10 + [None] * 984
    encoded, names = encode_owner_map(owners)
    for snap in fake.snaps["gpu-a"]:
        snap.blocks.owner_map, snap.blocks.owners = encoded, names

    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("t")
        assert "block map: tenants" in app.query_one("#map-panel").border_title
        legend = str(app.query_one("#map-legend", Readout).render())
        assert "a alice 30" in legend and "b bob 10" in legend and "no owner 984" in legend
        assert str(app.query_one("#block-map", Readout).render()).startswith("a" * 30 + "b" * 10)
        await pilot.press("t")
        assert "free 900" in str(app.query_one("#map-legend", Readout).render())

    run_app(body, fake=fake)


def test_owner_cells_show_the_tenant_owning_most_blocks() -> None:
    assert aggregate_owners("aab.", 4) == "a"
    assert aggregate_owners("....", 2) == ".."
    assert aggregate_owners(".b..a", 5) == "b"  # a tie goes to the first seen
    grid = layout_owners("a" * 16_384, width=120, height=20)
    assert grid.blocks_per_cell == 7 and set("".join(grid.rows)) == {"a"}


def test_log_panel_follows_the_selected_engine() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        log = str(app.query_one("#log", Readout).render())
        assert "gpu-a: preempted 2 sequences" in log and "gpu-a: request failed" in log
        await pilot.press("down")  # engines: gpu-b
        await settle(pilot)
        assert "gpu-b: engine started" in str(app.query_one("#log", Readout).render())
        assert fake.log_requests[-1] == "gpu-b"
        await pilot.press("l")
        assert not app.query_one("#log-panel").display
        requests = len(fake.log_requests)
        app.action_refresh()
        await settle(pilot)
        assert len(fake.log_requests) == requests  # hidden: not fetched

    run_app(body)


def test_the_log_filter_shows_only_the_lines_with_its_text_and_level() -> None:
    def log_text(app: KvopsTop) -> str:
        return str(app.query_one("#log", Readout).render())

    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        panel = app.query_one(LogPanel)
        assert panel.border_title == "log: gpu-a (l hides)"
        await pilot.press("backslash", *"PREEMPTED")  # any case
        assert app.query_one("#log-filter", Input).has_focus
        shown = log_text(app)
        assert "gpu-a: preempted 2 sequences" in shown and "engine started" not in shown and "failed" not in shown
        await pilot.press("enter")
        assert not app.query_one("#log-filter", Input).has_focus and app.focused.id == "engines"
        assert panel.border_title == "log: gpu-a (filter: PREEMPTED; l hides)"
        assert panel.lines_wanted == 500  # a filter searches the supervisor's whole tail
        await pilot.press("backslash", "x")
        assert log_text(app) == "none of the last 3 lines passes the filter"
        await pilot.press(*["backspace"] * 10, "escape")  # empty: no text filter
        assert "engine started" in log_text(app) and panel.border_title == "log: gpu-a (l hides)"
        await pilot.press("w")  # warnings and up
        shown = log_text(app)
        assert "preempted" in shown and "request failed" in shown and "engine started" not in shown
        assert panel.border_title == "log: gpu-a (warnings and up; l hides)"
        await pilot.press("w")  # errors and up
        assert "request failed" in log_text(app) and "preempted" not in log_text(app)
        await pilot.press("w")  # all again
        assert "engine started" in log_text(app) and panel.border_title == "log: gpu-a (l hides)"

    run_app(body)


def test_the_log_filter_keys_show_a_hidden_log() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("l")
        assert not app.query_one("#log-panel").display
        await pilot.press("w")
        await settle(pilot)
        assert app.query_one("#log-panel").display and "engine started" not in str(
            app.query_one("#log", Readout).render())

    run_app(body)


def test_a_starting_engine_says_what_it_waits_for() -> None:
    class Starting(FakeSupervisor):
        def engines(self) -> list[EngineEntry]:
            self._check()
            return [EngineEntry(name="gpu-c", url="http://127.0.0.1:8123", managed=True, up=False, pid=77,
                                started_at=time.time() - 12, last_log="loading weights from model.safetensors")]

    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        info = str(app.query_one("#engine-info", Readout).render())
        assert "gpu-c: starting (pid 77), 0m1" in info  # 12 s and counting
        assert "waiting for http://127.0.0.1:8123/health" in info
        assert "engine: loading weights from model.safetensors" in info

    fake = Starting()
    fake.snaps = {}
    run_app(body, fake=fake)


def test_an_embedded_supervisor_that_is_not_up_yet_is_not_lost() -> None:
    fake = FakeSupervisor()
    fake.down = True

    async def main() -> None:
        app = KvopsTop(fake, interval_s=60, starting="starting the supervisor (pid 99)")
        async with app.run_test(size=(160, 50)) as pilot:
            await settle(pilot)
            assert not app.query_one("#banner", Static).has_class("lost")
            assert "starting the supervisor (pid 99)" in str(app.query_one("#engine-info", Readout).render())
            fake.down = False
            app.action_refresh()
            await settle(pilot)
            assert rows(app, "engines") == ["gpu-a", "gpu-b"]
            fake.down = True  # once it has answered, losing it is news
            app.action_refresh()
            await settle(pilot)
            assert app.query_one("#banner", Static).has_class("lost")

    asyncio.run(main())


def test_latency_series_are_interval_means() -> None:
    history = [snapshot(T0 + i, requests={"ttft_seconds_sum": 0.5 * i, "ttft_count": i,
                                          "itl_seconds_sum": 0.02 * 10 * i, "itl_count": 10 * (i // 2)})
               for i in range(4)]
    data = series(history)
    assert data["ttft"] == [0.5, 0.5, 0.5]
    # intervals with no new tokens carry the last mean over (0 before the first)
    assert data["itl"] == pytest.approx([0.0, 0.02, 0.02])


def test_an_external_server_without_block_states_says_so() -> None:
    fake = FakeSupervisor()
    for snap in fake.snaps["gpu-a"]:
        snap.source, snap.blocks.state_map, snap.blocks.usage = "vllm", "", 0.42

    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        shown = str(app.query_one("#block-map", Readout).render())
        assert "a vllm server: its /metrics has no per-block states" in shown and "KV usage 42%" in shown

    run_app(body, fake=fake)


# ----------------------------------------------------------------- audit: each action once


def test_collapse_keeps_one_row_per_engine_rule_subject_action_and_fix_change() -> None:
    def fix(blocks: int) -> Fix:
        return Fix(kind=FixKind.ADMIN, action="set_tenant_quota", params={"tenant": "bob", "blocks": blocks},
                   description=f"cap bob at {blocks} blocks (measured at {T0})")  # prose is not the change

    def entry(i: int, action: str = "proposed", subject: str = "bob", blocks: int = 200) -> AuditEntry:
        return AuditEntry(id=i, time=T0 + i, engine="gpu-a", rule="noisy_tenant", subject=subject,
                          action=action, fix=fix(blocks))

    entries = [entry(1), entry(2, subject="carol"), entry(3), entry(4, blocks=300), entry(5), entry(6, "applied")]
    rows = collapse(entries)
    assert [(r.latest.id, r.count) for r in rows] == [(6, 1), (5, 3), (4, 1), (2, 1)]  # newest first
    assert [e.id for e in rows[1].entries] == [5, 3, 1]
    assert collapse([]) == []


def test_the_audit_panel_shows_a_repeated_proposal_once() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        # FakeSupervisor's log: "proposed" #4, #5, #6 for the same fix (the diagnosis came back
        # twice), then #7 "applied"
        assert rows(app, "audit") == ["7", "6"]
        assert rows(app, "audit", 2) == ["applied", "proposed ×3"]
        assert rows(app, "audit", 1)[1] == time.strftime("%H:%M:%S", time.localtime(T0 - 20))  # the latest
        await pilot.press("tab", "tab", "tab", "down", "enter")
        body_text = str(app.screen.query_one("#detail-body", Static).render())
        assert "recorded 3 times: #6" in body_text and "#5" in body_text and "#4" in body_text

    run_app(body)


def test_a_diagnosis_summary_shows_in_full() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("tab", "tab")  # diagnoses: noisy_tenant, whose summary is wider than the panel
        summary = fake.diags[0].summary
        table = app.query_one("#diagnoses", DataTable)
        assert len(summary) > table.content_size.width  # the table's column cannot show it whole
        detail = app.query_one("#diagnosis-detail", Readout)
        text = detail.render()
        assert summary in text.plain
        lines = text.wrap(app.console, detail.content_size.width)
        assert len(lines) <= detail.content_size.height  # wrapped, every line has room: nothing cut off
        assert any("lost 35% hit rate" in str(line) for line in lines)

    run_app(body)


def test_the_engine_info_shows_its_gpu_on_one_line() -> None:
    fake = FakeSupervisor()
    fake.snaps["gpu-a"] = [snapshot(T0 - 10 + i, **on_gpu(utilization=37.0, used=80 * 2**30, total=141 * 2**30,
                                                         kvops=60 * 2**30)) for i in range(11)]

    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        info = str(app.query_one("#engine-info", Readout).render())
        assert info.splitlines()[-1] == "gpu0 37% kvops 60G other 20G free 61G"
        await pilot.press("down")  # gpu-b: a CPU engine says why it has no GPU facts instead of zeros
        assert str(app.query_one("#engine-info", Readout).render()).splitlines()[-1] == "gpu: no GPU"

    run_app(body, fake=fake)
