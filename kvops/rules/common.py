"""What the rules share: the settings bases, "is there enough data", building a diagnosis, and the
small measurements several rules make (reclaimable blocks, prefix-cache lookups, the engine's GPU,
recent decode steps, the capacity fix, the KV event view over a window).

Every helper is a pure function of snapshots; none reads the clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvops.history import EngineHistory, Getter
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.kv_events import KvEventStats
from kvops.schema.snapshot import GpuStats, Histogram, Snapshot, StepSample, histogram_since

Evidence = dict[str, float | int | str | bool | None]

# A window must be at least this much covered by snapshots before a rule reads a trend or a rate
# from it: a rule that just saw the engine start would otherwise extrapolate from two points.
MIN_COVERAGE = 0.5

# Raising the KV budget is proposed only when the engine's GPU has this share of the extra bytes
# free on top (allocator fragmentation and activations need room too).
GPU_HEADROOM = 0.9


class RuleSettings(BaseModel):
    """Base of every rule's settings: unknown keys are an error, so a typo in the config is caught."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SnapshotRuleSettings(RuleSettings):
    max_snapshot_age_s: float = Field(
        60.0, gt=0,
        description="the latest snapshot must be at most this old at evaluation time; older data is stale "
                    "(the engine stopped answering: engine_down covers that) and the rule stays silent")


class WindowRuleSettings(SnapshotRuleSettings):
    """A rule reading counters and trends over a window of snapshots (rules override the defaults)."""

    window_s: float = Field(300.0, gt=0, description="counters and rates are read over this window (clipped to the "
                                                     "current run)")
    min_samples: int = Field(3, ge=2, description="snapshots needed in the window (covering half of it)")


class PrefixCacheRuleSettings(WindowRuleSettings):
    """A rule comparing the prefix cache's hit rate with a shadow cache's over the window."""

    min_queried_tokens: int = Field(2000, ge=1, description="prompt tokens the shadow cache must have looked up in "
                                                            "the window")


def diagnosis(history: EngineHistory, rule: str, title: str, severity: Severity, summary: str, evidence: Evidence,
              *, fix: Fix | None = None, subject: str = "") -> Diagnosis:
    """A diagnosis of the history's engine; what its fix must move to be kept is the fix's `objectives`."""
    return Diagnosis(rule=rule, engine=history.engine, subject=subject, severity=severity, title=title,
                     summary=summary, evidence=evidence, fix=fix)


def with_objectives(fix: Fix | None, *objectives: Objective) -> Fix | None:
    """`fix` (built by a shared helper such as `capacity_fix`) with the objectives the rule judges it by."""
    return None if fix is None else fix.model_copy(update={"objectives": list(objectives)})


def fresh_latest(history: EngineHistory, now: float, max_age_s: float) -> Snapshot | None:
    """The latest snapshot, unless there is none or it is stale."""
    latest = history.latest
    if latest is None or now - latest.time > max_age_s:
        return None
    return latest


def run_span(latest: Snapshot, window_s: float) -> float:
    """The window clipped to the current engine run: counters and gauges from before a restart
    (another config, another pool) must not leak into this run's trends."""
    return max(0.0, min(window_s, latest.uptime_s))


def steady_span(history: EngineHistory, latest: Snapshot, window_s: float,
                same: Callable[[Snapshot], object]) -> float:
    """The run window clipped further to the snapshots where `same(snapshot)` equals the latest's
    (e.g. the normalization mode): a live switch changes what the counters mean."""
    span = run_span(latest, window_s)
    current = same(latest)
    earliest = latest.time
    for snap in reversed(history.window(span)):
        if same(snap) != current:
            break
        earliest = snap.time
    return latest.time - earliest


def covered_steady_span(history: EngineHistory, latest: Snapshot, settings: WindowRuleSettings,
                        same: Callable[[Snapshot], object]) -> float | None:
    """`steady_span` over the settings' window, or None when its snapshots are too few or too bunched."""
    span = steady_span(history, latest, settings.window_s, same)
    return span if covered_window(history, span, settings) else None


