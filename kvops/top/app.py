"""`kvops top`: an htop-like Textual view of a running supervisor (its JSON API, kvops.supervisor.api).

The app composes one widget per panel (kvops/top/widgets/), holds the key bindings and the refresh
loop, and routes each poll's state to the panels; each panel draws itself. The styles are in
top.tcss beside this file.

The app never touches the network on its event loop: a thread worker polls the `Source` (the
supervisor client) every `interval_s` and hands the result back with `call_from_thread`. When the
supervisor stops answering, a banner says so, the last data stays on screen and polling goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.events import Key, Resize
from textual.widgets import DataTable, Footer, Input, Static

from kvops.top.client import ADMIN_TOKEN_ENV, EngineView, Poller, Source, SupervisorUnreachable, TopState
from kvops.top.screens import ConfirmScreen, HelpScreen
from kvops.top.widgets.audit import AuditPanel
from kvops.top.widgets.block_map import BlockMapPanel
from kvops.top.widgets.diagnoses import DiagnosesPanel
from kvops.top.widgets.engines import EnginesPanel
from kvops.top.widgets.log import LEVEL_NAMES, LogPanel
from kvops.top.widgets.prompt_lengths import PromptLengths
from kvops.top.widgets.tenants import TenantsPanel
from kvops.top.widgets.trends import TrendsPanel

MIN_WIDTH, MIN_HEIGHT = 80, 24
# Below this width the top row's side panels are too narrow for a trend's label and its sparkline side by side
# (a 24-column label in a 25-column panel at 100 columns left the sparklines no room): top.tcss stacks them.
NARROW_WIDTH = 140
LOG_PANEL_MIN_HEIGHT = 36  # below this the log panel starts hidden (`l` shows it)


class KvopsTop(App[None]):
    TITLE = "kvops top"
    CSS_PATH = "top.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
        Binding("slash", "filter", "filter"),
        Binding("s", "sort", "sort"),
        Binding("f", "apply_fix", "apply fix"),
        Binding("r", "revert_fix", "revert"),
        Binding("t", "map_view", "map: tenants/states"),
        Binding("l", "toggle_log", "log"),
        # htop's filter key; `/` is the tenants' and diagnoses' filter already
        Binding("backslash", "log_filter", "log filter"),
        Binding("w", "log_level", "log level"),
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
        self.show_log: bool | None = None  # None: decided by the terminal height at start
        self.lost: str | None = None  # why the supervisor is not answering, while it is not
        self.last_ok: float | None = None
        self.polling = False  # a poll is in flight (the benchmark sets it to keep polls from starting)

    # ----------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        yield Static("", id="banner")
        yield Static("", id="too-small")
        with Vertical(id="main"):
            with Horizontal(id="top-row"):
                yield EnginesPanel(self.starting or f"connecting to the supervisor at {self.source.url}")
                yield BlockMapPanel()
                yield TrendsPanel()
            with Horizontal(id="bottom-row"):
                yield TenantsPanel()
                yield DiagnosesPanel()
                yield AuditPanel()
            yield LogPanel()
        yield Input(placeholder="filter tenants and diagnoses", id="filter")
        yield Input(placeholder="log: only the lines containing this, in any case (enter or esc closes; empty clears)",
                    id="log-filter")
        yield Footer()

    def on_mount(self) -> None:
        if self.show_log is None:
            self.show_log = self.size.height >= LOG_PANEL_MIN_HEIGHT
        self.query_one(LogPanel).set_shown(self.show_log)
        self.query_one(LogPanel).show_title(self.selected_engine)
        self._check_size(self.size.width, self.size.height)
        self.query_one("#engines", DataTable).focus()
        self.action_refresh()
        # The refresh timer belongs to the widget it redraws: it stops when the screen is torn
        # down, instead of firing into a half-removed screen while the app exits.
        self.query_one("#main").set_interval(self.interval_s, self.action_refresh)

    def on_resize(self, event: Resize) -> None:
        self._check_size(event.size.width, event.size.height)

    def _check_size(self, width: int, height: int) -> None:
        small = width < MIN_WIDTH or height < MIN_HEIGHT
        # The panels' screen, not a help or detail screen open above it while the terminal is resized.
        main = self.screen_stack[0]
        main.set_class(small, "too-small")
        main.set_class(width < NARROW_WIDTH, "narrow")
        main.query_one("#too-small", Static).update(
            f"terminal too small: {width}×{height}, kvops top needs at least {MIN_WIDTH}×{MIN_HEIGHT}")

    # ----------------------------------------------------------- polling

    def action_refresh(self) -> None:
        if not self.polling:
            self.polling = True
            self._poll(self._log_lines())

    def _log_lines(self) -> int:
        """How many of the engine's log lines the poll asks for: none while the panel is hidden."""
        if not self.show_log:
            return 0
        try:
            return self.query_one(LogPanel).lines_wanted
        except NoMatches:  # the app is tearing its panels down
            return 0

    @work(thread=True, group="poll")
    def _poll(self, log_lines: int) -> None:
        try:
            state = self.poller.poll(log_engine=self.selected_engine, log_lines=log_lines)
        except SupervisorUnreachable as exc:
            self.call_from_thread(self._lost, str(exc))
        else:
            self.call_from_thread(self.show_state, state)
        finally:
            self.polling = False

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

    def show_state(self, state: TopState) -> None:
        """A poll's result: every panel gets its part of it."""
        self.state = state
        self.last_ok = state.time
        if self.lost is not None:
            self.lost = None
            self.query_one("#banner", Static).remove_class("lost")
        names = [v.entry.name for v in state.engines]
        if self.selected_engine not in names:
            self.selected_engine = names[0] if names else None
            self.query_one(LogPanel).show_title(self.selected_engine)
        try:
            self.query_one(EnginesPanel).show_engines(state, self.selected_engine)
            self._show_engine()
            self.query_one(DiagnosesPanel).show_diagnoses(state.diagnoses)
            self.query_one(AuditPanel).show_audit(state.audit)
            self.query_one(AuditPanel).show_jobs(state.jobs)
            self.query_one(LogPanel).show_log(self.engine, state.logs)
        except NoMatches:
            # A first poll can answer before a panel has mounted its table, and a last one after the app began
            # tearing its panels down (CI saw the first): this state is kept, and the next refresh draws it.
            return

    @property
    def engine(self) -> EngineView | None:
        """The highlighted engine, which the block map, trends, prompt lengths, tenants and log show."""
        if self.state is None:
            return None
        return next((v for v in self.state.engines if v.entry.name == self.selected_engine), None)

    def _show_engine(self) -> None:
        view = self.engine
        self.query_one(BlockMapPanel).show_engine(view)
        self.query_one(TrendsPanel).show_engine(view)
        self.query_one(PromptLengths).show_engine(view)
        self.query_one(TenantsPanel).show_engine(view)

    @on(DataTable.RowHighlighted, "#engines")
    def _engine_highlighted(self, event: DataTable.RowHighlighted) -> None:
        name = event.row_key.value
        if name != self.selected_engine:
            self.selected_engine = name
            self.query_one(EnginesPanel).select(name)
            self.query_one(LogPanel).show_title(name)
            self._show_engine()
            self.action_refresh()  # the log panel follows the engine

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
        self.query_one(TenantsPanel).set_filter(self.filter_text)
        self.query_one(DiagnosesPanel).set_filter(self.filter_text)

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        self._close_filter()

    def _close_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.remove_class("shown")
        self.query_one("#diagnoses" if self.filter_text else "#engines", DataTable).focus()

    def on_key(self, event: Key) -> None:
        if event.key != "escape":
            return
        if self.query_one("#filter", Input).has_focus:
            event.stop()
            self._close_filter()
        elif self.query_one("#log-filter", Input).has_focus:
            event.stop()
            self._close_log_filter()

    def action_log_filter(self) -> None:
        if not self.show_log:
            self.action_toggle_log()  # a filter on a hidden panel would do nothing to see
        box = self.query_one("#log-filter", Input)
        box.add_class("shown")
        box.focus()

    @on(Input.Changed, "#log-filter")
    def _log_filter_changed(self, event: Input.Changed) -> None:
        self.query_one(LogPanel).set_filter(event.value)

    @on(Input.Submitted, "#log-filter")
    def _log_filter_done(self) -> None:
        self._close_log_filter()

    def _close_log_filter(self) -> None:
        self.query_one("#log-filter", Input).remove_class("shown")
        self.query_one("#engines", DataTable).focus()
        self.action_refresh()  # a filter asks for more lines: fetch them now, not at the next tick

    def action_log_level(self) -> None:
        if not self.show_log:
            self.action_toggle_log()
        level = self.query_one(LogPanel).cycle_level()
        self.notify(f"log: {LEVEL_NAMES.get(level, 'all lines')}", timeout=2)
        self.action_refresh()

    def action_sort(self) -> None:
        self.query_one(TenantsPanel).cycle_sort()

    def action_map_view(self) -> None:
        self.query_one(BlockMapPanel).toggle_view()

    def action_toggle_log(self) -> None:
        self.show_log = not self.show_log
        self.query_one(LogPanel).set_shown(self.show_log)
        if self.show_log:
            self.action_refresh()

    def _need_token(self) -> bool:
        if getattr(self.source, "admin_token", None):
            return False
        self.notify(f"changing things needs the supervisor's admin token: pass --admin-token or set "
                    f"${ADMIN_TOKEN_ENV}", severity="error", timeout=6)
        return True

    def action_apply_fix(self) -> None:
        d = self.query_one(DiagnosesPanel).selected
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
        entry = self.query_one(AuditPanel).selected
        if entry is None or entry.action not in ("applied", "queued", "verifying", "verified"):
            self.notify("select a queued, verifying or verified fix in the audit panel to revert", severity="warning")
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
