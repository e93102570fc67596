"""Why the prefix cache hits little: one diagnosis naming the cause that holds, measured from the KV events.

Over the window (counter deltas; the snapshots must carry the engine's KV event view, `Snapshot.kv_events`),
at least `min_queried_tokens` prompt tokens were looked up and at most `max_hit_rate` of them hit. The causes
are checked in this order and the first that holds is named (the others that hold are listed in `also`):

1. `short_prompts`: at least `min_short_share` of the window's prompts (the prompt-length histogram) are
   shorter than one block. Only full blocks are cached, so such a prompt leaves nothing to share.
2. `tenant_duplicates`: at least `min_duplicate_share` of the stored blocks repeat a token chain another
   tenant (cache salt or LoRA) holds: the same prefix cached once per salt.
3. `preemption_hits`: the hits come with preemptions (at least `min_preemption_hit_share` of the hit tokens
   in the snapshot intervals that saw one) while every request stores a root of its own: the hits re-find
   the blocks of preempted requests, not a shared prefix (vLLM #25780: vLLM releases before its fix,
   #25787 of September 2025, counted them as prefix-cache hits). Checked against the hit rate without those hits.
4. `no_shared_prefix`: new root blocks (root stores that are not re-stores) per ended request at least
   `min_new_root_share`: every request brings a first block no other request had.
5. `eviction_before_reuse`: blocks sit idle for less time before their eviction than the gap until their
   reuse (the medians of the window's idle-before-eviction and reuse-gap histograms: the events', else vLLM's
   own `--kv-cache-metrics` ones in `Snapshot.residency`). Where the engine publishes no events but has those
   histograms, only this cause and `short_prompts` (the prompt histogram) are read.

One problem, one diagnosis (kvops.rules.SUPERSEDED): this diagnosis replaces no_prefix_hits (which guesses
the same causes from the counters), prompt_variance's low-hit note on a server without normalization, and a
block-size capacity diagnosis raised only for its prefix block; it gives way to prefix_cache_thrash
(`eviction_before_reuse` is thrash seen from the hit rate) and to prompt_variance's root variants (roots that
differ in a few tokens: `no_shared_prefix` with its cause named).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import Field

from kvops.history import EngineHistory
from kvops.kinds import profile_of
from kvops.rules.block_size_waste import CAPACITY_SUBJECT, CapacitySettings, candidate_block_sizes
from kvops.rules.common import (
    Evidence,
    WindowRuleSettings,
    cache_lookups,
    covered_steady_span,
    covered_window,
    diagnosis,
    events_delta,
    events_span,
    fresh_latest,
    histogram_share_below,
    reuse_capacity_fix,
    rounded,
    usable_events,
    window_histogram,
)
from kvops.rules.prefix_cache_thrash import needed_blocks
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Objective, Severity
from kvops.schema.snapshot import Histogram, Snapshot

RULE_ID = "low_hit_cause"
TITLE = "Low prefix-cache hit rate, and its cause"
DESCRIPTION = "the prefix cache hits little, and the KV events say why"

SHORT_PROMPTS = "short_prompts"
TENANT_DUPLICATES = "tenant_duplicates"
PREEMPTION_HITS = "preemption_hits"
NO_SHARED_PREFIX = "no_shared_prefix"
EVICTION_BEFORE_REUSE = "eviction_before_reuse"


class Settings(WindowRuleSettings):
    min_queried_tokens: int = Field(1000, ge=1, description="prompt tokens looked up in the window")
    max_hit_rate: float = Field(0.2, ge=0, lt=1, description="fire at or below this hit rate")
    min_requests: int = Field(20, ge=1, description="requests that ended in the window, for the per-request causes")
    min_short_share: float = Field(0.5, gt=0, le=1, description="short_prompts: this share of prompts shorter "
                                                                "than one block")
    min_duplicate_share: float = Field(0.2, gt=0, le=1, description="tenant_duplicates: this share of stored "
                                                                    "blocks repeating another tenant's chain")
    min_preemption_hit_share: float = Field(0.8, gt=0, le=1, description="preemption_hits: this share of hit "
                                                                         "tokens in intervals with preemptions")
    min_new_root_share: float = Field(0.8, gt=0, description="no_shared_prefix: new root blocks per ended request")
    min_histogram_samples: int = Field(10, ge=1, description="eviction_before_reuse: observations each histogram "
                                                             "needs in the window")
    headroom: float = Field(1.1, ge=1, description="eviction_before_reuse: the proposed pool is the estimated "
                                                   "working set times this")
    verify_min_change: float = Field(0.1, ge=0, description="relative rise of the hit rate that counts (absolute "
                                                            "from 0)")


@dataclass(frozen=True)
class Window:
    """What the window shows: the lookups, and the numbers each cause is judged by (None: not measured)."""

    latest: Snapshot
    snaps: list[Snapshot]
    span: float
    queries: float
    hits: float
    requests: float
    block_size: int | None
    prompts: Histogram | None
    short_share: float | None
    stores: float | None
    root_stores: float | None
    new_root_share: float | None
    duplicates: float | None
    tenants: int | None
    preemptions: float
    preemption_hits: float
    idle_p50: float | None
    gap_p50: float | None
    residency_source: str  # "events", "engine" (vLLM's --kv-cache-metrics) or "" (neither)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries

    @property
    def duplicate_share(self) -> float | None:
        return self.duplicates / self.stores if self.duplicates is not None and self.stores else None

    @property
    def preemption_hit_share(self) -> float | None:
        return self.preemption_hits / self.hits if self.hits > 0 else None


def _span(history: EngineHistory, latest: Snapshot, settings: Settings) -> float | None:
    """The events' window; where kvops reads no usable events, the window of the engine's residency histograms."""
    if usable_events(latest) is not None:
        return events_span(history, latest, settings)
    if latest.residency is None:
        return None
    return covered_steady_span(history, latest, settings, lambda snap: snap.residency is not None)


def _pairs_with_preemptions(snaps: list[Snapshot]) -> float:
    """Hit tokens counted in the snapshot intervals that also counted a preemption."""
    total = 0.0
    for a, b in itertools.pairwise(snaps):
        hits = b.prefix_cache.hits_total - a.prefix_cache.hits_total
        if b.requests.preemptions_total > a.requests.preemptions_total and hits > 0:
            total += hits
    return total


def _p50(hist: Histogram | None, min_samples: int) -> float | None:
    return hist.p50 if hist is not None and hist.count >= min_samples else None


def _residency(snaps: list[Snapshot], settings: Settings,
               with_events: bool) -> tuple[float | None, float | None, str]:
    """Median idle-before-eviction and reuse gap over the window, from the events (when usable), else the
    engine's own."""
    sources: tuple[tuple[str, Callable[[Snapshot], Histogram | None], Callable[[Snapshot], Histogram | None]], ...] = (
        ("events", lambda s: s.kv_events.idle_before_evict_s if s.kv_events else None,
         lambda s: s.kv_events.reuse_gap_s if s.kv_events else None),
        ("engine", lambda s: s.residency.idle_before_evict_s if s.residency else None,
         lambda s: s.residency.reuse_gap_s if s.residency else None),
    )
    for source, idle_of, gap_of in sources[0 if with_events else 1:]:
        idle = _p50(window_histogram(snaps, idle_of), settings.min_histogram_samples)
        gap = _p50(window_histogram(snaps, gap_of), settings.min_histogram_samples)
        if idle is not None and gap is not None:
            return idle, gap, source
    return None, None, ""


