"""`kvops top`: an htop-like Textual view of a running supervisor (its JSON API, kvops.supervisor.api).

The app never touches the network on its event loop: a thread worker polls the `Source` (the
supervisor client) every `interval_s` and hands the result back with `call_from_thread`. When the
supervisor stops answering, a banner says so, the last data stays on screen and polling goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Button, DataTable, Footer, Input, Label, Sparkline, Static

from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Diagnosis
from kvops.schema.snapshot import TenantStats, decode_block_map
from kvops.top import block_map
from kvops.top.client import ADMIN_TOKEN_ENV, EngineView, Poller, Source, SupervisorUnreachable, TopState
from kvops.top.render import (
    capacity,
    fmt_duration,
    fmt_pct,
    fmt_seconds,
    health,
    histogram_lines,
    series,
    tenant_detail,
)

MIN_WIDTH, MIN_HEIGHT = 80, 24
LOG_PANEL_MIN_HEIGHT = 36  # below this the log panel starts hidden (`l` shows it)
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def _quota(t: TenantStats) -> int:
    return t.quota_blocks if t.quota_blocks is not None else -1


# The tenants table: (column, what `s` and the title call it, sort key; None sorts by name, A to Z).
# Every other column sorts biggest first; `s` cycles, a click on a column header sorts by it, a
# second click reverses.
TENANT_COLUMNS: list[tuple[str, str, Any]] = [
    ("tenant", "name", None),
    ("held", "blocks held", lambda t: t.blocks_held),
    ("owned", "blocks owned", lambda t: t.blocks_owned),
    ("quota", "quota", _quota),
    ("hit", "hit rate", lambda t: t.hit_rate),
    ("caused", "evictions caused", lambda t: t.evictions_caused),
    ("suffered", "evictions suffered", lambda t: t.evictions_suffered),
]
DEFAULT_TENANT_SORT = 1

TRENDS = (("kv_usage", "KV usage"), ("hit_rate", "hit rate"), ("swap_rate", "swap rate"),
          ("throughput", "throughput"), ("ttft", "TTFT"), ("itl", "ITL"))

HELP = """\
[b]kvops top[/b]: the supervisor's engines, live

  q          quit
  ?          this help
  tab        next panel (shift+tab: previous)
  ↑ ↓        move in the focused table (engines: pick the engine shown)
  /          filter tenants and diagnoses (enter or esc to close; empty clears)
  s          cycle the tenants' sort column (or click a column header; again: reverse)
  enter      detail of the selected engine, tenant, diagnosis or audit entry
  f          apply the selected diagnosis's fix (asks first; needs the admin token)
  r          revert the selected audit entry's fix (asks first; needs the admin token)
  t          block map: colour by state, or by the tenant owning each block
  l          show or hide the engine log
  ctrl+r     refresh now

Admin token: --admin-token, or ${env}.
Block map: one glyph per cell; when blocks outnumber cells a cell shows the most
interesting state among its blocks (swapped > pending free > filling > full > cached > free);
in the tenant view, the tenant owning most of its blocks.
Trends: the last two minutes; the label gives the latest value and the window's maximum.

