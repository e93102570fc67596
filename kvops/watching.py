"""Watching an engine kvops does not run, whatever its kind: a kvops engine (read whole from `/stats`), or
another server (read from `/metrics` through its kind's profile). Same interface as `EngineClient`, so the
supervisor polls them alike; kvops's admin API exists only where the kind's profile says so, so admin calls
to the others are refused with the reason. It asks the kinds' registry (kvops.kinds) what a server is and how
to read it, so it sits above the profiles, beside the rules; the supervisor and doctor use it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvops.adapters.engine_client import EngineClient, EngineUnreachable
from kvops.adapters.http_client import HttpError
from kvops.adapters.prometheus import Scrape
from kvops.kinds import (
    AUTO,
    Capability,
    EngineProfile,
    detect,
    first_scrape,
    kinds,
    profile,
    snapshot_from_scrape,
    unrecognised,
)
from kvops.schema.reports import BlockSizeProfile, KVQuantProfile
from kvops.schema.snapshot import Snapshot


class WatchedEngineClient(EngineClient):
    def __init__(self, url: str, kind: str = "auto", admin_token: str | None = None, timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        if kind != AUTO and kind not in kinds():
            raise ValueError(f"engine kind {kind!r} is not one of {', '.join((AUTO, *kinds()))}")
        super().__init__(url, admin_token, timeout_s)
        self.kind: str | None = None if kind == AUTO else kind
        self.clock = clock
        self.first_seen: float | None = None  # uptime fallback when the scrape has no process start time
        self._models: dict[str, Any] | None = None
        self._metrics_path: str | None = None  # where its Prometheus text was found

    # ------------------------------------------------------------- reading

    def scrape(self) -> Scrape:
        """The Prometheus text, from the first of the kind's paths that has samples (kvops.kinds.metrics_paths:
        trtllm-serve's is `/prometheus/metrics`, its `/metrics` is JSON); the path found is kept, one request a poll."""
        if self._metrics_path is not None:
            return Scrape.parse(self._request("GET", self._metrics_path).text)
        statuses: list[str] = []

        def get(path: str) -> str | None:
            try:
                reply = self._http.request("GET", path)
            except HttpError as exc:  # no answer at all: the other paths would not answer either
                raise EngineUnreachable(f"GET {self.url}{path}: {exc}") from None
            if reply.status_code >= 400:
                statuses.append(f"GET {self.url}{path}: HTTP {reply.status_code}: {reply.text[:200]}")
                return None
            return reply.text

        found = first_scrape(get, self.kind)
        if found is None:
            raise EngineUnreachable(statuses[0])
        path, scrape = found
        if scrape.names:
            self._metrics_path = path
        return scrape

    def models(self) -> dict[str, Any] | None:
        try:
            body = self._request("GET", "/v1/models").json()
        except (EngineUnreachable, ValueError):
            return None
        return body if isinstance(body, dict) else None

    def detect(self) -> EngineProfile:
        """Which server this is; raises EngineUnreachable when it answers but is not one kvops reads."""
        if self.kind is None:
            failure: EngineUnreachable | None = None
            try:
                scrape: Scrape | None = self.scrape()
            except EngineUnreachable as exc:
                scrape, failure = None, exc
            self._models = self.models()
            found = detect(scrape, self._models)
            if found is None and self._models is None and failure is not None:
                raise failure  # no answer, or an error status: say that, not "it answers but is something else"
            if found is None:
                raise EngineUnreachable(unrecognised(self.url))
            self.kind = found.kind
        return profile(self.kind)

    def snapshot(self) -> Snapshot:
        kind = self.detect()
        if kind.can(Capability.STATS):
            return super().snapshot()
        scrape = self.scrape()
        if self._models is None:
            self._models = self.models()
        now = self.clock()
        if self.first_seen is None:
            self.first_seen = now
        return snapshot_from_scrape(kind.kind, scrape, now, self._models, self.first_seen)

    def health(self) -> dict[str, Any]:
        response = self._request("GET", "/health")
        try:
            body = response.json()  # kvops answers JSON; vLLM and SGLang an empty 200
        except ValueError:
            body = None
        return body if isinstance(body, dict) else {"status": "ok"}

    # --------------------------------------------------------------- admin

    def _needs(self, capability: Capability, what: str) -> None:
        kind = self.detect()
        if not kind.can(capability):
            raise EngineUnreachable(f"{what} needs kvops's admin API, which a {kind.kind} server does not have: "
                                    f"change the {kind.kind} server's flags by hand")

    def knobs(self) -> dict[str, Any]:
        self._needs(Capability.ADMIN_API, "reading the knobs")
        return super().knobs()

    def admin(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        self._needs(Capability.ADMIN_API, f"{action} {params}")
        return super().admin(action, params)

    def kv_quant_profile(self, timeout_s: float = 120.0) -> KVQuantProfile:
        self._needs(Capability.PROFILES, "the KV quantization error profile")
        return super().kv_quant_profile(timeout_s)

    def block_size_profile(self, timeout_s: float = 120.0) -> BlockSizeProfile:
        self._needs(Capability.PROFILES, "the block-size profile")
        return super().block_size_profile(timeout_s)
