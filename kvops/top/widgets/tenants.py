"""The tenants panel: the highlighted engine's tenants (blocks held and owned, quota, hit rate,
evictions caused and suffered), filtered by `/` and sorted by `s` or a click on a column header."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable

from kvops.row_table import RowTable
from kvops.schema.snapshot import TenantStats
from kvops.top.client import EngineView
from kvops.top.render import fmt_pct, tenant_detail, tenant_field
from kvops.top.widgets.common import Detail, TablePanel, filter_suffix, matches


def quota_key(t: TenantStats) -> int:
    return t.quota_blocks if t.quota_blocks is not None else -1


# The tenants table: (column, what `s` and the title call it, sort key; None sorts by name, A to Z).
# Every other column sorts biggest first; `s` cycles, a click on a column header sorts by it, a
# second click reverses.
TENANT_COLUMNS: list[tuple[str, str, Callable[[TenantStats], float] | None]] = [
    ("tenant", "name", None),
    ("held", "blocks held", lambda t: t.blocks_held),
    ("owned", "blocks owned", lambda t: t.blocks_owned),
    ("quota", "quota", quota_key),
    ("hit", "hit rate", lambda t: t.hit_rate),
    ("caused", "evictions caused", lambda t: t.evictions_caused),
    ("suffered", "evictions suffered", lambda t: t.evictions_suffered),
]
DEFAULT_TENANT_SORT = 1


class TenantsPanel(TablePanel):
    def __init__(self) -> None:
        super().__init__("tenants", id="tenants-panel")
        self.view: EngineView | None = None
        self.filter_text = ""
        self.sort_column = DEFAULT_TENANT_SORT
        self.sort_reversed = False

    def compose(self) -> ComposeResult:
        yield RowTable(id="tenants")

    def on_mount(self) -> None:
        self.query_one(RowTable).add_columns(*(column for column, _, _ in TENANT_COLUMNS))
        self.show_title()

    def show_engine(self, view: EngineView | None) -> None:
        self.view = view
        self.redraw()

    def set_filter(self, needle: str) -> None:
        self.filter_text = needle
        self.show_title()
        self.redraw()

    def cycle_sort(self) -> None:
        """`s`: the next column, in its natural order."""
        self.sort_by((self.sort_column + 1) % len(TENANT_COLUMNS), reverse=False)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        # A click on the sorting column reverses it; on another column, sorts by that one.
        event.stop()
        same = event.column_index == self.sort_column
        self.sort_by(event.column_index, reverse=not self.sort_reversed if same else False)

    def sort_by(self, column: int, reverse: bool) -> None:
        self.sort_column, self.sort_reversed = column, reverse
        self.show_title()
        self.redraw()

    def show_title(self) -> None:
        _, sort_name, key = TENANT_COLUMNS[self.sort_column]
        order = ("Z-A" if self.sort_reversed else "A-Z") if key is None else ("↑" if self.sort_reversed else "↓")
        self.border_title = f"tenants by {sort_name} {order}{filter_suffix(self.filter_text)}"

    def sorted_tenants(self) -> list[tuple[str, TenantStats]]:
        view = self.view
        tenants = dict(view.latest.tenants) if view and view.latest else {}
        items = [kv for kv in tenants.items() if matches(self.filter_text, kv[0], kv[1].cache_salt)]
        _, _, key = TENANT_COLUMNS[self.sort_column]
        if key is None:
            items.sort(key=lambda kv: kv[0], reverse=self.sort_reversed)
        else:
            items.sort(key=lambda kv: (key(kv[1]), kv[0]), reverse=not self.sort_reversed)
        return items

    def redraw(self) -> None:
        s = self.view.latest if self.view else None

        def count(t: TenantStats, field: str) -> str:  # "-" where the source does not report it (a gateway's)
            return tenant_field(s, t, field) if s is not None else str(getattr(t, field))

        rows = [(name, (name, count(t, "blocks_held"), count(t, "blocks_owned"),
                        str(t.quota_blocks) if t.quota_blocks is not None else "-", fmt_pct(t.hit_rate),
                        count(t, "evictions_caused"), count(t, "evictions_suffered")))
                for name, t in self.sorted_tenants()]
        self.query_one(RowTable).fill(rows)

    def detail(self, key: str) -> Detail | None:
        view = self.view
        tenant = view.latest.tenants.get(key) if view and view.latest else None
        return None if tenant is None else (f"tenant {key}", Text(tenant_detail(key, tenant, view.latest)))
