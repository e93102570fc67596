"""The admin API: each tenant's policy read and changed live (`/admin/tenants`), so that a supervisor can apply a
fix through the gateway and roll it back. Every change is logged with the tenant and the policy before and after;
keys and the admin token never are."""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvops.gateway.errors import GatewayError, bad_request
from kvops.gateway.policy import TenantPolicy, TenantPolicyUpdate
from kvops.gateway.state import Gateway
from kvops.tenancy.names import tenant_name_problem

log = structlog.get_logger("kvops.gateway")


def build_admin_router(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    def checked(request: Request, tenant: str | None = None) -> str | None:
        gateway.check_admin(request)
        if tenant is None:
            return None
        problem = tenant_name_problem(tenant)  # the server has URL-decoded the path once
        if problem is not None:
            raise bad_request(problem, param="tenant")
        return tenant

    async def list_tenants(request: Request) -> Response:
        try:
            checked(request)
        except GatewayError as exc:
            return exc.response()
        known = sorted(set(gateway.keys.tenants if gateway.keys is not None else {"default"})
                       | set(gateway.policies.all()))
        return JSONResponse({"default": gateway.policies.default.model_dump(),
                             "tenants": {name: gateway.policies.policy(name).model_dump() for name in known},
                             "overridden": sorted(gateway.policies.all())})

    async def put_tenant(tenant: str, change: TenantPolicyUpdate, request: Request) -> Response:
        try:
            name = checked(request, tenant)
        except GatewayError as exc:
            return exc.response()
        assert name is not None
        before, after = gateway.policies.update(name, change)
        return _changed(gateway, "set", name, before, after)

    async def put_default(change: TenantPolicyUpdate, request: Request) -> Response:
        try:
            checked(request)
        except GatewayError as exc:
            return exc.response()
        before, after = gateway.policies.update_default(change)
        if before.tokens_per_minute != after.tokens_per_minute:
            gateway.limits.reset_all_but(set(gateway.policies.all()))
        body = {"before": before.model_dump(), "after": after.model_dump(),
                "overridden": sorted(gateway.policies.all())}
        log.info("gateway policy change", action="set default", before=body["before"], after=body["after"])
        return JSONResponse(body)

    async def delete_tenant(tenant: str, request: Request) -> Response:
        try:
            name = checked(request, tenant)
        except GatewayError as exc:
            return exc.response()
        assert name is not None
        before, after = gateway.policies.reset(name)
        return _changed(gateway, "reset", name, before, after)

    router.add_api_route("/admin/tenants", list_tenants, methods=["GET"])
    # The default: every tenant without a policy of its own, present and future ("for all").
    router.add_api_route("/admin/default", put_default, methods=["PUT"])
    # {tenant:path}: a quoted '/' in a tenant name (team%2Fa) still reaches the route.
    router.add_api_route("/admin/tenants/{tenant:path}", put_tenant, methods=["PUT"])
    router.add_api_route("/admin/tenants/{tenant:path}", delete_tenant, methods=["DELETE"])
    return router


def _changed(gateway: Gateway, action: str, tenant: str, before: TenantPolicy, after: TenantPolicy) -> Response:
    if before.tokens_per_minute != after.tokens_per_minute:
        gateway.limits.reset(tenant)  # a new rate starts with a full bucket
    body: dict[str, Any] = {"tenant": tenant, "before": before.model_dump(), "after": after.model_dump()}
    log.info("gateway policy change", action=action, tenant=tenant, before=body["before"], after=body["after"])
    return JSONResponse(body)
