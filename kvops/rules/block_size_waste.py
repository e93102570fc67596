"""Block-size capacity: the KV slots a block size leaves empty, from the request-length histograms.

A sequence of L tokens holds ceil(L/b) blocks of b slots; the last one is partly empty. The expected
internal fragmentation over the workload is

    fragmentation(b) = E[ceil(L/b)·b − L] / E[ceil(L/b)·b] = 1 − E[L] / E[ceil(L/b)·b]

with L = prompt + generation tokens of a finished request. vLLM exports both histograms
(`vllm:request_prompt_tokens`, `vllm:request_generation_tokens`); a kvops engine exports the prompt
histogram and the mean generation (generation_tokens_total / finished_total), taken as every request's.

**From buckets to lengths.** A histogram gives counts per bucket (lo, hi], not the lengths. Within a
bucket the lengths are taken as uniform over its integers lo+1..hi (Prometheus's own assumption for
histogram_quantile); the bucket above the last bound holds the histogram's remaining sum, as one length.
Prompt and generation are taken as independent (the histograms do not pair them), so L's distribution is
the sum of the two. For a uniform P over (lo, hi] and a fixed g, E[ceil((P+g)/b)] is exact in O(1)
(`ceil_sum`); g runs over the generation bucket's integers (at most `MAX_STEPS` evenly spread ones
when the bucket is wider). With one-token-wide buckets the result is exact.

The candidates are the block sizes the engine takes, as its kind's profile gives them per device
(`candidate_block_sizes`). The best is the one with the fewest expected allocated slots (ties go to the
larger block: fewer blocks to manage); the KV freed is the share of the current allocation it saves.

Prefix caching shares whole blocks only: when prompts are mostly shorter than one block, no block of a
shared prefix ever fills, and the hit rate stays ~0 however much the prompts share (`prefix_blocked`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from dataclasses import dataclass

from pydantic import Field

from kvops.history import EngineHistory
from kvops.kinds import profile_of
from kvops.rules.common import Evidence, SnapshotRuleSettings, diagnosis
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.snapshot import Histogram, Snapshot

CAPACITY_SUBJECT = "capacity"
CAPACITY_TITLE = "Block size wastes KV capacity: partly filled last blocks"

MAX_STEPS = 256  # generation lengths summed over per bucket pair


class CapacitySettings(SnapshotRuleSettings):
    capacity_min_requests: int = Field(20, ge=1, description="finished requests the length histograms need")
    capacity_min_saving: float = Field(
        0.10, gt=0, lt=1, description="report (info) when the best candidate block size holds at least this share "
                                      "fewer KV slots per sequence than the configured one")
    capacity_warning_saving: float = Field(0.25, gt=0, lt=1, description="warning from this share of KV freed")
    capacity_critical_saving: float = Field(0.5, gt=0, lt=1, description="critical from this share of KV freed")
    prefix_min_queried_tokens: int = Field(
        500, ge=1, description="prompt tokens looked up before a ~0 hit rate counts as evidence")
    prefix_max_hit_rate: float = Field(0.02, ge=0, le=1, description="a hit rate at most this counts as ~0")


@dataclass(frozen=True)
class Lengths:
    """A length distribution: (lo, hi, weight) = `weight` requests spread evenly over lo+1..hi."""

    ranges: tuple[tuple[int, int, float], ...]

    @property
    def mean(self) -> float:
        total = sum(w for _, _, w in self.ranges)
        return sum(w * (lo + hi + 1) / 2 for lo, hi, w in self.ranges) / total if total else 0.0


def lengths_from_histogram(hist: Histogram) -> Lengths:
    """Uniform over the integers of each bucket; the bucket above every bound holds the remaining sum."""
    ranges: list[tuple[int, int, float]] = []
    lower = 0
    inside_sum = 0.0
    for index, count in enumerate(hist.counts):
        if index >= len(hist.buckets):
            if count > 0:
                rest = (hist.sum - inside_sum) / count
                length = max(lower + 1, round(rest))
                ranges.append((length - 1, length, float(count)))
            break
        upper = max(lower + 1, math.floor(hist.buckets[index]))
        if count > 0:
            ranges.append((lower, upper, float(count)))
            inside_sum += count * (lower + upper + 1) / 2
        lower = upper
    return Lengths(tuple(ranges))


def point(length: int) -> Lengths:
    return Lengths(((length - 1, length, 1.0),))


def ceil_sum(n: int, b: int) -> int:
    """sum of ceil(L/b) for L = 1..n (0 for n <= 0)."""
    if n <= 0:
        return 0
    q, r = divmod(n, b)
    return b * q * (q + 1) // 2 + r * (q + 1)


@functools.lru_cache(maxsize=65536)
def _mean_blocks(p_lo: int, p_hi: int, g_lo: int, g_hi: int, b: int) -> float:
    """Mean blocks of a sequence whose prompt is uniform in (p_lo, p_hi] and generation in (g_lo, g_hi]. Cached:
    it depends on histogram bounds only, which a server keeps, so a supervisor evaluating this every poll for
    hundreds of engines computes each once (it was most of the rules' time: docs/benchmarks.md, "A fleet")."""
    width = g_hi - g_lo
    steps = min(width, MAX_STEPS)
    gs = [g_lo + 1 + math.floor((i + 0.5) * width / steps) for i in range(steps)]
    return sum(ceil_sum(p_hi + g, b) - ceil_sum(p_lo + g, b) for g in gs) / (steps * (p_hi - p_lo))


def expected_allocated(prompts: Lengths, generations: Lengths, b: int) -> float:
    """E[ceil(L/b)·b] for L = P + G, P and G independent."""
    total = weighted = 0.0
    for p_lo, p_hi, p_w in prompts.ranges:
        for g_lo, g_hi, g_w in generations.ranges:
            weighted += p_w * g_w * _mean_blocks(p_lo, p_hi, g_lo, g_hi, b) * b
            total += p_w * g_w
    return weighted / total if total else 0.0


def fragmentation(prompts: Lengths, generations: Lengths, b: int) -> float:
    """The expected share of allocated KV slots left empty at block size b."""
    allocated = expected_allocated(prompts, generations, b)
    return 1 - (prompts.mean + generations.mean) / allocated if allocated > 0 else 0.0


def candidate_block_sizes(snap: Snapshot) -> tuple[int, ...]:
    """The block sizes this engine takes on its device; on an unknown device, the ones every device takes.
    None for a token-granular cache (block size 1) or a kind whose sizes kvops does not know."""
    return profile_of(snap).block_sizes_on(snap.engine.device if snap.knows("engine.device") else "")


def _generations(snap: Snapshot) -> Lengths | None:
    hist = snap.generation_lengths
    if hist is not None and hist.count > 0:
        return lengths_from_histogram(hist)
    finished = snap.requests.finished_total
    if finished <= 0 or not snap.knows("requests.generation_tokens_total"):
        return None
    return point(max(1, round(snap.requests.generation_tokens_total / finished)))


def _gpu_alternative(latest: Snapshot, candidates: tuple[int, ...], allocated: dict[int, float],
                     frag: dict[int, float], best: int) -> str:
    """The scrape does not say CPU or GPU: the proposal is a size both take; say what a GPU could add."""
    gpu_only = [size for size in profile_of(latest).block_sizes_by_device.get("cuda", ()) if size not in candidates]
    if latest.knows("engine.device") or not gpu_only:
        return ""
    on_gpu = min(gpu_only, key=lambda size: (round(allocated[size], 6), -size))
    if allocated[on_gpu] >= allocated[best]:
        return ""
    return f"; {best} is taken on CPU and GPU, a GPU server also takes {on_gpu} ({frag[on_gpu]:.0%} empty)"


def capacity_diagnoses(history: EngineHistory, settings: CapacitySettings, latest: Snapshot, rule: str,
                       exclude: Collection[int] = ()) -> list[Diagnosis]:
    """The block-size capacity diagnosis (subject `CAPACITY_SUBJECT`) of `latest`, under rule id `rule`;
    `exclude`: block sizes not to propose (a kvops engine's profile measured them clearly slower)."""
    engine, prompts_hist, kind = latest.engine, latest.prompt_lengths, profile_of(latest)
    b = engine.block_size
    candidates = tuple(size for size in candidate_block_sizes(latest) if size not in exclude)
    if (b < 2 or not candidates or not latest.knows("engine.block_size") or not latest.knows("prompt_lengths")
            or prompts_hist.count < settings.capacity_min_requests):
        return []
    generations = _generations(latest)
    if generations is None:
        return []
    prompts = lengths_from_histogram(prompts_hist)
    sizes = sorted({b, *candidates})
    # Reported at every size of this kind of engine (on each device it runs on), proposed among the candidates.
    shown = sorted({*sizes, *(size for on_device in kind.block_sizes_by_device.values() for size in on_device)})
    allocated = {size: expected_allocated(prompts, generations, size) for size in shown}
    mean_len = prompts.mean + generations.mean
    frag = {size: 1 - mean_len / allocated[size] for size in shown}
    best = min(sizes, key=lambda size: (round(allocated[size], 6), -size))
    saving = 1 - allocated[best] / allocated[b]

    prefix = latest.prefix_cache
    queried = prefix.queries_total if latest.knows("prefix_cache.queries_total") else 0
    hit_rate = prefix.hits_total / queried if queried else None
    p50 = prompts_hist.p50
    prefix_blocked = (engine.enable_prefix_caching and hit_rate is not None
                      and queried >= settings.prefix_min_queried_tokens and hit_rate <= settings.prefix_max_hit_rate
                      and p50 is not None and p50 < b)
    if best == b or (saving < settings.capacity_min_saving and not (prefix_blocked and best <= p50)):
        return []
    severity = (Severity.CRITICAL if saving >= settings.capacity_critical_saving else
                Severity.WARNING if saving >= settings.capacity_warning_saving else Severity.INFO)
    pool_tokens = engine.num_blocks * b if latest.knows("engine.num_blocks") else 0
    evidence: Evidence = {
        "block_size": b,
        "proposed_block_size": best,
        "candidates": ",".join(map(str, candidates)),
        "fragmentation": round(frag[b], 4),
        "proposed_fragmentation": round(frag[best], 4),
        "fragmentation_by_block_size": ", ".join(f"{size}: {frag[size]:.3f}" for size in shown),
        "expected_seq_len": round(mean_len, 1),
        "allocated_slots_per_seq": round(allocated[b], 1),
        "proposed_allocated_slots_per_seq": round(allocated[best], 1),
        "kv_freed_fraction": round(saving, 4),
        "kv_freed_bytes": round(saving * engine.kv_cache_bytes) if latest.knows("engine.kv_cache_bytes") else None,
        "seqs_per_pool": round(pool_tokens / allocated[b], 1) if pool_tokens else None,
        "proposed_seqs_per_pool": round(pool_tokens / allocated[best], 1) if pool_tokens else None,
        "requests": prompts_hist.count,
        "prompt_p50": None if p50 is None else round(p50, 1),
        "prompt_p95": None if prompts_hist.p95 is None else round(prompts_hist.p95, 1),
        "generation_mean": round(generations.mean, 1),
        "prefix_queried_tokens": queried,
        "prefix_hit_rate": None if hit_rate is None else round(hit_rate, 4),
        "prefix_blocked": prefix_blocked,
    }
    summary = (f"block size {b} leaves {frag[b]:.0%} of allocated KV slots empty (sequences of ~{mean_len:.0f} "
               f"tokens); at {best}, {frag[best]:.0%}: {saving:.0%} of the KV freed")
    if prefix_blocked:
        summary += (f"; prefix caching hit {hit_rate:.1%} of {queried} prompt tokens because the median prompt "
                    f"({p50:.0f} tokens) is shorter than one block")
    also = _gpu_alternative(latest, candidates, allocated, frag, best)
    return [diagnosis(
        history, rule, CAPACITY_TITLE, severity, summary, evidence, subject=CAPACITY_SUBJECT,
        fix=Fix(kind=FixKind.RESTART, action="restart_engine", params={"block_size": best},
                description=f"drain and restart with {kind.flag('block_size', best)} (now {b}): each sequence holds "
                            f"~{allocated[best]:.0f} KV slots instead of ~{allocated[b]:.0f}{also}",
                # Used over allocated slots rises by saving / (1 - saving) when each sequence holds `saving`
                # fewer slots for the same tokens: half of that must show. A server without a slot fill
                # level (vLLM): the slots each running request holds fall by `saving`; half must show.
                objectives=[Objective(measure="slot_efficiency", better="higher",
                                      min_effect=round(saving / (1 - saving) / 2, 4))
                            if latest.knows("blocks.used_slots") else
                            Objective(measure="kv_slots_per_request", better="lower",
                                      min_effect=round(saving / 2, 4))]),
    )]
