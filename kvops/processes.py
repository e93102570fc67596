"""Child processes kvops starts (engines, an embedded supervisor): they die with their parent, and they
listen on a port chosen free at start. Shared by the supervisor and `kvops top`, so neither imports the
other."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket

PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends SIGTERM when the parent dies."""
    with contextlib.suppress(OSError):  # not Linux: the parent's own shutdown path still stops the child
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the child binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
