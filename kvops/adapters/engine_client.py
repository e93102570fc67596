"""Talking to a kvops engine over its HTTP API: the only way the supervisor touches an engine.

That contract (docs/architecture.md) is what lets kvops watch engines it does not manage.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from kvops.adapters.http_client import HttpClient, HttpError, Reply
from kvops.schema.admin import ADMIN_ACTIONS
from kvops.schema.reports import BlockSizeProfile, KVQuantProfile
from kvops.schema.snapshot import STEPS_KEPT_HEADER, Snapshot, StepSample


class EngineUnreachable(Exception):
    """The engine did not answer, or answered with an error; the message says which."""


# An admin call runs on the engine's step loop between two steps, so it waits for the step in flight: a prefill of
# max_num_batched_tokens on a 2-core CPU takes seconds (5-9 s in CI), past the read timeout. Timing out there was
# worse than slow: the change still landed after the step, while the fix job recorded it as not made and kept no undo.
ADMIN_TIMEOUT_S = 60.0


class EngineClient:
    def __init__(self, url: str, admin_token: str | None = None, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.admin_token = admin_token
        self.timeout_s = timeout_s
        self._http = HttpClient(self.url, timeout_s)
        self._last: Snapshot | None = None  # the last snapshot read: its steps are not read again

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, *, admin: bool = False, timeout: float | None = None,
                 **kwargs: Any) -> Reply:
        headers = {}
        if admin:
            if not self.admin_token:
                raise EngineUnreachable(f"{self.url}{path} needs the engine's admin token, and none is configured "
                                        "(admin_token_env in the engine's config)")
            headers["Authorization"] = f"Bearer {self.admin_token}"
            if timeout is None:
                timeout = max(self.timeout_s, ADMIN_TIMEOUT_S)
        try:
            if timeout is not None:
                kwargs["timeout"] = timeout
            response = self._http.request(method, path, headers=headers, **kwargs)
        except HttpError as exc:
            raise EngineUnreachable(f"{method} {self.url}{path}: {exc}") from None
        if response.status_code >= 400:
            try:
                detail = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                detail = response.text[:200]
            raise EngineUnreachable(f"{method} {self.url}{path}: HTTP {response.status_code}: {detail}")
        return response

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health").json()

    def snapshot(self) -> Snapshot:
        """The engine's snapshot, whole. After the first, only the steps newer than the last one read cross
        the wire (a 512-step snapshot is ~68 KB, nine tenths of it steps); the rest are the last snapshot's,
        the same objects, so a history of snapshots holds each step once."""
        last = self._last
        if last is None or not last.steps:
            snap = Snapshot.model_validate_json(self._request("GET", "/stats").content)
        else:
            response = self._request("GET", "/stats", params={"steps_after": repr(last.steps[-1].t)})
            snap = Snapshot.model_validate_json(response.content)
            kept = response.headers.get(STEPS_KEPT_HEADER)
            # A restarted engine's steps are all newer than the last run's (and all it has); an engine that
            # ignores steps_after (no header) sent them all.
            if kept is not None and abs(snap.engine.started_at - last.engine.started_at) < 1e-3:
                snap.steps = merge_steps(last.steps, snap.steps, int(kept))
        self._last = snap
        return snap

    def knobs(self) -> dict[str, Any]:
        return self._request("GET", "/admin/config", admin=True).json()

    def admin(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        """Apply one admin action (a name in kvops.schema.admin.ADMIN_ACTIONS); returns the knobs after it.
        KeyError or ValueError when the params do not fit the action."""
        spec = ADMIN_ACTIONS.get(action)
        if spec is None:
            raise ValueError(f"unknown admin action {action!r}; known: {', '.join(ADMIN_ACTIONS)}")
        # Each path field is quoted whole, so a tenant named 'a/b' stays one segment (the engine decodes it).
        path = spec.path.format(**{name: quote(str(params[name]), safe="") for name in spec.path_params})
        return self._request(spec.method, path, admin=True, json=spec.request_body(params)).json()

    def kv_quant_profile(self, timeout_s: float = 120.0) -> KVQuantProfile:
        return KVQuantProfile.model_validate_json(
            self._request("GET", "/admin/profile/kv-quant", admin=True, timeout=timeout_s).content)

    def block_size_profile(self, timeout_s: float = 120.0) -> BlockSizeProfile:
        return BlockSizeProfile.model_validate_json(
            self._request("GET", "/admin/profile/block-size", admin=True, timeout=timeout_s).content)


def merge_steps(held: list[StepSample], newer: list[StepSample], kept: int) -> list[StepSample]:
    """The engine's last `kept` steps, from those held and the ones newer than them."""
    return [*held, *newer][-kept:] if kept > 0 else []
