"""Block-size mismatch, decided by measurement.

The rule of thumb ("pick the block size from the prompt lengths") is folklore: the answer depends
on the kernels, the model and the lengths actually served. So the rule fires only on a
`BlockSizeProfile` (decode-step timings of candidate block sizes on this model and these lengths)
in which the configured size is clearly slower than another candidate.

Two observations from the live engine are reported beside it:

- **Periodicity at the block size.** A decode step whose longest context has just crossed into a
  new block (`max_context_len % block_size == 1`: the step wrote the block's first slot) pays for
  the allocation and for attention over a nearly empty block. Each decode-only step's duration is
  divided by the median of the steps with the same batch size (so batch changes do not count),
  and `boundary_step_excess` = median ratio of boundary steps / median ratio of the others − 1.
  Binning by phase rather than an autocorrelation at lag block_size: steps of a continuous batch
  are not a regular series (sequences join and leave), but each step's phase is known exactly.
- **Internal fragmentation** = 1 − used slots / allocated slots, averaged over the window.

Without a profile, strong periodicity and fragmentation together give only an `info` diagnosis
proposing the measurement (setting `suggest_profile`), never a block-size change.

Beside speed, capacity: `kvops.rules.block_size_waste` computes from the request-length histograms the
share of KV slots the block size leaves empty at every block size the engine takes, and proposes the one
that holds the fewest (subject "capacity"; every engine with blocks, vLLM included). On a kvops engine
the measured-speed profile above still decides whether a size decodes faster.
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.rules.block_size_waste import CapacitySettings, capacity_diagnoses
from kvops.rules.common import (
    Evidence,
    diagnosis,
    fresh_latest,
    median,
    recent_steps,
    rounded,
    run_span,
)
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.reports import BlockSizeProfile, BlockSizeTiming
from kvops.schema.snapshot import Snapshot, StepSample

RULE_ID = "block_size_mismatch"
TITLE = "Block-size mismatch: another block size decodes measurably faster"
DESCRIPTION = ("the block-size profile measured a candidate block size whose decode step is clearly faster, or "
               "the request lengths leave much of each last block empty at the configured size")


class Settings(CapacitySettings):
    min_slowdown: float = Field(
        0.10, gt=0, description="fire when the configured block size's decode step is this much slower than the "
                                "proposed candidate's (0.10: 10%)")
    max_fragmentation_increase: float = Field(
        0.15, ge=0, le=1, description="a candidate whose expected fragmentation exceeds the configured size's by more "
                                      "than this is not proposed: the pool would hold that much less")
    max_profile_age_s: float = Field(86400.0, gt=0, description="a profile older than this is not acted on")
    gap_above_iqr: bool = Field(True, description="the gap between the two candidates must also exceed the larger of "
                                                  "their step-to-step spreads (iqr_ms): a smaller gap is noise")
    window_s: float = Field(300.0, gt=0, description="steps and fragmentation are read over this window")
    min_boundary_steps: int = Field(8, ge=2, description="decode-only steps just past a block boundary needed to "
                                                         "measure periodicity (and four times as many others)")
    suggest_profile: bool = Field(True, description="without a profile, emit an info diagnosis asking for one when "
                                                    "periodicity and fragmentation are both strong")
    periodicity_threshold: float = Field(0.15, gt=0, description="boundary_step_excess that counts as strong")
    fragmentation_threshold: float = Field(0.25, gt=0, le=1, description="fragmentation that counts as strong")


def boundary_step_excess(steps: list[StepSample], block_size: int, min_boundary_steps: int) -> float | None:
    """How much slower decode steps just past a block boundary are than the others (0.2 = 20%)."""
    if block_size < 2:
        return None  # every step starts a block: there is no phase to compare
    decode = [s for s in steps if s.decode_only and s.duration_s > 0]
    by_batch: dict[int, list[float]] = {}
    for step in decode:
        by_batch.setdefault(step.num_seqs, []).append(step.duration_s)
    typical = {n: median(durations) for n, durations in by_batch.items()}
    boundary: list[float] = []
    others: list[float] = []
    for step in decode:
        relative = step.duration_s / typical[step.num_seqs]
        (boundary if step.max_context_len % block_size == 1 else others).append(relative)
    if len(boundary) < min_boundary_steps or len(others) < 4 * min_boundary_steps:
        return None
    return median(boundary) / median(others) - 1


def _timing(profile: BlockSizeProfile, block_size: int) -> BlockSizeTiming | None:
    return next((c for c in profile.candidates if c.block_size == block_size), None)


def faster_block_size(profile: BlockSizeProfile, configured: BlockSizeTiming,
                      settings: Settings) -> BlockSizeTiming | None:
    """The candidate of `profile` to switch to from `configured`, or None: the fastest one that is
    clearly faster (by `settings.min_slowdown`, and beyond both candidates' step-to-step spread when
    `gap_above_iqr`) and whose fragmentation exceeds the configured one's by at most
    `max_fragmentation_increase`. The rule's criteria, public so `kvops doctor` judges a profile the
    same way."""

    def clearly_faster(c: BlockSizeTiming) -> bool:
        gap = configured.decode_step_ms - c.decode_step_ms
        noise = max(configured.iqr_ms, c.iqr_ms) if settings.gap_above_iqr else 0.0
        return c.decode_step_ms > 0 and gap / c.decode_step_ms > settings.min_slowdown and gap > noise

    acceptable = [c for c in profile.candidates
                  if c.block_size != configured.block_size and clearly_faster(c)
                  and c.fragmentation - configured.fragmentation <= settings.max_fragmentation_increase]
    return min(acceptable, key=lambda c: c.decode_step_ms, default=None)


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None:
        return []
    # Speed stays measured: a size the profile timed clearly slower than the configured one is not proposed
    # for capacity either.
    profile = _usable_profile(history, settings, now, latest.engine.block_size)
    configured = _timing(profile, latest.engine.block_size) if profile is not None else None
    slower = {c.block_size for c in profile.candidates
              if c.decode_step_ms > configured.decode_step_ms * (1 + settings.min_slowdown)} if configured else set()
    return (_speed(history, settings, now, latest)
            + capacity_diagnoses(history, settings, latest, RULE_ID, exclude=slower))


def _usable_profile(history: EngineHistory, settings: Settings, now: float,
                    block_size: int) -> BlockSizeProfile | None:
    """The history's block-size profile, unless it is of another configuration (taken before a restart), old,
    or measured on the fixed default lengths (before anything was served): those say nothing about this
    engine's workload."""
    profile = history.block_size_profile
    if profile is not None and (profile.configured != block_size or profile.lengths_from != "recent"
                                or now - profile.measured_at > settings.max_profile_age_s):
        return None
    return profile


