"""The pieces every panel of `kvops top` is built from: a text box that repaints cheaply, a bordered
panel, a table that keeps its cursor across refreshes, and the filter both filterable panels share."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import DataTable

from kvops.top.screens import DetailScreen

# One table row: its key (what the cursor follows across refreshes) and its cells.
Row = tuple[str, tuple[Any, ...]]
# What `enter` on a row opens: the detail screen's title and body.
Detail = tuple[str, Text]


class Readout(Widget):
    """Text in a box whose size the CSS fixes. A new text repaints it without the layout pass a
    Static asks for on every update, which would be most of a refresh.

    `grows`: the CSS gives this box `height: auto` instead, so a new text also asks for a layout
    pass (its height may change); for text that changes rarely and must not be cut off."""

    def __init__(self, *, id: str, classes: str | None = None, grows: bool = False) -> None:
        super().__init__(id=id, classes=classes)
        self.content: Text | str = ""
        self.grows = grows

    def render(self) -> Text:
        return Text.from_markup(self.content) if isinstance(self.content, str) else self.content

    def show(self, content: Text | str) -> None:
        if content != self.content:
            self.content = content
            self.refresh(layout=self.grows)


class Panel(Vertical):
    """A bordered box with a title."""

    def __init__(self, title: str, *children: Widget, id: str | None = None) -> None:
        super().__init__(*children, id=id)
        self.border_title = title


class RowTable(DataTable[Any]):
    """A row-cursor table refilled on every refresh. `fill` leaves it alone when the rows did not
    change (a clear and refill would repaint it and lose the scroll position) and otherwise keeps
    the cursor on the same row key when that row is still there."""

    def __init__(self, *, id: str) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self.shown: list[Row] = []

    def fill(self, rows: list[Row]) -> None:
        if rows == self.shown:
            return
        self.shown = rows
        current = self.selected_key()
        self.clear()
        for key, cells in rows:
            self.add_row(*cells, key=key)
        keys = [key for key, _ in rows]
        if current in keys:
            self.move_cursor(row=keys.index(current), animate=False)

    def selected_key(self) -> str | None:
        """The key of the row under the cursor, or None for an empty table."""
        if self.row_count == 0:
            return None
        row = min(self.cursor_row, self.row_count - 1)
        return self.coordinate_to_cell_key((row, 0)).row_key.value


class TablePanel(Panel):
    """A panel around a `RowTable` whose `enter` opens the selected row's detail (`detail`)."""

    def detail(self, key: str) -> Detail | None:
        """Title and body of the detail screen for the row `key`; None opens nothing."""
        return None

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        found = self.detail(str(event.row_key.value))
        if found is not None:
            self.app.push_screen(DetailScreen(*found))


def matches(needle: str, *fields: str) -> bool:
    """The `/` filter: a case-insensitive substring of any field; an empty filter matches all."""
    needle = needle.lower()
    return not needle or any(needle in field.lower() for field in fields)


def filter_suffix(needle: str) -> str:
    """What a filtered panel adds to its title."""
    return f" (filter: {needle})" if needle else ""