def measure(history: EngineHistory, latest: Snapshot, span: float, settings: Settings) -> Window:
    snaps = covered_window(history, span, settings)
    queries, hits = cache_lookups(history, span)
    requests = history.delta(lambda s: s.requests.finished_total + s.requests.aborted_total, span) or 0.0
    events = usable_events(latest)
    block_size = (events.block_size if events is not None and events.block_size else
                  latest.engine.block_size if latest.knows("engine.block_size") else None)
    prompts = window_histogram(snaps, lambda s: s.prompt_lengths if s.knows("prompt_lengths") else None)
    short = histogram_share_below(prompts, block_size) if prompts is not None and block_size else None
    stores = root_stores = new_root_share = duplicates = None
    if events is not None:
        stores = events_delta(history, span, lambda e: e.stores_total)
        root_stores = events_delta(history, span, lambda e: e.root_stores_total)
        new_roots = root_stores - events_delta(history, span, lambda e: e.root_restores_total)
        new_root_share = new_roots / requests if requests >= settings.min_requests else None
        duplicates = events_delta(history, span, lambda e: e.cross_tenant_duplicates_total)
    idle, gap, source = _residency(snaps, settings, events is not None)
    return Window(
        latest=latest, snaps=snaps, span=span, queries=queries, hits=hits, requests=requests, block_size=block_size,
        prompts=prompts, short_share=short, stores=stores, root_stores=root_stores, new_root_share=new_root_share,
        duplicates=duplicates, tenants=len(events.tenants) if events is not None else None,
        preemptions=history.delta(lambda s: s.requests.preemptions_total, span) or 0.0,
        preemption_hits=_pairs_with_preemptions(snaps), idle_p50=idle, gap_p50=gap, residency_source=source)


