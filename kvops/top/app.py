"""`kvops top`: an htop-like Textual view of a running supervisor (its JSON API, kvops.supervisor_api).

The app never touches the network on its event loop: a thread worker polls the `Source` (the
supervisor client) every `interval_s` and hands the result back with `call_from_thread`. When the
supervisor stops answering, a banner says so, the last data stays on screen and polling goes on.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Footer, Input, Label, Sparkline, Static

from kvops.diagnosis import Diagnosis
from kvops.fixes import AuditEntry
from kvops.snapshot import decode_block_map
from kvops.top import block_map
from kvops.top.client import ADMIN_TOKEN_ENV, EngineView, Poller, Source, SupervisorUnreachable, TopState
from kvops.top.render import capacity, fmt_duration, fmt_pct, health, histogram_lines, series

MIN_WIDTH, MIN_HEIGHT = 80, 24

# Tenant sort orders cycled by `s`: (label, key over (name, TenantStats)), biggest first.
TENANT_SORTS: list[tuple[str, Any]] = [
    ("blocks held", lambda kv: kv[1].blocks_held),
    ("quota", lambda kv: kv[1].quota_blocks if kv[1].quota_blocks is not None else -1),
    ("hit rate", lambda kv: kv[1].hit_rate),
    ("evictions caused", lambda kv: kv[1].evictions_caused),
    ("evictions suffered", lambda kv: kv[1].evictions_suffered),
    ("name", None),
]

HELP = """\
[b]kvops top[/b]: the supervisor's engines, live

  q          quit
  ?          this help
  tab        next panel (shift+tab: previous)
  ↑ ↓        move in the focused table (engines: pick the engine shown)
  /          filter tenants and diagnoses (enter or esc to close; empty clears)
  s          cycle the tenants' sort column
  f          apply the selected diagnosis's fix (asks first; needs the admin token)
  r          revert the selected audit entry's fix (asks first; needs the admin token)
  ctrl+r     refresh now

