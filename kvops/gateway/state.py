"""What the gateway's routes share: its settings, the keys, the policies, the limits, the accounting, the upstream."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from fastapi import Request

from kvops.gateway.accounting import Accounting
from kvops.gateway.errors import GatewayError
from kvops.gateway.limits import TenantLimits
from kvops.gateway.policy import PolicyStore
from kvops.gateway.shadow import ShadowReuse
from kvops.gateway.upstream import Upstream
from kvops.tenancy.api_keys import ApiKeys

DEFAULT_TENANT = "default"
MiB = 1024 * 1024


@dataclass(frozen=True)
class GatewaySettings:
    max_body_bytes: int = 4 * MiB
    body_timeout_s: float = 30.0  # the whole request body must arrive within this
    admin_token: str | None = None
    admin_token_env: str | None = None  # named in messages, never the token


@dataclass
class Gateway:
    upstream: Upstream
    keys: ApiKeys | None = None
    policies: PolicyStore = field(default_factory=PolicyStore)
    settings: GatewaySettings = field(default_factory=GatewaySettings)
    limits: TenantLimits = field(default_factory=TenantLimits)
    accounting: Accounting = field(default_factory=Accounting)
    shadow: ShadowReuse = field(default_factory=ShadowReuse)

    def tenant_of(self, request: Request) -> str:
        """The tenant of the request's API key; `default` without keys; 401 GatewayError without a valid key. The
        key is compared by its sha256 digest in constant time (kvops.tenancy.api_keys) and never logged."""
        if self.keys is None:
            return DEFAULT_TENANT
        send = "send 'Authorization: Bearer <API key>' with the key you were given for your tenant"
        authorization = request.headers.get("authorization")
        if not authorization or not authorization.startswith("Bearer "):
            raise GatewayError(401, f"this gateway needs an API key: {send}", "authentication_error", "no_api_key")
        tenant = self.keys.tenant_for(authorization.removeprefix("Bearer ").strip())
        if tenant is None:
            raise GatewayError(401, f"the API key is not valid: {send}", "authentication_error", "bad_api_key")
        return tenant

    def check_admin(self, request: Request) -> None:
        """403 while no admin token is configured (saying how to set one), 401 without a bearer token, 403 with a
        wrong one. A tenant's API key never opens the admin routes."""
        if self.settings.admin_token is None:
            raise GatewayError(403, "the admin routes are disabled: start the gateway with --admin-token-env VAR, "
                               "VAR holding a bearer token for them", "permission_error", "admin_disabled")
        authorization = request.headers.get("authorization")
        if not authorization or not authorization.startswith("Bearer "):
            raise GatewayError(401, "the admin routes need 'Authorization: Bearer <admin token>'",
                               "authentication_error", "admin_no_token")
        given = authorization.removeprefix("Bearer ").encode()
        if not hmac.compare_digest(given, self.settings.admin_token.encode()):
            raise GatewayError(403, "the admin token is wrong", "permission_error", "admin_bad_token")