def causes(window: Window, settings: Settings) -> list[str]:
    """The causes that hold, in the order they are named."""
    held = []
    if window.short_share is not None and window.short_share >= settings.min_short_share:
        held.append(SHORT_PROMPTS)
    duplicate_share = window.duplicate_share
    if duplicate_share is not None and (window.tenants or 0) >= 2 and duplicate_share >= settings.min_duplicate_share:
        held.append(TENANT_DUPLICATES)
    unshared = window.new_root_share is not None and window.new_root_share >= settings.min_new_root_share
    preemption_share = window.preemption_hit_share
    if (unshared and window.preemptions > 0 and preemption_share is not None
            and preemption_share >= settings.min_preemption_hit_share):
        held.append(PREEMPTION_HITS)
    if unshared:
        held.append(NO_SHARED_PREFIX)
    if window.idle_p50 is not None and window.gap_p50 is not None and window.idle_p50 < window.gap_p50:
        held.append(EVICTION_BEFORE_REUSE)
    return held


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if (latest is None or not latest.knows("prefix_cache.queries_total")
            or (latest.knows("engine.enable_prefix_caching") and not latest.engine.enable_prefix_caching)):
        return []  # caching off: prefix_caching_off's case
    span = _span(history, latest, settings)
    if span is None:
        return []
    window = measure(history, latest, span, settings)
    if window.queries < settings.min_queried_tokens:
        return []
    held = causes(window, settings)
    # Hits that only re-find preempted requests' blocks are no sharing: judged without them.
    sharing_hits = window.hits - (window.preemption_hits if PREEMPTION_HITS in held else 0.0)
    if not held or sharing_hits / window.queries > settings.max_hit_rate:
        return []
    cause = held[0]
    wording, fix = _explain(cause, window, settings)
    summary = (f"the prefix cache hit {window.hit_rate:.1%} of {window.queries:.0f} prompt tokens in the last "
               f"{window.span:.0f} s: {wording}")
    return [diagnosis(history, RULE_ID, TITLE, Severity.WARNING, summary,
                      {"cause": cause, "also": ",".join(held[1:]), **_evidence(window), **fix[1]}, fix=fix[0])]


def _evidence(window: Window) -> Evidence:
    prompts = window.prompts
    return {
        "hit_rate": round(window.hit_rate, 4),
        "queried_tokens": int(window.queries),
        "hit_tokens": int(window.hits),
        "requests": int(window.requests),
        "block_size": window.block_size,
        "prompt_tokens_p50": rounded(prompts.p50 if prompts is not None else None, 1),
        "short_prompt_share": rounded(window.short_share),
        "stores": None if window.stores is None else int(window.stores),
        "root_stores": None if window.root_stores is None else int(window.root_stores),
        "new_root_share": rounded(window.new_root_share),
        "cross_tenant_duplicates": None if window.duplicates is None else int(window.duplicates),
        "duplicate_share": rounded(window.duplicate_share),
        "tenants": window.tenants,
        "preemptions": int(window.preemptions),
        "preemption_hit_share": rounded(window.preemption_hit_share),
        "idle_before_evict_p50_s": rounded(window.idle_p50, 3),
        "reuse_gap_p50_s": rounded(window.gap_p50, 3),
        "residency_source": window.residency_source or None,
        "window_s": round(window.span, 1),
    }


def _advice(text: str) -> tuple[Fix, Evidence]:
    return Fix(kind=FixKind.REPORT, action="advice", description=text), {}


