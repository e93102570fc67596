"""What the supervisor serves about its engines: a row of GET /api/engines and a line of
GET /api/engines/{name}/logs. The supervisor builds these; `kvops top` and scripts read them, and
ignore fields they do not know, so a newer supervisor can add some."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from kvops.schema.kv_events import EventStreamHealth


class EngineExit(BaseModel):
    """How a managed engine's process ended."""

    t: float
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    stderr_tail: tuple[str, ...] = ()

    @classmethod
    def of(cls, t: float, returncode: int, stderr_tail: tuple[str, ...]) -> EngineExit:
        """From a Popen return code: negative for the signal that killed it."""
        return cls(t=t, exit_code=returncode if returncode >= 0 else None,
                   signal=-returncode if returncode < 0 else None, stderr_tail=stderr_tail)

    def describe(self) -> str:
        return f"signal {self.signal}" if self.signal is not None else f"exit code {self.exit_code}"


class GatewayLink(BaseModel):
    """The `kvops gateway` in front of an engine, as the supervisor reads it (docs/gateway.md)."""

    url: str
    tenants: int = 0  # tenants in its last /stats/tenants
    errors_total: int = 0  # reads that failed
    error: str = ""  # the last failure, "" once a read succeeds
    managed: bool = False  # kvops started it ([engines.gateway] without url)
    pid: int | None = None  # a managed gateway's process, while it runs
    starts: int = 0  # a managed gateway's starts (restarts after an exit included)
    last_exit: str = ""  # how a managed gateway last exited
    admin: bool = False  # kvops knows its admin token: fixes can go through it
    exits: int = 0  # a managed gateway's exits since the supervisor started
    stopped: str = ""  # why kvops stopped starting a managed gateway again ("" while it runs or a restart is due)
    restart_at: float | None = None  # when a restart is due, after an exit
    last_lines: list[str] = []  # the last lines of its log before its last exit (the reason is usually there)
    log: str = ""  # a managed gateway's output file (gateway-<engine>.log in the state dir)


class EngineEntry(BaseModel):
    """One row of GET /api/engines."""

    model_config = ConfigDict(extra="ignore")

    name: str
    url: str = ""
    kind: str = "kvops"
    managed: bool = False
    up: bool = False
    pid: int | None = None
    restarts: int = 0
    crash_loop: bool = False
    last_error: str | None = None
    last_exit: EngineExit | None = None
    args: dict[str, Any] | None = None  # a managed engine's current settings
    diagnoses: int = 0
    snapshot_time: float | None = None
    started_at: float | None = None  # when the running process started (managed engines)
    restart_at: float | None = None  # when a restart is due, after an exit
    last_log: str | None = None  # the engine's latest log line: what a starting engine is busy with
    data_problems: list[str] = []  # values its metrics reported that cannot be right (kvops.adapters.plausibility)
    events: EventStreamHealth | None = None  # its KV cache event stream, where kvops reads one (docs/vllm.md)
    gateway: GatewayLink | None = None  # the gateway in front of it, where its entry names one


class LogLine(BaseModel):
    """One line of an engine's log as `kvops top` shows it: the engine's own lines (stdout and
    stderr, JSON log records flattened to "event key=value") and the manager's notes (stream "kvops")."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    time: float
    stream: str
    level: str = "info"
    text: str
