"""The supervisor's KV event feeds: one EventFeed (kvops.events.subscriber) per engine whose KV cache events kvops
reads, from the supervisor's start to its stop, and what each poll takes from them.

A managed vLLM's restart needs no new feed: the new process's publisher counts its sequence from 0 again, which
the feed takes as a publisher restart and empties its index. At each poll the engine's snapshot gets the
index's view (`Snapshot.kv_events`) and, where the source reports only a usage fraction (vLLM's /metrics), block
states from it: resident blocks as cached, the blocks in use (usage × pool) as full, the rest free, and the maps
`kvops top` draws. The stream is marked stale when it no longer describes the cache: no batch since the engine
went down or was restarted, or none for STALE_AFTER_S while the engine computed more prompt tokens than its
requests could without filling a block (block size - 1 each: a prompt whose prefix was cached computes only its
tail, which may fill no block, so vLLM publishes nothing for a load of repeated prompts).
Nothing a feed does reaches the supervisor as an exception: failures are logged and counted (`errors`).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from kvops.events.endpoint import EventSource
from kvops.events.subscriber import EventFeed
from kvops.history import EngineHistory
from kvops.schema.kv_events import NO_TENANT, EventStreamHealth, KvEventStats
from kvops.schema.snapshot import (
    BLOCK_STATE_CODES,
    NO_OWNER_CODE,
    OTHER_OWNER_CODE,
    OWNER_CODES,
    Snapshot,
)

log = structlog.get_logger("kvops.supervisor.events")

STALE_AFTER_S = 30.0  # no batch for this long while the engine computed prompt tokens: the stream is stale
POOL_MEDIUM = "GPU"  # the medium of the engine's own pool (vLLM says GPU on its CPU build too); others offload
DERIVED_STATE_MAP = "blocks.state_map"  # the field a usage-only source does not report, and the index fills

FeedFactory = Callable[..., EventFeed]


@dataclass
class _Tracked:
    feed: EventFeed
    started_at: float
    stale_since: float | None = None  # the engine went down or restarted then: stale until a batch comes after it
    stale: bool = False  # as of the last poll


class EventFeeds:
    """`sources`: engine name -> (where its events come from, the host a wildcard endpoint is reached at)."""

    def __init__(self, sources: Mapping[str, tuple[EventSource, str]], clock: Callable[[], float] = time.time,
                 make: FeedFactory = EventFeed) -> None:
        self.clock = clock
        self.errors: Counter[str] = Counter()  # per engine: feed failures the supervisor survived
        self._feeds: dict[str, _Tracked] = {}
        for name, (source, host) in sources.items():
            try:
                self._feeds[name] = _Tracked(make(source, connect_host=host, clock=clock), clock())
            except Exception:  # a feed that cannot be made leaves the engine without events, nothing more
                self._fault(name, "KV event feed not created")

    def __contains__(self, name: object) -> bool:
        return name in self._feeds

    def start(self) -> None:
        for name, tracked in self._feeds.items():
            try:
                tracked.feed.start()
                tracked.started_at = self.clock()
            except Exception:
                self._fault(name, "KV event feed did not start")

    def close(self) -> None:
        for name, tracked in self._feeds.items():
            try:
                tracked.feed.close()
            except Exception:
                self._fault(name, "KV event feed did not close")

    def health(self, name: str, now: float) -> EventStreamHealth | None:
        """The stream's health for GET /api/engines and /metrics (stale as of the last poll); None: no feed."""
        tracked = self._feeds.get(name)
        if tracked is None:
            return None
        try:
            health = tracked.feed.health(now)
        except Exception:
            self._fault(name, "KV event feed health not read")
            return None
        return health.model_copy(update={"stale": tracked.stale})

    def engine_down(self, name: str, now: float) -> None:
        """The engine did not answer (or its process exited): stale until a batch comes after this."""
        tracked = self._seen(name, now)
        if tracked is not None and tracked.stale_since is None:
            tracked.stale_since = now
            tracked.stale = True

    def engine_restarted(self, name: str, now: float) -> None:
        """A new engine process: what the index holds is the old one's until its publisher sends."""
        tracked = self._seen(name, now)
        if tracked is not None:
            tracked.stale_since = now
            tracked.stale = True

    def _seen(self, name: str, now: float) -> _Tracked | None:
        """The engine's feed once it has received a batch: before that its index is empty, which describes an
        engine that is starting (the first start included) as well as any view can."""
        tracked = self._feeds.get(name)
        if tracked is None:
            return None
        try:
            return tracked if tracked.feed.health(now).last_event_at is not None else None
        except Exception:
            self._fault(name, "KV event feed health not read")
            return None

    def enrich(self, name: str, snap: Snapshot, history: EngineHistory, now: float) -> Snapshot:
        """The poll's snapshot with the index's view (and, for a usage-only source, its block states); the
        snapshot as it came when the engine has no feed, or the feed fails."""
        tracked = self._feeds.get(name)
        if tracked is None:
            return snap
        try:
            return self._enrich(name, tracked, snap, history, now)
        except Exception:
            self._fault(name, "KV event view not added to the snapshot")
            return snap

    def _enrich(self, name: str, tracked: _Tracked, snap: Snapshot, history: EngineHistory, now: float) -> Snapshot:
        previous = history.latest
        if previous is not None and snap.knows("uptime_s") and snap.uptime_s + 1.0 < previous.uptime_s:
            # A watched engine restarted between two polls: what its new publisher sent since its start counts.
            self.engine_restarted(name, snap.time - snap.uptime_s)
        pool = snap.engine.num_blocks if snap.knows("engine.num_blocks") else None
        stats = tracked.feed.stats(now, pool_blocks=pool)
        last = stats.stream.last_event_at
        if tracked.stale_since is not None and last is not None and last >= tracked.stale_since:
            tracked.stale_since = None
        quiet_since = last if last is not None else tracked.started_at
        block = max(1, stats.block_size or snap.engine.block_size)
        tracked.stale = tracked.stale_since is not None or (
            now - quiet_since >= STALE_AFTER_S
            and computed_prompt_tokens(history, snap, STALE_AFTER_S) > requests_seen(history, snap, STALE_AFTER_S)
            * (block - 1))
        stats = stats.model_copy(update={"stream": stats.stream.model_copy(update={"stale": tracked.stale})})
        snap = snap.model_copy(update={"kv_events": stats})
        return snap if tracked.stale else with_event_blocks(snap, stats)

    def _fault(self, name: str, what: str) -> None:
        self.errors[name] += 1
        log.exception(what, engine=name)


