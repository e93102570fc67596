"""`kvops top` on a narrow terminal (100x30, and the 80x24 minimum), as an operator first ran it in tmux against a
real vLLM-CPU behind the gateway. Each test fails on the code before the fix:

- the trends' 24-column labels took the whole 25-column panel: every sparkline had no width;
- vLLM's 12 prompt-length buckets wrapped in that panel and pushed the percentiles out of it;
- the help was taller than the terminal (its borders and last lines off the screen);
- a diagnosis's detail did not scroll from the keyboard: its fix, after the evidence, was below the fold;
- the confirmation cut the fix's description at the box's edge (a Label does not wrap);
- a terminal resized while the help was open left the panels' layout as it was;
- a trend the source does not report (vLLM's swap) was drawn as a flat 0%;
- the running fix job's progress on the audit panel's border was cut to "tenant_pollution on vllm-0:…"."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from textual.containers import VerticalScroll
from textual.widgets import Static

from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.schema.histogram import Histogram
from kvops.top.app import KvopsTop
from kvops.top.render import histogram_lines
from kvops.top.screens import ConfirmScreen, DetailScreen, HelpScreen
from kvops.top.widgets.audit import AuditPanel
from kvops.top.widgets.common import Readout
from tests.helpers.fake_supervisor import FakeSupervisor

# vLLM 0.32's prompt-length buckets, every prompt between 100 and 200 tokens (the operator's two tenants)
VLLM_PROMPTS = Histogram(buckets=[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0],
                         counts=[0, 0, 0, 0, 0, 0, 0, 349, 0, 0, 0, 0], sum=52_000.0, count=349,
                         p50=150.0, p95=195.0, p99=199.0)


def run_at(size: tuple[int, int], body: Callable[[Any, KvopsTop, FakeSupervisor], Awaitable[None]],
           fake: FakeSupervisor | None = None) -> None:
    fake = fake or FakeSupervisor()

    async def main() -> None:
        app = KvopsTop(fake, interval_s=60)
        async with app.run_test(size=size) as pilot:
            await pilot.app.workers.wait_for_complete()
            await pilot.pause()
            await body(pilot, app, fake)

    asyncio.run(main())


def test_the_sparklines_have_room_at_100_columns() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        for key in ("kv_usage", "hit_rate", "ttft"):
            assert app.query_one(f"#spark-{key}").size.width >= 15
        assert "KV usage 4%" in str(app.query_one("#kv_usage-label", Readout).render())
        assert app.screen.has_class("narrow")

    run_at((100, 30), body)


def test_a_short_histogram_box_shows_the_percentiles_and_the_filled_buckets() -> None:
    lines = histogram_lines(VLLM_PROMPTS, width=16, fit=(23, 7))
    assert lines == ["p50 150  p95 195  p99 199  (n=349)", "≤200 " + "█" * 14 + " 349"]  # 23 columns
    # A box tall enough keeps every bucket, percentiles last, as on a wide terminal.
    assert len(histogram_lines(VLLM_PROMPTS, width=16, fit=(40, 16))) == 13
    assert histogram_lines(VLLM_PROMPTS, width=16)[-1].startswith("p50 150")


def test_the_help_fits_the_terminal_and_scrolls() -> None:
    for size in ((100, 30), (80, 24)):
        async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor, size: tuple[int, int] = size) -> None:
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            box = app.screen.query_one("#help")
            assert box.region.y >= 0 and box.region.bottom <= size[1] and box.region.right <= size[0]
            assert isinstance(box, VerticalScroll)
            if box.max_scroll_y > 0:  # the 80x24 one: the keyboard reaches its end
                await pilot.press("end")
                await pilot.pause()
                assert box.scroll_y == box.max_scroll_y
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)

        run_at(size, body)


def test_a_long_diagnosis_detail_scrolls_from_the_keyboard() -> None:
    fake = FakeSupervisor()
    fix = Fix(kind=FixKind.GATEWAY, action="set_gateway_policy", params={"tenant": "batch", "tokens_per_minute": 1236},
              description="limit gateway tenant 'batch' to 1236 tokens a minute (it sent about 4946 a minute in the "
                          "window): fewer of its blocks stored, fewer of the other tenants' cached prefixes pushed out")
    evidence: dict[str, Any] = {f"field_{i}": i for i in range(16)}
    fake.diags = [Diagnosis(rule="tenant_pollution", engine="gpu-a", subject="tenant:batch",
                            severity=Severity.WARNING, title="Tenant pollution", summary="batch floods the cache",
                            evidence=evidence, fix=fix)]

    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("tab", "tab", "enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailScreen)
        box = app.screen.query_one("#detail", VerticalScroll)
        assert box.max_scroll_y > 0  # the fix is below the fold
        await pilot.press("pagedown", "pagedown")
        await pilot.pause()
        assert box.scroll_y == box.max_scroll_y
        await pilot.press("escape", "f")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        question = app.screen.query_one("#question", Static)
        assert question.size.height >= 3  # the description wraps: all of it is on the screen
        assert "cached prefixes pushed out" in str(question.render())

    run_at((100, 30), body, fake)


def test_resizing_under_the_help_lays_the_panels_out_for_the_new_size() -> None:
    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        await pilot.press("question_mark")
        await pilot.resize_terminal(70, 20)  # the classes went to the help screen, not the panels' one
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen.has_class("too-small")
        await pilot.press("question_mark")
        await pilot.resize_terminal(100, 30)
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        assert not app.screen.has_class("too-small") and app.screen.has_class("narrow")

    run_at((160, 50), body)


def test_a_trend_the_source_does_not_report_says_so() -> None:
    fake = FakeSupervisor()
    for snap in fake.snaps["gpu-a"]:
        snap.source, snap.unknown = "vllm", ["swap"]

    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        assert "swap rate not reported" in str(app.query_one("#swap_rate-label", Readout).render())
        assert not app.query_one("#spark-swap_rate").display
        assert "KV usage 4%" in str(app.query_one("#kv_usage-label", Readout).render())

    run_at((160, 50), body, fake)


def test_the_fix_jobs_progress_fits_the_audit_panels_border() -> None:
    fake = FakeSupervisor()
    fake.jobs = [{"rule": "tenant_pollution", "engine": "vllm-0", "state": "verifying",
                  "progress": "verifying 76/180 s"}]

    async def body(pilot: Any, app: KvopsTop, fake: FakeSupervisor) -> None:
        panel = app.query_one(AuditPanel)
        assert str(panel.border_subtitle) == "verifying 76/180 s"  # the rule is in the row above
        assert len(str(panel.border_subtitle)) <= panel.size.width - 6

    run_at((100, 30), body, fake)
    # Where it fits, all of it.
    run_at((160, 50), lambda pilot, app, fake: _subtitle_is(app, "tenant_pollution on vllm-0: verifying 76/180 s"),
           fake)


async def _subtitle_is(app: KvopsTop, text: str) -> None:
    assert str(app.query_one(AuditPanel).border_subtitle) == text
