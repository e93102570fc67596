"""The supervisor's HTTP API (loopback by default): what `kvops top` and scripts read.

GET  /health                                  the supervisor itself
GET  /metrics                                 Prometheus exposition (kvops.supervisor.exporter)
GET  /api/engines                             every engine: url, managed, up, pid, restarts, crash loop, last error,
                                              its KV cache event stream's health (`events`) where kvops reads one,
                                              and its gateway (`gateway`: a managed one's exits, why it is stopped)
GET  /api/engines/{name}/snapshot             the latest snapshot
GET  /api/engines/{name}/history?seconds=60   snapshots of the last N seconds
GET  /api/engines/{name}/logs?lines=100       the managed engine's latest log lines ([] for a watched one)
GET  /api/prometheus/targets                  every engine as a Prometheus HTTP service-discovery target
GET  /api/diagnoses                           active diagnoses, all engines
GET  /api/alerts                              pending and firing alerts
GET  /api/alerts/dead-letters?limit=100       notifications a receiver refused for good, most recent first
GET  /api/audit                               the fix audit log
GET  /api/fixes                               fix jobs, pending and the last finished, oldest first: id (its queued
                                              audit entry), engine, rule, subject, fix, state (queued, applying,
                                              verifying, reverting, verified, rolled_back, failed, reverted),
                                              progress ("verifying 40/60 s"), times, windows, settings, verdict
POST /api/fixes/apply                         {"engine", "rule", "subject"}: queue a proposed fix (admin token);
                                              answers its `queued` audit entry, the job runs in the background;
                                              409 on a standby (another supervisor holds the fix lease: named)
POST /api/fixes/{id}/revert                   undo a fix (any of its audit ids) verifying or kept (admin token);
                                              503 when the engine is unreachable: kvops retries the undo itself;
                                              409 on a standby
POST /api/engines/{name}/resume               restart a managed engine stopped in a crash loop, and the gateway
                                              kvops runs in front of it once stopped (admin token)
GET  /api/fix-lease                           high availability: this supervisor's role (holder, standby, or alone
                                              without a lease), the lease's holder and its URL
GET  /api/engines/{name}/profiles             the latest block-size and KV quantization profiles, and which runs now
POST /api/engines/{name}/profiles/block-size  run the block-size profile now (admin token; serving pauses 5-15 s);
                                              202, then GET .../profiles; 409 when off, running or not a kvops engine
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvops.schema.audit import AuditEntry
from kvops.schema.engines import EngineEntry
from kvops.supervisor import exporter
from kvops.supervisor.fixes.lease import ALONE
from kvops.supervisor.fixes.manager import FixError, NotHolder, RevertPending
from kvops.supervisor.managed_engine import LOG_TAIL_LINES, ManagedEngine
from kvops.supervisor.probes import ProbeRefused

if TYPE_CHECKING:
    from kvops.supervisor.supervisor import EngineState, Supervisor


class ApplyFixBody(BaseModel):
    engine: str
    rule: str
    subject: str = ""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


class Refusal(Exception):
    """A request the API turns down (no token, no such engine...): raised from anywhere in a handler
    and answered with the error body, so each endpoint reads as its happy path."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _last_log(managed: ManagedEngine | None) -> str | None:
    """The engine's latest log line: what a starting engine is busy with."""
    if managed is None or not managed.log_tail:
        return None
    return managed.log_tail[-1].text


def require_admin(sup: Supervisor, authorization: str | None) -> None:
    if not sup.admin_token:
        raise Refusal(403, "changing things needs an admin token: start kvops run with "
                           f"${sup.config.supervisor.admin_token_env} set")
    if not authorization or not authorization.startswith("Bearer "):
        raise Refusal(401, "this call needs 'Authorization: Bearer <admin token>'")
    if not hmac.compare_digest(authorization.removeprefix("Bearer ").encode(), sup.admin_token.encode()):
        raise Refusal(403, "the admin token is wrong")


def engine_named(sup: Supervisor, name: str) -> EngineState:
    state = sup.engines.get(name)
    if state is None:
        raise Refusal(404, f"no engine named {name!r}; engines: {', '.join(sup.engines)}")
    return state


def fix_step(step: Callable[[], AuditEntry], status_if_refused: int) -> JSONResponse:
    """Run a fix step; a FixError (the reason it cannot be done) is the refusal's message."""
    try:
        entry = step()
    except NotHolder as exc:  # whatever the step: another supervisor does it
        raise Refusal(409, str(exc)) from None
    except RevertPending as exc:  # not a refusal: accepted, and retried in the background
        raise Refusal(503, str(exc)) from None
    except FixError as exc:
        raise Refusal(status_if_refused, str(exc)) from None
    return JSONResponse(entry.model_dump(mode="json"))


