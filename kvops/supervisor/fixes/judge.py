"""A fix's verdict from its outcome: its objectives and the guards, measured over a window before the fix and
an equal one after it (kvops.supervisor.fixes.measures).

A pure function of the two windows. The fix jobs (kvops.supervisor.fixes.jobs) pick the windows, extend the
after-window once when the verdict is inconclusive, and decide FAILED (the engine went down) themselves.

- An objective improved when it moved the right way by more than its smallest effect and than the noise
  (noise_k x the spread of the before-window's own sub-windows: a change within it is no change).
- It made things worse when it moved the wrong way beyond both; a guard (throughput, TTFT, errors) broke
  when it got worse beyond its tolerance and the noise. Either rolls the fix back.
- Tokens per second measure demand as much as speed: an engine that keeps up generates what is asked of it.
  So a fall in throughput breaks its guard only when the engine did not keep up after the fix (requests
  waited) or generated each token more slowly; otherwise the traffic fell, and the guard holds with a note.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvops.schema.diagnosis import Objective
from kvops.schema.snapshot import Snapshot
from kvops.schema.verdict import Change, Verdict, VerdictKind
from kvops.supervisor.fixes.measures import MEASURES, Measurement, measure, traffic

Better = Literal["lower", "higher"]
THROUGHPUT = "throughput_tokens_per_s"

# What no fix may cost, whatever its objectives: (measure, better, tolerance). Tolerances are relative to
# the value before, except for the measures in ABSOLUTE (a share: 1% -> 3% errors is +200%, and small).
GUARDS: tuple[tuple[str, Better, float], ...] = (
    (THROUGHPUT, "higher", 0.10),
    ("ttft_mean_s", "lower", 0.20),
    ("error_share", "lower", 0.05),
)
ABSOLUTE = frozenset({"error_share"})
# A throughput fall is less demand when, after the fix, fewer than this many requests waited on average...
KEPT_UP_WAITING = 1.0
# ... and the time between a request's tokens did not grow by more than this (relative) and the noise.
ITL_TOLERANCE = 0.20

# How the message names the guards: (label, unit, as percent).
LABELS: dict[str, tuple[str, str, bool]] = {
    "throughput_tokens_per_s": ("throughput", " tok/s", False),
    "ttft_mean_s": ("ttft", " s", False),
    "error_share": ("errors", "", True),
}


class JudgeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_traffic: int = Field(20, ge=0, description="requests that must end in each window")
    parts: int = Field(4, ge=1, description="sub-windows of the before-window whose spread is the noise")
    noise_k: float = Field(2.0, ge=0, description="the noise bound is this many standard deviations of the parts")


DEFAULT_SETTINGS = JudgeSettings()


def noise_bound(before: Measurement, k: float) -> float:
    """k x the standard deviation of the before-window's parts; 0 when fewer than 2 parts."""
    return k * statistics.stdev(before.parts) if len(before.parts) >= 2 else 0.0


def _gain(better: Better, before: float, after: float) -> float:
    """How far the measure moved the right way (negative: the wrong way)."""
    return after - before if better == "higher" else before - after


def _change(name: str, subject: str, better: Better, effect: float, before: Measurement, after: Measurement,
            k: float) -> Change:
    return Change(measure=name, subject=subject, better=better, before=before.value, after=after.value,
                  noise=noise_bound(before, k) if before.value is not None else None, min_effect=effect)


def _threshold(change: Change, absolute: bool = False) -> float:
    """The smallest move that counts: min_effect relative to |before|, absolute when before is 0."""
    assert change.before is not None
    return change.min_effect if absolute or change.before == 0 else change.min_effect * abs(change.before)


def _measured(name: str, snaps: Sequence[Snapshot], subject: str, parts: int) -> Measurement:
    """The measure, or not measurable when no measure has that name (a rule's typo must not crash a job)."""
    return measure(name, snaps, subject, parts) if name in MEASURES else Measurement(None, (), traffic(snaps))


def _window(snaps: Sequence[Snapshot]) -> tuple[float, float]:
    return (snaps[0].time, snaps[-1].time) if snaps else (0.0, 0.0)


