"""Alerting settings: where notifications go, how they are grouped, when an alert fires.

The models reject unknown keys: a misspelt `group_wait` in the supervisor's TOML must stop the
daemon at start rather than silently fall back to a default nobody chose. Secrets are `SecretStr`
so a config echoed into a log or a traceback shows stars, never the token.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, field_validator, model_validator

from kvops.schema.diagnosis import Diagnosis, Severity

DEFAULT_RUNBOOK_BASE_URL = "https://github.com/kvops/kvops/blob/main/docs/runbooks"

_http_url = TypeAdapter(AnyHttpUrl)


class AlertingConfigError(ValueError):
    """A setting that validates on its own but cannot be used. (An unset `*_env` variable is not one: it
    disables its receiver with a warning, see `resolve_receivers`.)"""


class ReceiverConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    type: Literal["webhook", "alertmanager"] = "webhook"
    # webhook: the URL posted to; alertmanager: the Alertmanager's base URL (`/api/v2/alerts` is appended)
    url: str
    bearer_token: SecretStr | None = None
    bearer_token_env: str | None = None
    hmac_secret: SecretStr | None = None
    hmac_secret_env: str | None = None
    timeout_s: float = Field(default=5.0, gt=0)
    initial_backoff_s: float = Field(default=1.0, gt=0)
    max_backoff_s: float = Field(default=300.0, gt=0)
    # webhook only: Alertmanager itself must always learn about resolutions
    send_resolved: bool = True

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, value: str) -> str:
        # validated as a URL but kept as written: AnyHttpUrl would add a trailing slash to a bare host
        _http_url.validate_python(value)
        return value.strip()

    @model_validator(mode="after")
    def _one_source_per_secret(self) -> ReceiverConfig:
        for secret in ("bearer_token", "hmac_secret"):
            if getattr(self, secret) is not None and getattr(self, f"{secret}_env") is not None:
                raise ValueError(f"set either {secret} or {secret}_env, not both")
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("max_backoff_s must be >= initial_backoff_s")
        return self


class AlertingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    receivers: list[ReceiverConfig] = Field(default_factory=list)
    group_by: list[str] = Field(default_factory=lambda: ["alertname", "engine"])
    group_wait_s: float = Field(default=10.0, ge=0)  # a new group waits this long so its first alerts go together
    group_interval_s: float = Field(default=60.0, gt=0)  # changes to a notified group are batched this often
    repeat_interval_s: float = Field(default=4 * 3600.0, gt=0)  # an unchanged firing group is re-sent this often
    default_for_s: float = Field(default=30.0, ge=0)  # how long a diagnosis must persist before its alert fires
    critical_for_s: float = Field(default=0.0, ge=0)  # for critical diagnoses without a per-rule setting
    for_s: dict[str, float] = Field(default_factory=dict)  # per rule id; beats the two above
    alertmanager_resend_s: float = Field(default=60.0, gt=0)  # re-push firing alerts; keep < Alertmanager's 5m
    runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL
    outbox_retention_s: float = Field(default=7 * 86400.0, gt=0)  # delivered and dead rows kept this long for forensics
    # kvops's alerts about itself (docs/alerting.md, "When kvops itself fails")
    self_alert_hold_s: float = Field(default=3600.0, gt=0)  # a state reset or a dead letter is alerted this long
    outbox_backlog_alert_s: float = Field(default=300.0, gt=0)  # oldest undelivered notification older than this

    @field_validator("for_s")
    @classmethod
    def _for_not_negative(cls, value: dict[str, float]) -> dict[str, float]:
        negative = sorted(rule for rule, seconds in value.items() if seconds < 0)
        if negative:
            raise ValueError(f"for_s must be >= 0 (rules: {', '.join(negative)})")
        return value

    @field_validator("runbook_base_url")
    @classmethod
    def _runbook_base_is_http(cls, value: str) -> str:
        _http_url.validate_python(value)
        return value.rstrip("/")

    @model_validator(mode="after")
    def _unique_receiver_names(self) -> AlertingConfig:
        names = [r.name for r in self.receivers]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"receiver names must be unique (duplicated: {', '.join(duplicates)})")
        return self

    def for_duration(self, diagnosis: Diagnosis) -> float:
        if diagnosis.rule in self.for_s:
            return self.for_s[diagnosis.rule]
        if diagnosis.severity is Severity.CRITICAL:
            return self.critical_for_s
        return self.default_for_s


@dataclass(frozen=True)
class ResolvedReceiver:
    """A receiver with its `*_env` indirections looked up: what the delivery code works with."""

    name: str
    type: Literal["webhook", "alertmanager"]
    url: str
    bearer_token: SecretStr | None
    hmac_secret: SecretStr | None
    timeout_s: float
    initial_backoff_s: float
    max_backoff_s: float
    send_resolved: bool

    @property
    def endpoint(self) -> str:
        if self.type == "webhook":
            return self.url
        base = self.url.rstrip("/")
        return base if base.endswith("/api/v2/alerts") else f"{base}/api/v2/alerts"


@dataclass(frozen=True)
class ReceiverProblem:
    """A receiver that cannot be used as configured (its secret's variable is unset): it is disabled, not fatal.

    A missing secret should not take down the supervisor and every other receiver with it: the engines
    still need watching, and the other receivers can say that this one is off.
    """

    index: int  # position in alerting.receivers, as a person finds it in the TOML
    receiver: str
    key: str  # e.g. "hmac_secret_env"
    variable: str  # the environment variable it names

    @property
    def message(self) -> str:
        return (
            f"alerting.receivers[{self.index}] ({self.receiver!r}): {self.key} names the environment variable "
            f"{self.variable!r}, which is not set (or empty); this receiver is disabled until it is set "
            f"and kvops restarts"
        )


def resolve_receivers(
    config: AlertingConfig, environ: Mapping[str, str] | None = None
) -> tuple[list[ResolvedReceiver], list[ReceiverProblem]]:
    """Look up every `*_env` secret now: the usable receivers, and one problem per receiver left disabled.

    `kvops run` and `kvops run --check-config` both call this, so both say the same about a missing secret.
    """
    env = os.environ if environ is None else environ
    resolved: list[ResolvedReceiver] = []
    problems: list[ReceiverProblem] = []
    for index, receiver in enumerate(config.receivers):
        secrets: dict[str, SecretStr | None] = {}
        missing: ReceiverProblem | None = None
        for secret in ("bearer_token", "hmac_secret"):
            value: SecretStr | None = getattr(receiver, secret)
            variable: str | None = getattr(receiver, f"{secret}_env")
            if variable is not None:
                raw = env.get(variable)
                if not raw:
                    missing = missing or ReceiverProblem(index, receiver.name, f"{secret}_env", variable)
                    continue
                value = SecretStr(raw)
            secrets[secret] = value
        if missing is not None:
            # sending without the secret would be worse than not sending: unsigned requests get refused, or
            # worse, accepted by a receiver that does not check
            problems.append(missing)
            continue
        resolved.append(
            ResolvedReceiver(
                name=receiver.name,
                type=receiver.type,
                url=receiver.url,
                bearer_token=secrets["bearer_token"],
                hmac_secret=secrets["hmac_secret"],
                timeout_s=receiver.timeout_s,
                initial_backoff_s=receiver.initial_backoff_s,
                max_backoff_s=receiver.max_backoff_s,
                send_resolved=receiver.send_resolved,
            )
        )
    return resolved, problems


def receiver_problems(config: AlertingConfig, environ: Mapping[str, str] | None = None) -> list[ReceiverProblem]:
    """What `kvops run --check-config` prints as warnings: exactly what `kvops run` will disable."""
    return resolve_receivers(config, environ)[1]
