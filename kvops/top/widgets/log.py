"""The log panel: the last lines of the highlighted engine's log (warnings yellow, errors red) and
the supervisor's notes on it, as many as the box holds. `l` shows or hides it; hidden, the app
does not fetch the log at all."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.events import Resize

from kvops.schema.engines import LogLine
from kvops.top.client import EngineView
from kvops.top.widgets.common import Panel, Readout

LOG_COLOURS = {"warning": "yellow", "error": "bold red", "critical": "bold red", "debug": "dim"}


class LogPanel(Panel):
    def __init__(self) -> None:
        super().__init__("log", id="log-panel")
        self.view: EngineView | None = None
        self.lines: list[LogLine] = []

    def compose(self) -> ComposeResult:
        yield Readout(id="log")

    def on_resize(self, _event: Resize) -> None:
        # How many lines fit is known once the new size is laid out.
        self.call_after_refresh(self.redraw)

    @property
    def shown(self) -> bool:
        return not self.has_class("hidden")

    def set_shown(self, shown: bool) -> None:
        self.set_class(not shown, "hidden")

    def show_title(self, name: str | None) -> None:
        """The title names the engine whose log this is (its lines come with the next poll)."""
        self.border_title = f"log: {name or '-'} (l hides)"

    def show_log(self, view: EngineView | None, lines: list[LogLine]) -> None:
        self.view, self.lines = view, lines
        self.redraw()

    def redraw(self) -> None:
        if not self.shown:
            return
        widget = self.query_one("#log", Readout)
        view = self.view
        if view is not None and not view.entry.managed and not self.lines:
            widget.show(Text(f"{view.entry.name} is watched, not managed: its log is wherever it was started",
                             style="dim"))
            return
        height = max(1, widget.content_size.height or 7)
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, line in enumerate(self.lines[-height:]):
            if i:
                text.append("\n")
            text.append(time.strftime("%H:%M:%S ", time.localtime(line.time)), style="dim")
            text.append(line.text, style=LOG_COLOURS.get(line.level, ""))
        widget.show(text)
