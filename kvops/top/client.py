"""A small client for the supervisor's JSON API (kvops.supervisor.api), for `kvops top` and scripts.

Every call returns pydantic models (the same Snapshot, Diagnosis and AuditEntry the supervisor
serves). Any failure becomes `SupervisorUnreachable` with a message that says which call failed
and why; an HTTP error the supervisor answered on purpose (401, 403, 404, 409) is the subclass
`SupervisorRefused`, so callers can tell "the supervisor is gone" from "it said no".

`Poller` gathers everything one refresh of `kvops top` shows. It fetches an engine's history
once and then only the latest snapshot per poll, keeping the window locally, so a 1 s refresh
does not re-download a minute of snapshots every second.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter, ValidationError

from kvops.schema.audit import AuditEntry
from kvops.schema.diagnosis import Diagnosis
from kvops.schema.engines import EngineEntry, LogLine
from kvops.schema.snapshot import Snapshot

DEFAULT_URL = "http://127.0.0.1:9400"  # `kvops run --listen`'s default
URL_ENV = "KVOPS_TOP_URL"  # the supervisor `kvops top` shows when --attach is not given
ADMIN_TOKEN_ENV = "KVOPS_ADMIN_TOKEN"
PROBE_TIMEOUT_S = 3.0  # as long as the client's own calls: a busy supervisor is still one


def normalize_url(url: str) -> str:
    """`host:port` or a full URL, without the trailing slash."""
    return (url if "://" in url else f"http://{url}").rstrip("/")


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a kvops supervisor answers at `url` (its /health counts engines); otherwise why
    not, in a few words, for the message that says nothing answers there."""
    try:
        response = httpx.get(f"{normalize_url(url)}/health", timeout=timeout_s)
    except httpx.ConnectError:
        return "connection refused"  # by far the usual case: nothing listens on that port
    except httpx.TimeoutException:
        return f"no answer within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc or 'no answer'}"
    if response.status_code != 200:
        return f"GET /health answered HTTP {response.status_code}: not a kvops supervisor"
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "engines" not in body:
        # A kvops engine answers /health too (with its model): a common mix-up of the two ports.
        hint = " (a kvops engine? attach to the supervisor that watches it)" if isinstance(body, dict) \
            and "model" in body else ""
        return f"something answers, but not a kvops supervisor{hint}"
    return None


class SupervisorUnreachable(Exception):
    """The supervisor did not answer, or answered with an error; the message says which."""


