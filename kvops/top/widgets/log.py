"""The log panel: the last lines of the highlighted engine's log (warnings yellow, errors bold red) and
the supervisor's notes on it, as many as the box holds. `l` shows or hides it; hidden, the app
does not fetch the log at all. `\\` filters it by text (case-insensitive), `w` by level (warnings and
up, errors and up); its title says which filter is on."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.content import Content
from textual.events import Resize

from kvops.logs import LEVELS, level_rank
from kvops.schema.engines import LogLine
from kvops.top.client import EngineView
from kvops.top.widgets.common import Panel, Readout

LOG_COLOURS = {"warning": "yellow", "error": "bold red", "critical": "bold red", "debug": "dim"}
# `w` cycles the lowest level shown: all lines, warnings and up, errors and up.
LEVEL_STEPS = ("debug", "warning", "error")
LEVEL_NAMES = {"warning": "warnings and up", "error": "errors and up"}
LINES = 100  # asked of the supervisor each refresh
FILTERED_LINES = 500  # with a filter on: the supervisor's whole tail, for the filter to search


class LogPanel(Panel):
    def __init__(self) -> None:
        super().__init__("log", id="log-panel")
        self.view: EngineView | None = None
        self.lines: list[LogLine] = []
        self.engine_name: str | None = None
        self.text_filter = ""
        self.min_level = LEVEL_STEPS[0]

    def compose(self) -> ComposeResult:
        yield Readout(id="log")

    def on_resize(self, _event: Resize) -> None:
        # How many lines fit is known once the new size is laid out.
        self.call_after_refresh(self.redraw)

    @property
    def shown(self) -> bool:
        return not self.has_class("hidden")

    @property
    def filtered(self) -> bool:
        return bool(self.text_filter) or self.min_level != LEVEL_STEPS[0]

    @property
    def lines_wanted(self) -> int:
        """How many of the engine's latest lines to fetch: more while a filter is on, so it has more to find."""
        return FILTERED_LINES if self.filtered else LINES

    def set_shown(self, shown: bool) -> None:
        self.set_class(not shown, "hidden")

    def show_title(self, name: str | None) -> None:
        """The title names the engine whose log this is (its lines come with the next poll) and the filter."""
        self.engine_name = name
        filters = [f"filter: {self.text_filter}"] if self.text_filter else []
        if self.min_level in LEVEL_NAMES:
            filters.append(LEVEL_NAMES[self.min_level])
        said = f"{', '.join(filters)}; l hides" if filters else "l hides"
        # Content, not markup: a filter is typed text, often with vLLM's brackets ("[core.py").
        self.border_title = Content(f"log: {name or '-'} ({said})")

    def set_filter(self, text: str) -> None:
        self.text_filter = text.strip()
        self._filter_changed()

    def cycle_level(self) -> str:
        """The next lowest level shown (all, warnings and up, errors and up); returns it."""
        self.min_level = LEVEL_STEPS[(LEVEL_STEPS.index(self.min_level) + 1) % len(LEVEL_STEPS)]
        self._filter_changed()
        return self.min_level

    def _filter_changed(self) -> None:
        self.show_title(self.engine_name)
        self.redraw()

    def show_log(self, view: EngineView | None, lines: list[LogLine]) -> None:
        self.view, self.lines = view, lines
        self.redraw()

    def matching(self) -> list[LogLine]:
        """The lines the filters let through, oldest first."""
        needle = self.text_filter.casefold()
        lowest = LEVELS.index(self.min_level)
        return [line for line in self.lines
                if level_rank(line.level) >= lowest and (not needle or needle in line.text.casefold())]

    def redraw(self) -> None:
        if not self.shown:
            return
        widget = self.query_one("#log", Readout)
        view = self.view
        if view is not None and not view.entry.managed and not self.lines:
            widget.show(Text(f"{view.entry.name} is watched, not managed: its log is wherever it was started",
                             style="dim"))
            return
        lines = self.matching()
        if self.filtered and self.lines and not lines:
            widget.show(Text(f"none of the last {len(self.lines)} lines passes the filter", style="dim"))
            return
        height = max(1, widget.content_size.height or 7)
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, line in enumerate(lines[-height:]):
            if i:
                text.append("\n")
            text.append(time.strftime("%H:%M:%S ", time.localtime(line.time)), style="dim")
            text.append(line.text, style=LOG_COLOURS.get(line.level, ""))
        widget.show(text)
