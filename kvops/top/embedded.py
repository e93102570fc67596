"""The supervisor `kvops top --start` / `--demo` starts for the session: `kvops run` as a child process.

A child process rather than threads in the TUI's own process: the supervisor's log goes to a
file instead of over the screen, and the TUI stays responsive while the engine loads. The child
gets a fresh admin token (so `f` and `r` work out of the box), a free port on the loopback, dies
with `kvops top` (PR_SET_PDEATHSIG) and is stopped, with its engine, when `kvops top` exits.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections import deque
from pathlib import Path

import platformdirs

from kvops.processes import die_with_parent, reserve_port, stop_process
from kvops.top.client import probe

STOP_TIMEOUT_S = 40.0  # the supervisor drains its engine (up to its drain timeout) before exiting


def supervisor_answers(url: str, timeout_s: float = 0.5) -> bool:
    """True when a kvops supervisor answers at `url` (its /health says how many engines it runs)."""
    return probe(url, timeout_s) is None


def default_state_dir() -> Path:
    return Path(platformdirs.user_state_dir("kvops")) / "top-embedded"


class EmbeddedSupervisor:
    def __init__(self, run_args: list[str] | None = None, state_dir: Path | None = None) -> None:
        self.run_args = list(run_args or [])
        self.state_dir = state_dir or default_state_dir()
        self._port_hold = reserve_port("127.0.0.1")  # nothing else takes it before the supervisor binds it
        self.port = int(self._port_hold.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_token = secrets.token_urlsafe(24)
        self.log_path = self.state_dir / "supervisor.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvops", "run", "--listen", f"127.0.0.1:{self.port}",
                "--state-dir", str(self.state_dir), *self.run_args]

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "KVOPS_ADMIN_TOKEN": self.admin_token, "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def exited(self) -> str | None:
        """Why the supervisor is gone (its exit code and last log lines), or None while it runs."""
        if self.process is None or self.process.poll() is None:
            return None
        return f"the embedded supervisor exited with code {self.process.returncode}: {self.log_tail(3)}"

    def log_tail(self, lines: int = 10) -> str:
        try:
            with self.log_path.open(errors="replace") as log:
                return " | ".join(line.rstrip() for line in deque(log, maxlen=lines))
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        process = self.process
        if process is not None:
            stop_process(process, STOP_TIMEOUT_S)
        self._port_hold.close()
