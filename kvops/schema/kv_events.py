"""What kvops learns from an engine's KV cache events, as the snapshot carries it.

vLLM publishes every block it caches and evicts (`--kv-events-config`: BlockStored, BlockRemoved,
AllBlocksCleared, over ZMQ). kvops's subscriber reads that stream and keeps an index of the resident
blocks (kvops.events); `KvEventStats` is that index's view at one moment plus the stream's own health.
The supervisor writes it into each snapshot of an engine whose events it reads, and the rules, doctor,
`/metrics` and `kvops top` read it from there. Counters and histograms are cumulative since kvops started reading the
stream: a publisher restart empties the resident set but keeps counting, so they only go down when kvops
itself restarts (as Prometheus counters do). Rules read them over a window, as every other counter
(`histogram_since` gives a window's histogram).

`BlockResidency` is the other source of the same facts: vLLM's own sampled histograms
(`--kv-cache-metrics`: vllm:kv_block_lifetime_seconds, ..._idle_before_evict_seconds, ..._reuse_gap_seconds),
read from `/metrics` where they are on.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kvops.schema.histogram import Histogram

# The resident-block map's age classes: blocks stored less than 10 s ago, 10 s to a minute, ... (one class
# more than bounds: older than the last).
AGE_BOUNDS_S = [10.0, 60.0, 300.0, 1800.0]
# Bounds of the lifetime, idle-before-eviction and reuse-gap histograms the index keeps, in seconds.
RESIDENCY_BOUNDS_S = [0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0]
# The tenant of a block that has neither a cache salt nor a LoRA.
NO_TENANT = "-"
# Event type names as vLLM writes them (the msgpack tag), and the counters keep them.
EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class EventStreamHealth(BaseModel):
    """The event stream as kvops receives it: enough to tell a quiet engine from a broken stream."""

    endpoint: str  # the publisher's endpoint, e.g. ipc:///var/lib/kvops/vllm-0.kv or tcp://10.0.0.5:5557
    replay_endpoint: str | None = None
    topic: str = ""
    # How kvops's SUB socket opened the endpoint: "connect" to a publisher that binds (vLLM binds ipc://,
    # inproc:// and wildcard tcp://*:N), "bind" for one that connects (any other tcp:// address).
    socket_role: Literal["connect", "bind"] = "connect"
    batches_total: int = 0
    events_total: dict[str, int] = Field(default_factory=dict)  # event type (EVENT_TYPES, or "unknown") -> events
    events_per_s: float = 0.0  # over the last `rate_window_s`
    rate_window_s: float = 10.0
    last_seq: int | None = None  # the publisher's sequence number of the last batch applied
    gaps_total: int = 0  # sequence jumps seen (batches missed between two received ones)
    replayed_batches_total: int = 0  # missed batches got back from the replay socket and applied
    dropped_batches_total: int = 0  # missed batches that could not be replayed: the index may be off until reset
    malformed_total: int = 0  # messages that did not decode as an event batch (skipped)
    unknown_events_total: int = 0  # events of a type kvops does not know (skipped)
    publisher_restarts_total: int = 0  # the sequence started again (a new vLLM process): the index was reset
    last_event_at: float | None = None  # unix seconds when the last batch arrived
    last_event_age_s: float | None = None  # at the snapshot's time
    # No batch since the engine went down or was restarted, or none while it kept admitting prompts: the index
    # no longer describes the cache (written by the supervisor, which knows the engine's health).
    stale: bool = False
    error: str = ""  # why the stream cannot be read (bad endpoint, bind refused, ...), "" when it is


class SharedPrefix(BaseModel):
    """A resident chain head with many resident blocks below it: a prefix many requests share."""

    block_hash: str  # hex, shortened to 16 characters
    depth: int  # blocks from the root to this block, 1 for a root
    tokens: int  # tokens from the root to the end of this block
    descendants: int  # resident blocks below it
    tenant: str = NO_TENANT
    first_tokens: list[int] = Field(default_factory=list)  # the root's first token ids (at most 16), to name it


class ResidentChain(BaseModel):
    """A run of resident blocks linked parent to child (linear or branching), from a resident block whose parent is
    not resident: how much of the cache one prefix holds, and what the events say of its reuse."""

    block_hash: str  # its first resident block, hex, shortened to 16 characters
    blocks: int  # resident blocks in the run
    depth: int  # blocks on its longest path
    tokens: int  # tokens on its longest path
    leaves: int  # resident blocks without a resident child: each the end of another request's path
    branches: int  # resident blocks with two or more resident children
    # Stores of its first block while it was resident: vLLM publishes those only for requests that ask it to
    # (kv_cache_report_mode "full"), once per request that found the block cached; 0 says nothing otherwise.
    hits: int = 0
    hit_tokens: int = 0  # the same stores over every block of the run: tokens they found cached
    tenant: str = NO_TENANT
    detached: bool = False  # its parent is known but not resident: vLLM's prefix lookup cannot reach it


class RootVariant(BaseModel):
    """Root blocks (a prompt's first block) that differ in only a few token positions: the same prompt with a
    timestamp, a request id or whitespace changed, which defeats the prefix cache (prompt variance)."""

    block_tokens: int  # tokens per root block compared
    roots: int  # distinct root blocks in the group
    positions: list[int]  # token positions at which they differ
    variants: list[list[int]]  # the token ids at those positions, one list per root (at most 8 roots)
    tenant: str = NO_TENANT


class TenantBlocks(BaseModel):
    """One tenant (a cache salt, else a LoRA name, else NO_TENANT) as the events show it."""

    resident: int = 0
    stores_total: int = 0
    removed_total: int = 0  # its blocks removed
    # Removals of other tenants' blocks in the batches where this tenant stored: the evictions its stores caused
    # (vLLM evicts while allocating for the step's new blocks, and publishes both in that step's batch).
    evicted_others_total: int = 0


class KvEventStats(BaseModel):
    stream: EventStreamHealth
    block_size: int | None = None  # tokens per block, from the stored blocks
    pool_blocks: int | None = None  # the engine's pool size, when known (vLLM's cache_config_info num_gpu_blocks)
    resident: dict[str, int] = Field(default_factory=dict)  # medium (GPU, CPU, ...) -> resident blocks
    resident_tokens: int = 0
    age_bounds_s: list[float] = Field(default_factory=lambda: list(AGE_BOUNDS_S))
    resident_by_age: list[int] = Field(default_factory=list)  # one more than age_bounds_s: the last is older
    tenants: dict[str, TenantBlocks] = Field(default_factory=dict)
    stores_total: int = 0  # blocks stored
    removes_total: int = 0  # blocks removed
    clears_total: int = 0  # AllBlocksCleared events
    # Stores of a hash that was removed less than `restore_window_s` before: the same work computed again.
    restores_total: int = 0
    restored_tokens_total: int = 0
    restore_window_s: float = 300.0
    root_stores_total: int = 0  # stores of a prompt's first block (no parent)
    root_restores_total: int = 0  # ... of those, re-stores
    # Stores whose token chain (tokens and parent chain, without salt or LoRA) was resident under another tenant:
    # the same prefix kept twice because the salts or LoRAs differ.
    cross_tenant_duplicates_total: int = 0
    lifetime_s: Histogram  # removed blocks: stored -> removed
    idle_before_evict_s: Histogram  # removed blocks: last use seen (its store, or a child's store) -> removed
    reuse_gap_s: Histogram  # re-stored blocks: removed -> stored again
    shared_prefixes: list[SharedPrefix] = Field(default_factory=list)  # most descendants first, at most 5
    resident_chains: list[ResidentChain] = Field(default_factory=list)  # most blocks first, at most 5
    resident_chains_total: int = 0  # every resident chain, shown or not
    root_variants: list[RootVariant] = Field(default_factory=list)  # most roots first, at most 5


class BlockResidency(BaseModel):
    """vLLM's own sampled residency histograms (`--kv-cache-metrics`), in seconds, cumulative."""

    lifetime_s: Histogram | None = None
    idle_before_evict_s: Histogram | None = None
    reuse_gap_s: Histogram | None = None
