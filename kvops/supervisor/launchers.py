"""How each kind of managed engine is started, read and reconfigured: chosen once per engine (`launcher_for`).

A launcher gives the command, environment and working directory of a start, the client that health-checks
the engine and reads its snapshot, which of its output streams hold the lines worth keeping when it dies, and
how a restart fix's settings (kvops setting names) become the engine's args. ManagedEngine does the rest
(start, restart with backoff, crash loop, drain) the same way for every kind.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvops.adapters import WatchedEngineClient
from kvops.engine.args import engine_flags
from kvops.supervisor.config import EngineSpec
from kvops.supervisor.engine_client import EngineClient
from kvops.vllm.flags import args_for_fix, resolve_python, server_settings, with_drain
from kvops.vllm.install import neutral_cwd
from kvops.vllm.launch import server_argv, server_env


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    shown_from: int = 3  # argv[shown_from:] is what the log shows (not the interpreter and module)


class Launcher(Protocol):
    kind: str
    tail_streams: tuple[str, ...]  # the streams whose last lines are kept for the exit record and errors

    def launch(self, spec: EngineSpec, port: int, args: Mapping[str, Any], admin_token: str) -> Launch: ...

    def client(self, url: str, admin_token: str | None) -> EngineClient: ...

    def with_settings(self, args: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]: ...


class KvopsLauncher:
    """`python -m kvops engine serve`, read from /stats, with the supervisor's admin token."""

    kind = "kvops"
    tail_streams = ("stderr",)  # stdout holds the JSON log; a crash's traceback is on stderr

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec

    def launch(self, spec: EngineSpec, port: int, args: Mapping[str, Any], admin_token: str) -> Launch:
        argv = [sys.executable, "-m", "kvops", "engine", "serve", "--host", spec.host, "--port", str(port),
                "--drain-timeout", str(spec.drain_timeout_s), *engine_flags(args)]
        return Launch(argv, {**os.environ, "KVOPS_ADMIN_TOKEN": admin_token, "PYTHONUNBUFFERED": "1"})

    def client(self, url: str, admin_token: str | None) -> EngineClient:
        return EngineClient(url, admin_token)

    def with_settings(self, args: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        return {**args, **params}


class VllmLauncher:
    """vLLM's OpenAI server (kvops.vllm.launch) from the configured interpreter, read from /metrics through
    kvops.adapters like a watched vLLM; it has no kvops admin API, so it gets no admin token."""

    kind = "vllm"
    tail_streams = ("stdout", "stderr")  # vLLM logs to stdout

    def __init__(self, spec: EngineSpec) -> None:
        self.python: Path = resolve_python(spec.python)

    def launch(self, spec: EngineSpec, port: int, args: Mapping[str, Any], admin_token: str) -> Launch:
        settings = server_settings(with_drain(args, spec.drain_timeout_s), spec.host, port)
        env = {**server_env(settings), "PYTHONUNBUFFERED": "1"}
        return Launch(server_argv(self.python, settings), env, str(neutral_cwd()))

    def client(self, url: str, admin_token: str | None) -> EngineClient:
        return WatchedEngineClient(url, "vllm")

    def with_settings(self, args: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        return args_for_fix(args, params)


LAUNCHERS: dict[str, type[KvopsLauncher] | type[VllmLauncher]] = {
    "auto": KvopsLauncher, "kvops": KvopsLauncher, "vllm": VllmLauncher}


def launcher_for(spec: EngineSpec) -> Launcher:
    return LAUNCHERS[spec.kind](spec)
