"""Who sends a request to the engine: its API key's tenant (kvops.tenancy.api_keys), or the tenant the client
names in trusted mode, and whether the admin token opens /admin."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from kvops.engine.errors import InvalidRequestError
from kvops.schema.errors import EngineError
from kvops.tenancy.api_keys import ApiKeys, load_api_keys
from kvops.tenancy.names import tenant_name_problem

if TYPE_CHECKING:
    from kvops.engine.config import EngineConfig


class AuthenticationError(EngineError):
    """A request without a valid API key; the server answers 401 with this message."""


def check_client_tenant(name: str, field: str) -> str:
    """A tenant named by a request (`user`, `X-Tenant`, an admin path): the name, or a 400 naming the field."""
    problem = tenant_name_problem(name)
    if problem is not None:
        raise InvalidRequestError(f"{field}: {problem}", field)
    return name


class TenantResolver:
    """Which tenant a request is accounted to.

    No keys: the client names it (`user`, else `X-Tenant`, else `default`), the trusted mode. With keys: a valid
    `Authorization: Bearer <key>` is required and its tenant is the request's; `user` and `X-Tenant` are ignored,
    unless `trust_client_tenant` lets an authenticated client (a gateway) name the tenant itself.
    """

    def __init__(self, keys: ApiKeys | None, trust_client_tenant: bool = False) -> None:
        self.keys = keys
        self.trust_client_tenant = trust_client_tenant or keys is None

    @classmethod
    def from_config(cls, config: EngineConfig) -> TenantResolver:
        """The engine's keys (`--api-keys-file`, `--api-keys-env`); ConfigError for a bad key file."""
        return cls(load_api_keys(config.api_keys_file, config.api_keys_env), config.trust_client_tenant)

    def authenticate(self, authorization: str | None) -> str | None:
        """The key's tenant (None without keys); AuthenticationError for a missing or unknown key."""
        if self.keys is None:
            return None
        send = "send 'Authorization: Bearer <API key>' with the key you were given for your tenant"
        if not authorization or not authorization.startswith("Bearer "):
            raise AuthenticationError(f"this engine needs an API key: {send}")
        tenant = self.keys.tenant_for(authorization.removeprefix("Bearer ").strip())
        if tenant is None:
            raise AuthenticationError(f"the API key is not valid: {send}")
        return tenant

    def tenant(self, key_tenant: str | None, user: str | None, header: str | None) -> str:
        """The request's tenant, given what `authenticate` returned; a 400 for a client-named tenant that breaks
        the name rule. Ignored client names are not checked: they cannot change anything."""
        if self.trust_client_tenant:
            if user:
                return check_client_tenant(user, "user")
            if header:
                return check_client_tenant(header, "X-Tenant")
        return key_tenant or "default"


def admin_refusal(admin_token: str | None, authorization: str | None) -> tuple[int, str, str] | None:
    """Why an admin request is refused, as (HTTP status, message, error type), or None when its token is right.
    The admin token is apart from the API keys: a tenant's key never opens /admin."""
    if admin_token is None:
        return 404, "admin endpoints are disabled: start the engine with --admin-token", "not_found_error"
    if not authorization or not authorization.startswith("Bearer "):
        return 401, "admin endpoints need 'Authorization: Bearer <admin token>'", "authentication_error"
    if not hmac.compare_digest(authorization.removeprefix("Bearer ").encode(), admin_token.encode()):
        return 403, "the admin token is wrong", "permission_error"
    return None
