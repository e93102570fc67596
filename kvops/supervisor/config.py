"""The supervisor's configuration: one TOML file (see `kvops.example.toml`), overridable by flags.

Validation happens once, up front, and every error names the file, the key and what is allowed,
so `kvops run --check-config` can tell a person exactly what to change.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import platformdirs
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvops.alerting import AlertingConfig
from kvops.config_files import first_error, read_toml
from kvops.events.endpoint import EventSource, parse_source
from kvops.kinds import AUTO, PROFILES, Capability, kinds, managed_kinds, managed_profile, profile
from kvops.rules import RULES
from kvops.schema.errors import ConfigError
from kvops.supervisor.fixes.judge import JudgeSettings
from kvops.supervisor.fixes.lease import lease_problem
from kvops.supervisor.launchers import MANAGED, EngineStart, managed_kind
from kvops.supervisor.probes import BlockSizeProfileSettings
from kvops.vllm.launch import KV_EVENTS_KEY, managed_event_endpoints, read_kv_events_config

Policy = Literal["off", "suggest", "auto"]

ENGINE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
ENGINE_NAME_RULE = "1 to 64 characters of letters, digits, '.', '_' and '-'"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_url(value: str) -> str:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL: write e.g. http://127.0.0.1:8000")
    return value.rstrip("/")


def _check_listen(value: str) -> str:
    if not re.fullmatch(r"[^\s:]+:\d{1,5}", value) or not 0 <= int(value.rsplit(":", 1)[1]) <= 65535:
        raise ValueError(f"{value!r} is not host:port: write e.g. 127.0.0.1:9400")
    return value


class RestartPolicy(_Strict):
    initial_backoff_s: float = Field(1.0, gt=0)
    max_backoff_s: float = Field(60.0, gt=0)
    crash_loop_exits: int = Field(5, ge=1)  # this many exits ...
    crash_loop_window_s: float = Field(300.0, gt=0)  # ... within this window is a crash loop: stop restarting
    stable_after_s: float = Field(60.0, gt=0)  # up this long: the backoff starts over


# What [engines.gateway] sets itself (the managed gateway's own flags are kvops's to give: upstream, listen, admin).
GATEWAY_OWN_FLAGS = ("upstream", "listen", "admin_token_env", "api_keys_file", "api_keys_env", "policy_file",
                     "upstream_api_key_env", "upstream_kind")


class GatewaySpec(_Strict):
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

    @property
    def managed(self) -> bool:
        return self.url is None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else _check_url(value)

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        return _check_listen(value)

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
                                     "listen", "upstream_kind", "args") if name in self.model_fields_set]
        if self.url is not None and started:
            raise ValueError(f"{', '.join(started)}: these configure a gateway kvops starts; with url kvops starts "
                             "none (give them to that gateway's own command)")
        return self


class EngineSpec(_Strict):
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
        return None if value is None else _check_url(value)

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

class RuleConfig(_Strict):
    policy: Policy = "suggest"
    settings: dict[str, Any] = Field(default_factory=dict)  # thresholds, validated by the rule's Settings
    # Hold a diagnosis this long after the rule stopped raising it (default: the rule's CLEAR_FOR_S)
    clear_for_s: float | None = Field(None, ge=0)


class SupervisorSettings(_Strict):
    listen: str = "127.0.0.1:9400"
    state_dir: str = Field(default_factory=lambda: platformdirs.user_state_dir("kvops"))
    poll_interval_s: float = Field(0.5, gt=0, le=60)
    # Rules, alerts and fixes run this often at most, and the history keeps snapshots this far apart (the
    # newest aside): a faster poll refreshes the live numbers (`kvops top`, /metrics) without making every
    # rule read five times the snapshots five times as often.
    evaluation_interval_s: float = Field(0.5, gt=0, le=60)
    verify_after_s: float = Field(60.0, gt=0)  # the judge's windows: this long before a fix, and after it took effect
    fix_cooldown_s: float = Field(600.0, ge=0)  # after a fix job ends, no other fix for the same (rule, subject)
    inconclusive: Literal["rollback", "keep"] = "rollback"  # a fix that cannot be judged, even after one extension
    revert_retry_s: float = Field(10.0, gt=0)  # an undo that cannot reach the engine is retried this often
    judge: JudgeSettings = Field(default_factory=JudgeSettings)  # [supervisor.judge]: traffic and noise bounds
    # [supervisor.block_size_profile]: off, on demand, or when the engine is idle (the profile pauses serving)
    block_size_profile: BlockSizeProfileSettings = Field(default_factory=BlockSizeProfileSettings)
    alert_warmup_s: float = Field(30.0, ge=0)  # after start, rules gather data before alerts are evaluated
    admin_token_env: str = "KVOPS_ADMIN_TOKEN"  # the supervisor API's token for applying or reverting fixes
    external_url: str | None = None  # how people reach this supervisor (alert links); default http://listen
    # Two supervisors, one engine (docs/deployment.md): the lease file they share; only its holder applies fixes.
    # Relative: in state_dir. None: this supervisor alone applies them. The TTL is checked (default too) with a lease.
    fix_lease: str | None = None
    fix_lease_ttl_s: float = Field(15.0, gt=0, validate_default=True)  # renewed every evaluation, else lost

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        return _check_listen(value)

    @field_validator("fix_lease")
    @classmethod
    def _fix_lease(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and (problem := lease_problem(_lease_path(value, info.data.get("state_dir", "")))):
            raise ValueError(problem)
        return value

    @field_validator("fix_lease_ttl_s")
    @classmethod
    def _fix_lease_ttl(cls, value: float, info: ValidationInfo) -> float:
        # The holder renews once per evaluation (every n-th poll): a lease of fewer than three would be lost to one
        # slow poll cycle, and the two supervisors would trade it back and forth.
        if info.data.get("fix_lease") is None:
            return value
        poll, evaluation = info.data.get("poll_interval_s", 0.5), info.data.get("evaluation_interval_s", 0.5)
        period = max(1, round(evaluation / poll)) * poll
        if value < 3 * period:
            raise ValueError(f"the lease must last at least 3 evaluations (3 x {period:g} s = {3 * period:g} s): "
                             "the holder renews it once per evaluation")
        return value

    @property
    def fix_lease_path(self) -> Path | None:
        return None if self.fix_lease is None else _lease_path(self.fix_lease, self.state_dir)

    @field_validator("external_url")
    @classmethod
    def _external_url(cls, value: str | None) -> str | None:
        return None if value is None else _check_url(value)


def _lease_path(value: str, state_dir: str) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else Path(os.path.expanduser(state_dir)) / path


class KvopsConfig(_Strict):
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings)
    engines: list[EngineSpec] = Field(default_factory=lambda: [EngineSpec(name="default")])
    rules: dict[str, RuleConfig] = Field(default_factory=dict)
    alerting: AlertingConfig = Field(default_factory=AlertingConfig)

    @field_validator("rules")
    @classmethod
    def _rules(cls, value: dict[str, RuleConfig]) -> dict[str, RuleConfig]:
        for rule_id, rule in value.items():
            if rule_id not in RULES:
                raise ValueError(f"unknown rule {rule_id!r}; rules: {', '.join(sorted(RULES))}")
            try:
                RULES[rule_id].settings_type(**rule.settings)
            except ValidationError as exc:
                raise ValueError(f"rule {rule_id}: {first_error(exc)}") from None
        return value

    @field_validator("engines")
    @classmethod
    def _engines(cls, value: list[EngineSpec]) -> list[EngineSpec]:
        names = [e.name for e in value]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate:
            raise ValueError(f"two engines are named {duplicate!r}: names must be unique")
        if not value:
            raise ValueError("no engine: configure at least one [[engines]] entry")
        return value

    @model_validator(mode="after")
    def _engine_state_dirs(self) -> KvopsConfig:
        # A managed vLLM's KV event sockets go in the state dir, which the engines' own entries do not know.
        for spec in self.engines:
            spec._state_dir = self.state_path
        return self

    def policy(self, rule_id: str) -> Policy:
        rule = self.rules.get(rule_id)
        return rule.policy if rule else "suggest"

    def clear_for_s(self, rule_id: str) -> float:
        rule = self.rules.get(rule_id)
        if rule is not None and rule.clear_for_s is not None:
            return rule.clear_for_s
        return RULES[rule_id].clear_for_s if rule_id in RULES else 0.0

    def rule_settings(self) -> dict[str, BaseModel]:
        return {rule_id: RULES[rule_id].settings_type(**rule.settings) for rule_id, rule in self.rules.items()}

    @property
    def state_path(self) -> Path:
        return Path(os.path.expanduser(self.supervisor.state_dir))


def parse_config(data: dict[str, Any], source: str) -> KvopsConfig:
    """Validate a config mapping; ConfigError names `source`, the key and what is allowed."""
    try:
        return KvopsConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {first_error(exc)}") from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> KvopsConfig:  # type: ignore[assignment]
    """Read the TOML file (None: defaults), apply `--set key.path=value` overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        data = read_toml(path, "config file", "kvops.example.toml")
    for override in overrides:
        apply_override(data, override)
    return parse_config(data, source)


def apply_override(data: dict[str, Any], override: str) -> None:
    """`engines.0.args.block_size=32` or `rules.swap_storm.policy=auto`: the value is read as TOML
    (numbers, booleans, quoted strings, arrays), or taken as a plain string."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r}: write key.path=value, e.g. rules.swap_storm.policy=auto")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    parts = key.strip().split(".")
    node: Any = data
    for index, part in enumerate(parts[:-1]):
        following = parts[index + 1]
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {override!r}: {'.'.join(parts[: index + 1])} is not an existing list entry")
            node = node[int(part)]
            continue
        if part == "engines" and part not in node:
            node[part] = [{"name": "default"}]
        node = node.setdefault(part, [] if following.isdigit() else {})
    last = parts[-1]
    if isinstance(node, list):
        raise ConfigError(f"--set {override!r}: cannot set a whole list entry; name a key inside it")
    node[last] = value