def _explain(cause: str, window: Window, settings: Settings) -> tuple[str, tuple[Fix, Evidence]]:
    """The cause in words with its numbers, and the fix (with the numbers behind it)."""
    if cause == SHORT_PROMPTS:
        return (f"{window.short_share:.0%} of the prompts are shorter than one block of {window.block_size} "
                f"tokens, so they leave no full block to share"), _smaller_block(window, settings)
    if cause == TENANT_DUPLICATES:
        return (f"{window.duplicate_share:.0%} of the {window.stores:.0f} blocks stored repeat a token chain "
                f"another of the {window.tenants} tenants (cache salts or LoRAs) holds: the same prefix is "
                f"cached once per tenant"), _advice(
            "give the tenants that may share a prefix one cache salt (or serve them on one LoRA); different "
            "salts keep identical prompts apart by design")
    if cause == PREEMPTION_HITS:
        return (f"{window.preemption_hit_share:.0%} of the hit tokens came with the window's "
                f"{window.preemptions:.0f} preemptions while every request stored a first block of its own "
                f"({window.new_root_share:.2f} new roots per request): the hits re-find the blocks of preempted "
                f"requests, no prefix is shared"), _advice(
            "the workload shares no prefix; the reported hits are preempted requests re-finding their own blocks "
            "(vLLM releases before September 2025 counted them as prefix-cache hits: vLLM #25780). The preemptions "
            "are the KV pressure's (see kv_oom_runtime)")
    if cause == NO_SHARED_PREFIX:
        return (f"{window.new_root_share:.2f} new first blocks per request ({window.root_stores:.0f} root blocks "
                f"stored for {window.requests:.0f} requests): the prompts share no prefix of one block"), _advice(
            "put the shared part of the prompts (system prompt, instructions, documents) first and keep it "
            "byte-identical; a date, a request id or a user name before it makes every first block different")
    return (f"blocks sit idle ~{window.idle_p50:.1f} s before eviction but are needed again ~{window.gap_p50:.1f} s "
            f"later ({_residency_words(window)}): the pool evicts them before their reuse"), _bigger_pool(
        window, settings)


def _residency_words(window: Window) -> str:
    if window.residency_source == "events":
        return "from the KV events: reuse gap = eviction to the next store"
    return "from the engine's residency histograms: reuse gap = between two uses"


def _smaller_block(window: Window, settings: Settings) -> tuple[Fix, Evidence]:
    """A block size the typical prompt fills, among those the engine takes; advice when none is smaller."""
    latest, prompts = window.latest, window.prompts
    p50 = prompts.p50 if prompts is not None else None
    fitting = [size for size in candidate_block_sizes(latest)
               if window.block_size is not None and size < window.block_size and p50 is not None and size <= p50]
    if not fitting:
        return _advice(f"the prompts are shorter than the smallest block size this engine takes that fits them; "
                       f"only longer shared prefixes (at least {window.block_size} tokens) can hit")
    size = max(fitting)
    flag = profile_of(latest).flag("block_size", size)
    return Fix(kind=FixKind.RESTART, action="restart_engine", params={"block_size": size},
               description=f"restart with {flag} (now {window.block_size}): the median prompt ({p50:.0f} tokens) "
                           f"then fills a block that later prompts can share",
               objectives=[Objective(measure="hit_rate", better="higher", min_effect=settings.verify_min_change)]), {
        "proposed_block_size": size}


def _bigger_pool(window: Window, settings: Settings) -> tuple[Fix, Evidence]:
    latest = window.latest
    pool = latest.engine.num_blocks if latest.knows("engine.num_blocks") else 0
    idle, gap = window.idle_p50, window.gap_p50
    # The events' reuse gap starts at the eviction (the block was idle before it); the engine's is use to use.
    reuse_after = gap if window.residency_source == "events" else max(0.0, (gap or 0.0) - (idle or 0.0))
    needed = needed_blocks(pool, idle, reuse_after, settings.headroom)
    reason = f"blocks are evicted after ~{idle:.1f} s idle but reused after ~{gap:.1f} s"
    fix, numbers = reuse_capacity_fix(latest, window.snaps, needed, reason) if needed else (None, {})
    if fix is None:
        return _advice(f"{reason}: give the engine more KV memory or run fewer sequences at once")
    objective = Objective(measure="hit_rate", better="higher", min_effect=settings.verify_min_change)
    return fix.model_copy(update={"objectives": [objective]}), numbers


def blocked_only(capacity: Diagnosis) -> bool:
    """Whether a block-size capacity diagnosis was raised only because prompts shorter than a block keep the hit
    rate at ~0 (its saving alone is under the default threshold): this diagnosis then says it with the cause."""
    saving = capacity.evidence.get("kv_freed_fraction")
    return (capacity.subject == CAPACITY_SUBJECT and capacity.evidence.get("prefix_blocked") is True
            and isinstance(saving, float | int) and saving < CapacitySettings().capacity_min_saving)
