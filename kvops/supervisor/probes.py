"""The profiles that take a kvops engine a few seconds: the KV quantization error profile and the
block-size profile (decode steps timed at candidate block sizes).

The block-size profile runs batches on the engine's own thread, so serving pauses while it runs
(5-15 s on 2 cores). That is why it has a schedule: `off`, `on_demand` (only when someone asks,
through the supervisor API) or `idle` (the default: only after the engine has had no request
running or waiting for `idle_s`, and at most once per `every_s`). A poll that times out while a
profile runs is not the engine being down: the supervisor asks `Probes.busy` before counting it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

from kvops.adapters.engine_client import EngineClient, EngineUnreachable
from kvops.history import EngineHistory

log = structlog.get_logger("kvops.supervisor.probes")

KV_PROFILE_INTERVAL_S = 3600.0
Schedule = Literal["off", "on_demand", "idle"]


class BlockSizeProfileSettings(BaseModel):
    """[supervisor.block_size_profile]: when kvops measures decode steps at other block sizes."""

    model_config = ConfigDict(extra="forbid")
    schedule: Schedule = "idle"
    idle_s: float = Field(60.0, gt=0)  # idle: no request running or waiting for this long
    every_s: float = Field(3600.0, gt=0)  # idle: at most this often
    min_requests: int = Field(50, ge=0)  # measure on a real length distribution, not an empty one


class ProbeRefused(Exception):
    """An on-demand profile that cannot start now; the message says why."""


def idle_for(history: EngineHistory, seconds: float, now: float) -> bool:
    """No request running or waiting in any snapshot of the last `seconds`, and the history reaches back that far."""
    snaps = history.snapshots
    if not snaps or snaps[0].time > now - seconds:
        return False
    recent = [s for s in snaps if s.time >= now - seconds]
    return bool(recent) and all(s.requests.running == 0 and s.requests.waiting == 0 for s in recent)


@dataclass
class Probes:
    """One engine's profiles: which is due, and the side thread that runs them."""

    engine: str
    history: EngineHistory
    settings: BlockSizeProfileSettings
    clock: Callable[[], float] = time.time
    next_kv_at: float = 0.0
    next_block_size_at: float = 0.0
    running: str = ""  # the profile in progress ("kv", "block_size"), "" when none
    started_at: float = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def reset(self) -> None:
        """A new engine process: its old profiles do not describe it; measure it afresh."""
        self.history.kv_profile = self.history.block_size_profile = None
        self.next_kv_at = self.next_block_size_at = 0.0

    def due(self, quantized: bool, finished: int, now: float) -> tuple[bool, bool]:
        kv = quantized and now >= self.next_kv_at
        bs = self.settings
        block_size = (bs.schedule == "idle" and finished >= bs.min_requests and now >= self.next_block_size_at
                      and idle_for(self.history, bs.idle_s, now))
        return kv, block_size

    def start(self, url: str, token: str, kv: bool, block_size: bool) -> None:
        self.running = "block_size" if block_size else "kv"
        self.started_at = self.clock()
        threading.Thread(target=self._run, args=(url, token, kv, block_size), daemon=True,
                         name=f"kvops-probe-{self.engine}").start()

    def request_block_size(self, url: str, token: str | None) -> None:
        """On demand (the supervisor API): start the block-size profile now, unless it is off or one is running."""
        if self.settings.schedule == "off":
            raise ProbeRefused("the block-size profile is off ([supervisor.block_size_profile] schedule = \"off\"): "
                               "set schedule to \"on_demand\" or \"idle\"")
        if token is None:
            raise ProbeRefused(f"{self.engine}: the profile is an admin call and kvops has no admin token for it")
        if self.busy:
            raise ProbeRefused(f"{self.engine}: a {self.running.replace('_', '-')} profile is already running")
        self.start(url, token, kv=False, block_size=True)

    def _run(self, url: str, token: str, kv: bool, block_size: bool) -> None:
        client = EngineClient(url, token)
        try:
            if kv:
                self.running = "kv"
                self.next_kv_at = self.clock() + KV_PROFILE_INTERVAL_S
                self.history.kv_profile = client.kv_quant_profile()
                log.info("kv quantization profile", engine=self.engine, flagged=self.history.kv_profile.flagged)
            if block_size:
                self.running = "block_size"
                self.next_block_size_at = self.clock() + self.settings.every_s
                profile = self.history.block_size_profile = client.block_size_profile()
                log.info("block size profile", engine=self.engine, configured=profile.configured, best=profile.best)
        except EngineUnreachable as exc:
            log.warning("profile failed", engine=self.engine, error=str(exc))
        finally:
            client.close()
            self.running = ""
