"""A `kvops gateway` in front of an engine, as the supervisor's snapshot of that engine carries it: each tenant's
policy now and the gateway's counters the rules read (token-rate charges, the shadow prefix caches of the prompt
text). Written by the supervisor from the gateway's `/stats/tenants` (kvops.supervisor.gateway_tenants); the
tenants' requests and tokens go into `Snapshot.tenants` as an engine's would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

from kvops.schema.diagnosis import Fix, FixKind, Objective

# The cache policies of a gateway tenant (kvops.gateway.policy), and the salts the gateway sends for them: what
# vLLM's KV events report. A group's salt is its policy string; a shared tenant sends none, and its namespace in
# the gateway's shadow caches is called SHARED.
SHARED, ISOLATED, GROUP_PREFIX = "shared", "isolated", "group:"
TENANT_SALT_PREFIX = "tenant:"


class GatewayTenant(BaseModel):
    cache: str = "isolated"  # "shared", "isolated" or "group:<name>"
    normalize: bool = False
    mask: list[str] = Field(default_factory=list)  # volatile patterns replaced by placeholders (kvops.gateway.volatile)
    max_concurrency: int | None = None
    tokens_per_minute: int | None = None
    estimated_tokens_total: int = 0  # the token-rate limit's charges of admitted requests (its own unit)
    prompt_chars_total: int = 0  # text prompts admitted
    reusable_chars_total: int = 0  # of those, what a prefix cache of the prompts as sent would reuse
    normalized_reusable_chars_total: int = 0  # ... of the same prompts whitespace-normalized
    masked_reusable_chars_total: int = 0  # ... normalized, with every volatile value masked
    volatile_chars_total: dict[str, int] = Field(default_factory=dict)  # volatile pattern -> characters of it sent
    # namespace (a cache salt; "shared" for none) -> characters only sharing that salt would have reused
    shareable_chars_total: dict[str, int] = Field(default_factory=dict)
    rate_limited_total: int = 0  # 429s: concurrency and token-rate limits
    client_disconnects_total: int = 0


class GatewayView(BaseModel):
    url: str
    tenants: dict[str, GatewayTenant] = Field(default_factory=dict)

    def tenant_of_salt(self, salt: str) -> str | None:
        """The gateway tenant whose own salt this is (`tenant:<name>`, an isolated tenant); None for a group's salt,
        no salt, or a tenant the gateway does not know."""
        if not salt.startswith(TENANT_SALT_PREFIX):
            return None
        name = salt.removeprefix(TENANT_SALT_PREFIX)
        tenant = self.tenants.get(name)
        return name if tenant is not None and tenant.cache == "isolated" else None


# The one action a fix takes through a gateway: `PUT /admin/tenants/{tenant}` with the policy fields to change
# (docs/gateway.md, "The admin API"); the gateway answers the policy before and after, and the undo sends the
# changed fields' old values back.
SET_GATEWAY_POLICY = "set_gateway_policy"
POLICY_FIELDS = ("cache", "normalize", "mask", "max_concurrency", "tokens_per_minute")


def gateway_fix(tenant: str, change: dict[str, Any], description: str,
                objectives: Sequence[Objective] = ()) -> Fix:
    """A fix that changes `tenant`'s policy on the gateway (fields of POLICY_FIELDS), with what it must move."""
    unknown = set(change) - set(POLICY_FIELDS)
    if unknown:
        raise ValueError(f"not a gateway policy field: {', '.join(sorted(unknown))}; fields: "
                         f"{', '.join(POLICY_FIELDS)}")
    return Fix(kind=FixKind.GATEWAY, action=SET_GATEWAY_POLICY, params={"tenant": tenant, **change},
               description=description, objectives=list(objectives))
