"""Liveness: is anything listening, does it answer `/health` in time, is it an inference server kvops
knows (from `/metrics` and `/v1/models`), and how long one token takes. Then reading it: the few snapshots
(and, where its kind has them, kvops's profiles) the sections after this one check; or, offline, what a saved
scrape says of the process that wrote it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from kvops.adapters import Scrape
from kvops.adapters.engine_client import EngineUnreachable
from kvops.doctor.report import Check, Status
from kvops.doctor.validator import Examined
from kvops.kinds import (
    ENABLE_METRICS,
    PROFILES,
    Capability,
    Remedy,
    detect,
    first_scrape,
    metrics_switches,
    model_card,
    profile,
)
from kvops.schema.reports import BlockSizeProfile, KVQuantProfile
from kvops.schema.snapshot import Snapshot
from kvops.watching import WatchedEngineClient

SECTION = "Liveness"
SLOW_FIRST_TOKEN_S = 5.0  # an idle server taking longer than this for one token is worth a look
LOCAL_URL = "http://127.0.0.1:8000"  # `kvops engine serve`'s default address
SUPERVISOR_URL = "http://127.0.0.1:9400"  # `kvops run`'s default address: its engines are local ones too
SAMPLES = 3
SAMPLE_INTERVAL_S = 0.5  # three snapshots over 1 s: the whole doctor stays under 2 s
PROFILE_REPEATS = 3  # block-size profile: enough to see a clear difference, short enough for doctor
NEEDS_TOKEN = "needs the engine's admin token: pass --admin-token or set $KVOPS_ADMIN_TOKEN"


def known_prefixes() -> str:
    """The metric-name prefixes of the kinds kvops reads, as a sentence ("kvops_, vllm: or sglang:")."""
    prefixes = [prefix for p in PROFILES.values() for prefix in p.recognition.metric_prefixes]
    return f"{', '.join(prefixes[:-1])} or {prefixes[-1]}" if len(prefixes) > 1 else "".join(prefixes)


def _start_commands(port: int) -> str:
    return "; ".join(f"{p.kind}: {p.remedy(Remedy.START, port=port)}" for p in PROFILES.values()
                     if p.remedy(Remedy.START))


def not_a_server_remedy() -> str:
    """Check the port, and turn metrics on where a kind exports none by default."""
    return ", and ".join(["check the port (the engine's --port)",
                          *(f"for {p.title} start it with {p.notes[ENABLE_METRICS]}" for p in metrics_switches())])


@dataclass
class Probe:
    """What liveness learnt, for the sections after it."""

    checks: list[Check] = field(default_factory=list)
    answering: bool = False  # /health answered (any status)
    kind: str | None = None
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
            starts = _start_commands(port)
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
        found = detect(result.scrape, result.models)
        result.kind = None if found is None else found.kind
        if found is None:
            content = health.headers.get("content-type", "?").split(";")[0]
            result.checks.append(Check(
                section=SECTION, title="Inference server", status=Status.FAIL,
                evidence=f"something answers at {url} but it is not an inference engine: GET /health → "
                         f"{health.status_code} {content}; /metrics has no {known_prefixes()} metrics and "
                         "/v1/models names no model",
                remedy=not_a_server_remedy()))
            return result
        result.checks.append(_health_check(url, health, health_ms))
        if health.status_code == 200:
            result.checks.append(_first_token(http, model_card(result.models).get("id"), timeout_s))
    return result


def _reason(exc: Exception) -> str:
    text = str(exc)
    return "connection refused" if "refused" in text.lower() else text or type(exc).__name__


def _scrape(http: httpx.Client) -> Scrape | None:
    """The Prometheus text from the first path that has it (kvops.kinds.metrics_paths: trtllm-serve's `/metrics` is
    JSON, its text is at `/prometheus/metrics`)."""
    def get(path: str) -> str | None:
        try:
            response = http.get(path)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    found = first_scrape(get)
    return None if found is None else found[1]


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


# ------------------------------------------------------------------- reading the target

def offline(examined: Examined) -> list[Check]:
    """A saved scrape: nothing to ask, and what it says of the process that wrote it."""
    checks = []
    if examined.snaps and "uptime_s" in examined.snaps[-1].unknown:
        # A scrape without the process start: doctor then reads it as an hour's work.
        checks.append(Check(section=SECTION, title="Process start", status=Status.INFO,
                            evidence="the scrape has no process_start_time_seconds: rates are taken over an "
                                     "assumed hour"))
    if examined.scrape is not None and examined.scrape.damaged_lines:
        damaged = examined.scrape.damaged_lines
        checks.append(Check(section=SECTION, title="Scrape", status=Status.WARN,
                            evidence=f"{len(damaged)} line(s) do not parse (a cut-off scrape?); the checks use the "
                                     "rest", detail=damaged[:5]))
    checks.append(Check(section=SECTION, title="Liveness", status=Status.SKIPPED,
                        evidence="an offline scrape: nothing to ask", remedy="kvops doctor --url URL for a live check"))
    return checks


def reach(examined: Examined) -> list[Check]:
    """Probe the engine; if it is one kvops reads, take its snapshots (and profiles) into `examined`."""
    checks: list[Check] = []
    url = examined.url or local_engine(checks, examined.timeout_s)
    found = probe(url, examined.timeout_s)
    if examined.local and not found.answering and found.checks and found.checks[0].title == "Listening":
        return [*checks, Check(section=SECTION, title="Local engine", status=Status.INFO,
                               evidence=f"none running at {url}; the checks above are the configuration's",
                               remedy="start one: kvops engine serve; or check another: kvops doctor --url URL")]
    checks += found.checks
    if found.kind is None:
        return checks
    examined.kind = found.kind
    try:
        snaps = sample(url, found.kind, examined.timeout_s)
    except EngineUnreachable as exc:
        return [*checks, Check(section=SECTION, title="Snapshot", status=Status.FAIL, evidence=str(exc))]
    if profile(found.kind).can(Capability.PROFILES):
        examined.block_profile, examined.block_why = admin_profile(
            url, "block-size", BlockSizeProfile, examined.admin_token, {"repeats": PROFILE_REPEATS},
            examined.timeout_s)
        if examined.kv_quant:
            examined.kv_profile, examined.kv_why = admin_profile(url, "kv-quant", KVQuantProfile,
                                                                 examined.admin_token, {}, examined.timeout_s)
    else:
        examined.block_why = examined.kv_why = f"a {found.kind} server has no kvops profile endpoints"
    examined.snaps = snaps
    return checks


def local_engine(checks: list[Check], timeout_s: float) -> str:
    """The engine a plain `kvops doctor` examines: the first one a local supervisor runs (a managed
    engine's port is picked at start), else `kvops engine serve`'s default address."""
    try:
        answer = httpx.get(f"{SUPERVISOR_URL}/api/engines", timeout=min(timeout_s, 2.0)).json()
        engines = [(str(e["name"]), str(e["url"])) for e in answer if isinstance(e, dict) and e.get("url")]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return LOCAL_URL
    if not engines:
        return LOCAL_URL
    (name, url), others = engines[0], engines[1:]
    checks.append(Check(section=SECTION, title="Supervisor", status=Status.INFO,
                        evidence=f"kvops run at {SUPERVISOR_URL} runs {len(engines)} engine(s); checking {name} at "
                                 f"{url}",
                        remedy="; ".join(f"kvops doctor --url {u} ({n})" for n, u in others)))
    return url


def sample(url: str, kind: str, timeout_s: float) -> list[Snapshot]:
    """SAMPLES snapshots SAMPLE_INTERVAL_S apart: enough for a trend over the sample, not for the
    supervisor's windows (see kvops.doctor.cache for how the rules read them)."""
    client = WatchedEngineClient(url, kind, timeout_s=timeout_s)
    try:
        snaps = []
        for index in range(SAMPLES):
            if index:
                time.sleep(SAMPLE_INTERVAL_S)
            snaps.append(client.snapshot())
        return snaps
    finally:
        client.close()


def admin_profile(url: str, which: str, model: Any, token: str | None, params: dict[str, Any],
                  timeout_s: float) -> tuple[Any, str]:
    """An on-demand profile through the admin API; (None, why) when it cannot be had."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(f"{url}/admin/profile/{which}", params=params, headers=headers,
                             timeout=max(timeout_s, 120.0))
    except httpx.HTTPError as exc:
        return None, f"GET /admin/profile/{which}: {type(exc).__name__}: {exc}"
    if response.status_code == 401:
        return None, f"{NEEDS_TOKEN} (the engine answered 401)"
    if response.status_code == 403:
        return None, "the engine refused the admin token (403): check --admin-token / $KVOPS_ADMIN_TOKEN"
    if response.status_code == 404:
        return None, "the engine's admin endpoints are off: restart it with --admin-token to allow profiles"
    if response.status_code != 200:
        return None, f"GET /admin/profile/{which} → {response.status_code}: {response.text[:160]}"
    try:
        return model.model_validate_json(response.content), ""
    except ValueError as exc:
        return None, f"GET /admin/profile/{which}: unexpected answer: {exc}"