def covered(snaps: list[Snapshot], window_s: float, min_samples: int) -> bool:
    """Enough snapshots, spread over enough of the window, to read a rate or a trend."""
    if len(snaps) < max(2, min_samples):
        return False
    return snaps[-1].time - snaps[0].time >= MIN_COVERAGE * window_s


def covered_window(history: EngineHistory, span: float, settings: WindowRuleSettings) -> list[Snapshot]:
    """The snapshots of the last `span` seconds, or [] when they are too few or too bunched to read from."""
    snaps = history.window(span)
    return snaps if covered(snaps, settings.window_s, settings.min_samples) else []


def cache_lookups(history: EngineHistory, span: float,
                  cache: Literal["", "shadow_", "potential_"] = "") -> tuple[float, float]:
    """Prompt tokens looked up and hit over the window in the prefix cache (`cache` ""), the shadow cache
    of normalized prompts ("shadow_") or the one measuring caching while it is off ("potential_")."""
    queries = history.delta(lambda s: getattr(s.prefix_cache, f"{cache}queries_total"), span) or 0.0
    hits = history.delta(lambda s: getattr(s.prefix_cache, f"{cache}hits_total"), span) or 0.0
    return queries, hits


def earlier_and_recent(history: EngineHistory, getter: Getter, span: float) -> tuple[float, float] | None:
    """A counter's increase over the first and the second half of the window (None when either
    half has no data), so a rule can tell "rising" from "steady"."""
    whole = history.delta(getter, span)
    recent = history.delta(getter, span / 2)
    if whole is None or recent is None:
        return None
    return whole - recent, recent


def halves_duration(history: EngineHistory, span: float) -> tuple[float, float] | None:
    """Seconds covered by the first and the second half, matching `earlier_and_recent`."""
    whole = history.window(span)
    recent = history.window(span / 2)
    if len(whole) < 2 or len(recent) < 2:
        return None
    return recent[0].time - whole[0].time, recent[-1].time - recent[0].time


def window_histogram(snaps: list[Snapshot], get: Callable[[Snapshot], Histogram | None]) -> Histogram | None:
    """A cumulative histogram's observations over the window: the last snapshot's minus the first one's that
    has it (the server may start reporting mid-window). None when the last snapshot has none."""
    last = get(snaps[-1]) if snaps else None
    if last is None:
        return None
    first = next(hist for hist in map(get, snaps) if hist is not None)
    return histogram_since(last, first)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def reclaimable_blocks(snap: Snapshot) -> int:
    """Blocks an allocation can take without preempting anyone: free, cached (evictable) and
    pending-free (reclaimed at the next step)."""
    counts = snap.blocks.counts
    return counts.get("free", 0) + counts.get("cached", 0) + counts.get("pending_free", 0)


def live_blocks(snap: Snapshot) -> int:
    """Device blocks held by live sequences."""
    counts = snap.blocks.counts
    return counts.get("filling", 0) + counts.get("full", 0)


