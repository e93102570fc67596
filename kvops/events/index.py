"""The resident-block index: vLLM's KV cache events applied in order, and its view (KvEventStats).

Per medium (GPU, CPU, ...; None is GPU) a dict maps each block hash to a slot of a SlotTable (kvops.events.chains):
parent, token count, tenant, stored-at, last use, a salt-free chain key. Time is the publisher's clock
(DecodedBatch.ts), so replayed and live batches age alike.

- A store of a hash already resident is a hit that vLLM reports (`kv_cache_report_mode = "full"`): it is a use,
  not a store, counted in the block's hits (a resident chain's reuse, chains.resident_chains).
- A block's last use is its store or a store under it. Only the direct parent is stamped on a store, and a
  removed block hands its last use to its parent: vLLM evicts a chain tail first, so by the time a block goes,
  the uses below it have come up to it, at O(1) a block instead of a walk to the root.
- A removed block that still parents resident ones stays as a ghost (chains.SlotTable), so that a later store
  of the same hash joins them up again. A store under a parent the index never saw (it joined late) makes that
  parent a ghost.
- Removed hashes are remembered for `restore_window_s` (at most `restore_memory` of them, in two generations:
  O(1) to add, to find and to forget), so that a store of one is a restore: work computed again.
- A block's tenant is its chain's: the cache salt, which vLLM puts in the first block's extra keys only, else the
  LoRA name, else NO_TENANT. A block stored under a parent the index never saw cannot know its salt.
- Cross-tenant duplicates (kvops.events.duplicates) are looked for only once a second tenant stores, so a
  single-tenant engine pays nothing for them.
- AllBlocksCleared (POST /reset_prefix_cache) empties the resident set; the cleared blocks are not evictions:
  no lifetime, no restore later. reset() (a new publisher process) empties the resident set and the removed
  memory. Neither touches the cumulative counters and histograms.
"""

from __future__ import annotations

from collections import Counter

from kvops.events.chains import PrefixView, SlotTable, prefix_view, resident_by_age
from kvops.events.counters import FLUSH_AT, ResidencyHistogram, TenantTable
from kvops.events.duplicates import CrossTenant
from kvops.events.extra_keys import content_keys, tenant_name
from kvops.events.restores import RemovedMemory
from kvops.events.variance import RecentRoots
from kvops.events.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, DecodedBatch
from kvops.schema.kv_events import (
    AGE_BOUNDS_S,
    NO_TENANT,
    RESIDENCY_BOUNDS_S,
    EventStreamHealth,
    KvEventStats,
)

GPU = "GPU"
RESTORE_MEMORY = 1 << 20  # removed hashes remembered at most (about 100 MB when full)
_ROOT_CHAIN = 0x6B76_6F70  # the chain key a root block's chain starts from
# Shared prefixes cost a numpy pass over every slot per chain level (about 60 ms at a million blocks in 64-block
# chains): past this many slots they are recomputed at most every PREFIX_REFRESH_S, not at every stats().
PREFIX_EVERY_CALL = 100_000
PREFIX_REFRESH_S = 5.0
# Chain keys are kept in 1 .. 2**60-1: a Python int of two digits, and never 0 (an empty ChainHolders entry).
_CHAIN_MASK = (1 << 60) - 1
_Slots = dict[BlockHash, int]