esc / q / ? closes this help."""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [("escape,q,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP.replace("${env}", f"${ADMIN_TOKEN_ENV}"), id="help")


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [("y", "answer(True)", "yes"), ("n,escape", "answer(False)", "no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Label(self.question, id="question")
            with Horizontal(id="buttons"):
                yield Button("Yes (y)", id="yes", variant="warning")
                yield Button("No (n)", id="no")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class DetailScreen(ModalScreen[None]):
    """`enter` on a row: everything kvops knows about it."""

    BINDINGS: ClassVar[list[BindingType]] = [("escape,q,enter", "dismiss", "close")]

    def __init__(self, title: str, body: Text | str) -> None:
        super().__init__()
        self.title_text = title
        self.body = body

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="detail", can_focus=False):
            yield Label(Text(self.title_text, style="bold"), id="detail-title")
            yield Static(self.body, id="detail-body")
            yield Label(Text("esc closes", style="dim"))


class Readout(Widget):
    """Text in a box whose size the CSS fixes. A new text repaints it without the layout pass a
    Static asks for on every update, which would be most of a refresh."""

    DEFAULT_CSS = "Readout { height: 1fr; }"

    def __init__(self, *, id: str, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.content: Text | str = ""

    def render(self) -> Text:
        return Text.from_markup(self.content) if isinstance(self.content, str) else self.content

    def show(self, content: Text | str) -> None:
        if content != self.content:
            self.content = content
            self.refresh()


class Panel(Vertical):
    """A bordered box with a title."""

    def __init__(self, title: str, *children: Any, **kwargs: Any) -> None:
        super().__init__(*children, **kwargs)
        self.border_title = title


class KvopsTop(App[None]):
    TITLE = "kvops top"
    CSS = """
    Screen { layout: vertical; }
    #banner { display: none; background: $error; color: $text; padding: 0 1; height: auto; }
    #banner.lost { display: block; }
    #too-small { display: none; height: 1fr; content-align: center middle; }
    Screen.too-small #too-small { display: block; }
    Screen.too-small #main { display: none; }
    #main { height: 1fr; }
    Panel { border: round $primary-darken-1; height: 1fr; }
    Panel:focus-within { border: round $accent; }
    #top-row { height: 2fr; }
    #bottom-row { height: 1fr; }
    #engines-panel { width: 1fr; }
    #map-panel { width: 2fr; }
    #trends-panel { width: 1fr; }
    #engine-info { height: 7; }
    #block-map { width: 1fr; height: 1fr; }
    #map-legend { height: 3; }
    .trend { height: 1; }
    .trend-label { width: 24; height: 1; }
    .trend Sparkline { width: 1fr; height: 1; }
    #histogram { height: 16; margin-top: 1; }
    #diagnosis-detail { height: 5; }
    #log-panel { height: 9; }
    #log-panel.hidden { display: none; }
    #log { height: 1fr; }
    #filter { display: none; dock: bottom; }
    #filter.shown { display: block; }
    DataTable { height: 1fr; }
    HelpScreen, ConfirmScreen, DetailScreen { align: center middle; }
    #help { width: 90; height: auto; border: thick $accent; background: $surface; padding: 1 2; }
    #confirm { width: 80; height: auto; border: thick $warning; background: $surface; padding: 1 2; }
    #detail { width: 100; height: auto; max-height: 90%; border: thick $accent; background: $surface;
              padding: 1 2; }
    #buttons { height: auto; margin-top: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
        Binding("slash", "filter", "filter"),
        Binding("s", "sort", "sort"),
        Binding("f", "apply_fix", "apply fix"),
        Binding("r", "revert_fix", "revert"),
        Binding("t", "map_view", "map: tenants/states"),
        Binding("l", "toggle_log", "log"),
        Binding("tab", "focus_next", "next panel", show=True),
        Binding("ctrl+r", "refresh", "refresh", show=False),
    ]

    def __init__(self, source: Source, interval_s: float = 1.0, history_s: float = 120.0,
                 starting: str | None = None, gone: Callable[[], str | None] | None = None) -> None:
        """`starting`: what is being started before the supervisor can answer (an embedded one),
        shown instead of the lost-supervisor banner until it answers once. `gone`: says why that
        supervisor process exited, or None while it runs."""
        super().__init__()
        self.gone = gone
        self.source = source
        self.interval_s = interval_s
        self.poller = Poller(source, history_s=history_s)
        self.starting = starting
        self.state: TopState | None = None
        self.selected_engine: str | None = None
        self.filter_text = ""
        self.sort_column = DEFAULT_TENANT_SORT
        self.sort_reversed = False
        self.map_by_tenant = False
        self.show_log: bool | None = None  # None: decided by the terminal height at start
        self.lost: str | None = None  # why the supervisor is not answering, while it is not
        self.last_ok: float | None = None
        self._polling = False
        self._spin = 0
        self._shown: dict[str, Any] = {}  # what each table shows now (see _fill)

    # ----------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        yield Static("", id="banner")
        yield Static("", id="too-small")
        with Vertical(id="main"):
            with Horizontal(id="top-row"):
                with Panel("engines", id="engines-panel"):
                    yield DataTable(id="engines", cursor_type="row", zebra_stripes=True)
                    yield Readout(id="engine-info")
                with Panel("block map", id="map-panel"):
                    yield Readout(id="block-map")
                    yield Readout(id="map-legend")
                with Panel("trends", id="trends-panel"), VerticalScroll(can_focus=False):
                    for key, _ in TRENDS:
                        with Horizontal(classes="trend"):
                            yield Readout(id=f"{key}-label", classes="trend-label")
                            yield Sparkline([], id=f"spark-{key}")
                    yield Readout(id="histogram")
            with Horizontal(id="bottom-row"):
                with Panel("tenants", id="tenants-panel"):
                    yield DataTable(id="tenants", cursor_type="row", zebra_stripes=True)
                with Panel("diagnoses", id="diagnoses-panel"):
                    yield DataTable(id="diagnoses", cursor_type="row", zebra_stripes=True)
                    yield Readout(id="diagnosis-detail")
                with Panel("audit", id="audit-panel"):
                    yield DataTable(id="audit", cursor_type="row", zebra_stripes=True)
            with Panel("log", id="log-panel"):
                yield Readout(id="log")
        yield Input(placeholder="filter tenants and diagnoses", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#engines", DataTable).add_columns("engine", "health", "model", "restarts")
        self.query_one("#tenants", DataTable).add_columns(*(column for column, _, _ in TENANT_COLUMNS))
        self.query_one("#diagnoses", DataTable).add_columns("sev", "engine", "rule", "subject", "summary")
        self.query_one("#audit", DataTable).add_columns("#", "time", "action", "engine", "rule", "message")
        if self.show_log is None:
            self.show_log = self.size.height >= LOG_PANEL_MIN_HEIGHT
        self.query_one("#log-panel").set_class(not self.show_log, "hidden")
        self._check_size(self.size.width, self.size.height)
        self._update_titles()
        self._render_engine_info()
        self.query_one("#engines", DataTable).focus()
        self.action_refresh()
        # Timers of the widgets they redraw: they stop when the screen is torn down, instead of
        # firing into a half-removed screen while the app exits.
        self.query_one("#main").set_interval(self.interval_s, self.action_refresh)
        self.query_one("#engine-info").set_interval(0.25, self._tick)

    def on_resize(self, event: Any) -> None:
        self._check_size(event.size.width, event.size.height)
        self.call_after_refresh(self._render_block_map)
        self.call_after_refresh(self._render_log)

    def _check_size(self, width: int, height: int) -> None:
        small = width < MIN_WIDTH or height < MIN_HEIGHT
        self.screen.set_class(small, "too-small")
        self.query_one("#too-small", Static).update(
            f"terminal too small: {width}×{height}, kvops top needs at least {MIN_WIDTH}×{MIN_HEIGHT}")

    def _tick(self) -> None:
        """Turn the spinner while something is starting."""
        if self.state is None or (self.engine is not None and self.engine.latest is None):
            self._spin += 1
            self._render_engine_info()

    # ----------------------------------------------------------- polling

    def action_refresh(self) -> None:
        if not self._polling:
            self._polling = True
            self._poll()

    @work(thread=True, group="poll")
    def _poll(self) -> None:
        try:
            state = self.poller.poll(log_engine=self.selected_engine, log_lines=100 if self.show_log else 0)
        except SupervisorUnreachable as exc:
            self.call_from_thread(self._lost, str(exc))
        else:
            self.call_from_thread(self._update, state)
        finally:
            self._polling = False

    def _lost(self, message: str) -> None:
        exited = self.gone() if self.gone is not None else None
        if exited is not None:
            message = exited
        elif self.starting is not None and self.last_ok is None:
            return  # not up yet: the engine panel says what is being waited for
        self.lost = message
        since = (f"; showing data from {time.strftime('%H:%M:%S', time.localtime(self.last_ok))}"
                 if self.last_ok else "")
        banner = self.query_one("#banner", Static)
        banner.update(f"supervisor lost: {message} — retrying every {self.interval_s:g} s{since}")
        banner.add_class("lost")

    def _update(self, state: TopState) -> None:
        self.state = state
        self.last_ok = state.time
        if self.lost is not None:
            self.lost = None
            self.query_one("#banner", Static).remove_class("lost")
        names = [v.entry.name for v in state.engines]
        if self.selected_engine not in names:
            self.selected_engine = names[0] if names else None
            self._update_titles()
            self.call_after_refresh(self._render_block_map)  # the map's size is known once laid out
        self._render_all()

    # ----------------------------------------------------------- rendering

    @property
    def engine(self) -> EngineView | None:
        if self.state is None:
            return None
        return next((v for v in self.state.engines if v.entry.name == self.selected_engine), None)

    def _render_all(self) -> None:
        self._render_engines()
        self._render_engine_detail()
        self._render_tenants()
        self._render_diagnoses()
        self._render_audit()
        self._render_log()

    def _render_engine_detail(self) -> None:
        self._render_engine_info()
        self._render_block_map()
        self._render_trends()

    def _fill(self, table: DataTable, rows: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Replace a table's rows, keeping the cursor on the same row key when it is still there."""
        key = table.id or str(id(table))
        if self._shown.get(key) == rows:
            return
        self._shown[key] = rows
        current = None
        if table.row_count and table.cursor_row < table.row_count:
            current = table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value
        table.clear()
        for key, cells in rows:
            table.add_row(*cells, key=key)
        keys = [key for key, _ in rows]
        if current in keys:
            table.move_cursor(row=keys.index(current), animate=False)

    def _render_engines(self) -> None:
        assert self.state is not None
        rows = []
        for view in self.state.engines:
            h = health(view)
            style = "green" if h == "up" else "yellow" if h == "starting" else "bold red"
            model = view.latest.engine.model if view.latest else "-"
            rows.append((view.entry.name, (view.entry.name, Text(h, style=style), model, str(view.entry.restarts))))
        self._fill(self.query_one("#engines", DataTable), rows)

    def _spinner(self) -> str:
        return SPINNER[self._spin % len(SPINNER)]

    def _render_engine_info(self) -> None:
        info = self.query_one("#engine-info", Readout)
        if self.state is None:
            what = self.starting or f"connecting to the supervisor at {self.source.url}"
            info.show(Text(f"{self._spinner()} {what}…", style="yellow"))
            return
        view = self.engine
        if view is None:
            info.show("no engines")
            return
        s = view.latest
        if s is None:
            info.show(self._waiting_text(view))
            return
        info.show(
            f"[b]{view.entry.name}[/b] {health(view)}  pid {view.entry.pid or '-'}\n"
            f"model {s.engine.model}\nblock size {s.engine.block_size}  KV dtype {s.engine.kv_cache_dtype}\n"
            f"capacity {capacity(s)}\nuptime {fmt_duration(s.uptime_s)}  restarts {view.entry.restarts}\n"
            f"running {s.requests.running}  waiting {s.requests.waiting}")

    def _waiting_text(self, view: EngineView) -> Text:
        """What an engine without a snapshot is waiting for: its process, /health, a restart."""
        e = view.entry
        now = time.time()
        text = Text()
        if e.crash_loop:
            text.append(f"{e.name}: CRASH LOOP, not restarting\n", style="bold red")
            text.append(f"{e.last_error or ''}\nPOST /api/engines/{e.name}/resume restarts it")
            return text
        if e.restart_at is not None and e.pid is None:
            text.append(f"{self._spinner()} {e.name}: exited; restarting in {max(0.0, e.restart_at - now):.0f} s\n",
                        style="yellow")
        elif e.started_at is not None:
            text.append(f"{self._spinner()} {e.name}: starting (pid {e.pid}), {fmt_duration(now - e.started_at)}\n",
                        style="yellow")
            text.append(f"waiting for {e.url}/health\n")
        else:
            text.append(f"{self._spinner()} {e.name}: waiting for {e.url} to answer\n", style="yellow")
        if e.last_log:
            text.append(f"engine: {e.last_log[:200]}", style="dim")
        elif view.error or e.last_error:
            text.append(view.error or e.last_error or "", style="dim")
        return text

    def _render_block_map(self) -> None:
        view = self.engine
        widget = self.query_one("#block-map", Readout)
        legend_widget = self.query_one("#map-legend", Readout)
        if view is None or view.latest is None:
            widget.show("")
            legend_widget.show("")
            return
        s = view.latest
        if not s.blocks.state_map:  # a vLLM or SGLang server read through kvops.adapters
            widget.show(Text(f"a {s.source} server: its /metrics has no per-block states\n"
                                    f"KV usage {fmt_pct(s.blocks.usage)}", style="dim"))
            legend_widget.show("")
            return
        width = max(1, widget.content_size.width or 40)
        host_line = bool(s.swap.host_state_map) and not self.map_by_tenant
        height = max(1, (widget.content_size.height or 10) - (1 if host_line else 0))
        if self.map_by_tenant:
            owners = decode_block_map(s.blocks.owner_map) if s.blocks.owner_map else ""
            if not owners:
                widget.show(Text("this engine reports no block owners (an older kvops engine)", style="dim"))
                legend_widget.show("")
                return
            grid = block_map.layout_owners(owners, width, height)
            text = block_map.render_owner_rows(grid.rows)
            legend = block_map.owner_legend(s.blocks.owners, owners)
        else:
            grid = block_map.layout(decode_block_map(s.blocks.state_map), width, height)
            text = block_map.render_rows(grid.rows)
            legend = block_map.legend(s.blocks.counts)
            if host_line:
                host = block_map.layout(decode_block_map(s.swap.host_state_map), max(1, width - 6), 1)
                text.append("\nhost  ")
                text.append_text(block_map.render_rows(host.rows[:1]))
        widget.show(text)
        legend.append(f"\n{grid.scale} ({grid.total_blocks} blocks)  usage {fmt_pct(s.blocks.usage)}", style="dim")
        legend_widget.show(legend)

    def _render_trends(self) -> None:
        view = self.engine
        history = view.history if view else []
        data = series(history)

        def label(key: str, values: list[float]) -> str:
            if not values:
                return "-"
            last, top = values[-1], max(values)
            if key == "throughput":
                return f"{last:.0f} tok/s ↑{top:.0f}"
            if key in ("ttft", "itl"):
                return f"{fmt_seconds(last)} ↑{fmt_seconds(top)}"
            return f"{fmt_pct(last)} ↑{fmt_pct(top)}"

        for key, name in TRENDS:
            self.query_one(f"#{key}-label", Readout).show(f"{name} {label(key, data[key])}")
            self.query_one(f"#spark-{key}", Sparkline).data = data[key]
        hist = self.query_one("#histogram", Readout)
        hist.show("prompt lengths\n" + "\n".join(histogram_lines(view.latest.prompt_lengths, width=16))
                    if view and view.latest else "")

    def _matches(self, *fields: str) -> bool:
        needle = self.filter_text.lower()
        return not needle or any(needle in f.lower() for f in fields)

    def _sorted_tenants(self) -> list[tuple[str, TenantStats]]:
        view = self.engine
        tenants = dict(view.latest.tenants) if view and view.latest else {}
        items = [kv for kv in tenants.items() if self._matches(kv[0], kv[1].cache_salt)]
        _, _, key = TENANT_COLUMNS[self.sort_column]
        if key is None:
            items.sort(key=lambda kv: kv[0], reverse=self.sort_reversed)
        else:
            items.sort(key=lambda kv: (key(kv[1]), kv[0]), reverse=not self.sort_reversed)
        return items

    def _render_tenants(self) -> None:
        rows = [(name, (name, str(t.blocks_held), str(t.blocks_owned),
                        str(t.quota_blocks) if t.quota_blocks is not None else "-", fmt_pct(t.hit_rate),
                        str(t.evictions_caused), str(t.evictions_suffered))) for name, t in self._sorted_tenants()]
        self._fill(self.query_one("#tenants", DataTable), rows)

    def _visible_diagnoses(self) -> list[Diagnosis]:
        if self.state is None:
            return []
        return [d for d in self.state.diagnoses if self._matches(d.engine, d.rule, d.subject, d.title, d.summary)]

    def _render_diagnoses(self) -> None:
        colours = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
        rows = [("|".join(d.key), (Text(d.severity.value, style=colours.get(d.severity.value, "")), d.engine, d.rule,
                                   d.subject, d.summary)) for d in self._visible_diagnoses()]
        self._fill(self.query_one("#diagnoses", DataTable), rows)
        self._render_diagnosis_detail()

    def _render_diagnosis_detail(self) -> None:
        d = self.selected_diagnosis
        detail = self.query_one("#diagnosis-detail", Readout)
        if d is None:
            detail.show("")
            return
        text = Text()
        text.append(f"{d.title}\n", style="bold")
        text.append("evidence: " + ", ".join(f"{k}={v}" for k, v in d.evidence.items()) + "\n")
        text.append(f"fix ({d.fix.kind.value}): {d.fix.description}  [f applies]" if d.fix else "no fix proposed",
                    style="green" if d.fix else "dim")
        detail.show(text)

    def _render_audit(self) -> None:
        entries = list(reversed(self.state.audit)) if self.state else []
        rows = [(str(a.id), (str(a.id), time.strftime("%H:%M:%S", time.localtime(a.time)),
                             Text(a.action, style=AUDIT_COLOURS.get(a.action, "")), a.engine, a.rule, a.message))
                for a in entries]
        self._fill(self.query_one("#audit", DataTable), rows)

    def _render_log(self) -> None:
        if not self.show_log:
            return
        widget = self.query_one("#log", Readout)
        view = self.engine
        if view is not None and not view.entry.managed and not (self.state and self.state.logs):
            widget.show(Text(f"{view.entry.name} is watched, not managed: its log is wherever it was started",
                               style="dim"))
            return
        lines = self.state.logs if self.state else []
        height = max(1, widget.content_size.height or 7)
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, line in enumerate(lines[-height:]):
            if i:
                text.append("\n")
            text.append(time.strftime("%H:%M:%S ", time.localtime(line.time)), style="dim")
            text.append(line.text, style=LOG_COLOURS.get(line.level, ""))
        widget.show(text)

    def _update_titles(self) -> None:
        suffix = f" (filter: {self.filter_text})" if self.filter_text else ""
        _, sort_name, key = TENANT_COLUMNS[self.sort_column]
        order = ("Z-A" if self.sort_reversed else "A-Z") if key is None else ("↑" if self.sort_reversed else "↓")
        self.query_one("#tenants-panel").border_title = f"tenants by {sort_name} {order}{suffix}"
        self.query_one("#diagnoses-panel").border_title = f"diagnoses{suffix}"
        view = "tenants (t: states)" if self.map_by_tenant else "states (t: tenants)"
        self.query_one("#map-panel").border_title = f"block map: {view}"
        self.query_one("#log-panel").border_title = f"log: {self.selected_engine or '-'} (l hides)"

    # ----------------------------------------------------------- selection

    @on(DataTable.RowHighlighted, "#engines")
    def _engine_highlighted(self, event: DataTable.RowHighlighted) -> None:
        name = event.row_key.value
        if name != self.selected_engine:
            self.selected_engine = name
            self._update_titles()
            self._render_engine_detail()
            self._render_tenants()
            self.action_refresh()  # the log panel follows the engine

    @on(DataTable.RowHighlighted, "#diagnoses")
    def _diagnosis_highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self._render_diagnosis_detail()

    @on(DataTable.HeaderSelected, "#tenants")
    def _tenant_header(self, event: DataTable.HeaderSelected) -> None:
        if event.column_index == self.sort_column:
            self.sort_reversed = not self.sort_reversed
        else:
            self.sort_column, self.sort_reversed = event.column_index, False
        self._update_titles()
        self._render_tenants()

    @on(DataTable.RowSelected)
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        detail = self._detail(event.data_table.id or "", str(event.row_key.value))
        if detail is not None:
            self.push_screen(DetailScreen(*detail))

    def _detail(self, table: str, key: str) -> tuple[str, Text] | None:
        if self.state is None:
            return None
        if table == "engines":
            view = next((v for v in self.state.engines if v.entry.name == key), None)
            return None if view is None else (f"engine {key}", engine_detail(view))
        if table == "tenants":
            view = self.engine
            tenant = view.latest.tenants.get(key) if view and view.latest else None
            return None if tenant is None else (f"tenant {key}", Text(tenant_detail(key, tenant)))
        if table == "diagnoses":
            d = next((d for d in self.state.diagnoses if "|".join(d.key) == key), None)
            return None if d is None else (f"{d.rule} on {d.engine}", diagnosis_detail(d))
        if table == "audit":
            a = next((a for a in self.state.audit if str(a.id) == key), None)
            return None if a is None else (f"audit #{a.id}: {a.action}", audit_detail(a))
        return None

    @property
    def selected_diagnosis(self) -> Diagnosis | None:
        visible = self._visible_diagnoses()
        table = self.query_one("#diagnoses", DataTable)
        if not visible or table.row_count == 0:
            return None
        key = table.coordinate_to_cell_key((min(table.cursor_row, table.row_count - 1), 0)).row_key.value
        return next((d for d in visible if "|".join(d.key) == key), None)

    @property
    def selected_audit(self) -> AuditEntry | None:
        table = self.query_one("#audit", DataTable)
        if self.state is None or table.row_count == 0:
            return None
        key = table.coordinate_to_cell_key((min(table.cursor_row, table.row_count - 1), 0)).row_key.value
        return next((a for a in self.state.audit if str(a.id) == key), None)

    # ----------------------------------------------------------- actions

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("shown")
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self._update_titles()
        self._render_tenants()
        self._render_diagnoses()

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        self._close_filter()

    def _close_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.remove_class("shown")
        self.query_one("#diagnoses" if self.filter_text else "#engines", DataTable).focus()

    def on_key(self, event: Any) -> None:
        if event.key == "escape" and self.query_one("#filter", Input).has_focus:
            event.stop()
            self._close_filter()

    def action_sort(self) -> None:
        self.sort_column = (self.sort_column + 1) % len(TENANT_COLUMNS)
        self.sort_reversed = False
        self._update_titles()
        self._render_tenants()

    def action_map_view(self) -> None:
        self.map_by_tenant = not self.map_by_tenant
        self._update_titles()
        self._render_block_map()

    def action_toggle_log(self) -> None:
        self.show_log = not self.show_log
        self.query_one("#log-panel").set_class(not self.show_log, "hidden")
        if self.show_log:
            self.action_refresh()

    def _need_token(self) -> bool:
        if getattr(self.source, "admin_token", None):
            return False
        self.notify(f"changing things needs the supervisor's admin token: pass --admin-token or set "
                    f"${ADMIN_TOKEN_ENV}", severity="error", timeout=6)
        return True

    def action_apply_fix(self) -> None:
        d = self.selected_diagnosis
        if d is None:
            self.notify("no diagnosis selected", severity="warning")
            return
        if d.fix is None:
            self.notify(f"{d.rule} proposes no fix", severity="warning")
            return
        if self._need_token():
            return
        subject = f" [{d.subject}]" if d.subject else ""
        question = f"Apply the fix for {d.rule}{subject} on {d.engine}?\n\n{d.fix.kind.value}: {d.fix.description}"

        def answered(yes: bool | None) -> None:
            if yes:
                self._call_source("apply", d.engine, d.rule, d.subject)

        self.push_screen(ConfirmScreen(question), answered)

    def action_revert_fix(self) -> None:
        entry = self.selected_audit
        if entry is None or entry.action != "applied":
            self.notify("select an 'applied' entry in the audit panel to revert", severity="warning")
            return
        if self._need_token():
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self._call_source("revert", entry.id)

        self.push_screen(ConfirmScreen(f"Revert fix #{entry.id} ({entry.rule} on {entry.engine})?"), answered)

    @work(thread=True, group="admin")
    def _call_source(self, what: str, *args: Any) -> None:
        try:
            entry = self.source.apply_fix(*args) if what == "apply" else self.source.revert_fix(*args)
        except SupervisorUnreachable as exc:
            self.call_from_thread(self.notify, f"{what} failed: {exc}", severity="error", timeout=8)
            return
        self.call_from_thread(self.notify, f"fix #{entry.id} {entry.action}: {entry.message or entry.rule}")
        self.call_from_thread(self.action_refresh)


AUDIT_COLOURS = {"applied": "yellow", "verified": "green", "rolled_back": "red", "failed": "bold red",
                 "reverted": "magenta"}
LOG_COLOURS = {"warning": "yellow", "error": "bold red", "critical": "bold red", "debug": "dim"}


def engine_detail(view: EngineView) -> Text:
    e = view.entry
    text = Text()
    text.append(f"health {health(view)}  url {e.url}  pid {e.pid or '-'}  restarts {e.restarts}  "
                f"{'managed' if e.managed else 'watched'}\n")
    if e.last_error:
        text.append(f"last error: {e.last_error}\n", style="red")
    s = view.latest
    if s is not None:
        text.append(f"model {s.engine.model}  device {s.engine.device}  dtype {s.engine.dtype}\n"
                    f"block size {s.engine.block_size}  KV dtype {s.engine.kv_cache_dtype}  "
                    f"capacity {capacity(s)}\n"
                    f"max model len {s.engine.max_model_len}  max seqs {s.engine.max_num_seqs}  "
                    f"batched tokens {s.engine.max_num_batched_tokens}\n"
                    f"prefix caching {'on' if s.engine.enable_prefix_caching else 'off'}  eviction "
                    f"{s.engine.eviction_policy}  normalization {s.prefix_cache.normalization}\n"
                    f"requests finished {s.requests.finished_total}  aborted {s.requests.aborted_total}  "
                    f"preemptions {s.requests.preemptions_total}\n"
                    f"prefix hit rate {fmt_pct(s.prefix_cache.hit_rate)} overall, "
                    f"{fmt_pct(s.prefix_cache.window_hit_rate)} in the last {s.prefix_cache.window_s:g} s; "
                    f"evictions {s.prefix_cache.evictions_total}\n"
                    f"swap: {s.swap.preemption_mode}, host blocks {s.swap.host_blocks}, swapped "
                    f"{s.swap.swapped_blocks}\n"
                    f"process: cpu {s.process.cpu_percent:.0f}%  rss {s.process.rss_bytes / 2**20:.0f} MiB  "
                    f"gpu {s.process.gpu_status}")
    return text


def diagnosis_detail(d: Diagnosis) -> Text:
    text = Text()
    text.append(f"{d.title}\n", style="bold")
    text.append(f"severity {d.severity.value}  engine {d.engine}  subject {d.subject or '-'}\n\n")
    text.append(f"{d.summary}\n\nevidence\n")
    for key, value in d.evidence.items():
        text.append(f"  {key}: {value}\n")
    if d.fix is None:
        text.append("\nno fix proposed", style="dim")
    else:
        text.append(f"\nfix ({d.fix.kind.value}): {d.fix.description}\n", style="green")
        text.append(f"  {d.fix.action} {d.fix.params}\n  f applies it (after a confirmation)")
    return text


def audit_detail(a: AuditEntry) -> Text:
    text = Text()
    text.append(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(a.time))}  {a.engine}  {a.rule}"
                f"{' [' + a.subject + ']' if a.subject else ''}\n")
    text.append(f"{a.action}", style=AUDIT_COLOURS.get(a.action, ""))
    text.append(f": {a.message}\n")
    if a.fix is not None:
        text.append(f"fix ({a.fix.kind.value}): {a.fix.description}\n")
    for label, value in (("settings before", a.before), ("settings after", a.after),
                         ("evidence before", a.evidence_before), ("evidence after", a.evidence_after)):
        if value:
            text.append(f"{label}: {value}\n")
    return text


