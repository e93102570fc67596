"""The engine's admin actions, defined once: what a fix may change live, and how.

One row per action: its name (what a rule's `Fix(kind=ADMIN, action=...)` says), the engine
endpoint (method and path template), the request body model (the engine parses it, the supervisor
writes it), the knobs of `GET /admin/config` read before the change, how the change is planned
from those knobs (the params sent, the audit's "before", the params that undo it) and the rules
whose fixes use it. The engine registers its routes from this table, `EngineClient.admin` calls
them through it, `FixManager` plans before/undo with it, and the rules name their actions from it,
so adding an action is one row here plus its engine-side handler (kvops/engine/serving/admin_routes.py).

A wire-layer module: pydantic and the standard library only (no torch, fastapi, engine or
supervisor imports, and no urllib: the rules import it and must stay free of I/O modules), so
both sides can import it.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from kvops.schema.diagnosis import Fix, FixKind, Objective

# ---------------------------------------------------------------- request bodies


class PrefixCachingBody(BaseModel):
    enabled: bool


class EvictionPolicyBody(BaseModel):
    policy: str = Field(pattern="^(lru|lfu)$")


class NormalizationBody(BaseModel):
    mode: str = Field(pattern="^(off|shadow|on)$")


class TenantBody(BaseModel):
    cache_salt: str | None = Field(default=None, max_length=256,
                                   description="tenants with the same salt share prefix blocks; null = own salt")
    quota_blocks: int | None = Field(default=None, description="most blocks the tenant may own; null = no quota")


# ---------------------------------------------------------------- planning a change


@dataclass(frozen=True, slots=True)
class AdminChange:
    """One planned change: what to send, what the knobs were (the audit's "before"), and the params
    that put them back (the rollback)."""

    params: dict[str, Any]
    before: dict[str, Any]
    undo: dict[str, Any]


Planner = Callable[[Mapping[str, Any], Mapping[str, Any]], AdminChange]  # (knobs, fix params) -> change


def _one_knob(knob: str, param: str) -> Planner:
    """An action that sets one knob from one param: undo sends the knob's old value back."""

    def plan(knobs: Mapping[str, Any], params: Mapping[str, Any]) -> AdminChange:
        return AdminChange(params=dict(params), before={knob: knobs[knob]}, undo={param: knobs[knob]})

    return plan


def _tenant_plan(knobs: Mapping[str, Any], params: Mapping[str, Any]) -> AdminChange:
    """A quota change that keeps the tenant's cache salt: the endpoint sets quota and salt together
    (a missing salt restores the tenant's own), so the current salt is sent along both ways."""
    tenant = params["tenant"]
    salt = knobs["tenant_salts"].get(tenant)
    quota = knobs["tenant_quotas"].get(tenant)
    send, undo = dict(params), {"tenant": tenant, "quota_blocks": quota}
    if salt is not None:
        send["cache_salt"] = undo["cache_salt"] = salt
    return AdminChange(params=send, before={"tenant": tenant, "quota_blocks": quota}, undo=undo)


# ---------------------------------------------------------------- the table


@dataclass(frozen=True, slots=True)
class AdminAction:
    name: str
    method: str
    path: str  # template: `{name}` fields are taken from the params (the client quotes them), the rest is the body
    body: type[BaseModel]
    knobs: tuple[str, ...]  # the GET /admin/config keys `plan` reads
    plan: Planner
    undo: str  # how the rollback is built, in words (docs/server.md lists it)
    rules: tuple[str, ...]  # rule ids whose fixes use this action
    path_params: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        names = tuple(name for _, name, _, _ in string.Formatter().parse(self.path) if name)
        object.__setattr__(self, "path_params", names)  # frozen: set once, derived from the template

    def request_body(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON body: the params the body model knows, validated here so a bad fix fails before
        anything is sent (pydantic's ValidationError is a ValueError)."""
        return self.body.model_validate(dict(params)).model_dump(mode="json", exclude_unset=True)

    def fix(self, params: dict[str, Any], description: str, objectives: Sequence[Objective] = ()) -> Fix:
        """The Fix a rule proposes for this action, with what it must move to be kept."""
        return Fix(kind=FixKind.ADMIN, action=self.name, params=params, description=description,
                   objectives=list(objectives))


SET_NORMALIZATION = AdminAction(
    name="set_normalization", method="PUT", path="/admin/normalization", body=NormalizationBody,
    knobs=("normalize_prompts",), plan=_one_knob("normalize_prompts", "mode"),
    undo="`mode` = the old `normalize_prompts`", rules=("prompt_variance",))
SET_PREFIX_CACHING = AdminAction(
    name="set_prefix_caching", method="PUT", path="/admin/prefix-caching", body=PrefixCachingBody,
    knobs=("enable_prefix_caching",), plan=_one_knob("enable_prefix_caching", "enabled"),
    undo="`enabled` = the old `enable_prefix_caching`", rules=("prefix_caching_off",))
SET_EVICTION_POLICY = AdminAction(
    name="set_eviction_policy", method="PUT", path="/admin/eviction-policy", body=EvictionPolicyBody,
    knobs=("eviction_policy",), plan=_one_knob("eviction_policy", "policy"),
    undo="`policy` = the old `eviction_policy`", rules=())
SET_TENANT_QUOTA = AdminAction(
    name="set_tenant_quota", method="PUT", path="/admin/tenants/{tenant}", body=TenantBody,
    knobs=("tenant_quotas", "tenant_salts"), plan=_tenant_plan,
    undo="`quota_blocks` = the tenant's old quota (null: none); its `cache_salt`, if set, is sent both ways",
    rules=("tenant_pollution",))

ADMIN_ACTIONS: dict[str, AdminAction] = {
    action.name: action for action in (SET_NORMALIZATION, SET_PREFIX_CACHING, SET_EVICTION_POLICY, SET_TENANT_QUOTA)
}
