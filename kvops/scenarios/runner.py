"""Running a fault scenario: a real supervisor with a managed engine, a workload, and a stopwatch.

A scenario injects one fault and follows the whole loop: the fault's first signal in the
snapshots → the diagnosis (with its evidence) → the fix (automatic, or applied as a person
would) → the verdict. The context records when each of those happened, so the report can say
how long detection and a verified fix took.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog
from pydantic import BaseModel, Field

from kvops.history import EngineHistory
from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Diagnosis
from kvops.schema.snapshot import Snapshot
from kvops.supervisor.config import parse_config
from kvops.supervisor.supervisor import Supervisor

log = structlog.get_logger("kvops.scenarios")

ENGINE = "default"


class Check(BaseModel):
    name: str
    passed: bool
    detail: str = ""


class ScenarioResult(BaseModel):
    name: str
    title: str
    passed: bool = False
    checks: list[Check] = Field(default_factory=list)
    signal_at_s: float | None = None  # seconds from scenario start: the fault's first signal in a snapshot
    diagnosed_at_s: float | None = None
    fix_applied_at_s: float | None = None
    verified_at_s: float | None = None
    detection_s: float | None = None  # diagnosed - signal
    time_to_verified_fix_s: float | None = None  # verified - signal
    metric: str = ""
    before: float | None = None
    after: float | None = None
    evidence: dict[str, Any] = Field(default_factory=dict)
    audit: list[dict[str, Any]] = Field(default_factory=list)
    command: str = ""
    duration_s: float = 0.0
    error: str = ""

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(Check(name=name, passed=bool(passed), detail=detail))
        return bool(passed)


class ScenarioContext:
    """`with ScenarioContext(...) as ctx:` starts the supervisor and waits for the engine."""

    def __init__(self, engine_args: dict[str, Any], rules: dict[str, Any] | None = None,
                 supervisor: dict[str, Any] | None = None, restart: dict[str, Any] | None = None,
                 state_dir: Path | None = None, wait_ready: bool = True, drain_timeout_s: float = 10.0,
                 kind: str = "kvops", gateway: dict[str, Any] | None = None) -> None:
        """A managed engine of `kind` (kvops or vllm) with `engine_args`; `gateway`: an [engines.gateway] table, a
        `kvops gateway` the supervisor starts in front of it."""
        self._tmp = tempfile.TemporaryDirectory(prefix="kvops-scenario-") if state_dir is None else None
        state = Path(self._tmp.name) if self._tmp else state_dir
        self.state_dir = state
        engine: dict[str, Any] = {"name": ENGINE, "kind": kind, "args": engine_args, "drain_timeout_s": drain_timeout_s}
        if restart:
            engine["restart"] = restart
        if gateway is not None:
            engine["gateway"] = gateway
        self.config = parse_config({
            # Short windows to keep scenarios short: fixes are judged on 10 s before and after, with at least
            # 10 requests in each (the defaults: 60 s and 20).
            "supervisor": {"state_dir": str(state), "poll_interval_s": 0.5, "verify_after_s": 10,
                           "alert_warmup_s": 0, "judge": {"min_traffic": 10}, **(supervisor or {})},
            "engines": [engine],
            "rules": rules or {},
        }, "scenario")
        self.sup = Supervisor(self.config)
        self.started = time.monotonic()
        self._wait_ready = wait_ready

    def __enter__(self) -> ScenarioContext:
        self.sup.start()
        try:
            if self._wait_ready:
                # A vLLM's first start on 2 CPUs takes minutes (docs/vllm.md); a kvops engine's seconds.
                self.wait_until("the engine to answer", lambda: self.history.is_up and self.latest is not None, 480)
            if self._wait_ready and self.state.gateway is not None:
                self.wait_until("the gateway to answer", self._gateway_up, 60)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _gateway_up(self) -> bool:
        import httpx  # only the gateway scenarios ask

        try:
            return httpx.get(f"{self.gateway_url}/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def gateway_url(self) -> str:
        """The base URL of the gateway the supervisor started in front of the engine (clients send through it)."""
        handle = self.state.gateway
        if handle is None or not handle.url:
            raise RuntimeError("this scenario's engine has no gateway")
        return str(handle.url)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.sup.stop()
        if self._tmp:
            self._tmp.cleanup()

    # ------------------------------------------------------------ reading

    @property
    def state(self) -> Any:
        return self.sup.engines[ENGINE]

    @property
    def history(self) -> EngineHistory:
        return self.state.history

    @property
    def latest(self) -> Snapshot | None:
        return self.history.latest

    @property
    def url(self) -> str:
        return str(self.state.url)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def diagnoses(self, rule: str) -> list[Diagnosis]:
        return [d for d in self.sup.diagnoses if d.rule == rule]

    def audit(self, rule: str | None = None) -> list[AuditEntry]:
        return [e for e in self.sup.fixes.audit.entries if rule is None or e.rule == rule]

    # ------------------------------------------------------------ waiting

    def wait_until(self, what: str, condition: Callable[[], Any], timeout_s: float) -> Any:
        """Poll `condition` until it is truthy; returns its value. Raises TimeoutError naming `what`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")

    def wait_signal(self, what: str, signal: Callable[[Snapshot], bool], timeout_s: float) -> float:
        """Seconds from start to the first snapshot showing the fault (checked as snapshots arrive)."""
        def seen() -> float | None:
            for snap in self.history.window(timeout_s + 60):
                if signal(snap):
                    return snap.time
            return None
        signal_time = self.wait_until(what, seen, timeout_s)
        return self.since_start(signal_time)

    def wait_diagnosis(self, rule: str, timeout_s: float,
                       where: Callable[[Diagnosis], bool] = lambda d: True) -> tuple[Diagnosis, float]:
        found = self.wait_until(f"diagnosis {rule}", lambda: [d for d in self.diagnoses(rule) if where(d)],
                                timeout_s)
        return found[0], self.elapsed()

    def wait_audit(self, rule: str, actions: tuple[str, ...], timeout_s: float) -> tuple[AuditEntry, float]:
        entries = self.wait_until(f"{rule} fix {'/'.join(actions)}",
                                  lambda: [e for e in self.audit(rule) if e.action in actions], timeout_s)
        return entries[0], self.since_start(entries[0].time)

    def since_start(self, unix_time: float) -> float:
        """A unix timestamp as seconds since this scenario started."""
        return unix_time - (time.time() - self.elapsed())


def tenant_hit_rate(history: EngineHistory, tenants: tuple[str, ...], start: float, end: float) -> float | None:
    """Prefix-cache hit rate of some tenants between two unix times, from the engine's own counters."""
    snaps = [s for s in history.snapshots if start <= s.time <= end]
    if len(snaps) < 2:
        return None
    first, last = snaps[0], snaps[-1]

    def total(snap: Snapshot, field: str) -> int:
        return sum(getattr(snap.tenants[t], field) for t in tenants if t in snap.tenants)

    prompt = total(last, "prompt_tokens_total") - total(first, "prompt_tokens_total")
    hits = total(last, "hit_tokens_total") - total(first, "hit_tokens_total")
    return hits / prompt if prompt > 0 else None
