"""The prompt-length histogram of the highlighted engine, with p50/p95/p99 (in the trends box)."""

from __future__ import annotations

from kvops.top.client import EngineView
from kvops.top.render import histogram_lines
from kvops.top.widgets.common import Readout


class PromptLengths(Readout):
    def __init__(self) -> None:
        super().__init__(id="histogram")

    def show_engine(self, view: EngineView | None) -> None:
        if view is None or view.latest is None:
            self.show("")
            return
        self.show("prompt lengths\n" + "\n".join(histogram_lines(view.latest.prompt_lengths, width=16)))
