"""The modal screens of `kvops top`: the help (`?`), a yes/no confirmation before changing anything
(`f`, `r`), and the detail of a selected row (`enter`). Their sizes and colours are in top.tcss."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from kvops.top.client import ADMIN_TOKEN_ENV

HELP = """\
[b]kvops top[/b]: the supervisor's engines, live

  q        quit
  ?        this help
  tab      next panel (shift+tab: previous)
  ↑ ↓      move in the focused table (engines: pick the engine shown)
  /        filter tenants, diagnoses (enter or esc closes; empty clears)
  s        cycle the tenants' sort (or click a header; again: reverse)
  enter    detail of the selected engine, tenant, diagnosis or audit row
  f        apply the selected diagnosis's fix (asks first; admin token)
  r        revert the selected audit entry's fix (asks first; admin token)
  t        block map by state or tenant (vLLM events: age, tenant, medium)
  l        show or hide the engine log
  \\        filter the log by text, any case (enter or esc closes)
  w        log level: all lines, warnings and up, errors and up
  ctrl+r   refresh now
  pgdn     scroll this help or a detail (also ↑ ↓ pgup home end)

Admin token: --admin-token, or ${env}.
Block map: one glyph per cell; when blocks outnumber cells a cell shows
the most interesting state among its blocks (swapped > pending free >
filling > full > cached > free); by tenant, the one owning most of them.
Trends: the last two minutes; the label gives the latest value and the
window's maximum.

esc / q / ? closes this help."""


class HelpScreen(ModalScreen[None]):
    """The help, in a box no taller than the terminal that the arrow keys scroll: on 100x30 it was taller than the
    screen, its borders and last lines off it."""

    BINDINGS: ClassVar[list[BindingType]] = [("escape,q,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(HELP.replace("${env}", f"${ADMIN_TOKEN_ENV}"), id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help", VerticalScroll).focus()


class ConfirmScreen(ModalScreen[bool]):
    """Asks `question`; dismisses with True for yes (`y` or the button), False for no."""

    BINDINGS: ClassVar[list[BindingType]] = [("y", "answer(True)", "yes"), ("n,escape", "answer(False)", "no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            # A Static wraps (a Label cut the fix's description at the box's edge: what was being confirmed)
            yield Static(self.question, id="question")
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
        # Focused, so that the arrow keys and page keys scroll it: a diagnosis's fix comes after its evidence,
        # below the fold of a 30-row terminal, and only a mouse could reach it.
        with VerticalScroll(id="detail"):
            yield Label(Text(self.title_text, style="bold"), id="detail-title")
            yield Static(self.body, id="detail-body")
            yield Label(Text("esc closes; ↑ ↓ pgup pgdn scroll", style="dim"))

    def on_mount(self) -> None:
        self.query_one("#detail", VerticalScroll).focus()
