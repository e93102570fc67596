"""Hysteresis: a diagnosis clears only after its rule has stopped raising it for a while.

Rules are pure functions of the history and answer "is it a problem now?". A value hovering at a
threshold makes that answer flip every poll, and every flip would resolve and re-fire an alert.
So the supervisor holds a diagnosis that its rule stopped raising for the rule's `clear_for_s`
(per rule, `[rules.<id>] clear_for_s`); raised again within it, it never cleared. Held, it
carries `clearing_since` (when the rule last raised it). A diagnosis raised again soon after it
did clear is a flap: counted per rule and engine, for /metrics and the clean scenario.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from kvops.schema.diagnosis import Diagnosis

log = structlog.get_logger("kvops.supervisor.hysteresis")

FLAP_WINDOW_S = 600.0  # raised again this soon after it cleared: a flap

Key = tuple[str, str, str]


@dataclass
class Hysteresis:
    clear_for_s: Callable[[str], float]  # rule id -> how long it must stay away before it clears
    flap_window_s: float = FLAP_WINDOW_S
    flaps: Counter[tuple[str, str]] = field(default_factory=Counter)  # (rule, engine) -> count
    _raised: dict[Key, tuple[Diagnosis, float]] = field(default_factory=dict)  # key -> (latest, last raised at)
    _cleared_at: dict[Key, float] = field(default_factory=dict)

    def update(self, raised: list[Diagnosis], now: float) -> list[Diagnosis]:
        """The diagnoses active now: those raised, and those held because they were raised less than
        their rule's clear_for_s ago."""
        active: list[Diagnosis] = []
        for diagnosis in raised:
            key = diagnosis.key
            cleared_at = self._cleared_at.pop(key, None)
            if cleared_at is not None and now - cleared_at <= self.flap_window_s:
                self.flaps[(diagnosis.rule, diagnosis.engine)] += 1
                log.warning("diagnosis flapped", rule=diagnosis.rule, engine=diagnosis.engine,
                            subject=diagnosis.subject, cleared_s_ago=round(now - cleared_at, 1))
            self._raised[key] = (diagnosis, now)
            active.append(diagnosis)
        seen = {d.key for d in raised}
        for key, (diagnosis, last) in list(self._raised.items()):
            if key in seen:
                continue
            if now - last < self.clear_for_s(diagnosis.rule):
                active.append(diagnosis.model_copy(update={"clearing_since": last}))
            else:
                del self._raised[key]
                self._cleared_at[key] = now
        for key, at in list(self._cleared_at.items()):
            if now - at > self.flap_window_s:
                del self._cleared_at[key]
        return active