def _increase(points: list[Snapshot], get: Callable[[Snapshot], float]) -> float:
    """A counter's increase along `points`; one that went down (a restart) counts from 0, as Prometheus does."""
    total = 0.0
    for before, after in itertools.pairwise(points):
        now, then = get(after), get(before)
        total += now - then if now >= then else now
    return total


def requests_seen(history: EngineHistory, snap: Snapshot, seconds: float) -> float:
    """Requests that may have computed prompt tokens over the last `seconds` up to `snap`: those that ended
    (normally or aborted) and those running now (at least one, so that one request's prompt is weighed too)."""
    points = [*history.window(seconds, snap.time), snap]
    ended = _increase(points, lambda s: s.requests.finished_total + s.requests.aborted_total)
    return max(1.0, ended + snap.requests.running)


def computed_prompt_tokens(history: EngineHistory, snap: Snapshot, seconds: float) -> float:
    """Prompt tokens the engine computed (admitted less prefix-cache hits) over the last `seconds` up to `snap`:
    computing them fills blocks, which vLLM publishes as they fill."""
    if not snap.knows("requests.prompt_tokens_total"):
        return 0.0
    points = [*history.window(seconds, snap.time), snap]
    admitted = _increase(points, lambda s: s.requests.prompt_tokens_total)
    hits = _increase(points, lambda s: s.prefix_cache.hits_total) if snap.knows("prefix_cache.hits_total") else 0.0
    return max(0.0, admitted - hits)


def with_event_blocks(snap: Snapshot, stats: KvEventStats) -> Snapshot:
    """Block states from the index for a snapshot whose source reports only usage (and knows its pool): the blocks
    in use as full, the other resident blocks as cached, the rest free; the state map in that order, and the
    owner map of the resident blocks (their tenants: a cache salt, else a LoRA), most resident tenant first."""
    if snap.knows(DERIVED_STATE_MAP) or not snap.knows("blocks.usage") or not snap.knows("engine.num_blocks"):
        return snap
    pool = snap.engine.num_blocks
    counts = snap.blocks.counts
    full = min(pool, counts.get("full", 0) + counts.get("filling", 0))
    resident = stats.resident.get(POOL_MEDIUM, 0)
    cached = max(0, min(resident - full, pool - full))
    free = pool - full - cached
    runs = [(full, BLOCK_STATE_CODES["full"]), (cached, BLOCK_STATE_CODES["cached"]),
            (free, BLOCK_STATE_CODES["free"])]
    tenants = sorted(((t, b.resident) for t, b in stats.tenants.items() if b.resident > 0), key=lambda kv: -kv[1])
    owner_map, owners = _owner_runs(tenants, min(resident, full + cached), pool)
    blocks = snap.blocks.model_copy(update={
        "counts": {"full": full, "cached": cached, "free": free},
        "state_map": "".join(f"{n}{code}" for n, code in runs if n),  # encode_block_map's runs, without the string
        "owner_map": owner_map, "owners": owners})
    unknown = [field for field in snap.unknown if field != DERIVED_STATE_MAP]
    return snap.model_copy(update={"blocks": blocks, "unknown": unknown})


def _owner_runs(tenants: list[tuple[str, int]], owned: int, pool: int) -> tuple[str, list[str]]:
    """encode_owner_map of `owned` blocks in runs by tenant (most blocks first) then unowned up to `pool`, built
    from the runs (a pool of a million blocks is not listed block by block at every poll)."""
    parts: list[str] = []
    letters: list[str] = []
    left = owned
    for tenant, count in tenants:
        take = min(count, left)
        if take <= 0:
            break
        code = OWNER_CODES[len(letters)] if len(letters) < len(OWNER_CODES) else OTHER_OWNER_CODE
        if code != OTHER_OWNER_CODE:
            letters.append(tenant if tenant else NO_TENANT)
        parts.append(f"{take}{code}")
        left -= take
    if pool - owned + left > 0:
        parts.append(f"{pool - owned + left}{NO_OWNER_CODE}")
    return "".join(parts), letters
