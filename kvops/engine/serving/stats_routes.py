"""The engine's observability routes: /health (the step loop alive and ticking), /stats (the snapshot
kvops polls) and /metrics (Prometheus)."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from kvops.engine.serving.async_engine import AsyncEngine
from kvops.engine.serving.metrics import EngineMetrics
from kvops.schema.snapshot import SNAPSHOT_SOURCE_HEADER, STEPS_KEPT_HEADER

HEALTH_STALL_S = 30.0  # a step loop silent for this long is stuck: /health says 503


def add_stats_routes(app: FastAPI, runner: AsyncEngine, metrics: EngineMetrics) -> None:
    engine = runner.engine

    @app.get("/health")
    async def health() -> JSONResponse:
        stalled = time.monotonic() - runner.heartbeat
        if not runner.alive:
            return JSONResponse({"status": "down", "reason": f"step loop stopped: {runner.error}"}, status_code=503)
        if stalled > HEALTH_STALL_S:
            return JSONResponse({"status": "stuck", "reason": f"step loop silent for {stalled:.0f} s"},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": engine.model_name})

    @app.get("/stats")
    async def stats(steps_after: float | None = None) -> Response:
        entry = runner.snapshots.serve()
        source = "cached"
        if entry is None:
            entry, source = await runner.run(runner.snapshots.refresh), "built"
        headers = {SNAPSHOT_SOURCE_HEADER: source}
        if steps_after is None:
            return Response(entry.body, media_type="application/json", headers=headers)
        headers[STEPS_KEPT_HEADER] = str(engine.stats.steps.maxlen)  # for the poller to merge the steps it holds
        return Response(entry.steps_after(steps_after), media_type="application/json", headers=headers)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = await runner.run(metrics.render)
        return Response(body, media_type=content_type)

