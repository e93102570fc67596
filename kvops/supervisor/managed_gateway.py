"""The `kvops gateway` in front of an engine, as the supervisor holds it: one it starts and keeps running
([engines.gateway] without `url`), or one that runs on its own (`url`), which it only reads and fixes through.

A managed gateway is `python -m kvops gateway --upstream <the engine's URL>` in its own process group, dying with
the supervisor, its output in `gateway-<engine>.log` in the state dir (a file, never a pipe nobody reads). What it is
started with (its key file, policy file, variables and flags) is checked before anything starts, by `kvops run` and
`kvops run --check-config` alike (kvops.supervisor.gateway_preflight). Its admin token is fresh at every start
unless `admin_token_env` names one; it reaches the child through an environment variable and the fixes through
`GatewayHandle.admin_token`, never a command line.

An exit is noticed at the next poll and recorded, with the last lines of its log, in the engine's history
(`EngineHistory.gateway`, which the `gateway_down` rule reads). Exit code 2 is the gateway refusing its
configuration: it is not started again, since it would refuse it again. Any other exit is started again after the
backoff of [engines.gateway] `restart` (1 s, doubling to 30 s; back to 1 s once it has run for a minute), and not
again once it has exited `crash_loop_exits` times within `crash_loop_window_s`, as a managed engine. Stopped, it
starts again on `POST /api/engines/<engine>/resume` (`resume`). A gateway started again has forgotten the live
policy changes: a fix still being judged is sent again by its job.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from kvops.history import GATEWAY_CONFIG_ERROR_EXIT, EngineHistory, GatewayRecord
from kvops.processes import die_with_parent, free_port, start_in_own_session, stop_process
from kvops.schema.engines import EngineExit
from kvops.supervisor.engine_spec import GatewaySpec

log = structlog.get_logger("kvops.supervisor")

TOKEN_VARIABLE = "KVOPS_GATEWAY_ADMIN_TOKEN"  # the child's environment: how its admin token reaches it
STOP_TIMEOUT_S = 10.0
LOG_TAIL_LINES = 10  # of gateway-<engine>.log, kept with each exit
LOG_TAIL_BYTES = 64 * 1024  # read from the end of the log for them: a long-running gateway's log is large


def gateway_argv(spec: GatewaySpec, upstream: str, listen: str) -> list[str]:
    """The `kvops gateway` flags a managed gateway is started with (the preflight parses the same ones)."""
    given = {"api_keys_file": spec.api_keys_file, "api_keys_env": spec.api_keys_env,
             "policy_file": spec.policy_file, "upstream_api_key_env": spec.upstream_api_key_env, **spec.args}
    return ["--upstream", upstream, "--listen", listen, "--admin-token-env", TOKEN_VARIABLE,
            "--upstream-kind", spec.upstream_kind,
            *(part for name, value in given.items() if value is not None
              for part in (f"--{name.replace('_', '-')}", str(value)))]


def describe_exit(code: int) -> str:
    """A return code as people read it: `exit code 2`, `exit code -9 (SIGKILL)`."""
    if code >= 0:
        return f"exit code {code}"
    with contextlib.suppress(ValueError):
        return f"exit code {code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


class GatewayHandle:
    """What the rest of the supervisor knows of an engine's gateway: its base URL and admin token (None when kvops
    knows none: an external gateway without admin_token_env), and for a managed one, its process and its record in
    the engine's history."""

    def __init__(self, engine: str, spec: GatewaySpec, state_dir: Path, clock: Callable[[], float] = time.time,
                 history: EngineHistory | None = None) -> None:
        self.engine = engine
        self.spec = spec
        self.clock = clock  # unix seconds: the exits it records are read by the rules against theirs
        self.managed = spec.managed
        self.log_path = state_dir / f"gateway-{engine}.log"
        self.record = GatewayRecord(log=str(self.log_path))
        if history is not None and self.managed:
            history.gateway = self.record
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.exits = 0
        self.last_exit = ""
        self._upstream = ""
        self._started_at = 0.0
        self._log_offset = 0  # where this start's output begins in the log
        self._next_start_at: float | None = None
        self._backoff_s = spec.restart.initial_backoff_s
        self._closed = False
        self._lock = threading.Lock()  # the poll loop checks it, a request thread may resume it
        configured = os.environ.get(spec.admin_token_env) if spec.admin_token_env else None
        if spec.admin_token_env is not None and not configured:
            log.warning("gateway admin token not set: fixes through it will fail", engine=engine,
                        variable=spec.admin_token_env)
        self.admin_token: str | None = configured or (secrets.token_urlsafe(24) if self.managed else None)
        if self.managed:
            host, port = spec.listen.rsplit(":", 1)
            self.url = f"http://{host}:{int(port) or free_port(host)}"
        else:
            self.url = str(spec.url)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def start(self, upstream: str) -> None:
        """Start the managed gateway in front of `upstream` (nothing for an external one)."""
        if not self.managed or self._closed:
            return
        self._upstream = upstream
        argv = [sys.executable, "-m", "kvops", "gateway",
                *gateway_argv(self.spec, upstream, self.url.removeprefix("http://"))]
        env = dict(os.environ, **{TOKEN_VARIABLE: str(self.admin_token)})
        with self.log_path.open("ab") as output:
            self._log_offset = output.tell()
            self.process = start_in_own_session(argv, stdout=output, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)
        self.starts += 1
        self._started_at, self._next_start_at = self.clock(), None
        self.record.down_since = None
        log.info("gateway started", engine=self.engine, pid=self.process.pid, url=self.url, upstream=upstream,
                 log=str(self.log_path))

    def check(self) -> bool:
        """Every poll: notice an exit and start the gateway again when its backoff is over. True while it runs (an
        external gateway: always, as far as kvops can tell)."""
        if not self.managed:
            return True
        with self._lock:
            now = self.clock()
            process = self.process
            if process is not None and process.poll() is not None:
                self._on_exit(process, now)
            due = self._next_start_at is not None and now >= self._next_start_at
            if self.process is None and due and not self.record.stopped:
                self.start(self._upstream)
            if self.process is not None and now - self._started_at >= self.spec.restart.stable_after_s:
                self._backoff_s = self.spec.restart.initial_backoff_s
            return self.process is not None

    def _on_exit(self, process: subprocess.Popen[bytes], now: float) -> None:
        """Record the exit with its log's last lines, then decide: a configuration error or a crash loop stops it,
        anything else is started again after the backoff."""
        code = process.returncode
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # what it may have left in its group
        self.process = None
        self.exits += 1
        self.last_exit = describe_exit(code)
        lines = self._log_tail()
        self.record.record_exit(EngineExit.of(now, code, lines))
        policy = self.spec.restart
        recent = self.record.exits_within(policy.crash_loop_window_s, now)
        if code == GATEWAY_CONFIG_ERROR_EXIT:
            self.record.stopped = (f"it refused its configuration ({self.last_exit}): not started again until "
                                   "the cause in its log is fixed and it is resumed")
        elif len(recent) >= policy.crash_loop_exits:
            self.record.stopped = (f"crash loop: {len(recent)} exits in {policy.crash_loop_window_s:g} s, the "
                                   f"last with {self.last_exit}; not started again until it is resumed")
        if self.record.stopped:
            log.error("gateway exited; not restarting", engine=self.engine, how=self.last_exit,
                      why=self.record.stopped, last_lines=list(lines[-3:]), log=str(self.log_path))
            return
        self._next_start_at = now + self._backoff_s
        log.warning("gateway exited; restarting", engine=self.engine, how=self.last_exit, in_s=self._backoff_s,
                    last_lines=list(lines[-3:]), log=str(self.log_path))
        self._backoff_s = min(self._backoff_s * 2, policy.max_backoff_s)

    def _log_tail(self) -> tuple[str, ...]:
        """The last lines this start wrote to its log (never an earlier start's)."""
        try:
            with self.log_path.open("rb") as output:
                size = output.seek(0, os.SEEK_END)
                output.seek(max(self._log_offset, size - LOG_TAIL_BYTES))
                text = output.read().decode(errors="replace")
        except OSError as exc:
            return (f"(its log {self.log_path} cannot be read: {exc.strerror or exc})",)
        return tuple(line for line in text.splitlines() if line.strip())[-LOG_TAIL_LINES:]

    def resume(self) -> bool:
        """A person says try again (POST /api/engines/<engine>/resume): a gateway kvops stopped starting is started
        at the next poll, its backoff from the start. False when it was not stopped."""
        with self._lock:
            if not self.managed or self._closed or not self.record.stopped:
                return False
            self.record.stopped = ""
            self._backoff_s = self.spec.restart.initial_backoff_s
            self._next_start_at = self.clock()
            log.info("gateway resumed", engine=self.engine)
            return True

    def stop(self) -> None:
        """SIGTERM (it drains its streams), then SIGKILL; nothing starts it again."""
        with self._lock:
            self._closed = True
            process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        stop_process(process, STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        log.info("gateway stopped", engine=self.engine, exit_code=process.returncode)

    def view(self) -> dict[str, object]:
        """For GET /api/engines (the fields of kvops.schema.engines.GatewayLink the handle knows)."""
        latest = self.record.exits[-1] if self.record.exits else None
        return {"url": self.url, "managed": self.managed, "pid": self.pid, "starts": self.starts, "exits": self.exits,
                "last_exit": self.last_exit, "admin": self.admin_token is not None, "stopped": self.record.stopped,
                "restart_at": self._next_start_at if self.process is None else None,
                "last_lines": list(latest.stderr_tail) if latest is not None else [],
                "log": str(self.log_path) if self.managed else ""}
