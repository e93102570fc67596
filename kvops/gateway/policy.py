"""Each tenant's policy: its cache salt, prompt normalization and limits; from a TOML file, changed live.

The cache policy is one string:

- `shared`: no salt is sent, so the tenant shares cached prefixes with every other `shared` tenant (and with
  clients that reach the upstream directly);
- `isolated`: salt `tenant:<name>`, so its prefixes are its own;
- `group:<name>`: salt `group:<name>`, shared by the tenants of that group only.

The salts are readable on purpose: vLLM's KV cache events report each block's salt, and kvops's event index
(`kvops.events`) shows tenants by salt, so `tenant:team-a` and `group:research` name themselves there.
"""

from __future__ import annotations

import threading
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvops.config_files import first_error, read_toml
from kvops.gateway.volatile import MASK_RULE, check_mask
from kvops.schema.errors import ConfigError
from kvops.schema.gateway import GROUP_PREFIX, ISOLATED, SHARED, TENANT_SALT_PREFIX
from kvops.tenancy.names import tenant_name_problem

CACHE_RULE = "'shared', 'isolated' or 'group:<name>'"


def check_cache(value: str) -> str:
    if value in (SHARED, ISOLATED):
        return value
    if value.startswith(GROUP_PREFIX):
        problem = tenant_name_problem(value.removeprefix(GROUP_PREFIX))
        if problem is None:
            return value
        raise ValueError(f"the group name: {problem.replace('tenant name', 'name')}")
    raise ValueError(f"cache must be {CACHE_RULE}")


class TenantPolicy(BaseModel):
    """What the gateway does with one tenant's requests."""

    model_config = ConfigDict(extra="forbid")

    cache: str = Field(default=ISOLATED, description=f"cache sharing: {CACHE_RULE}")
    normalize: bool = Field(default=False,
                            description="canonicalize whitespace in prompts (kvops.prompt_normalization)")
    mask: list[str] = Field(default_factory=list, description=f"volatile values replaced by a placeholder: {MASK_RULE} "
                                                              "(kvops.gateway.volatile)")
    max_concurrency: int | None = Field(default=None, ge=1, description="requests in flight at once; null: no limit")
    tokens_per_minute: int | None = Field(default=None, ge=1,
                                          description="estimated tokens per minute (docs/gateway.md); null: no limit")

    @field_validator("cache")
    @classmethod
    def _cache(cls, value: str) -> str:
        return check_cache(value)

    @field_validator("mask")
    @classmethod
    def _mask(cls, value: list[str]) -> list[str]:
        return check_mask(value)

    def salt_for(self, tenant: str) -> str | None:
        """The `cache_salt` the upstream gets for `tenant`'s requests; None: no salt (shared)."""
        if self.cache == SHARED:
            return None
        if self.cache == ISOLATED:
            return f"{TENANT_SALT_PREFIX}{tenant}"
        return self.cache  # "group:<name>" is its own salt

    def updated(self, change: TenantPolicyUpdate) -> Self:
        """This policy with the fields `change` sets (a field sent as null sets null: no limit)."""
        return self.model_validate({**self.model_dump(), **change.model_dump(exclude_unset=True)})


class TenantPolicyUpdate(BaseModel):
    """The body of `PUT /admin/tenants/{tenant}`: the fields to change; the others keep their value."""

    model_config = ConfigDict(extra="forbid")

    cache: str | None = Field(default=None, description=CACHE_RULE)
    normalize: bool | None = None
    mask: list[str] | None = Field(default=None, description=MASK_RULE)
    max_concurrency: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)

    # A validator runs only for a field the body sends: null is refused where it means nothing.
    @field_validator("cache")
    @classmethod
    def _cache(cls, value: str | None) -> str | None:
        if value is None:
            raise ValueError(f"cache must be {CACHE_RULE}")
        return check_cache(value)

    @field_validator("normalize")
    @classmethod
    def _normalize(cls, value: bool | None) -> bool | None:
        if value is None:
            raise ValueError("normalize must be true or false")
        return value

    @field_validator("mask")
    @classmethod
    def _mask(cls, value: list[str] | None) -> list[str]:
        return check_mask(value or [])  # null: mask nothing


class PolicyFile(BaseModel):
    """`--policy-file`: `[default]` for every tenant, `[tenants."name"]` for one (fields left out take the
    default's)."""

    model_config = ConfigDict(extra="forbid")

    default: TenantPolicy = Field(default_factory=TenantPolicy)
    tenants: dict[str, dict[str, Any]] = Field(default_factory=dict)


class PolicyStore:
    """The default policy, each tenant's own (set in the file or live), and changes to them; thread-safe."""

    def __init__(self, default: TenantPolicy | None = None, tenants: dict[str, TenantPolicy] | None = None) -> None:
        self._lock = threading.Lock()
        self.default = default or TenantPolicy()
        self._initial = dict(tenants or {})
        self._tenants = dict(self._initial)

    def policy(self, tenant: str) -> TenantPolicy:
        with self._lock:
            return self._tenants.get(tenant, self.default)

    def all(self) -> dict[str, TenantPolicy]:
        with self._lock:
            return dict(self._tenants)

    def update(self, tenant: str, change: TenantPolicyUpdate) -> tuple[TenantPolicy, TenantPolicy]:
        """(before, after) of applying `change` to `tenant`'s policy."""
        with self._lock:
            before = self._tenants.get(tenant, self.default)
            after = before.updated(change)
            self._tenants[tenant] = after
            return before, after

    def update_default(self, change: TenantPolicyUpdate) -> tuple[TenantPolicy, TenantPolicy]:
        """(before, after) of applying `change` to the default policy: every tenant without a policy of its own
        (from the file or set live) takes it at its next request."""
        with self._lock:
            before = self.default
            self.default = before.updated(change)
            return before, self.default

    def reset(self, tenant: str) -> tuple[TenantPolicy, TenantPolicy]:
        """(before, after) of dropping `tenant`'s own policy: it takes the default again (not the file's entry:
        `DELETE` is the way back to the gateway's default, whatever was set before)."""
        with self._lock:
            before = self._tenants.pop(tenant, self.default)
            return before, self.default


def load_policy_file(path: str | None) -> PolicyStore:
    """The store for `--policy-file` (None: every tenant gets the built-in default); ConfigError names the key."""
    if path is None:
        return PolicyStore()
    data = read_toml(path, "policy file", "docs/gateway.md's example")
    try:
        parsed = PolicyFile.model_validate(data)
        tenants: dict[str, TenantPolicy] = {}
        for name, fields in parsed.tenants.items():
            problem = tenant_name_problem(name)
            if problem is not None:
                raise ConfigError(f"{path}: tenants.{name!r}: {problem}")
            base = parsed.default.model_dump()
            tenants[name] = _validated(path, f"tenants.{name}", {**base, **fields})
    except ValidationError as exc:
        raise ConfigError(f"{path}: {first_error(exc)}") from None
    return PolicyStore(parsed.default, tenants)


def _validated(path: str, where: str, fields: dict[str, Any]) -> TenantPolicy:
    try:
        return TenantPolicy.model_validate(fields)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {where}.{first_error(exc)}") from None
