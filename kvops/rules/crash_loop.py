"""Crash loop: the engine keeps exiting.

Fires when the engine manager gave up restarting (`history.crash_loop`) or when `max_exits`
abnormal exits happened within the window. An exit with code 0 is a requested stop (a managed
restart, a shutdown), not a crash, and does not count.
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.rules.common import RuleSettings, diagnosis
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.schema.engines import EngineExit

RULE_ID = "crash_loop"
TITLE = "Crash loop: the engine keeps exiting"
CLEAR_FOR_S = 0.0  # it ends by a person's resume (or a fix), never by a value wavering at a threshold
DESCRIPTION = "the engine exited abnormally several times within minutes, or its manager stopped restarting it"


class Settings(RuleSettings):
    window_s: float = Field(600.0, gt=0, description="exits are counted over this window")
    max_exits: int = Field(3, ge=1, description="abnormal exits within the window that make a crash loop")
    stderr_lines: int = Field(10, ge=0, description="last stderr lines of the latest exit kept in the evidence")


def _crashed(event: EngineExit) -> bool:
    return event.exit_code != 0


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    crashes = [e for e in history.exits_within(settings.window_s, now) if _crashed(e)]
    if not history.crash_loop and len(crashes) < settings.max_exits:
        return []
    # The latest abnormal exit explains the loop, even when it fell out of the window.
    latest = crashes[-1] if crashes else next((e for e in reversed(history.exits) if _crashed(e)), None)
    stderr = "\n".join(latest.stderr_tail[-settings.stderr_lines:]) if latest and settings.stderr_lines else ""
    if history.crash_loop:
        advice = "the engine manager stopped restarting it: fix the cause in the last stderr lines, then restart it"
        headline = "the engine manager gave up restarting"
    else:
        advice = "the engine manager keeps restarting it with backoff: read the last stderr lines for the cause"
        headline = f"{len(crashes)} crashes in {settings.window_s:.0f} s"
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.CRITICAL, headline + (f"; last: {latest.describe()}" if latest else ""),
        {
            "crash_loop": history.crash_loop,
            "exits_in_window": len(crashes),
            "window_s": settings.window_s,
            "exit_codes": ",".join(str(e.exit_code) for e in crashes if e.exit_code is not None),
            "signals": ",".join(str(e.signal) for e in crashes if e.signal is not None),
            "last_exit_at": None if latest is None else latest.t,
            "last_exit_code": None if latest is None else latest.exit_code,
            "last_signal": None if latest is None else latest.signal,
            "last_stderr": stderr,
            "restarts_total": history.restarts_total,
        },
        fix=Fix(kind=FixKind.REPORT, action="advice", description=advice),
    )]
