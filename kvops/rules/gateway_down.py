"""Gateway down: the `kvops gateway` kvops runs in front of the engine is not running.

The engine answers kvops directly, so neither `engine_down` nor `crash_loop` sees it: its clients, who reach it
through the gateway, get "connection refused". Reads what the gateway's manager records in `history.gateway`
(kvops.supervisor.managed_gateway): it fires at once when the manager stopped starting it (exit code 2, the gateway
refusing its configuration, or a crash loop), and when it has been down `min_down_s` while a restart is still due.
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import GATEWAY_CONFIG_ERROR_EXIT, EngineHistory, GatewayRecord
from kvops.rules.common import RuleSettings, diagnosis
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.schema.engines import EngineExit

RULE_ID = "gateway_down"
TITLE = "Gateway down: the engine's clients cannot reach it"
CLEAR_FOR_S = 0.0  # it ends when the gateway is started again, never by a value wavering at a threshold
DESCRIPTION = "the gateway kvops runs in front of the engine exited and is not running"


class Settings(RuleSettings):
    min_down_s: float = Field(10.0, ge=0, description="down this long while a restart is due makes an outage "
                                                      "(a gateway kvops stopped starting fires at once)")
    window_s: float = Field(600.0, gt=0, description="exits are counted over this window, for the evidence")
    log_lines: int = Field(10, ge=0, description="last lines of the gateway's log kept in the evidence")


def _advice(record: GatewayRecord, latest: EngineExit | None, engine: str) -> str:
    resume = f"then POST /api/engines/{engine}/resume (admin token) or restart `kvops run`"
    if record.stopped and latest is not None and latest.exit_code == GATEWAY_CONFIG_ERROR_EXIT:
        return (f"the gateway refused its configuration: fix what the last lines of {record.log} name (the API key "
                f"file, the policy file, a variable or a flag of [engines.gateway]), check it with `kvops run "
                f"--check-config`, {resume}")
    if record.stopped:
        return f"kvops stopped restarting the gateway: read the last lines of {record.log} for the cause, {resume}"
    return f"kvops restarts the gateway with backoff; if it keeps exiting, read the last lines of {record.log}"


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    record = history.gateway
    if record is None or record.down_since is None:
        return []
    down_for = now - record.down_since
    if not record.stopped and down_for < settings.min_down_s:
        return []
    latest = record.exits[-1] if record.exits else None
    how = f"; last: {latest.describe()}" if latest is not None else ""
    headline = (f"not running: {record.stopped}" if record.stopped else
                f"down for {down_for:.0f} s, a restart is due{how}")
    lines = list(latest.stderr_tail[-settings.log_lines:]) if latest is not None and settings.log_lines else []
    if lines:
        headline += f"; its log: {lines[-1]}"
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.CRITICAL, headline,
        {
            "stopped": record.stopped,
            "down_since": record.down_since,
            "down_for_s": round(down_for, 1),
            "exits_in_window": len(record.exits_within(settings.window_s, now)),
            "window_s": settings.window_s,
            "last_exit_code": None if latest is None else latest.exit_code,
            "last_signal": None if latest is None else latest.signal,
            "last_lines": "\n".join(lines),
            "log": record.log,
        },
        fix=Fix(kind=FixKind.REPORT, action="advice", description=_advice(record, latest, history.engine)),
    )]