def _speed(history: EngineHistory, settings: Settings, now: float, latest: Snapshot) -> list[Diagnosis]:
    block_size = latest.engine.block_size
    span = run_span(latest, settings.window_s)
    snaps = history.window(span)
    steps = recent_steps(snaps, latest.time - span)
    excess = boundary_step_excess(steps, block_size, settings.min_boundary_steps)
    decode_ms = [s.duration_s * 1000 for s in steps if s.decode_only]
    step_ms = median(decode_ms) if decode_ms else None
    fragmentation_samples = [1 - s.blocks.used_slots / s.blocks.allocated_slots
                             for s in snaps if s.blocks.allocated_slots > 0]
    fragmentation = sum(fragmentation_samples) / len(fragmentation_samples) if fragmentation_samples else None
    live: Evidence = {
        "block_size": block_size,
        "boundary_step_excess": rounded(excess),
        "decode_steps": len(decode_ms),
        "decode_step_ms_median": rounded(step_ms, 3),
        "fragmentation": rounded(fragmentation),
    }

    profile = _usable_profile(history, settings, now, block_size)
    if profile is not None:
        configured = _timing(profile, block_size)
        proposal = faster_block_size(profile, configured, settings) if configured is not None else None
        if configured is None or proposal is None:
            return []
        slowdown = configured.decode_step_ms / proposal.decode_step_ms - 1
        summary = (f"block size {block_size} decodes in {configured.decode_step_ms:.2f} ms per step, "
                   f"{proposal.block_size} in {proposal.decode_step_ms:.2f} ms ({slowdown:.0%} slower), measured "
                   f"at batch {profile.batch_size}")
        return [diagnosis(
            history, RULE_ID, TITLE, Severity.WARNING, summary,
            {
                **live,
                "profile_best": profile.best,
                "proposed_block_size": proposal.block_size,
                "configured_decode_step_ms": round(configured.decode_step_ms, 3),
                "proposed_decode_step_ms": round(proposal.decode_step_ms, 3),
                "configured_iqr_ms": round(configured.iqr_ms, 3),
                "proposed_iqr_ms": round(proposal.iqr_ms, 3),
                "slowdown": round(slowdown, 4),
                "configured_fragmentation": round(configured.fragmentation, 4),
                "proposed_fragmentation": round(proposal.fragmentation, 4),
                "profile_batch_size": profile.batch_size,
                "profile_age_s": round(now - profile.measured_at, 1),
            },
            fix=Fix(kind=FixKind.RESTART, action="restart_engine", params={"block_size": proposal.block_size},
                    description=f"drain and restart with block_size={proposal.block_size} (measured "
                                f"{slowdown:.0%} faster decode steps than {block_size})",
                    # The live decode step must get faster by at least half of what the profile promised;
                    # an engine without decode steps to measure gets none (kept or rolled back by policy).
                    objectives=[Objective(measure="decode_step_ms", better="lower",
                                          min_effect=round(slowdown / (1 + slowdown) / 2, 4))]
                    if step_ms is not None else []),
        )]

    strong = (excess is not None and excess >= settings.periodicity_threshold
              and fragmentation is not None and fragmentation >= settings.fragmentation_threshold)
    if not settings.suggest_profile or not strong:
        return []
    summary = (f"decode steps just past a block boundary are {excess:.0%} slower and {fragmentation:.0%} of "
               f"allocated slots are empty at block size {block_size}: measure other block sizes")
    return [diagnosis(history, RULE_ID, TITLE, Severity.INFO, summary, live, fix=Fix(
        kind=FixKind.REPORT, action="advice",
        description="take a block-size profile (GET /admin/profile/block-size: decode-step timings of candidate "
                    "block sizes) before changing the block size: periodicity and fragmentation alone do not say "
                    "which is faster"))]
