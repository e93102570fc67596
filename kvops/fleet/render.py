"""The fleet as rows of text: `kvops top --prometheus --once`, the Textual table and doctor's lines read the cells
from here, so the three say the same thing about an engine."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from kvops.fleet.view import Fleet, FleetEngine

COLUMNS = ("engine", "kind", "status", "worst diagnosis", "KV", "hit", "waiting", "running", "tok/s", "supervisor")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _count(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def worst_text(engine: FleetEngine) -> str:
    """The worst diagnosis and how many more: `kv_oom_runtime (critical) +1`."""
    worst = engine.worst
    if worst is None:
        return "-"
    more = len(engine.diagnoses) - 1
    return f"{worst.rule} ({worst.severity})" + (f" +{more}" if more else "")


def cells(engine: FleetEngine) -> tuple[str, ...]:
    """The row of COLUMNS. Numbers of an engine whose supervisor stopped answering are not shown: they are as old
    as its last scrape."""
    return (engine.engine, engine.kind, engine.status, worst_text(engine), _pct(engine.kv_usage),
            _pct(engine.hit_rate), _count(engine.waiting), _count(engine.running), _rate(engine.tokens_per_s),
            engine.supervisor.url)


def summary(fleet: Fleet) -> str:
    """One line: how many engines, how many in trouble, how many supervisors not answering."""
    troubled = sum(1 for e in fleet.engines if e.status != "ok")
    down = len(fleet.supervisors_down)
    where = f" {{{fleet.selector}}}" if fleet.selector else ""
    return (f"{len(fleet.engines)} engine(s) under {len(fleet.supervisors)} supervisor(s) at "
            f"{fleet.prometheus}{where}: {troubled} need(s) attention"
            + (f", {down} supervisor(s) not answering" if down else ""))


def render_table(fleet: Fleet) -> str:
    """The fleet, worst first, as an aligned text table under its summary line."""
    rows = [COLUMNS, *(cells(e) for e in fleet.engines)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [f"kvops fleet at {time.strftime('%H:%M:%S', time.localtime(fleet.read_at))} — {summary(fleet)}", ""]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    for supervisor in fleet.supervisors_down:
        if not any(e.supervisor is supervisor for e in fleet.engines):
            lines.append(f"(supervisor {supervisor.url} not answering, no engines seen from it in the last hour)")
    return "\n".join(lines) + "\n"


def render_json(fleet: Fleet) -> str:
    """The fleet as JSON for scripts: each engine with its status and supervisor."""
    def engine(e: FleetEngine) -> dict[str, Any]:
        body = asdict(e)
        body["status"] = e.status
        return body

    return json.dumps({"prometheus": fleet.prometheus, "selector": fleet.selector, "read_at": fleet.read_at,
                       "supervisors": [asdict(s) for s in fleet.supervisors],
                       "engines": [engine(e) for e in fleet.engines]}, indent=2) + "\n"
