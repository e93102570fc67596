"""Child processes kvops starts (engines, an embedded supervisor): they run in a session of their own at
their parent's priority, die with their parent, and listen on a port chosen free at start. Shared by the
supervisor and `kvops top`, so neither imports the other."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends SIGTERM when the parent dies."""
    with contextlib.suppress(OSError):  # not Linux: the parent's own shutdown path still stops the child
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_in_own_session(argv: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Popen(argv, **popen) in a session of its own (a Ctrl-C at kvops's terminal reaches kvops, which stops
    the child in order; the child's whole group can be signalled), at this process's priority.

    Linux's autogroup schedules each session as one group at nice 0, whatever the nice level of the
    processes in it: a child in a new session would compete as the equal of everything else, so
    `nice -n 19 kvops run` would not be niced where it matters, its engines. The child's group gets
    the parent's nice level instead (seen: a nice-19 CPU burner in a session of its own slowed a
    2-thread matmul beside it 10x, and not at all once its group was at nice 19)."""
    child: subprocess.Popen[bytes] = subprocess.Popen(argv, start_new_session=True, **popen)
    keep_priority(child.pid)
    return child


def keep_priority(pid: int) -> None:
    """Give the autogroup of `pid` (a session leader) this thread's nice level; nothing where the kernel has
    no autogroup or refuses (a negative level needs privilege)."""
    try:
        nice = os.getpriority(os.PRIO_PROCESS, 0)  # Linux keeps it per thread
    except (AttributeError, OSError):  # not Unix
        return
    if nice == 0:
        return
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the child binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def reserve_port(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A port held for a child that binds it later (a free one for port 0): a socket bound with SO_REUSEADDR that
    never listens. Until it is closed, no other process's bind(0) or outgoing connection takes the port (on a busy
    machine one did, in the seconds an engine loads before it binds, and every restart on that port failed), while
    the child, which binds with SO_REUSEADDR (uvicorn, vLLM), still can. OSError when something else holds it."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def process_tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants now (vLLM's API server and its engine core); [] for one that is gone.
    A member can still exit while the caller reads it: catch psutil.Error per member."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


@dataclass(frozen=True)
class Launch:
    """A child process to start, as a managed engine's launcher gives it (the supervisor starts it)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    shown_from: int = 3  # argv[shown_from:] is what the log shows (not the interpreter and module)


class NotReady(RuntimeError):
    """A server kvops started exited, or did not answer /health in time; the message says which, with the end
    of its log when there is one."""


def start_engine_server(port: int, args: list[str], log: IO[bytes] | int = subprocess.DEVNULL,
                        ) -> subprocess.Popen[bytes]:
    """`kvops engine serve` on `port` in its own process group (benchmarks start one beside vLLM)."""
    return start_in_own_session([sys.executable, "-m", "kvops", "engine", "serve", "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, so that the child drains and exits on its own, then SIGKILL after `timeout_s`; waits for it."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float, name: str = "the server",
                 log_path: Path | None = None) -> float:
    """Seconds until GET {url}/health answers 200. NotReady when the process exits first or the time runs out."""
    import httpx

    def log_tail() -> str:
        if log_path is None or not log_path.exists():
            return ""
        return f"; the end of its log ({log_path}):\n{log_path.read_text(errors='replace')[-1500:]}"

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise NotReady(f"{name} exited with code {process.returncode} before it was ready{log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200:
                return time.monotonic() - started
        time.sleep(0.5)
    raise NotReady(f"{name} did not answer {url}/health within {timeout_s:.0f} s{log_tail()}")
