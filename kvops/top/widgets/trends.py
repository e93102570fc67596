"""The trends panel: sparklines over the last two minutes of the highlighted engine (KV usage, hit
rate, swap rate, throughput, TTFT, ITL), each labelled with its latest value and the window's
maximum; the prompt-length histogram (widgets/prompt_lengths.py) sits below them in the same box."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Sparkline

from kvops.top.client import EngineView
from kvops.top.render import fmt_pct, fmt_seconds, series
from kvops.top.widgets.common import Panel, Readout
from kvops.top.widgets.prompt_lengths import PromptLengths

# (key in render.series, label)
TRENDS = (("kv_usage", "KV usage"), ("hit_rate", "hit rate"), ("swap_rate", "swap rate"),
          ("throughput", "throughput"), ("ttft", "TTFT"), ("itl", "ITL"))
# The snapshot field each trend is drawn from: one its source does not report is said so, not drawn as zeros
# (vLLM has no swap: its "swap rate 0%" read as a healthy pool).
SOURCES = {"kv_usage": "blocks.usage", "hit_rate": "prefix_cache.hit_rate", "swap_rate": "swap",
           "throughput": "requests.generation_tokens_total", "ttft": "ttft", "itl": "itl"}


def trend_label(key: str, values: list[float]) -> str:
    """The latest value and the window's maximum (`↑`), which is the sparkline's scale."""
    if not values:
        return "-"
    last, top = values[-1], max(values)
    if key == "throughput":
        return f"{last:.0f} tok/s ↑{top:.0f}"
    if key in ("ttft", "itl"):
        return f"{fmt_seconds(last)} ↑{fmt_seconds(top)}"
    return f"{fmt_pct(last)} ↑{fmt_pct(top)}"


class TrendsPanel(Panel):
    def __init__(self) -> None:
        super().__init__("trends", id="trends-panel")

    def compose(self) -> ComposeResult:
        with VerticalScroll(can_focus=False):
            for key, _ in TRENDS:
                with Horizontal(classes="trend"):
                    yield Readout(id=f"{key}-label", classes="trend-label")
                    yield Sparkline([], id=f"spark-{key}")
            yield PromptLengths()

    def show_engine(self, view: EngineView | None) -> None:
        data = series(view.history if view else [])
        latest = view.latest if view else None
        for key, name in TRENDS:
            known = latest is None or latest.knows(SOURCES[key])
            self.query_one(f"#{key}-label", Readout).show(
                f"{name} {trend_label(key, data[key])}" if known else f"{name} not reported")
            spark = self.query_one(f"#spark-{key}", Sparkline)
            spark.data, spark.display = (data[key] if known else []), known
