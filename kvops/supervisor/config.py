"""The supervisor's configuration: one TOML file (see `kvops.example.toml`), overridable by flags.

Validation happens once, up front, and every error names the file, the key and what is allowed,
so `kvops run --check-config` can tell a person exactly what to change.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvops.alerting import AlertingConfig
from kvops.config_files import first_error, read_toml
from kvops.rules import RULES
from kvops.schema.errors import ConfigError
from kvops.supervisor.engine_spec import (
    EngineSpec,
    StrictModel,
    check_listen,
    check_url,
)
from kvops.supervisor.fixes.judge import JudgeSettings
from kvops.supervisor.fixes.lease import lease_problem
from kvops.supervisor.probes import BlockSizeProfileSettings

Policy = Literal["off", "suggest", "auto"]


class RuleConfig(StrictModel):
    policy: Policy = "suggest"
    settings: dict[str, Any] = Field(default_factory=dict)  # thresholds, validated by the rule's Settings
    # Hold a diagnosis this long after the rule stopped raising it (default: the rule's CLEAR_FOR_S)
    clear_for_s: float | None = Field(None, ge=0)


class SupervisorSettings(StrictModel):
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
        return check_listen(value)

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
        return None if value is None else check_url(value)


def _lease_path(value: str, state_dir: str) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else Path(os.path.expanduser(state_dir)) / path


class KvopsConfig(StrictModel):
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
