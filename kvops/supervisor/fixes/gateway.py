"""Live fixes through a `kvops gateway`: a tenant's policy read and changed on the gateway's admin API (docs/gateway.md,
"The admin API"), the way kvops.adapters.engine_client changes an engine's knobs. The fix jobs
(kvops.supervisor.fixes.jobs) call it for a fix of kind `gateway`.

Failures are EngineUnreachable, as the engine client's are, so a fix job handles a gateway that does not answer as
it handles an engine that does not: the change is not made (failed), or its undo is retried.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from kvops.adapters.engine_client import EngineUnreachable
from kvops.adapters.http_client import HttpClient, HttpError

TIMEOUT_S = 5.0


class GatewayAdmin:
    def __init__(self, url: str, admin_token: str | None, timeout_s: float = TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.admin_token = admin_token
        self._http = HttpClient(self.url, timeout_s)

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        if not self.admin_token:
            raise EngineUnreachable(f"{self.url}{path} needs the gateway's admin token, and none is known (the "
                                    "gateway's admin_token_env in the engine's [engines.gateway] table)")
        try:
            reply = self._http.request(method, path, json=body,
                                       headers={"Authorization": f"Bearer {self.admin_token}"})
        except HttpError as exc:
            raise EngineUnreachable(f"{method} {self.url}{path}: {exc}") from None
        if reply.status_code >= 400:
            try:
                detail = reply.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                detail = reply.text[:200]
            raise EngineUnreachable(f"{method} {self.url}{path}: HTTP {reply.status_code}: {detail}")
        try:
            return reply.json()
        except ValueError:
            raise EngineUnreachable(f"{method} {self.url}{path}: the answer is not JSON") from None

    def policy(self, tenant: str) -> dict[str, Any]:
        """The tenant's policy now (the default's for a tenant without one of its own)."""
        listed = self._request("GET", "/admin/tenants")
        try:
            return dict(listed["tenants"].get(tenant) or listed["default"])
        except (KeyError, TypeError, AttributeError):
            raise EngineUnreachable(f"GET {self.url}/admin/tenants: not a kvops gateway's tenant list") from None

    def set_policy(self, tenant: str, change: dict[str, Any]) -> dict[str, Any]:
        """Change the fields of `change` of the tenant's policy; returns the policy after it."""
        answer = self._request("PUT", f"/admin/tenants/{quote(tenant, safe='')}", change)
        try:
            return dict(answer["after"])
        except (KeyError, TypeError):
            raise EngineUnreachable(f"PUT {self.url}/admin/tenants/{tenant}: not a kvops gateway's answer") from None
