"""The pieces every panel of `kvops top` is built from: a text box that repaints cheaply, a bordered
panel, a panel around a table (the table itself, which the fleet view uses too, is kvops.row_table), and the
filter both filterable panels share."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import DataTable

from kvops.top.screens import DetailScreen

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
