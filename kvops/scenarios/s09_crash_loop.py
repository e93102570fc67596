"""Scenario 9: an engine that keeps crashing: the crash loop is reported and alerted, and the
supervisor stops restarting it instead of spinning."""

from __future__ import annotations

import time

from kvops.scenarios.runner import ScenarioContext, ScenarioResult

NAME = "crash_loop"
TITLE = "An engine that keeps crashing is reported and alerted, without a restart storm"


def run() -> ScenarioResult:
    result = ScenarioResult(name=NAME, title=TITLE, metric="restarts after the crash loop",
                            command="kvops scenario run crash_loop")
    # 1 MiB cannot hold one request of 512 tokens: every start exits with code 2 after loading the model.
    restart = {"initial_backoff_s": 0.2, "crash_loop_exits": 3, "crash_loop_window_s": 120}
    with ScenarioContext({"kv_cache_memory": "1MiB", "max_model_len": 512}, restart=restart,
                         wait_ready=False) as ctx:
        # The signal is the exit that makes it a loop (the third within the window).
        exits = ctx.wait_until("the third engine exit",
                               lambda: list(ctx.history.exits) if len(ctx.history.exits) >= 3 else None, 120)
        result.signal_at_s = round(ctx.since_start(exits[2].t), 2)
        diagnosis, result.diagnosed_at_s = ctx.wait_diagnosis("crash_loop", 120)
        result.detection_s = round(result.diagnosed_at_s - result.signal_at_s, 2)
        result.evidence = dict(diagnosis.evidence)
        restarts = ctx.history.restarts_total
        time.sleep(3)
        alerts = [a for a in ctx.sup.alerter.active_alerts() if a.labels.get("alertname") == "crash_loop"]
        result.before, result.after = float(restarts), float(ctx.history.restarts_total)
        result.check("crash_loop diagnosed as critical", diagnosis.severity.value == "critical")
        result.check("the evidence carries the engine's own error", "kv-cache-memory" in str(diagnosis.evidence),
                     str(diagnosis.evidence)[:300])
        result.check("alert firing", any(a.state == "firing" for a in alerts), f"{len(alerts)} alert(s)")
        result.check("no restart after the crash loop", ctx.history.restarts_total == restarts == 2,
                     f"{ctx.history.restarts_total} restarts")
    result.passed = all(c.passed for c in result.checks)
    return result