def blocks_per_seq(snaps: list[Snapshot]) -> float | None:
    """How many blocks a sequence needs, for sizing concurrency or the pool: the largest of the most
    seen per running sequence in the window, the median longest context of the window's steps, the
    median length live requests asked for (prompt + max_tokens), and what a p95 prompt plus the
    mean generation takes (sequences still growing hold less than they will), at most one
    max_model_len request."""
    if not snaps:
        return None
    latest = snaps[-1]
    engine = latest.engine
    observed = [live_blocks(s) / s.requests.running for s in snaps if s.requests.running > 0]
    candidates = [max(observed)] if observed else []
    # How long sequences get: the longest context of each recent step, typically. Early in a run few
    # requests have finished, so the mean generation below underestimates; this does not.
    contexts = sorted(step.max_context_len for step in recent_steps(snaps, snaps[0].time))
    if contexts:
        candidates.append(blocks_for(contexts[len(contexts) // 2], engine.block_size))
    if latest.requests.live_requested_len_p50:
        candidates.append(blocks_for(latest.requests.live_requested_len_p50, engine.block_size))
    p95 = latest.prompt_lengths.p95
    finished = latest.requests.finished_total
    generations = latest.generation_lengths
    if p95 is not None and generations is not None and generations.count > 0:
        # The finished requests' own generation lengths (vLLM); the counter also counts running ones.
        candidates.append(blocks_for(math.ceil(p95 + generations.sum / generations.count), engine.block_size))
    elif p95 is not None and finished > 0:
        mean_generation = latest.requests.generation_tokens_total / finished
        candidates.append(blocks_for(math.ceil(p95 + mean_generation), engine.block_size))
    if not candidates or max(candidates) <= 0:
        return None
    if engine.max_model_len <= 0:  # not reported (a scrape without /v1/models): no cap
        return max(candidates)
    return min(max(candidates), blocks_for(engine.max_model_len, engine.block_size))


def engine_gpus(snap: Snapshot) -> list[GpuStats]:
    """The GPU(s) the engine runs on, or [] when it runs on the CPU or there is no GPU data.

    An engine that flags its GPU (matched by UUID, so CUDA_VISIBLE_DEVICES cannot mislead it) is taken at its
    word. Otherwise the engine's device index is torch's and NVML's is physical: when the index does not match
    a reported GPU, all reported GPUs are taken."""
    process = snap.process
    if process.gpu_status != "ok" or not process.gpus or not snap.engine.device.startswith("cuda"):
        return []
    flagged = [gpu for gpu in process.gpus if gpu.engine_device]
    if flagged:
        return flagged
    _, _, index = snap.engine.device.partition(":")
    wanted = int(index) if index.isdigit() else 0
    matching = [gpu for gpu in process.gpus if gpu.index == wanted]
    return matching or list(process.gpus)


def gpu_free_bytes(snap: Snapshot) -> int | None:
    gpus = engine_gpus(snap)
    if not gpus:
        return None
    return min(gpu.memory_total_bytes - gpu.memory_used_bytes for gpu in gpus)


def memory_evidence(snap: Snapshot) -> Evidence:
    """Process and GPU memory headroom, for rules that propose a larger KV budget."""
    gpus = engine_gpus(snap)
    return {
        "rss_bytes": snap.process.rss_bytes,
        "gpu_memory_used_bytes": sum(g.memory_used_bytes for g in gpus) if gpus else None,
        "gpu_memory_total_bytes": sum(g.memory_total_bytes for g in gpus) if gpus else None,
        "gpu_memory_free_bytes": gpu_free_bytes(snap),
    }


def recent_steps(snaps: Iterable[Snapshot], since: float) -> list[StepSample]:
    """Step samples with t >= since, oldest first, each once. Snapshots repeat the last 512 steps,
    so going newest first each snapshot only adds the steps older than those already seen (a
    bisect per snapshot: this runs at every poll over hundreds of snapshots)."""
    collected: list[list[StepSample]] = []
    oldest_seen = math.inf
    for snap in sorted(snaps, key=lambda s: s.time, reverse=True):
        steps = snap.steps
        if not steps or steps[0].t >= oldest_seen:
            continue  # nothing older than what newer snapshots already gave
        lo = bisect.bisect_left(steps, since, key=lambda s: s.t)
        hi = bisect.bisect_left(steps, oldest_seen, key=lambda s: s.t)
        if hi > lo:
            collected.append(steps[lo:hi])
            oldest_seen = steps[lo].t
        if lo > 0:  # this snapshot already reaches back past `since`
            break
    return [step for chunk in reversed(collected) for step in chunk]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def capacity_fix(latest: Snapshot, snaps: list[Snapshot], target_usage: float,
                 reason: str) -> tuple[Fix | None, Evidence]:
    """Restart so that `max_num_seqs` sequences of the size seen in `snaps` (`blocks_per_seq`) fit in
    `target_usage` of the pool: with a larger KV budget when the engine's GPU has that memory free,
    else with fewer concurrent sequences (always safe: requests queue instead of preempting each
    other), else with the budget anyway (the description says how much is needed). None when the
    pool already holds `max_num_seqs` sequences of that size (the numbers do not say what to change)
    or when the size is unknown.

    Returns the fix and the numbers behind the options, for the evidence."""
    per_seq = blocks_per_seq(snaps)
    if per_seq is None:
        return None, {}
    return _capacity_fix(latest, per_seq, target_usage, reason)


def _capacity_fix(latest: Snapshot, blocks_per_seq: float, target_usage: float,
                  reason: str) -> tuple[Fix | None, Evidence]:
    engine = latest.engine
    block_bytes = engine.block_size * engine.bytes_per_token
    budget_blocks = math.ceil(engine.max_num_seqs * blocks_per_seq / target_usage)
    budget_bytes = budget_blocks * block_bytes
    extra_bytes = budget_bytes - engine.kv_cache_bytes
    fit_seqs = max(1, math.floor(target_usage * engine.num_blocks / blocks_per_seq))
    free = gpu_free_bytes(latest)
    numbers: Evidence = {
        "blocks_per_seq": round(blocks_per_seq, 2),
        "fit_max_num_seqs": fit_seqs,
        "fit_kv_cache_memory_bytes": budget_bytes,
    }
    if extra_bytes > 0 and free is not None and extra_bytes <= GPU_HEADROOM * free:
        return Fix(kind=FixKind.RESTART, action="restart_engine", params={"kv_cache_memory": budget_bytes},
                   description=f"{reason}: restart with kv_cache_memory={budget_bytes} bytes ({budget_blocks} blocks, "
                               f"+{extra_bytes} bytes; the GPU has {free} free) so {engine.max_num_seqs} sequences "
                               f"of ~{blocks_per_seq:.1f} blocks fit"), numbers
    if engine.max_num_seqs <= 0:  # not reported (vLLM, SGLang): cap concurrency at what fits
        if not latest.knows("engine.num_blocks"):
            return None, numbers  # the pool's size is a nominal one: nothing to size from
        return Fix(kind=FixKind.RESTART, action="restart_engine", params={"max_num_seqs": fit_seqs},
                   description=f"{reason}: restart with max_num_seqs={fit_seqs}: {fit_seqs} sequences of "
                               f"~{blocks_per_seq:.1f} blocks fit in {target_usage:.0%} of {engine.num_blocks} "
                               f"blocks; or enlarge the KV pool"), numbers
    if fit_seqs < engine.max_num_seqs:
        return Fix(kind=FixKind.RESTART, action="restart_engine", params={"max_num_seqs": fit_seqs},
                   description=f"{reason}: restart with max_num_seqs={fit_seqs} (now {engine.max_num_seqs}): "
                               f"{fit_seqs} sequences of ~{blocks_per_seq:.1f} blocks fit in {target_usage:.0%} of "
                               f"{engine.num_blocks} blocks; or raise kv_cache_memory to {budget_bytes} bytes"), numbers
    if extra_bytes <= 0:
        return None, numbers
    return Fix(kind=FixKind.RESTART, action="restart_engine", params={"kv_cache_memory": budget_bytes},
               description=f"{reason}: restart with kv_cache_memory={budget_bytes} bytes ({budget_blocks} blocks, "
                           f"+{extra_bytes} bytes; check the device has that memory free)"), numbers


# ------------------------------------------------------------------ the KV event view (Snapshot.kv_events)


def usable_events(snap: Snapshot) -> KvEventStats | None:
    """The snapshot's KV event view when it describes the cache: read, not stale (the engine died or the stream
    stopped while prompts were admitted), and without a stream error. None otherwise: a rule then says nothing
    from the events."""
    events = snap.kv_events
    if events is None or events.stream.stale or events.stream.error:
        return None
    return events


def events_span(history: EngineHistory, latest: Snapshot, settings: WindowRuleSettings) -> float | None:
    """The settings' window, clipped to the engine run and to the snapshots that all carry the KV event view (a
    snapshot without it would read as a counter reset), or None when the latest view is unusable or the
    snapshots are too few or too bunched."""
    if usable_events(latest) is None:
        return None
    return covered_steady_span(history, latest, settings, lambda snap: snap.kv_events is not None)


def events_delta(history: EngineHistory, span: float, get: Callable[[KvEventStats], float]) -> float:
    """A cumulative KV event counter's increase over `span` (an events_span: every snapshot in it has the view)."""
    return history.delta(lambda snap: get(snap.kv_events) if snap.kv_events is not None else 0.0, span) or 0.0


def histogram_share_below(hist: Histogram, bound: float) -> float | None:
    """The share of a histogram's observations surely below `bound`: those in buckets whose upper bound is
    under it (a bucket straddling it is not counted). None for an empty histogram."""
    if hist.count <= 0:
        return None
    below = sum(count for upper, count in zip(hist.buckets, hist.counts, strict=False) if upper < bound)
    return below / hist.count


def reuse_capacity_fix(latest: Snapshot, snaps: list[Snapshot], needed_blocks: int,
                       reason: str) -> tuple[Fix | None, Evidence]:
    """Restart so that the pool keeps `needed_blocks` blocks resident (the blocks reused within their reuse
    distance): with a KV budget of that many blocks where a block's bytes are known (and, where the GPU is
    known, it has them free), else with fewer concurrent sequences where the running ones hold the room the
    cache lacks (each sequence fewer frees what one holds), else None: nothing the numbers size.

    Returns the fix and the numbers behind it, for the evidence."""
    engine = latest.engine
    deficit = needed_blocks - engine.num_blocks
    numbers: Evidence = {"needed_blocks": needed_blocks, "pool_blocks": engine.num_blocks}
    if deficit <= 0 or not latest.knows("engine.num_blocks"):
        return None, numbers
    block_bytes = engine.block_size * engine.bytes_per_token if latest.knows("engine.bytes_per_token") else 0
    free = gpu_free_bytes(latest)
    if block_bytes > 0:
        budget = needed_blocks * block_bytes
        extra = budget - engine.kv_cache_bytes
        numbers["fit_kv_cache_memory_bytes"] = budget
        if free is None or extra <= GPU_HEADROOM * free:
            where = f"the GPU has {free} free" if free is not None else "check the device has that memory free"
            return Fix(kind=FixKind.RESTART, action="restart_engine", params={"kv_cache_memory": budget},
                       description=f"{reason}: restart with kv_cache_memory={budget} bytes ({needed_blocks} blocks, "
                                   f"+{extra} bytes; {where}) so the reused blocks stay resident until reuse"), numbers
    per_seq = blocks_per_seq(snaps)
    running = max((snap.requests.running for snap in snaps), default=0) if latest.knows("requests.running") else 0
    if per_seq is None or running < 2:
        return None, numbers
    fewer = running - math.ceil(deficit / per_seq)
    numbers.update(blocks_per_seq=round(per_seq, 2), running_peak=running)
    if fewer < 1:
        return None, numbers
    numbers["fit_max_num_seqs"] = fewer
    return Fix(kind=FixKind.RESTART, action="restart_engine", params={"max_num_seqs": fewer},
               description=f"{reason}: restart with max_num_seqs={fewer} (up to {running} ran at once): "
                           f"{running - fewer} fewer sequences of ~{per_seq:.1f} blocks leave the cache the "
                           f"{deficit} blocks it lacks; or enlarge the KV pool to {needed_blocks} blocks"), numbers