class ResidentIndex:
    def __init__(self, restore_window_s: float = 300.0, *, restore_memory: int = RESTORE_MEMORY) -> None:
        self.restore_window_s = restore_window_s
        self._restore_memory = restore_memory
        self._table = SlotTable()
        self._media: dict[str, _Slots] = {}
        self._resident: dict[str, int] = {}
        self._removed: dict[str, RemovedMemory] = {}
        self._tenants = TenantTable()
        self._roots = RecentRoots()
        self._first_tenant: int | None = None
        # Resident roots and shared chains by chain key; None until a second tenant stores.
        self._dupes: CrossTenant | None = None
        self._resident_tokens = 0
        self._block_size: int | None = None
        self._stores = self._removes = self._clears = 0
        self._restores = self._restored_tokens = self._root_stores = self._root_restores = 0
        self._cross_tenant = 0
        self._lifetime = ResidencyHistogram(RESIDENCY_BOUNDS_S)
        self._idle = ResidencyHistogram(RESIDENCY_BOUNDS_S)
        self._reuse_gap = ResidencyHistogram(RESIDENCY_BOUNDS_S)
        self._version = 0
        self._prefixes: tuple[int, float, PrefixView] = (-1, 0.0, PrefixView())  # index version, next due, view

    # ------------------------------------------------------------------ applying

    def apply(self, batch: DecodedBatch) -> None:
        ts = batch.ts
        storers: set[int] = set()
        removed_by: dict[int, int] = {}
        events = batch.events
        count = len(events)
        i = 0
        while i < count:
            event = events[i]
            kind = type(event)
            i += 1
            if kind is BlockStored:
                self._store(event, ts, storers)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                # vLLM sends one event per evicted block: a run of them is taken in one call.
                medium, hashes = event.medium, event.block_hashes  # type: ignore[union-attr]
                if i < count and type(events[i]) is BlockRemoved:
                    hashes = list(hashes)
                    while i < count and type(after := events[i]) is BlockRemoved and after.medium == medium:
                        hashes.extend(after.block_hashes)  # type: ignore[union-attr]
                        i += 1
                self._remove(hashes, medium or GPU, ts, removed_by)
            elif kind is AllBlocksCleared:
                self._clears += 1
                self._empty()
        if storers and removed_by:
            # vLLM evicts while allocating a step's new blocks and publishes both in that step's batch.
            total = sum(removed_by.values())
            evicted = self._tenants.evicted
            for tenant in storers:
                evicted[tenant] += total - removed_by.get(tenant, 0)
        self._version += 1

    def reset(self) -> None:
        self._empty()
        self._removed.clear()
        self._block_size = None

    @property
    def resident_blocks(self) -> int:
        return sum(self._resident.values())

    def _medium(self, medium: str) -> _Slots:
        slots = self._media[medium] = {}
        self._resident.setdefault(medium, 0)
        return slots

    # Long: the per-block hot path, kept in one frame with its columns in locals (a call a block costs ~10%).
    def _store(self, event: BlockStored, ts: float, storers: set[int]) -> None:
        hashes = event.block_hashes
        count = len(hashes)
        if not count:
            return
        medium = event.medium or GPU
        slots = self._media.get(medium)
        if slots is None:
            slots = self._medium(medium)
        token_ids = event.token_ids
        size = event.block_size or len(token_ids) // count
        if size > (self._block_size or 0):
            self._block_size = size
        table = self._table
        table.reserve(count + 1)  # the blocks and a parent the index never saw: no growing from here on
        (parent_col, children, alive, tenant_col, chain_col, tokens_col, stored_col, use_col, root_col,
         _, hits_col) = table.columns
        extra = event.extra_keys
        if extra is not None and not any(extra):
            extra = None
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            parent, chain = -1, _ROOT_CHAIN
            tenant = self._tenants.id_of(tenant_name(event, extra[0] if extra else None))
        else:
            parent = slots.get(parent_hash, -1)
            if parent < 0:
                tenant = self._tenants.id_of(tenant_name(event, None))
                parent = self._late_parent(slots, parent_hash, tenant, ts)
            else:
                tenant = tenant_col[parent]
                use_col[parent] = ts
            chain = chain_col[parent]
        root_chain = root_col[parent] if parent >= 0 else 0
        if tenant != self._first_tenant:
            if self._first_tenant is None:
                self._first_tenant = tenant
            elif self._dupes is None:
                self._dupes = CrossTenant(table)  # a second tenant: duplicates are possible from now on
        dupes = self._dupes
        fresh: list[int] = []
        root_stored = False
        removed = self._removed.get(medium)
        take_new = take_old = None
        if removed is not None and (removed.current or removed.previous):
            take_new = removed.current.pop
            take_old = removed.previous.pop if removed.previous else None
        free, hashes_col = table.free, table.hashes
        new = new_tokens = 0
        end = 0
        all_tokens = tuple(token_ids)  # one copy; a tuple's slices are tuples
        for i in range(count):
            block_hash = hashes[i]
            start, end = end, end + size
            block = all_tokens[start:end]
            chain = (hash((chain, block or (block_hash,))) & _CHAIN_MASK) or 1
            if extra is not None and i < len(extra) and extra[i]:
                content = content_keys(extra[i])
                if content:
                    chain = (hash((chain, content)) & _CHAIN_MASK) or 1
            slot = slots.get(block_hash)
            if slot is None:
                if free:
                    slot = free.pop()
                else:
                    slot = table.used
                    table.used = slot + 1
                hashes_col[slot] = block_hash
                slots[block_hash] = slot
                parent_col[slot] = parent  # (its children count is 0: a new or a freed slot)
                if parent >= 0:
                    children[parent] += 1
            elif alive[slot]:
                use_col[slot] = ts  # a hit vLLM reported: a use, not a store
                hits_col[slot] += 1
                parent, chain, root_chain = slot, chain_col[slot], root_col[slot]
                continue
            elif parent_col[slot] != parent:  # a ghost stored again (its resident children join it) elsewhere
                self._relink(slots, slot, parent)
            tokens = len(block) or size
            tokens_col[slot] = tokens
            tenant_col[slot] = tenant
            stored_col[slot] = ts
            use_col[slot] = ts
            hits_col[slot] = 0
            chain_col[slot] = chain
            if parent < 0:  # a root: a prompt's first block
                root_chain = chain
                root_stored = True
                self._root_stores += 1
                self._roots.add(block_hash, block, self._tenants.names[tenant] or NO_TENANT)
            root_col[slot] = root_chain
            alive[slot] = 1
            new += 1
            new_tokens += tokens
            if take_new is not None:
                key = hash(block_hash)
                gone = take_new(key, None)
                if gone is None and take_old is not None:
                    gone = take_old(key, None)
                if gone is not None and ts - gone <= self.restore_window_s:
                    self._restores += 1
                    self._restored_tokens += tokens
                    self._root_restores += parent < 0
                    self._reuse_gap.observe(ts - gone)
            if dupes is not None:
                fresh.append(slot)
            parent = slot
        if fresh:
            self._cross_tenant += dupes.stored(table, fresh, tenant, root_chain, root_stored)  # type: ignore[union-attr]
        if new:
            self._stores += new
            self._resident[medium] += new
            self._resident_tokens += new_tokens
            self._tenants.stores[tenant] += new
            self._tenants.resident[tenant] += new
            storers.add(tenant)

    def _relink(self, slots: _Slots, slot: int, parent: int) -> None:
        """A ghost stored again under another parent than it had (or under one, after a late join)."""
        table = self._table
        linked = table.parent[slot]
        if parent >= 0:
            table.children[parent] += 1  # before the old parent goes, in case it is an ancestor of the new
        table.parent[slot] = parent
        if linked >= 0:
            self._unlink(slots, linked)

    def _late_parent(self, slots: _Slots, parent_hash: BlockHash, tenant: int, ts: float) -> int:
        """A ghost for a parent the index never saw stored (it joined late, or missed a batch)."""
        table = self._table
        slot = table.alloc(parent_hash)
        slots[parent_hash] = slot
        table.parent[slot] = -1
        table.children[slot] = 0
        table.alive[slot] = 0
        table.tokens[slot] = 0
        table.tenant[slot] = tenant
        table.chain[slot] = table.root_chain[slot] = (hash(parent_hash) & _CHAIN_MASK) or 1  # tokens unknown: its own
        table.held[slot] = 0
        table.stored_at[slot] = table.last_use[slot] = ts
        return slot

    # Long: the per-block hot path of removals, in one frame for the same reason as _store.
    def _remove(self, hashes: list[BlockHash], medium: str, ts: float, removed_by: dict[int, int]) -> None:
        self._removes += len(hashes)
        slots = self._media.get(medium)
        if slots is None:
            return
        removed = self._removed.get(medium)
        if removed is None:
            removed = self._removed[medium] = RemovedMemory(self.restore_window_s, self._restore_memory)
        removed.rotate(ts)
        remembered = removed.current
        dupes = self._dupes
        # Without it a single tenant has stored, and every resident block is that tenant's: count once.
        by_tenant = dupes is not None
        table = self._table
        (parent_col, children, alive, tenant_col, chain_col, tokens_col, stored_col, use_col, _,
         held_col, _) = table.columns
        free = table.free
        gone_tenants: list[int] = []
        roots: tuple[list[int], list[int]] = ([], [])
        shared: tuple[list[int], list[int]] = ([], [])
        resident, removed_total = self._tenants.resident, self._tenants.removed
        lifetimes, idle_times = self._lifetime.pending, self._idle.pending
        gone = gone_tokens = 0
        tenant = -1
        for block_hash in hashes:
            slot = slots.get(block_hash)
            if slot is None or not alive[slot]:
                continue  # stored before the index joined, or already removed
            alive[slot] = 0
            used = use_col[slot]
            lifetimes.append(ts - stored_col[slot])
            idle_times.append(ts - used)
            tenant = tenant_col[slot]
            parent = parent_col[slot]
            if by_tenant:
                gone_tenants.append(tenant)
                if parent < 0:
                    roots[0].append(chain_col[slot])
                    roots[1].append(tenant)
                if held_col[slot]:
                    held_col[slot] = 0
                    shared[0].append(chain_col[slot])
                    shared[1].append(tenant)
            gone += 1
            gone_tokens += tokens_col[slot]
            remembered[hash(block_hash)] = ts
            if parent >= 0 and use_col[parent] < used:
                use_col[parent] = used  # the uses below a block reach it when the block below goes
            if not children[slot]:  # nothing hangs from it: free the slot (else it stays a ghost)
                del slots[block_hash]
                free.append(slot)  # its columns are all set again when it is handed out
                if parent >= 0:
                    children[parent] -= 1
                    if not children[parent] and not alive[parent]:
                        self._drop(slots, parent)  # the ghosts above that this block held up
        if gone:
            for owner, count in (Counter(gone_tenants).items() if by_tenant else ((tenant, gone),)):
                resident[owner] -= count
                removed_total[owner] += count
                removed_by[owner] = removed_by.get(owner, 0) + count
            if by_tenant:
                dupes.removed(roots, shared)  # type: ignore[union-attr]
            self._resident[medium] -= gone
            self._resident_tokens -= gone_tokens
            if len(lifetimes) >= FLUSH_AT:
                self._lifetime.flush()
                self._idle.flush()

    def _drop(self, slots: _Slots, slot: int) -> None:
        """Free a slot nothing hangs from, and the ghosts above it that it was the last to hold up."""
        table = self._table
        while True:
            del slots[table.hashes[slot]]  # type: ignore[arg-type]
            parent = table.parent[slot]
            table.release(slot)
            if parent < 0:
                return
            table.children[parent] -= 1
            if table.children[parent] or table.alive[parent]:
                return
            slot = parent

    def _unlink(self, slots: _Slots, parent: int) -> None:
        table = self._table
        table.children[parent] -= 1
        if not table.children[parent] and not table.alive[parent]:
            self._drop(slots, parent)

    def _empty(self) -> None:
        self._table = SlotTable()
        for medium in self._media:
            self._media[medium] = {}
            self._resident[medium] = 0
        if self._dupes is not None:
            self._dupes = CrossTenant(self._table)
        self._resident_tokens = 0
        self._tenants.clear_resident()

    # ------------------------------------------------------------------ the view

    def stats(self, now: float, stream: EventStreamHealth, pool_blocks: int | None = None) -> KvEventStats:
        table = self._table
        version, due, _ = self._prefixes
        if version != self._version and (table.used < PREFIX_EVERY_CALL or now >= due):
            found = prefix_view(table, self._tenants.names, self._roots.first_tokens)
            self._prefixes = (self._version, now + PREFIX_REFRESH_S, found)
        return KvEventStats(
            stream=stream, block_size=self._block_size, pool_blocks=pool_blocks, resident=dict(self._resident),
            resident_tokens=self._resident_tokens, age_bounds_s=list(AGE_BOUNDS_S),
            resident_by_age=resident_by_age(table, now, AGE_BOUNDS_S), tenants=self._tenants.view(),
            stores_total=self._stores, removes_total=self._removes, clears_total=self._clears,
            restores_total=self._restores, restored_tokens_total=self._restored_tokens,
            restore_window_s=self.restore_window_s, root_stores_total=self._root_stores,
            root_restores_total=self._root_restores, cross_tenant_duplicates_total=self._cross_tenant,
            lifetime_s=self._lifetime.model(), idle_before_evict_s=self._idle.model(),
            reuse_gap_s=self._reuse_gap.model(), shared_prefixes=list(self._prefixes[2].shared),
            resident_chains=list(self._prefixes[2].chains), resident_chains_total=self._prefixes[2].chains_total,
            root_variants=list(self._roots.variants()))

    def memory_bytes(self) -> int:
        """The columns' and duplicate tables' bytes (the dicts and hash objects come on top: tracemalloc)."""
        dupes = self._dupes
        return self._table.nbytes() + (dupes.roots.nbytes() + dupes.blocks.nbytes() if dupes else 0)