class SupervisorRefused(SupervisorUnreachable):
    """The supervisor answered, with an HTTP error (no such engine, no admin token, fix conflict)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


_engines = TypeAdapter(list[EngineEntry])
_snapshots = TypeAdapter(list[Snapshot])
_diagnoses = TypeAdapter(list[Diagnosis])
_audit = TypeAdapter(list[AuditEntry])
_logs = TypeAdapter(list[LogLine])
_jobs = TypeAdapter(list[dict[str, Any]])


class Source(Protocol):
    """What `kvops top` needs from the supervisor: `SupervisorClient`, or a fake in tests."""

    url: str
    admin_token: str | None

    def engines(self) -> list[EngineEntry]: ...
    def snapshot(self, name: str) -> Snapshot: ...
    def history(self, name: str, seconds: float = 60.0) -> list[Snapshot]: ...
    def diagnoses(self) -> list[Diagnosis]: ...
    def audit(self) -> list[AuditEntry]: ...
    def fixes(self) -> list[dict[str, Any]]: ...
    def logs(self, name: str, lines: int = 100) -> list[LogLine]: ...
    def apply_fix(self, engine: str, rule: str, subject: str = "") -> AuditEntry: ...
    def revert_fix(self, entry_id: int) -> AuditEntry: ...


class SupervisorClient:
    def __init__(self, url: str = DEFAULT_URL, admin_token: str | None = None, timeout_s: float = 3.0) -> None:
        self.url = normalize_url(url)
        self.admin_token = admin_token or None
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SupervisorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, admin: bool = False, **kwargs: Any) -> bytes:
        headers = {}
        if admin:
            if not self.admin_token:
                raise SupervisorRefused(f"{method} {path} needs the supervisor's admin token: pass --admin-token "
                                        f"or set ${ADMIN_TOKEN_ENV}", 401)
            headers["Authorization"] = f"Bearer {self.admin_token}"
        try:
            response = self._http.request(method, path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise SupervisorUnreachable(f"supervisor at {self.url} unreachable ({method} {path}): "
                                        f"{type(exc).__name__}: {exc or 'no answer'}") from None
        if response.status_code >= 400:
            try:
                detail = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                detail = response.text[:200]
            message = f"{method} {self.url}{path}: HTTP {response.status_code}: {detail}"
            if response.status_code >= 500:
                raise SupervisorUnreachable(message)
            raise SupervisorRefused(message, response.status_code)
        return response.content

    def _parse(self, adapter: TypeAdapter[Any], body: bytes, what: str) -> Any:
        try:
            return adapter.validate_json(body)
        except ValidationError as exc:
            raise SupervisorUnreachable(f"{self.url}: {what} does not match kvops' schema (a different kvops "
                                        f"version?): {exc.error_count()} errors, first: {exc.errors()[0]['msg']}"
                                        ) from None

    def engines(self) -> list[EngineEntry]:
        return self._parse(_engines, self._request("GET", "/api/engines"), "/api/engines")

    def snapshot(self, name: str) -> Snapshot:
        body = self._request("GET", f"/api/engines/{quote(name, safe='')}/snapshot")
        return self._parse(TypeAdapter(Snapshot), body, f"the snapshot of {name!r}")

    def history(self, name: str, seconds: float = 60.0) -> list[Snapshot]:
        body = self._request("GET", f"/api/engines/{quote(name, safe='')}/history", params={"seconds": seconds})
        return self._parse(_snapshots, body, f"the history of {name!r}")

    def diagnoses(self) -> list[Diagnosis]:
        return self._parse(_diagnoses, self._request("GET", "/api/diagnoses"), "/api/diagnoses")

    def audit(self) -> list[AuditEntry]:
        return self._parse(_audit, self._request("GET", "/api/audit"), "/api/audit")

    def fixes(self) -> list[dict[str, Any]]:
        """GET /api/fixes: the fix jobs (state, progress), as the supervisor's docstring describes them."""
        return self._parse(_jobs, self._request("GET", "/api/fixes"), "/api/fixes")

    def logs(self, name: str, lines: int = 100) -> list[LogLine]:
        body = self._request("GET", f"/api/engines/{quote(name, safe='')}/logs", params={"lines": lines})
        return self._parse(_logs, body, f"the log of {name!r}")

    def apply_fix(self, engine: str, rule: str, subject: str = "") -> AuditEntry:
        body = self._request("POST", "/api/fixes/apply", admin=True,
                             json={"engine": engine, "rule": rule, "subject": subject})
        return self._parse(TypeAdapter(AuditEntry), body, "the audit entry")

    def revert_fix(self, entry_id: int) -> AuditEntry:
        body = self._request("POST", f"/api/fixes/{entry_id}/revert", admin=True)
        return self._parse(TypeAdapter(AuditEntry), body, "the audit entry")


@dataclass
class EngineView:
    entry: EngineEntry
    latest: Snapshot | None
    history: list[Snapshot]  # oldest first, the last `history_s` seconds
    error: str = ""  # why there is no snapshot (starting, engine down)


@dataclass
class TopState:
    engines: list[EngineView]
    diagnoses: list[Diagnosis]
    audit: list[AuditEntry]
    logs: list[LogLine] = field(default_factory=list)  # the log tail of the engine asked for
    jobs: list[dict[str, Any]] = field(default_factory=list)  # fix jobs (GET /api/fixes): the running one's progress
    time: float = field(default_factory=time.time)


class Poller:
    """One refresh of everything `kvops top` shows. Blocking: call it from a worker thread."""

    def __init__(self, source: Source, history_s: float = 120.0) -> None:
        self.source = source
        self.history_s = history_s
        self._history: dict[str, deque[Snapshot]] = {}

    def poll(self, log_engine: str | None = None, log_lines: int = 100) -> TopState:
        """Everything on screen; the log tail of `log_engine` (default: the first engine) when
        `log_lines` > 0."""
        entries = self.source.engines()
        views = [self._engine(entry) for entry in entries]
        for gone in set(self._history) - {e.name for e in entries}:
            del self._history[gone]
        names = [e.name for e in entries]
        log_engine = log_engine if log_engine in names else (names[0] if names else None)
        logs = self.source.logs(log_engine, log_lines) if log_engine and log_lines > 0 else []
        return TopState(engines=views, diagnoses=self.source.diagnoses(), audit=self.source.audit(), logs=logs,
                        jobs=self.source.fixes())

    def _engine(self, entry: EngineEntry) -> EngineView:
        kept = self._history.get(entry.name)
        try:
            if kept is None:
                kept = self._history[entry.name] = deque(self.source.history(entry.name, self.history_s))
            latest = self.source.snapshot(entry.name)
        except SupervisorRefused as exc:  # no snapshot yet: the engine is starting or down
            return EngineView(entry, None, list(kept or ()), error=str(exc).rpartition(": ")[2])
        if not kept or latest.time > kept[-1].time:
            kept.append(latest)
        while kept and kept[0].time < latest.time - self.history_s:
            kept.popleft()
        return EngineView(entry, latest, list(kept))
