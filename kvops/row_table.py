"""A Textual table refilled on every refresh that keeps its cursor: the panels of `kvops top` (kvops.top.widgets)
and the fleet's table (kvops.fleet.app) both show one. It sits below both because the fleet, which doctor reads
too, may not import `kvops top`; it imports only Textual."""

from __future__ import annotations

from typing import Any

from textual.widgets import DataTable

# One table row: its key (what the cursor follows across refreshes) and its cells.
Row = tuple[str, tuple[Any, ...]]


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
