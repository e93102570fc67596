"""`kvops top --prometheus URL`: the fleet read from Prometheus, one row per engine, worst first.

`enter` on a row leaves this view with the engine and its supervisor's address (`supervisor_url`); `run_fleet`
(kvops.fleet.run) then has `kvops top` show that supervisor as `--attach` does, and comes back here when it
quits. Reading Prometheus happens on a thread worker, never on the event loop; a Prometheus that stops answering
leaves the last fleet on screen under a banner saying why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Footer, Static

from kvops.fleet.prometheus_api import PrometheusError
from kvops.fleet.render import COLUMNS, cells, summary
from kvops.fleet.view import Fleet, FleetEngine
from kvops.row_table import RowTable

STATUS_STYLE = {"supervisor down": "bold red", "engine down": "bold red", "critical": "red", "warning": "yellow",
                "info": "cyan", "ok": "green"}


class FleetTop(App[tuple[str, str] | None]):
    """Exits with (supervisor_url, engine) when a row is opened, None on quit."""

    TITLE = "kvops top — fleet"
    CSS_PATH = "fleet.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("enter", "drill_down", "open its supervisor"),
        Binding("ctrl+r", "refresh", "refresh"),
    ]

    def __init__(self, read: Callable[[], Fleet], interval_s: float = 2.0, selected: str | None = None) -> None:
        super().__init__()
        self.read = read
        self.interval_s = interval_s
        self.fleet: Fleet | None = None
        self.selected = selected  # the row key to put the cursor on once it is shown (coming back from one)
        self.lost: str | None = None
        self.reading = False

    def compose(self) -> ComposeResult:
        yield Static("", id="fleet-banner")
        yield Static("reading the fleet from Prometheus…", id="fleet-summary")
        yield RowTable(id="fleet")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(RowTable)
        table.add_columns(*COLUMNS)
        table.focus()
        self.action_refresh()
        table.set_interval(self.interval_s, self.action_refresh)

    def action_refresh(self) -> None:
        if not self.reading:
            self.reading = True
            self._read()

    @work(thread=True, group="read")
    def _read(self) -> None:
        try:
            fleet = self.read()
        except PrometheusError as exc:
            self.call_from_thread(self._lost, str(exc))
        else:
            self.call_from_thread(self.show_fleet, fleet)
        finally:
            self.reading = False

    def _lost(self, message: str) -> None:
        self.lost = message
        since = (f"; showing the fleet read at {time.strftime('%H:%M:%S', time.localtime(self.fleet.read_at))}"
                 if self.fleet else "")
        banner = self.query_one("#fleet-banner", Static)
        banner.update(f"Prometheus not readable: {message}{since}")
        banner.add_class("lost")

    def show_fleet(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.lost = None
        self.query_one("#fleet-banner", Static).remove_class("lost")
        self.query_one("#fleet-summary", Static).update(summary(fleet))
        table = self.query_one(RowTable)
        rows = []
        for engine in fleet.engines:
            row = list(cells(engine))
            row[2] = Text(row[2], style=STATUS_STYLE.get(engine.status, ""))
            rows.append((row_key(engine), tuple(row)))
        table.fill(rows)  # keeps the cursor on its row across refreshes
        keys = [key for key, _ in rows]
        if self.selected in keys:  # back from a supervisor: on the row that was opened
            table.move_cursor(row=keys.index(self.selected), animate=False)
        self.selected = None

    def selected_engine(self) -> FleetEngine | None:
        key = self.query_one(RowTable).selected_key()
        if self.fleet is None or key is None:
            return None
        return next((e for e in self.fleet.engines if row_key(e) == key), None)

    @on(DataTable.RowSelected, "#fleet")
    def _row_selected(self) -> None:
        self.action_drill_down()

    def action_drill_down(self) -> None:
        engine = self.selected_engine()
        if engine is not None:
            self.exit((engine.supervisor.url, engine.engine))


def row_key(engine: FleetEngine) -> str:
    """Unique across the fleet: two supervisors may each call their engine "default"."""
    return f"{engine.supervisor.job}/{engine.supervisor.instance}/{engine.engine}"
