"""The block map panel: the highlighted engine's KV blocks, one glyph per cell, by state or (`t`) by
the tenant owning each block, and a legend. The layout itself is kvops.top.block_grid (pure). For a vLLM whose
KV cache events kvops reads, the map comes from the events instead (widgets/event_map.py): by age, tenant or
medium (`t` cycles), with the events' numbers below it."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.events import Resize

from kvops.schema.snapshot import decode_block_map
from kvops.top import block_grid as grids
from kvops.top.client import EngineView
from kvops.top.render import fmt_pct
from kvops.top.widgets import event_map
from kvops.top.widgets.common import Panel, Readout


class BlockMapPanel(Panel):
    def __init__(self) -> None:
        super().__init__("block map", id="map-panel")
        self.by_tenant = False
        self.event_view = 0  # the view of an engine with events: an index into event_map.EVENT_VIEWS
        self.view: EngineView | None = None

    def compose(self) -> ComposeResult:
        yield Readout(id="block-map")
        yield Readout(id="map-legend")
        yield event_map.EventStats()

    @property
    def has_events(self) -> bool:
        return self.view is not None and self.view.latest is not None and self.view.latest.kv_events is not None

    def on_mount(self) -> None:
        self.show_title()

    def on_resize(self, _event: Resize) -> None:
        # The grid fills the box: its cells are counted again once the new size is laid out.
        self.call_after_refresh(self.redraw)

    def toggle_view(self) -> None:
        if self.has_events:
            self.event_view = (self.event_view + 1) % len(event_map.EVENT_VIEWS)
        else:
            self.by_tenant = not self.by_tenant
        self.show_title()
        self.redraw()

    def show_title(self) -> None:
        if self.has_events:
            views = event_map.EVENT_VIEWS
            now, then = views[self.event_view], views[(self.event_view + 1) % len(views)]
            self.border_title = f"block map from KV events: by {now} (t: {then})"
            return
        view = "tenants (t: states)" if self.by_tenant else "states (t: tenants)"
        self.border_title = f"block map: {view}"

    def show_engine(self, view: EngineView | None) -> None:
        self.view = view
        # The events' numbers take room from the map only for an engine that has them (top.tcss); when that
        # changes, the map is drawn again once its new size is laid out.
        if self.has_class("events") != self.has_events:
            self.set_class(self.has_events, "events")
            self.call_after_refresh(self.redraw)
        self.show_title()
        self.query_one(event_map.EventStats).show_engine(view)
        self.redraw()

    def redraw(self) -> None:
        view = self.view
        widget = self.query_one("#block-map", Readout)
        legend_widget = self.query_one("#map-legend", Readout)
        if view is None or view.latest is None:
            widget.show("")
            legend_widget.show("")
            return
        s = view.latest
        if s.kv_events is not None:
            width, height = max(1, widget.content_size.width or 40), max(1, widget.content_size.height or 10)
            text, legend = event_map.draw(s.kv_events, s.blocks, event_map.EVENT_VIEWS[self.event_view], width,
                                          height)
            widget.show(text)
            legend_widget.show(legend)
            return
        if not s.blocks.state_map:  # a vLLM or SGLang server read through kvops.adapters
            widget.show(Text(f"a {s.source} server: its /metrics has no per-block states\n"
                             f"KV usage {fmt_pct(s.blocks.usage)}", style="dim"))
            legend_widget.show("")
            return
        width = max(1, widget.content_size.width or 40)
        host_line = bool(s.swap.host_state_map) and not self.by_tenant
        height = max(1, (widget.content_size.height or 10) - (1 if host_line else 0))
        if self.by_tenant:
            owners = decode_block_map(s.blocks.owner_map) if s.blocks.owner_map else ""
            if not owners:
                widget.show(Text("this engine reports no block owners (an older kvops engine)", style="dim"))
                legend_widget.show("")
                return
            grid = grids.layout_owners(owners, width, height)
            text = grids.render_owner_rows(grid.rows)
            legend = grids.owner_legend(s.blocks.owners, owners)
        else:
            grid = grids.layout(decode_block_map(s.blocks.state_map), width, height)
            text = grids.render_rows(grid.rows)
            legend = grids.legend(s.blocks.counts)
            if host_line:
                host = grids.layout(decode_block_map(s.swap.host_state_map), max(1, width - 6), 1)
                text.append("\nhost  ")
                text.append_text(grids.render_rows(host.rows[:1]))
        widget.show(text)
        legend.append(f"\n{grid.scale} ({grid.total_blocks} blocks)  usage {fmt_pct(s.blocks.usage)}", style="dim")
        legend_widget.show(legend)