def judge(objectives: Sequence[Objective], before: Sequence[Snapshot], after: Sequence[Snapshot],
          settings: JudgeSettings = DEFAULT_SETTINGS) -> Verdict:
    """The verdict on a fix whose objectives were measured over `before` and `after` (snapshots, oldest first)."""
    k, parts = settings.noise_k, settings.parts
    verdict = Verdict(kind=VerdictKind.INCONCLUSIVE, before_window=_window(before), after_window=_window(after),
                      traffic_before=traffic(before), traffic_after=traffic(after))
    verdict.objectives = [
        _change(o.measure, o.subject, o.better, o.min_effect, _measured(o.measure, before, o.subject, parts),
                _measured(o.measure, after, o.subject, parts), k) for o in objectives]
    verdict.guards = [_change(name, "", better, tolerance, measure(name, before, parts=parts),
                              measure(name, after, parts=parts), k) for name, better, tolerance in GUARDS]
    if not objectives:
        verdict.message = "no measurable objective"
        return verdict
    if min(verdict.traffic_before, verdict.traffic_after) < settings.min_traffic:
        verdict.message = (f"too little traffic: {verdict.traffic_before:.0f} requests ended before, "
                           f"{verdict.traffic_after:.0f} after ({settings.min_traffic} needed in each window)")
        return verdict
    unmeasured = [c for c in verdict.objectives if c.before is None or c.after is None]
    if unmeasured:
        verdict.message = "; ".join(f"{_name(c)} not measurable " + ("before" if c.before is None else "after")
                                    for c in unmeasured)
        return verdict

    worse = False
    for change in verdict.objectives:
        assert change.before is not None and change.after is not None
        gain = _gain(change.better, change.before, change.after)
        needed = max(_threshold(change), change.noise or 0.0)
        change.ok = gain > needed
        worse |= -gain > needed
    for guard in verdict.guards:
        if guard.before is None or guard.after is None:
            continue  # not reported by this source: nothing to hold
        allowed = max(_threshold(guard, guard.measure in ABSOLUTE), guard.noise or 0.0)
        guard.ok = -_gain(guard.better, guard.before, guard.after) <= allowed
        if not guard.ok and guard.measure == THROUGHPUT:
            guard.note = demand_fell(before, after, settings)
            guard.ok = bool(guard.note)
        worse |= not guard.ok
    improved = all(c.ok for c in verdict.objectives)
    verdict.kind = VerdictKind.WORSE if worse else VerdictKind.IMPROVED if improved else VerdictKind.NO_EFFECT
    verdict.message = _message(verdict)
    return verdict


def demand_fell(before: Sequence[Snapshot], after: Sequence[Snapshot], settings: JudgeSettings = DEFAULT_SETTINGS
                ) -> str:
    """Why the throughput fell with less traffic, not with a slower engine (the note on the held guard); ''
    when the windows do not show it: requests waited after the fix, tokens came more slowly, or the source
    reports neither (then the fall counts, as it always did)."""
    waiting = measure("waiting_mean", after)
    itl_before = measure("itl_mean_s", before, parts=settings.parts)
    itl_after = measure("itl_mean_s", after, parts=settings.parts)
    if waiting.value is None or itl_before.value is None or itl_after.value is None:
        return ""
    if waiting.value >= KEPT_UP_WAITING:
        return ""
    allowed = max(ITL_TOLERANCE * itl_before.value, noise_bound(itl_before, settings.noise_k))
    if itl_after.value - itl_before.value > allowed:
        return ""
    return (f"demand fell: {waiting.value:.2g} requests waiting on average after the fix, "
            f"{itl_before.value * 1000:.3g}→{itl_after.value * 1000:.3g} ms between tokens")


# ------------------------------------------------------------------ the message


def _name(change: Change) -> str:
    return f"{change.measure}[{change.subject}]" if change.subject else change.measure


def _num(value: float) -> str:
    return f"{value:.3g}"


def _objective_text(change: Change) -> str:
    assert change.before is not None and change.after is not None
    before, after = change.before, change.after
    verb = "rose" if after > before else "fell" if after < before else "stayed"
    if before:
        moved, needed = f"{(after - before) / abs(before):+.0%}", f"{change.min_effect:.0%}"
    else:
        moved, needed = f"{after - before:+.3g}", _num(change.min_effect)
    sign = "+" if change.better == "higher" else "-"
    return (f"{_name(change)} {verb} from {_num(before)} to {_num(after)} ({moved}, noise ±{_num(change.noise or 0)}, "
            f"needed {sign}{needed})")


def _guard_text(guard: Change) -> str:
    label, unit, percent = LABELS.get(guard.measure, (guard.measure, "", False))
    if guard.before is None or guard.after is None:
        return f"{label} n/a"
    show = (lambda v: f"{v:.0%}") if percent else _num
    note = f" ({guard.note})" if guard.note else ""
    return f"{label} {show(guard.before)}→{show(guard.after)}{unit}{note}"


def _message(verdict: Verdict) -> str:
    """One line with the numbers: each objective, then the guards (which broke, if any)."""
    text = "; ".join(_objective_text(c) for c in verdict.objectives)
    broken = [g for g in verdict.guards if g.ok is False]
    if broken:
        return f"{text}; guard broke: " + ", ".join(_guard_text(g) for g in broken)
    return f"{text}; guards held: " + ", ".join(_guard_text(g) for g in verdict.guards)
