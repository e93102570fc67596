"""The prompt-length histogram of the highlighted engine, with p50/p95/p99 (in the trends box)."""

from __future__ import annotations

from rich.text import Text

from kvops.schema.snapshot import Histogram
from kvops.top.client import EngineView
from kvops.top.render import histogram_lines
from kvops.top.widgets.common import Readout

BAR_WIDTH = 16


class PromptLengths(Readout):
    """Drawn at its own size at every paint (a resize included): the bars fit the box's width, and a box shorter
    than the buckets shows the filled ones (render.histogram_lines)."""

    def __init__(self) -> None:
        super().__init__(id="histogram")
        self.histogram: Histogram | None = None

    def show_engine(self, view: EngineView | None) -> None:
        histogram = view.latest.prompt_lengths if view is not None and view.latest is not None else None
        if histogram != self.histogram:
            self.histogram = histogram
            self.refresh()

    def render(self) -> Text:
        if self.histogram is None:
            return Text("")
        # One row for the heading; the box's size is 0 x 0 before its first layout.
        fit = (self.size.width, self.size.height - 1) if self.size.width else None
        return Text("prompt lengths\n" + "\n".join(histogram_lines(self.histogram, width=BAR_WIDTH, fit=fit)))
