"""Watching an engine kvops does not run, whatever it is: a kvops engine (read from `/stats`), or vLLM /
SGLang (read from `/metrics` through the adapters). Same interface as `EngineClient`, so the supervisor
polls them alike; kvops's admin API exists only on kvops engines, so admin calls to the others are
refused with the reason."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvops.adapters.detect import detect_flavour, snapshot_from_scrape
from kvops.adapters.prometheus import Scrape, ScrapeError
from kvops.schema.kinds import WATCH_KINDS, EngineKind
from kvops.schema.reports import BlockSizeProfile, KVQuantProfile
from kvops.schema.snapshot import Snapshot
from kvops.supervisor.engine_client import EngineClient, EngineUnreachable


class WatchedEngineClient(EngineClient):
    def __init__(self, url: str, kind: str = "auto", admin_token: str | None = None, timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        if kind not in WATCH_KINDS:
            raise ValueError(f"engine kind {kind!r} is not one of {', '.join(WATCH_KINDS)}")
        super().__init__(url, admin_token, timeout_s)
        self.flavour: EngineKind | None = None if kind == "auto" else kind  # type: ignore[assignment]
        self.clock = clock
        self.first_seen: float | None = None  # uptime fallback when the scrape has no process start time
        self._models: dict[str, Any] | None = None

    # ------------------------------------------------------------- reading

    def scrape(self) -> Scrape:
        try:
            return Scrape.parse(self._request("GET", "/metrics").text)
        except ScrapeError as exc:
            raise EngineUnreachable(f"GET {self.url}/metrics: {exc}") from None

    def models(self) -> dict[str, Any] | None:
        try:
            body = self._request("GET", "/v1/models").json()
        except (EngineUnreachable, ValueError):
            return None
        return body if isinstance(body, dict) else None

    def detect(self) -> EngineKind:
        """Which server this is; raises EngineUnreachable when it answers but is not one kvops reads."""
        if self.flavour is None:
            failure: EngineUnreachable | None = None
            try:
                scrape: Scrape | None = self.scrape()
            except EngineUnreachable as exc:
                scrape, failure = None, exc
            self._models = self.models()
            flavour = detect_flavour(scrape, self._models)
            if flavour is None and self._models is None and failure is not None:
                raise failure  # no answer, or an error status: say that, not "it answers but is something else"
            if flavour is None:
                raise EngineUnreachable(f"{self.url} answers, but neither /metrics nor /v1/models looks like a "
                                        "kvops, vLLM or SGLang server (vLLM and SGLang need metrics enabled: "
                                        "SGLang's --enable-metrics)")
            self.flavour = flavour
        return self.flavour

    def snapshot(self) -> Snapshot:
        flavour = self.detect()
        if flavour == "kvops":
            return super().snapshot()
        scrape = self.scrape()
        if self._models is None:
            self._models = self.models()
        now = self.clock()
        if self.first_seen is None:
            self.first_seen = now
        return snapshot_from_scrape(flavour, scrape, now, self._models, self.first_seen)

    def health(self) -> dict[str, Any]:
        response = self._request("GET", "/health")
        try:
            body = response.json()  # kvops answers JSON; vLLM and SGLang an empty 200
        except ValueError:
            body = None
        return body if isinstance(body, dict) else {"status": "ok"}

    # --------------------------------------------------------------- admin

    def _kvops_only(self, what: str) -> None:
        flavour = self.detect()
        if flavour != "kvops":
            raise EngineUnreachable(f"{what} needs kvops's admin API, which a {flavour} server does not have: "
                                    f"change the {flavour} server's flags by hand")

    def knobs(self) -> dict[str, Any]:
        self._kvops_only("reading the knobs")
        return super().knobs()

    def admin(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        self._kvops_only(f"{action} {params}")
        return super().admin(action, params)

    def kv_quant_profile(self, timeout_s: float = 120.0) -> KVQuantProfile:
        self._kvops_only("the KV quantization error profile")
        return super().kv_quant_profile(timeout_s)

    def block_size_profile(self, timeout_s: float = 120.0) -> BlockSizeProfile:
        self._kvops_only("the block-size profile")
        return super().block_size_profile(timeout_s)
