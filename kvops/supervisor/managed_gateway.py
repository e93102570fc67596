"""The `kvops gateway` in front of an engine, as the supervisor holds it: one it starts and keeps running
([engines.gateway] without `url`), or one that runs on its own (`url`), which it only reads and fixes through.

A managed gateway is `python -m kvops gateway --upstream <the engine's URL>` in its own process group, dying with
the supervisor, its output in `gateway-<engine>.log` in the state dir (a file, never a pipe nobody reads). Its admin
token is fresh at every start unless `admin_token_env` names one; it reaches the child through an environment
variable and the fixes through `GatewayHandle.admin_token`, never a command line. An exit is noticed at the next poll
and the gateway started again after a backoff (1 s, doubling to 30 s; back to 1 s once it has run for a minute). A
gateway started again has forgotten the live policy changes: a fix still being judged is sent again by its job.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from kvops.processes import die_with_parent, free_port, start_in_own_session, stop_process
from kvops.supervisor.engine_spec import GatewaySpec

log = structlog.get_logger("kvops.supervisor")

TOKEN_VARIABLE = "KVOPS_GATEWAY_ADMIN_TOKEN"  # the child's environment: how its admin token reaches it
INITIAL_BACKOFF_S, MAX_BACKOFF_S, STABLE_AFTER_S = 1.0, 30.0, 60.0
STOP_TIMEOUT_S = 10.0


class GatewayHandle:
    """What the rest of the supervisor knows of an engine's gateway: its base URL and admin token (None when kvops
    knows none: an external gateway without admin_token_env), and for a managed one, its process."""

    def __init__(self, engine: str, spec: GatewaySpec, state_dir: Path,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.spec = spec
        self.clock = clock
        self.managed = spec.managed
        self.log_path = state_dir / f"gateway-{engine}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.exits = 0
        self.last_exit = ""
        self._upstream = ""
        self._started_at = 0.0
        self._next_start_at: float | None = None
        self._backoff_s = INITIAL_BACKOFF_S
        self._closed = False
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
        argv = [sys.executable, "-m", "kvops", "gateway", "--upstream", upstream,
                "--listen", self.url.removeprefix("http://"), "--admin-token-env", TOKEN_VARIABLE,
                "--upstream-kind", self.spec.upstream_kind, *self._flags()]
        env = dict(os.environ, **{TOKEN_VARIABLE: str(self.admin_token)})
        with self.log_path.open("ab") as output:
            self.process = start_in_own_session(argv, stdout=output, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)
        self.starts += 1
        self._started_at, self._next_start_at = self.clock(), None
        log.info("gateway started", engine=self.engine, pid=self.process.pid, url=self.url, upstream=upstream,
                 log=str(self.log_path))

    def _flags(self) -> list[str]:
        spec = self.spec
        given = {"api_keys_file": spec.api_keys_file, "api_keys_env": spec.api_keys_env,
                 "policy_file": spec.policy_file, "upstream_api_key_env": spec.upstream_api_key_env, **spec.args}
        return [part for name, value in given.items() if value is not None
                for part in (f"--{name.replace('_', '-')}", str(value))]

    def check(self) -> bool:
        """Every poll: notice an exit and start the gateway again when its backoff is over. True while it runs (an
        external gateway: always, as far as kvops can tell)."""
        if not self.managed:
            return True
        now = self.clock()
        process = self.process
        if process is not None and process.poll() is not None:
            self.exits += 1
            self.last_exit = f"exit code {process.returncode}"
            self.process = None
            self._next_start_at = now + self._backoff_s
            log.warning("gateway exited; restarting", engine=self.engine, how=self.last_exit, in_s=self._backoff_s,
                        log=str(self.log_path))
            self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)
        if self.process is None and self._next_start_at is not None and now >= self._next_start_at:
            self.start(self._upstream)
        if self.process is not None and now - self._started_at >= STABLE_AFTER_S:
            self._backoff_s = INITIAL_BACKOFF_S
        return self.process is not None

    def stop(self) -> None:
        """SIGTERM (it drains its streams), then SIGKILL; nothing starts it again."""
        self._closed = True
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        stop_process(process, STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        log.info("gateway stopped", engine=self.engine, exit_code=process.returncode)

    def view(self) -> dict[str, object]:
        """For GET /api/engines."""
        return {"url": self.url, "managed": self.managed, "pid": self.pid, "starts": self.starts, "exits": self.exits,
                "last_exit": self.last_exit, "admin": self.admin_token is not None,
                **({"log": str(self.log_path)} if self.managed else {})}
