"""The diagnoses panel: the active diagnoses of every engine, filtered by `/`, and below the table
the highlighted one in full: its title, its whole summary (wrapped: the table's summary column is
only as wide as the panel leaves it), its proposed fix and its evidence."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable

from kvops.row_table import RowTable
from kvops.schema.diagnosis import Diagnosis
from kvops.top.widgets.common import Detail, Readout, TablePanel, filter_suffix, matches

SEVERITY_COLOURS = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def row_key(d: Diagnosis) -> str:
    return "|".join(d.key)


class DiagnosesPanel(TablePanel):
    def __init__(self) -> None:
        super().__init__("diagnoses", id="diagnoses-panel")
        self.diagnoses: list[Diagnosis] = []
        self.filter_text = ""

    def compose(self) -> ComposeResult:
        yield RowTable(id="diagnoses")
        # Grows with its text (a summary is a sentence with numbers), so nothing in it is cut off.
        yield Readout(id="diagnosis-detail", grows=True)

    def on_mount(self) -> None:
        self.query_one(RowTable).add_columns("sev", "engine", "rule", "subject", "summary")

    def show_diagnoses(self, diagnoses: list[Diagnosis]) -> None:
        self.diagnoses = diagnoses
        self.redraw()

    def set_filter(self, needle: str) -> None:
        self.filter_text = needle
        self.border_title = f"diagnoses{filter_suffix(needle)}"
        self.redraw()

    def visible(self) -> list[Diagnosis]:
        return [d for d in self.diagnoses
                if matches(self.filter_text, d.engine, d.rule, d.subject, d.title, d.summary)]

    def redraw(self) -> None:
        rows = [(row_key(d), (Text(d.severity.value, style=SEVERITY_COLOURS.get(d.severity.value, "")), d.engine,
                              d.rule, d.subject, d.summary)) for d in self.visible()]
        self.query_one(RowTable).fill(rows)
        self.show_selected()

    @property
    def selected(self) -> Diagnosis | None:
        key = self.query_one(RowTable).selected_key()
        return next((d for d in self.visible() if row_key(d) == key), None)

    def on_data_table_row_highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self.show_selected()

    def show_selected(self) -> None:
        d = self.selected
        detail = self.query_one("#diagnosis-detail", Readout)
        if d is None:
            detail.show("")
            return
        text = Text()
        text.append(f"{d.title}\n", style="bold")
        text.append(f"{d.summary}\n")
        # The fix before the evidence: when the panel is short, the action is what must show; the
        # whole evidence is one `enter` away.
        text.append(f"fix ({d.fix.kind.value}): {d.fix.description}  [f applies]\n" if d.fix else "no fix proposed\n",
                    style="green" if d.fix else "dim")
        text.append("evidence: " + ", ".join(f"{k}={v}" for k, v in d.evidence.items()))
        detail.show(text)

    def detail(self, key: str) -> Detail | None:
        d = next((d for d in self.diagnoses if row_key(d) == key), None)
        return None if d is None else (f"{d.rule} on {d.engine}", diagnosis_detail(d))


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
