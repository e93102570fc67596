"""Waiting in tests for something real processes do: poll a check until it gives a truthy value."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx


def wait_for(what: str, check: Callable[[], Any], timeout_s: float,
             procs: Sequence[subprocess.Popen[bytes]] = (), every_s: float = 0.25) -> Any:
    """The first truthy value of `check()`; an HTTP error or a missing key counts as not yet. Fails
    at once, with its stderr, when one of `procs` exits meanwhile, and after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace")[-3000:] if proc.stderr else ""
                raise AssertionError(f"{' '.join(map(str, proc.args))[:120]} exited {proc.returncode} while waiting "
                                     f"for {what}: {err}")
        try:
            value = check()
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            value = None
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s` (a clean stop first: servers drain)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
