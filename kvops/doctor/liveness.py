"""Liveness: is anything listening, does it answer `/health` in time, is it an inference server kvops
knows (from `/metrics` and `/v1/models`), and how long one token takes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from kvops.adapters import Scrape, ScrapeError, detect_flavour, model_card
from kvops.doctor.report import Check, Status
from kvops.schema.kinds import EngineKind

SECTION = "Liveness"
SLOW_FIRST_TOKEN_S = 5.0  # an idle server taking longer than this for one token is worth a look

START_COMMANDS = {
    "kvops": "kvops engine serve --port {port}",
    "vllm": "vllm serve MODEL --port {port}",
    "sglang": "python -m sglang.launch_server --model-path MODEL --port {port} --enable-metrics",
}


@dataclass
class Probe:
    """What liveness learnt, for the sections after it."""

    checks: list[Check] = field(default_factory=list)
    answering: bool = False  # /health answered (any status)
    flavour: EngineKind | None = None
    models: dict[str, Any] | None = None
    scrape: Scrape | None = None


def probe(url: str, timeout_s: float) -> Probe:
    result = Probe()
    port = urlparse(url).port or 80
    with httpx.Client(base_url=url, timeout=timeout_s) as http:
        started = time.perf_counter()
        try:
            health = http.get("/health")
        except httpx.ConnectError as exc:
            starts = "; ".join(f"{k}: {v.format(port=port)}" for k, v in START_COMMANDS.items())
            result.checks.append(Check(
                section=SECTION, title="Listening", status=Status.FAIL,
                evidence=f"nothing listening at {url} ({_reason(exc)})",
                remedy=f"start the engine on that port — {starts}; or point --url at the right host:port"))
            return result
        except httpx.TimeoutException:
            result.checks.append(Check(
                section=SECTION, title="Health", status=Status.FAIL,
                evidence=f"GET {url}/health: no answer within {timeout_s:g} s — the server accepts connections "
                         "but does not respond: a stuck step loop or a blocked event loop",
                remedy="look at its log and where it hangs (py-spy dump --pid PID), then restart it; kvops run "
                       "restarts a managed engine by itself"))
            return result
        except httpx.HTTPError as exc:
            result.checks.append(Check(section=SECTION, title="Health", status=Status.FAIL,
                                       evidence=f"GET {url}/health: {type(exc).__name__}: {exc}"))
            return result
        result.answering = True
        health_ms = (time.perf_counter() - started) * 1000
        engines = _supervisor_engines(http, health)
        if engines is not None:  # a `kvops run` supervisor, whose /metrics carries kvops_ series of its engines
            listed = ", ".join(f"{e.get('name')} ({e.get('kind')}) at {e.get('url')}" for e in engines) or "none"
            result.checks.append(Check(
                section=SECTION, title="Inference server", status=Status.FAIL,
                evidence=f"{url} is a kvops supervisor (kvops run), not an engine; it watches {len(engines)} "
                         f"engine(s): {listed}",
                remedy="; ".join([*(f"kvops doctor --url {e.get('url')}" for e in engines if e.get("url")),
                                  f"kvops top --attach {url}"])))
            return result
        result.scrape = _scrape(http)
        result.models = _json(http, "/v1/models")
        result.flavour = detect_flavour(result.scrape, result.models)
        if result.flavour is None:
            kind = health.headers.get("content-type", "?").split(";")[0]
            result.checks.append(Check(
                section=SECTION, title="Inference server", status=Status.FAIL,
                evidence=f"something answers at {url} but it is not an inference engine: GET /health → "
                         f"{health.status_code} {kind}; /metrics has no kvops_, vllm: or sglang: metrics and "
                         "/v1/models names no model",
                remedy="check the port (the engine's --port), and for SGLang start it with --enable-metrics"))
            return result
        result.checks.append(_health_check(url, health, health_ms))
        if health.status_code == 200:
            result.checks.append(_first_token(http, model_card(result.models).get("id"), timeout_s))
    return result


def _reason(exc: Exception) -> str:
    text = str(exc)
    return "connection refused" if "refused" in text.lower() else text or type(exc).__name__


def _scrape(http: httpx.Client) -> Scrape | None:
    try:
        response = http.get("/metrics")
        return Scrape.parse(response.text) if response.status_code == 200 else None
    except (httpx.HTTPError, ScrapeError):
        return None


def _supervisor_engines(http: httpx.Client, health: httpx.Response) -> list[dict[str, Any]] | None:
    """The engines of a kvops supervisor answering at this URL (its /health counts engines and polls), else None."""
    try:
        body = health.json() if health.status_code == 200 else None
    except ValueError:
        return None
    if not isinstance(body, dict) or "engines" not in body or "polls" not in body:
        return None
    try:
        engines = http.get("/api/engines").json()
    except (httpx.HTTPError, ValueError):
        return None
    return [e for e in engines if isinstance(e, dict)] if isinstance(engines, list) else None


def _json(http: httpx.Client, path: str) -> dict[str, Any] | None:
    try:
        response = http.get(path)
        body = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _health_check(url: str, health: httpx.Response, health_ms: float) -> Check:
    if health.status_code == 200:
        return Check(section=SECTION, title="Health", status=Status.OK, evidence=f"answers in {health_ms:.0f} ms")
    try:
        reason = health.json().get("reason", "")
    except (ValueError, AttributeError):
        reason = health.text[:120]
    return Check(section=SECTION, title="Health", status=Status.FAIL,
                 evidence=f"GET {url}/health → {health.status_code}: {reason or 'unhealthy'}",
                 remedy="the step loop stopped or is stuck: read the engine's log, then restart it")


def _first_token(http: httpx.Client, model: str | None, timeout_s: float) -> Check:
    """One greedy token: the whole path (tokenizer, scheduler, a forward pass) on an idle server."""
    body = {"model": model or "default", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    try:
        response = http.post("/v1/completions", json=body, timeout=max(timeout_s, 30.0))
    except httpx.HTTPError as exc:
        return Check(section=SECTION, title="One-token completion", status=Status.FAIL,
                     evidence=f"POST /v1/completions: {type(exc).__name__}: {exc}",
                     remedy="health answers but generation does not: the step loop may be stuck")
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        return Check(section=SECTION, title="One-token completion", status=Status.FAIL,
                     evidence=f"POST /v1/completions → {response.status_code}: {response.text[:160]}")
    status = Status.OK if elapsed <= SLOW_FIRST_TOKEN_S else Status.WARN
    return Check(section=SECTION, title="One-token completion", status=status,
                 evidence=f"{elapsed * 1000:.0f} ms" + (" (slow for one token)" if status is Status.WARN else ""),
                 remedy="a busy or overloaded server: see Cache health (waiting requests, preemptions)"
                 if status is Status.WARN else "")
