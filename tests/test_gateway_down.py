"""The `gateway_down` rule (a pure function of the engine's history: what the gateway's manager recorded in
`history.gateway`) and how `kvops top`'s engines panel shows an engine whose gateway is down: not as healthy."""

from __future__ import annotations

import asyncio

from textual.widgets import DataTable, Static

from kvops.history import EngineHistory, GatewayRecord
from kvops.rules import RULES, evaluate_all
from kvops.rules.gateway_down import Settings, evaluate
from kvops.schema.engines import EngineEntry, EngineExit, GatewayLink
from kvops.top.app import KvopsTop
from kvops.top.screens import DetailScreen
from kvops.top.widgets.common import Readout
from tests.helpers.fake_supervisor import FakeSupervisor

T0 = 1_700_000_000.0
LOG = "/var/lib/kvops/gateway-chat.log"
REFUSED = "kvops: error: /etc/kvops/keys line 3: the key of tenant 'team-b' must be at least 16 printable ASCII"


def _history(code: int | None, stopped: str = "", at: float = T0, down: bool = True) -> EngineHistory:
    record = GatewayRecord(log=LOG)
    if code is not None:
        record.record_exit(EngineExit(t=at, exit_code=code, signal=None, stderr_tail=("starting", REFUSED)))
    record.stopped = stopped
    if not down:
        record.down_since = None  # started again
    history = EngineHistory("chat")
    history.gateway = record
    return history


def test_a_gateway_that_refused_its_configuration_is_critical_with_the_reason() -> None:
    [d] = evaluate(_history(2, "it refused its configuration (exit code 2)"), Settings(), T0)
    assert d.rule == "gateway_down" and d.severity == "critical" and d.engine == "chat"
    assert "exit code 2" in d.summary and "keys line 3" in d.summary
    assert d.evidence["last_exit_code"] == 2 and d.evidence["log"] == LOG and REFUSED in str(d.evidence["last_lines"])
    assert d.fix is not None and "--check-config" in d.fix.description and "/api/engines/chat/resume" in (
        d.fix.description)


def test_a_crash_loop_says_to_read_the_log() -> None:
    [d] = evaluate(_history(1, "crash loop: 5 exits in 300 s"), Settings(), T0 + 1)
    assert "crash loop" in d.summary and d.fix is not None and LOG in d.fix.description
    assert "--check-config" not in d.fix.description


def test_a_restart_that_is_due_fires_only_after_min_down_s() -> None:
    history = _history(1)  # exited, a restart due
    assert evaluate(history, Settings(), T0 + 5) == []
    [d] = evaluate(history, Settings(), T0 + 12)
    assert "down for 12 s" in d.summary and d.evidence["stopped"] == ""


def test_a_running_gateway_or_none_gives_no_diagnosis() -> None:
    assert evaluate(_history(1, down=False), Settings(), T0 + 100) == []  # started again since
    assert evaluate(_history(None), Settings(), T0) == []
    assert evaluate(EngineHistory("chat"), Settings(), T0) == []  # no gateway kvops runs


def test_it_is_registered_and_runs_with_the_others() -> None:
    assert RULES["gateway_down"].clear_for_s == 0.0
    found = evaluate_all(_history(2, "it refused its configuration (exit code 2)"), None, T0)
    assert [d.rule for d in found] == ["gateway_down"]


# ----------------------------------------------------------------- kvops top


class GatewayDown(FakeSupervisor):
    def engines(self) -> list[EngineEntry]:
        self._check()
        link = GatewayLink(url="http://127.0.0.1:9500", managed=True, pid=None, starts=1, exits=1,
                           last_exit="exit code 2", stopped="it refused its configuration (exit code 2)",
                           last_lines=[REFUSED], log=LOG)
        return [EngineEntry(name=name, url=f"http://{name}", up=True, pid=1, gateway=link if name == "gpu-a" else None)
                for name in self.snaps]


def test_top_shows_the_engine_of_a_down_gateway_as_down_with_the_reason() -> None:
    async def main() -> None:
        app = KvopsTop(GatewayDown(), interval_s=60)
        async with app.run_test(size=(160, 50)) as pilot:
            await app.workers.wait_for_complete()
            await pilot.pause()
            table = app.query_one("#engines", DataTable)
            health = {str(table.get_row_at(i)[0]): str(table.get_row_at(i)[1]) for i in range(table.row_count)}
            assert health == {"gpu-a": "GATEWAY DOWN", "gpu-b": "up"}
            info = str(app.query_one("#engine-info", Readout).render())
            assert "GATEWAY DOWN" in info and "gateway exit code 2" in info
            await pilot.press("enter")
            assert isinstance(app.screen, DetailScreen)
            detail = str(app.screen.query_one("#detail-body", Static).render())
            assert "refused its configuration" in detail and REFUSED in detail and LOG in detail

    asyncio.run(main())