Admin token: --admin-token, or ${env}.
Block map: one glyph per cell; when blocks outnumber cells a cell shows the most
interesting state among its blocks (swapped > pending free > filling > full > cached > free).

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
    #engine-info { height: auto; }
    #block-map { height: 1fr; }
    #map-legend { height: auto; }
    .spark-label { height: 1; }
    Sparkline { height: 2; margin-bottom: 1; }
    #histogram { height: auto; }
    #diagnosis-detail { height: auto; max-height: 8; }
    #filter { display: none; dock: bottom; }
    #filter.shown { display: block; }
    DataTable { height: 1fr; }
    HelpScreen, ConfirmScreen { align: center middle; }
    #help { width: 90; height: auto; border: thick $accent; background: $surface; padding: 1 2; }
    #confirm { width: 80; height: auto; border: thick $warning; background: $surface; padding: 1 2; }
    #buttons { height: auto; margin-top: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
        Binding("slash", "filter", "filter"),
        Binding("s", "sort", "sort tenants"),
        Binding("f", "apply_fix", "apply fix"),
        Binding("r", "revert_fix", "revert"),
        Binding("tab", "focus_next", "next panel", show=True),
        Binding("ctrl+r", "refresh", "refresh", show=False),
    ]

    def __init__(self, source: Source, interval_s: float = 1.0, history_s: float = 120.0) -> None:
        super().__init__()
        self.source = source
        self.interval_s = interval_s
        self.poller = Poller(source, history_s=history_s)
        self.state: TopState | None = None
        self.selected_engine: str | None = None
        self.filter_text = ""
        self.sort_index = 0
        self.lost: str | None = None  # why the supervisor is not answering, while it is not
        self.last_ok: float | None = None
        self._polling = False

    # ----------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        yield Static("", id="banner")
        yield Static("", id="too-small")
        with Vertical(id="main"):
            with Horizontal(id="top-row"):
                with Panel("engines", id="engines-panel"):
                    yield DataTable(id="engines", cursor_type="row", zebra_stripes=True)
                    yield Static("", id="engine-info")
                with Panel("block map", id="map-panel"):
                    yield Static("", id="block-map")
                    yield Static("", id="map-legend")
                with Panel("trends", id="trends-panel"):
                    for key, label in (("kv_usage", "KV usage"), ("hit_rate", "hit rate"),
                                       ("swap_rate", "swap rate"), ("throughput", "throughput")):
                        yield Label(label, id=f"{key}-label", classes="spark-label")
                        yield Sparkline([], id=f"spark-{key}")
                    yield Label("prompt lengths", classes="spark-label")
                    yield Static("", id="histogram")
            with Horizontal(id="bottom-row"):
                with Panel("tenants", id="tenants-panel"):
                    yield DataTable(id="tenants", cursor_type="row", zebra_stripes=True)
                with Panel("diagnoses", id="diagnoses-panel"):
                    yield DataTable(id="diagnoses", cursor_type="row", zebra_stripes=True)
                    yield Static("", id="diagnosis-detail")
                with Panel("audit", id="audit-panel"):
                    yield DataTable(id="audit", cursor_type="row", zebra_stripes=True)
        yield Input(placeholder="filter tenants and diagnoses", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#engines", DataTable).add_columns("engine", "health", "model", "restarts")
        self.query_one("#tenants", DataTable).add_columns("tenant", "held", "owned", "quota", "hit", "caused",
                                                          "suffered")
        self.query_one("#diagnoses", DataTable).add_columns("sev", "engine", "rule", "subject", "summary")
        self.query_one("#audit", DataTable).add_columns("#", "time", "action", "engine", "rule", "message")
        self._check_size(self.size.width, self.size.height)
        self._update_titles()
        self.query_one("#engines", DataTable).focus()
        self.action_refresh()
        self.set_interval(self.interval_s, self.action_refresh)

    def on_resize(self, event: Any) -> None:
        self._check_size(event.size.width, event.size.height)
        self._render_block_map()

    def _check_size(self, width: int, height: int) -> None:
        small = width < MIN_WIDTH or height < MIN_HEIGHT
        self.screen.set_class(small, "too-small")
        self.query_one("#too-small", Static).update(
            f"terminal too small: {width}×{height}, kvops top needs at least {MIN_WIDTH}×{MIN_HEIGHT}")

    # ----------------------------------------------------------- polling

    def action_refresh(self) -> None:
        if not self._polling:
            self._polling = True
            self._poll()

    @work(thread=True, group="poll")
    def _poll(self) -> None:
        try:
            state = self.poller.poll()
        except SupervisorUnreachable as exc:
            self.call_from_thread(self._lost, str(exc))
        else:
            self.call_from_thread(self._update, state)
        finally:
            self._polling = False

    def _lost(self, message: str) -> None:
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

    def _render_engine_detail(self) -> None:
        self._render_engine_info()
        self._render_block_map()
        self._render_trends()

    @staticmethod
    def _fill(table: DataTable, rows: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Replace a table's rows, keeping the cursor on the same row key when it is still there."""
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

    def _render_engine_info(self) -> None:
        view = self.engine
        info = self.query_one("#engine-info", Static)
        if view is None:
            info.update("no engines" if self.state else "connecting…")
            return
        s = view.latest
        if s is None:
            info.update(f"{view.entry.name}: no snapshot ({view.error or view.entry.last_error or 'starting'})")
            return
        info.update(
            f"[b]{view.entry.name}[/b] {health(view)}  pid {view.entry.pid or '-'}\n"
            f"model {s.engine.model}\nblock size {s.engine.block_size}  KV dtype {s.engine.kv_cache_dtype}\n"
            f"capacity {capacity(s)}\nuptime {fmt_duration(s.uptime_s)}  restarts {view.entry.restarts}\n"
            f"running {s.requests.running}  waiting {s.requests.waiting}")

    def _render_block_map(self) -> None:
        view = self.engine
        if view is None or view.latest is None:
            self.query_one("#block-map", Static).update("")
            self.query_one("#map-legend", Static).update("")
            return
        widget = self.query_one("#block-map", Static)
        width = max(1, widget.content_size.width or 40)
        height = max(1, (widget.content_size.height or 10) - (1 if view.latest.swap.host_state_map else 0))
        grid = block_map.layout(decode_block_map(view.latest.blocks.state_map), width, height)
        text = block_map.render_rows(grid.rows)
        if view.latest.swap.host_state_map:
            host = block_map.layout(decode_block_map(view.latest.swap.host_state_map), max(1, width - 6), 1)
            text.append("\nhost  ")
            text.append_text(block_map.render_rows(host.rows[:1]))
        widget.update(text)
        legend = block_map.legend(view.latest.blocks.counts)
        legend.append(f"\n{grid.scale} ({grid.total_blocks} blocks)  usage {fmt_pct(view.latest.blocks.usage)}",
                      style="dim")
        self.query_one("#map-legend", Static).update(legend)

    def _render_trends(self) -> None:
        view = self.engine
        history = view.history if view else []
        data = series(history)
        last = {k: (v[-1] if v else None) for k, v in data.items()}
        labels = {"kv_usage": f"KV usage {fmt_pct(last['kv_usage'])}",
                  "hit_rate": f"hit rate {fmt_pct(last['hit_rate'])}",
                  "swap_rate": f"swap rate {fmt_pct(last['swap_rate'])}",
                  "throughput": "throughput " + ("-" if last["throughput"] is None
                                                 else f"{last['throughput']:.0f} tok/s")}
        for key, values in data.items():
            self.query_one(f"#{key}-label", Label).update(labels[key])
            self.query_one(f"#spark-{key}", Sparkline).data = values
        hist = self.query_one("#histogram", Static)
        hist.update("\n".join(histogram_lines(view.latest.prompt_lengths, width=20))
                    if view and view.latest else "")

    def _matches(self, *fields: str) -> bool:
        needle = self.filter_text.lower()
        return not needle or any(needle in f.lower() for f in fields)

    def _render_tenants(self) -> None:
        view = self.engine
        tenants = dict(view.latest.tenants) if view and view.latest else {}
        items = [kv for kv in tenants.items() if self._matches(kv[0], kv[1].cache_salt)]
        _, key = TENANT_SORTS[self.sort_index]
        items.sort(key=key or (lambda kv: kv[0]), reverse=key is not None)
        rows = [(name, (name, str(t.blocks_held), str(t.blocks_owned),
                        str(t.quota_blocks) if t.quota_blocks is not None else "-", fmt_pct(t.hit_rate),
                        str(t.evictions_caused), str(t.evictions_suffered))) for name, t in items]
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
        detail = self.query_one("#diagnosis-detail", Static)
        if d is None:
            detail.update("")
            return
        text = Text()
        text.append(f"{d.title}\n", style="bold")
        text.append("evidence: " + ", ".join(f"{k}={v}" for k, v in d.evidence.items()) + "\n")
        text.append(f"fix ({d.fix.kind.value}): {d.fix.description}  [f applies]" if d.fix else "no fix proposed",
                    style="green" if d.fix else "dim")
        detail.update(text)

    def _render_audit(self) -> None:
        entries = list(reversed(self.state.audit)) if self.state else []
        colours = {"applied": "yellow", "verified": "green", "rolled_back": "red", "failed": "bold red",
                   "reverted": "magenta"}
        rows = [(str(a.id), (str(a.id), time.strftime("%H:%M:%S", time.localtime(a.time)),
                             Text(a.action, style=colours.get(a.action, "")), a.engine, a.rule, a.message))
                for a in entries]
        self._fill(self.query_one("#audit", DataTable), rows)

    def _update_titles(self) -> None:
        suffix = f" (filter: {self.filter_text})" if self.filter_text else ""
        self.query_one("#tenants-panel").border_title = f"tenants by {TENANT_SORTS[self.sort_index][0]}{suffix}"
        self.query_one("#diagnoses-panel").border_title = f"diagnoses{suffix}"

    # ----------------------------------------------------------- selection

    @on(DataTable.RowHighlighted, "#engines")
    def _engine_highlighted(self, event: DataTable.RowHighlighted) -> None:
        name = event.row_key.value
        if name != self.selected_engine:
            self.selected_engine = name
            self._render_engine_detail()
            self._render_tenants()

    @on(DataTable.RowHighlighted, "#diagnoses")
    def _diagnosis_highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self._render_diagnosis_detail()

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
        self.sort_index = (self.sort_index + 1) % len(TENANT_SORTS)
        self._update_titles()
        self._render_tenants()

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
