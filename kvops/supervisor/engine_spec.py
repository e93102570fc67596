"""One engine's entry in the supervisor's configuration (`[[engines]]` in `kvops.example.toml`): managed (kvops
starts it, with its restart policy and, for vLLM, its gateway) or watched (given by URL). Its own module so that
what runs an engine (the managed engine, its gateway) needs this entry only, never the whole configuration, which
also holds the fix machinery's settings.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import platformdirs
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvops.events.endpoint import EventSource, parse_source
from kvops.kinds import AUTO, PROFILES, Capability, kinds, managed_kinds, managed_profile, profile
from kvops.supervisor.launchers import MANAGED, EngineStart, managed_kind
from kvops.vllm.launch import KV_EVENTS_KEY, managed_event_endpoints, read_kv_events_config

ENGINE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
ENGINE_NAME_RULE = "1 to 64 characters of letters, digits, '.', '_' and '-'"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def check_url(value: str) -> str:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL: write e.g. http://127.0.0.1:8000")
    return value.rstrip("/")


def check_listen(value: str) -> str:
    if not re.fullmatch(r"[^\s:]+:\d{1,5}", value) or not 0 <= int(value.rsplit(":", 1)[1]) <= 65535:
        raise ValueError(f"{value!r} is not host:port: write e.g. 127.0.0.1:9400")
    return value


class RestartPolicy(StrictModel):
    initial_backoff_s: float = Field(1.0, gt=0)
    max_backoff_s: float = Field(60.0, gt=0)
    crash_loop_exits: int = Field(5, ge=1)  # this many exits ...
    crash_loop_window_s: float = Field(300.0, gt=0)  # ... within this window is a crash loop: stop restarting
    stable_after_s: float = Field(60.0, gt=0)  # up this long: the backoff starts over


# What [engines.gateway] sets itself (the managed gateway's own flags are kvops's to give: upstream, listen, admin).
GATEWAY_OWN_FLAGS = ("upstream", "listen", "admin_token_env", "api_keys_file", "api_keys_env", "policy_file",
                     "upstream_api_key_env", "upstream_kind")


class GatewaySpec(StrictModel):
    """A `kvops gateway` in front of the engine (docs/gateway.md): one kvops starts and keeps running (managed), or,
    with `url`, one that runs on its own and that kvops only reads and fixes through."""

    url: str | None = None  # a gateway kvops does not start
    # Its /admin bearer token, for fixes through it: an external gateway's must be given; a managed one gets a fresh
    # token at every start unless this names one.
    admin_token_env: str | None = None
    listen: str = "127.0.0.1:0"  # managed: where it listens (port 0: a free one at start)
    api_keys_file: str | None = None
    api_keys_env: str | None = None
    policy_file: str | None = None
    upstream_api_key_env: str | None = None
    upstream_kind: Literal["auto", "vllm", "kvops", "openai"] = "auto"
    args: dict[str, Any] = Field(default_factory=dict)  # any other `kvops gateway` flag, snake_case
    # A managed gateway that exits is started again with this backoff, and not again once it exits
    # crash_loop_exits times within crash_loop_window_s (an exit with code 2, a configuration error, stops it at once).
    restart: RestartPolicy = Field(default_factory=lambda: RestartPolicy(max_backoff_s=30.0))

    @property
    def managed(self) -> bool:
        return self.url is None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else check_url(value)

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        return check_listen(value)

    @field_validator("api_keys_file", "policy_file")
    @classmethod
    def _file(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).expanduser().is_file():
            raise ValueError(f"{value!r} is not a file: give the path of an existing file")
        return None if value is None else str(Path(value).expanduser())

    @field_validator("args")
    @classmethod
    def _args(cls, value: dict[str, Any]) -> dict[str, Any]:
        from kvops.gateway.run import gateway_flags

        known = set(gateway_flags()) - set(GATEWAY_OWN_FLAGS)
        for name in value:
            if name not in known:
                what = "is set by its own key here" if name in GATEWAY_OWN_FLAGS else "is not a `kvops gateway` flag"
                raise ValueError(f"args.{name} {what}; flags: {', '.join(sorted(known))}")
        return value

    @model_validator(mode="after")
    def _external_or_managed(self) -> GatewaySpec:
        started = [name for name in ("api_keys_file", "api_keys_env", "policy_file", "upstream_api_key_env",
                                     "listen", "upstream_kind", "args", "restart") if name in self.model_fields_set]
        if self.url is not None and started:
            raise ValueError(f"{', '.join(started)}: these configure a gateway kvops starts; with url kvops starts "
                             "none (give them to that gateway's own command)")
        return self


class EngineSpec(StrictModel):
    """One engine: managed (kvops starts it) or watched (given by URL)."""

    name: str
    url: str | None = None  # watched engine; a managed one gets http://host:port
    managed: bool = True
    # What the engine is: a kind of kvops.kinds (a kvops engine is read from /stats, the others from /metrics),
    # or auto: a managed kvops engine, or a watched server recognised from /metrics and /v1/models at the first poll.
    kind: str = AUTO
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: a free port at start
    # kvops: EngineConfig settings, as `kvops engine serve` flags; vllm: vLLM's flags in snake_case (kvops.vllm.flags)
    args: dict[str, Any] = Field(default_factory=dict)
    python: str | None = None  # a kind started from an interpreter (vllm): the one that has it (kvops.vllm.flags)
    admin_token_env: str | None = None  # watched engine: env var with its admin token (needed for fixes)
    health_timeout_s: float = Field(180.0, gt=0)  # a managed engine: its kind's health_timeout_s unless given
    drain_timeout_s: float = Field(30.0, gt=0)
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    # A `kvops gateway` in front of this engine (docs/gateway.md): its tenants' requests and tokens are read from
    # its /stats/tenants at each poll, and fixes change their policies through its /admin. A URL (an external
    # gateway) or an [engines.gateway] table.
    gateway: GatewaySpec | None = None
    # KV cache events (docs/vllm.md, "KV cache events"). A watched engine: its publisher's endpoint, exactly the
    # string given to that server's --kv-events-config "endpoint" (and its replay endpoint and topic). A managed
    # vLLM publishes on unix sockets in the state dir unless `events = false`, or on the endpoint given here.
    events: str | bool | None = None
    events_replay: str | None = None
    events_topic: str | None = None
    _state_dir: Path | None = PrivateAttr(None)  # the supervisor's, set by KvopsConfig: where the sockets go

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        # The name goes into the supervisor's URLs, metric labels, alert labels and state; a narrow rule keeps
        # all of them plain.
        if not ENGINE_NAME.fullmatch(value):
            raise ValueError(f"an engine name is {ENGINE_NAME_RULE}, e.g. \"gpu-0\"")
        return value

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        if value != AUTO and value not in PROFILES:
            allowed = [repr(kind) for kind in (AUTO, *kinds())]
            raise ValueError(f"Input should be {', '.join(allowed[:-1])} or {allowed[-1]}")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else check_url(value)

    @field_validator("gateway", mode="before")
    @classmethod
    def _gateway(cls, value: object) -> object:
        return {"url": value} if isinstance(value, str) else value

    @field_validator("args")
    @classmethod
    def _args(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        how = managed_kind(info.data.get("kind", AUTO))
        return value if how is None else how.check_args(value)

    @model_validator(mode="after")
    def _managed_or_watched(self) -> EngineSpec:
        if self.url is not None and "managed" not in self.model_fields_set:
            self.managed = False
        if self.managed and self.url is not None:
            raise ValueError("a managed engine gets its URL from host and port: drop url, or set managed = false")
        if not self.managed and self.url is None:
            raise ValueError("a watched engine (managed = false) needs url, e.g. url = \"http://10.0.0.5:8000\"")
        managed_titles = [PROFILES[kind].title for kind in managed_kinds() if kind != AUTO]
        if self.managed and self.kind not in managed_kinds():
            raise ValueError(f"kvops manages {' and '.join(managed_titles)} engines: a {self.kind} server is watched "
                             "(give its url)")
        if not self.managed and self.args:
            raise ValueError("args apply to managed engines only: kvops cannot change a watched engine's flags")
        how = managed_kind(self.kind)
        if self.python is not None and (how is None or not how.interpreter or not self.managed):
            started = [PROFILES[kind] for kind, found in MANAGED.items() if found.interpreter]
            settings = " or ".join(f"kind = {json.dumps(p.kind)}" for p in started)
            raise ValueError(f"python applies to a managed {' or '.join(p.title for p in started)} ({settings}) only")
        if how is not None and how.health_timeout_s is not None and "health_timeout_s" not in self.model_fields_set:
            self.health_timeout_s = how.health_timeout_s
        self._check_events()
        return self

    def _check_events(self) -> None:
        """The events settings make sense for this engine, and its endpoints are ones kvops can read."""
        own = self.args.get(KV_EVENTS_KEY) if self.managed else None
        if isinstance(self.events, str):
            if own is not None:
                raise ValueError(f"events and args.{KV_EVENTS_KEY} both say where the KV events go: keep one")
            try:
                parse_source(self.events, self.events_replay, self.events_topic or "")
            except ValueError as exc:
                raise ValueError(f"events: {exc}") from None
        elif self.events_replay is not None or self.events_topic is not None:
            raise ValueError("events_replay and events_topic go with the publisher's endpoint: add events = "
                             "\"tcp://HOST:PORT\" (or \"ipc:///PATH\"), the endpoint of its --kv-events-config")
        elif self.events is True and not self.managed:
            raise ValueError("events = true: kvops needs the endpoint of a watched engine's publisher; write events = "
                             "\"tcp://HOST:PORT\" (or \"ipc:///PATH\"), the endpoint of its --kv-events-config")
        kind = managed_profile(self.kind) if self.managed else profile(self.kind)
        wanted = isinstance(self.events, str) or self.events is True
        if wanted and (self.managed or self.kind != AUTO) and not kind.can(Capability.KV_EVENTS):
            readers = " and ".join(p.title for p in PROFILES.values() if p.can(Capability.KV_EVENTS))
            raise ValueError(f"events: kvops reads the KV cache events of {readers} servers; a {kind.title} engine "
                             f"{'reports its blocks itself' if self.managed else 'publishes none kvops reads'}")
        if own is not None:
            try:
                found = read_kv_events_config(own)
                if found is not None:
                    parse_source(found.endpoint, found.replay_endpoint, found.topic)
            except ValueError as exc:
                raise ValueError(f"args.{KV_EVENTS_KEY}: {exc}") from None

    def event_source(self) -> EventSource | None:
        """Where kvops reads this engine's KV events; None when it reads none. A managed vLLM's: its own
        args.kv_events_config when given, else the endpoint in `events`, else unix sockets in the state dir. (Its
        launcher also leaves them off on a vLLM older than the events: kvops.vllm.launcher.)"""
        if self.events is False:
            return None
        if not self.managed:
            if not isinstance(self.events, str):
                return None
            return parse_source(self.events, self.events_replay, self.events_topic or "")
        if not managed_profile(self.kind).can(Capability.KV_EVENTS):
            return None
        if KV_EVENTS_KEY in self.args:
            found = read_kv_events_config(self.args[KV_EVENTS_KEY])
            return None if found is None else parse_source(found.endpoint, found.replay_endpoint, found.topic)
        if isinstance(self.events, str):
            return parse_source(self.events, self.events_replay, self.events_topic or "")
        state_dir = self._state_dir or Path(os.path.expanduser(platformdirs.user_state_dir("kvops")))
        found = managed_event_endpoints(state_dir, self.name)
        return parse_source(found.endpoint, found.replay_endpoint, found.topic)


    def start(self) -> EngineStart:
        """What this managed engine's launcher is told of it."""
        return EngineStart(self.name, self.python, dict(self.args), self.drain_timeout_s, self.event_source())
