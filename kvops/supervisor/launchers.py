"""How the supervisor starts each kind of engine it manages, whatever the kind: the `Launcher` protocol and
the registry, `MANAGED`, from a kind to what starts it.

A launcher gives the command, environment and working directory of a start (`kvops.processes.Launch`), which
of the engine's output streams hold the lines worth keeping when it dies, whether it publishes the KV events
kvops reads, and how a restart fix's settings (kvops setting names) become the engine's args. ManagedEngine
does the rest (start, restart with backoff, crash loop, drain) the same way for every kind. Each launcher sits
beside the process tools it uses (a vLLM's: kvops.vllm.launcher; a kvops engine's, a few lines, here) and
takes plain values: `EngineStart`, written here from the engine's config entry, is what a kind's entry of the
registry reads them from. The kind's profile (kvops.kinds) says what it is; this module says how to run it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvops.adapters.engine_client import EngineClient
from kvops.engine.args import ENGINE_SETTINGS, engine_flags
from kvops.engine.config import EngineConfig
from kvops.events.endpoint import EventSource
from kvops.kinds import Capability, managed_profile
from kvops.kinds import kvops as kvops_kind
from kvops.kinds import vllm as vllm_kind
from kvops.processes import Launch
from kvops.schema.errors import ConfigError
from kvops.vllm import flags as vllm_flags
from kvops.vllm import launcher as vllm_launcher
from kvops.vllm.launch import KvEventsEndpoints
from kvops.watching import WatchedEngineClient


class Launcher(Protocol):
    tail_streams: tuple[str, ...]  # the streams whose last lines are kept for the exit record and errors

    def launch(self, host: str, port: int, args: Mapping[str, Any], drain_timeout_s: float,
               admin_token: str) -> Launch: ...

    def publishes_kv_events(self) -> bool: ...

    def with_settings(self, args: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class EngineStart:
    """What a launcher is told of one managed engine's [[engines]] entry (EngineSpec.start writes it)."""

    name: str
    python: str | None = None
    args: Mapping[str, Any] = field(default_factory=dict)  # as configured (a fix changes the started ones)
    drain_timeout_s: float = 30.0
    events: EventSource | None = None  # where kvops reads its KV events (None: it reads none)


@dataclass(frozen=True)
class ManagedKind:
    """How kvops runs one kind of engine."""

    launcher: Callable[[EngineStart], Launcher]
    check_args: Callable[[dict[str, Any]], dict[str, Any]]  # [engines.args]: returns them; ValueError says why not
    health_timeout_s: float | None = None  # its start timeout when the config gives none
    interpreter: bool = False  # started from the interpreter that [[engines]] `python` names
    # Before kvops run starts it (True: check its flags too); ConfigError says what to do.
    preflight: Callable[[EngineStart, bool], None] | None = None


class KvopsLauncher:
    """`python -m kvops engine serve`, with the supervisor's admin token."""

    tail_streams = ("stderr",)  # stdout holds the JSON log; a crash's traceback is on stderr

    def launch(self, host: str, port: int, args: Mapping[str, Any], drain_timeout_s: float,
               admin_token: str) -> Launch:
        argv = [sys.executable, "-m", "kvops", "engine", "serve", "--host", host, "--port", str(port),
                "--drain-timeout", str(drain_timeout_s), *engine_flags(args)]
        return Launch(argv, {**os.environ, "KVOPS_ADMIN_TOKEN": admin_token, "PYTHONUNBUFFERED": "1"})

    def publishes_kv_events(self) -> bool:
        return False  # it reports its blocks in its snapshot

    def with_settings(self, args: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        return {**args, **params}


def check_engine_args(value: dict[str, Any]) -> dict[str, Any]:
    """[engines.args] of a kvops engine: EngineConfig's settings, checked the way `kvops engine serve` would take
    them."""
    unknown = sorted(set(value) - set(ENGINE_SETTINGS))
    if unknown:
        raise ValueError(f"unknown engine setting {unknown[0]!r}; allowed: {', '.join(ENGINE_SETTINGS)}")
    try:
        EngineConfig(**value)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    except TypeError as exc:
        raise ValueError(f"bad engine setting: {exc}") from None
    return value


def _vllm(start: EngineStart) -> Launcher:
    events = start.events
    endpoints = None if events is None else KvEventsEndpoints(events.endpoint, events.replay_endpoint, events.topic)
    return vllm_launcher.VllmLauncher(start.name, start.python, start.args, endpoints)


def _vllm_preflight(start: EngineStart, flags: bool) -> None:
    vllm_launcher.preflight(start.python, start.args, start.drain_timeout_s, flags)


MANAGED: dict[str, ManagedKind] = {
    kvops_kind.KIND: ManagedKind(launcher=lambda start: KvopsLauncher(), check_args=check_engine_args),
    # vLLM's flags in snake_case, checked here as far as kvops can without asking vLLM; `kvops run --check-config`
    # asks its interpreter (preflight).
    vllm_kind.KIND: ManagedKind(launcher=_vllm, check_args=vllm_flags.check_args,
                                health_timeout_s=vllm_launcher.HEALTH_TIMEOUT_S, interpreter=True,
                                preflight=_vllm_preflight),
}


def managed_kind(kind: str) -> ManagedKind | None:
    """How kvops runs a managed engine configured as `kind` (`auto` is a kvops engine); None: it does not."""
    return MANAGED.get(managed_profile(kind).kind)


def launcher_for(kind: str, start: EngineStart) -> Launcher:
    found = managed_kind(kind)
    if found is None:
        raise ValueError(f"kvops does not manage {kind} engines")
    return found.launcher(start)


def client_for(kind: str, url: str, admin_token: str | None) -> EngineClient:
    """The client that health-checks a managed engine and reads its snapshot: kvops's own, with the
    supervisor's token, where its kind answers /stats; else read from /metrics like a watched server of its
    kind (which has no kvops admin API, so no token)."""
    found = managed_profile(kind)
    if found.can(Capability.STATS):
        return EngineClient(url, admin_token)
    return WatchedEngineClient(url, found.kind)