def build_supervisor_app(sup: Supervisor) -> FastAPI:
    app = FastAPI(title="kvops supervisor", docs_url=None, redoc_url=None)
    _answer_errors(app)
    _add_watch_routes(app, sup)
    _add_fix_routes(app, sup)
    _add_control_routes(app, sup)
    return app


def _answer_errors(app: FastAPI) -> None:
    @app.exception_handler(Refusal)
    async def refused(_: Request, exc: Refusal) -> JSONResponse:
        return _error(exc.status, str(exc))

    # FastAPI's own refusals (a parameter of the wrong type, an unknown route, a wrong method) in the same body
    # as ours: clients such as kvops top read error.message, not FastAPI's `detail`.
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors())
        return _error(422, f"invalid request: {problems}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request refused"
        if exc.status_code == 404 and message == "Not Found":
            message = "no such endpoint: see the list in docs/supervisor.md (GET /api/engines, /api/diagnoses, ...)"
        return _error(exc.status_code, message)


def _add_watch_routes(app: FastAPI, sup: Supervisor) -> None:
    """What the supervisor sees: itself, its engines, their snapshots and logs, diagnoses and alerts."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "engines": len(sup.engines), "polls": sup.polls_total,
                "fix_lease": _lease_view(sup)["role"]}

    @app.get("/api/fix-lease")
    async def fix_lease() -> dict[str, Any]:
        return _lease_view(sup)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = exporter.render(sup)
        return Response(body, media_type=content_type)

    @app.get("/api/engines")
    async def engines() -> list[dict[str, Any]]:
        now = sup.clock()
        return [_engine_entry(name, state).model_copy(update={"events": sup.event_feeds.health(name, now),
                                                              "gateway": sup.gateway_status(name)})
                .model_dump(mode="json") for name, state in sup.engines.items()]

    @app.get("/api/engines/{name}/logs")
    async def logs(name: str, lines: int = 100) -> Any:
        state = engine_named(sup, name)
        if state.managed is None:
            return []  # a watched engine logs wherever it was started; kvops never sees its output
        tail = list(state.managed.log_tail)[-max(0, min(lines, LOG_TAIL_LINES)):] if lines > 0 else []
        return [line.model_dump(mode="json") for line in tail]

    @app.get("/api/engines/{name}/snapshot")
    async def snapshot(name: str) -> Response:
        state = engine_named(sup, name)
        if state.history.latest is None:
            raise Refusal(404, f"no snapshot from engine {name!r} yet ({state.last_error or 'starting'})")
        return Response(state.history.latest.model_dump_json(), media_type="application/json")

    @app.get("/api/engines/{name}/history")
    async def history(name: str, seconds: float = 60.0) -> Response:
        state = engine_named(sup, name)
        snaps = state.history.window(seconds)
        body = "[" + ",".join(s.model_dump_json() for s in snaps) + "]"
        return Response(body, media_type="application/json")

    @app.get("/api/prometheus/targets")
    async def prometheus_targets() -> list[dict[str, Any]]:
        # Prometheus's http_sd_configs format: a managed engine's port is chosen at start (and kept
        # across restarts), so Prometheus learns it here instead of from a static config. The kind is the
        # recognised one, as on the supervisor's own series, so the two halves of an alert join on it.
        return [{"targets": [urlsplit(state.url).netloc],
                 "labels": {"engine": name, "kind": exporter.engine_kind(state),
                            "managed": str(state.spec.managed).lower()}}
                for name, state in sup.engines.items()]

    @app.get("/api/diagnoses")
    async def diagnoses() -> list[dict[str, Any]]:
        return [d.model_dump(mode="json") for d in sup.diagnoses]

    @app.get("/api/alerts")
    async def alerts() -> list[dict[str, Any]]:
        return [a.model_dump(mode="json") for a in sup.alerter.active_alerts()]

    @app.get("/api/alerts/dead-letters")
    async def dead_letters(limit: int = 100) -> list[dict[str, Any]]:
        # capped: the list is for a person to read, the outbox keeps them all for its retention
        return [d.model_dump(mode="json") for d in sup.alerter.dead_letters(max(1, min(limit, 1000)))]



def refuse_if_standby(sup: Supervisor) -> None:
    """Before the request is looked up: a standby sends every change to the lease holder (its jobs, its audit log)."""
    try:
        sup.fixes.refuse_if_standby()
    except NotHolder as exc:
        raise Refusal(409, str(exc)) from None


def _lease_view(sup: Supervisor) -> dict[str, Any]:
    """GET /api/fix-lease: `role` holder or standby (with a lease configured) or alone (without one), the holder and
    its URL, when its lease expires."""
    return (ALONE if sup.fix_lease is None else sup.fix_lease.view()).as_dict()


def _engine_entry(name: str, state: EngineState) -> EngineEntry:
    """GET /api/engines's row for one engine."""
    latest, managed = state.history.latest, state.managed
    # Before the first health check `is_up` is None: not up yet (a None here was a 500 on every call).
    return EngineEntry(
        name=name, url=state.url, kind=exporter.engine_kind(state), managed=state.spec.managed,
        up=bool(state.history.is_up),
        pid=managed.pid if managed else (latest.engine.pid if latest else None),
        restarts=state.history.restarts_total, crash_loop=state.history.crash_loop,
        last_error=state.last_error,
        last_exit=state.history.exits[-1] if state.history.exits else None,
        args=managed.args if managed else None,
        diagnoses=len(state.diagnoses),
        snapshot_time=latest.time if latest else None,
        started_at=managed.started_at if managed and managed.pid else None,
        restart_at=managed.next_start_at if managed else None,
        last_log=_last_log(managed),
        data_problems=state.data_problems,
    )


def _add_fix_routes(app: FastAPI, sup: Supervisor) -> None:
    """The fix jobs and their audit log; applying and reverting need the admin token."""

    @app.get("/api/audit")
    async def audit() -> list[dict[str, Any]]:
        return sup.fixes.snapshot()

    @app.get("/api/fixes")
    async def fixes() -> list[dict[str, Any]]:
        return sup.fixes.job_views()

    @app.post("/api/fixes/apply")
    def apply_fix(body: ApplyFixBody, authorization: str | None = Header(default=None)) -> JSONResponse:
        require_admin(sup, authorization)
        refuse_if_standby(sup)
        state = engine_named(sup, body.engine)
        match = next((d for d in state.diagnoses if d.rule == body.rule and d.subject == body.subject), None)
        if match is None:
            raise Refusal(404, f"no active diagnosis {body.rule!r} (subject {body.subject!r}) on {body.engine!r}")
        return fix_step(lambda: sup.fixes.apply(match), 409)

    @app.post("/api/fixes/{entry_id}/revert")
    def revert_fix(entry_id: int, authorization: str | None = Header(default=None)) -> JSONResponse:
        require_admin(sup, authorization)
        refuse_if_standby(sup)
        return fix_step(lambda: sup.fixes.revert(entry_id), 404)



def _add_control_routes(app: FastAPI, sup: Supervisor) -> None:
    """Acting on an engine: resuming one stopped in a crash loop, profiles (running one needs the admin token)."""

    @app.post("/api/engines/{name}/resume")
    def resume(name: str, authorization: str | None = Header(default=None)) -> JSONResponse:
        require_admin(sup, authorization)
        state = engine_named(sup, name)
        gateway = state.gateway if state.gateway is not None and state.gateway.managed else None
        if state.managed is None and gateway is None:
            raise Refusal(409, f"engine {name!r} is watched, not managed, and kvops runs no gateway in front of it: "
                               "kvops cannot restart it")
        if state.managed is not None:
            state.managed.resume_after_crash_loop()
        # The gateway too, when kvops stopped starting it (its configuration refused, or a crash loop).
        resumed = gateway is not None and gateway.resume()
        return JSONResponse({"resumed": name, **({"gateway": True} if resumed else {})})

    @app.get("/api/engines/{name}/profiles")
    async def profiles(name: str) -> dict[str, Any]:
        state = engine_named(sup, name)
        history = state.history
        return {"running": state.probes.running or None, "schedule": state.probes.settings.schedule,
                "block_size": history.block_size_profile.model_dump(mode="json") if history.block_size_profile
                else None,
                "kv": history.kv_profile.model_dump(mode="json") if history.kv_profile else None}

    @app.post("/api/engines/{name}/profiles/block-size")
    def profile_block_size(name: str, authorization: str | None = Header(default=None)) -> JSONResponse:
        require_admin(sup, authorization)
        engine_named(sup, name)
        try:
            sup.profile_block_size(name)
        except ProbeRefused as exc:
            raise Refusal(409, str(exc)) from None
        return JSONResponse({"engine": name, "profile": "block_size", "started": True}, status_code=202)

