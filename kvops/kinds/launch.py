"""How a managed engine is started, read and reconfigured, whatever its kind: `Launch` and the `Launcher`
protocol. Each managed kind's module (kvops.kinds.kvops, kvops.kinds.vllm) defines its launcher as its
profile's `launcher`; `launcher_for` picks it once per engine.

A launcher gives the command, environment and working directory of a start, the client that health-checks
the engine and reads its snapshot, which of its output streams hold the lines worth keeping when it dies, and
how a restart fix's settings (kvops setting names) become the engine's args. ManagedEngine does the rest
(start, restart with backoff, crash loop, drain) the same way for every kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the supervisor's types, named here only for the checker: kinds sit below the supervisor
    from kvops.adapters.engine_client import EngineClient
    from kvops.supervisor.config import EngineSpec


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


def launcher_for(spec: EngineSpec) -> Launcher:
    """The launcher of a managed engine's kind (`auto`, managed, is a kvops engine)."""
    from kvops.kinds import managed_profile

    make = managed_profile(spec.kind).launcher
    if make is None:
        raise ValueError(f"kvops does not manage {spec.kind} engines")
    launcher: Launcher = make(spec)
    return launcher
