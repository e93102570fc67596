"""The block manager: which sequence holds which blocks, prefix caching, eviction and host swap.

Every state transition of a device block happens in `_set_state`, so the counts per state, the
free queue, the evictor and the prefix-cache map can never disagree with the blocks themselves.
Host blocks (the swap pool) are kept by `HostPool` (`host_pool.py`); this class decides what is
swapped out and back in.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvops.engine.block import Block, BlockState, SeqBlocks, state_map
from kvops.engine.eviction import ANY_OWNER, Evictor, make_policy
from kvops.engine.free_queue import FreeBlockQueue
from kvops.engine.hashing import BlockHash, block_hashes
from kvops.engine.host_pool import HostPool

DEFAULT_TENANT = "default"


@dataclass
class TenantBlockStats:
    evictions_caused: int = 0  # this tenant's allocations evicted another tenant's cached block
    evictions_suffered: int = 0  # another tenant's allocation evicted this tenant's cached block


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
        num_host_blocks: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} × {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.clock = clock
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(range(num_blocks))
        self.evictor = Evictor(make_policy(eviction_policy))
        self.pending_free: list[int] = []
        self.cached: dict[BlockHash, int] = {}  # prefix-cache map: block hash -> block id
        self.seqs: dict[str, SeqBlocks] = {}
        self.state_counts: Counter[BlockState] = Counter({BlockState.FREE: num_blocks})
        self.tenants: dict[str, TenantBlockStats] = {}
        self.evictions_total = 0
        self.quotas: dict[str, int] = {}  # tenant -> most blocks it may own; such a tenant is isolated
        self.owned: Counter[str] = Counter()  # tenant -> blocks it allocated that are not FREE yet
        self.allocations_total = 0  # device blocks handed out, for any reason
        self.host_pool = HostPool(num_host_blocks)
        self.swap_out_blocks_total = 0  # device -> host copies
        self.swap_in_blocks_total = 0  # host -> device copies
        self.swap_in_reused_total = 0  # host blocks found in the device prefix cache: no copy

    # ------------------------------------------------------------------ queries

    @property
    def eviction_policy(self) -> str:
        return self.evictor.policy.name

    def num_allocatable(self, tenant: str | None = None, reusing: Sequence[int] = ()) -> int:
        """Blocks an allocation for `tenant` can take right now: free, pending reclaim and cached
        (evictable). A tenant with a quota grows (from free blocks, or by the eviction policy)
        only up to its quota; at its quota it can only recycle its own cached blocks.

        `reusing`: blocks the allocation takes from the prefix cache before anything else. Those
        that are CACHED leave the evictor first, so they cannot also be counted as evictable.
        """
        reused_cached = [self.blocks[b] for b in reusing if self.blocks[b].state is BlockState.CACHED]
        free = len(self.free_queue) + len(self.pending_free) + len(self.evictor) - len(reused_cached)
        quota = self.quotas.get(tenant) if tenant is not None else None
        if quota is None:
            return free
        own_cached = self.evictor.count(tenant) - sum(1 for b in reused_cached if b.owner == tenant)
        return min(free - own_cached, max(0, quota - self.owned[tenant])) + own_cached  # type: ignore[index]

    def quota_limited(self, tenant: str) -> bool:
        """True when the tenant's quota, not the pool, is what stops its next allocation."""
        return tenant in self.quotas and self.num_allocatable(tenant) < self.num_allocatable()

    def block_table(self, seq_id: str) -> list[int]:
        return self.seqs[seq_id].block_ids

    def state_map(self) -> str:
        return state_map(self.blocks)

    def host_state_map(self) -> str:
        return self.host_pool.state_map()

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.num_blocks

    @property
    def num_swapped_blocks(self) -> int:
        """Host blocks holding a swapped-out sequence's K/V."""
        return self.host_pool.num_swapped

    @property
    def swapped(self) -> dict[str, SeqBlocks]:
        """Host block tables of swapped-out sequences."""
        return self.host_pool.tables

    # ------------------------------------------------------------ prefix cache

    def lookup(self, token_ids: Sequence[int], salt: str | None) -> tuple[list[int], list[BlockHash]]:
        """Cached blocks holding the longest prefix of `token_ids`, and the prompt's full-block hashes.

        At least the last token is left uncached: its logits must be computed.
        """
        if not self.enable_prefix_caching:
            return [], []
        hashes = block_hashes(token_ids, self.block_size, salt)
        hits: list[int] = []
        max_hit_blocks = (len(token_ids) - 1) // self.block_size
        for block_hash in hashes[:max_hit_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, hashes

    # -------------------------------------------------------------- allocation

    def allocate(
        self,
        seq_id: str,
        num_tokens: int,
        *,
        tenant: str = DEFAULT_TENANT,
        salt: str | None = None,
        hit_block_ids: Sequence[int] = (),
        hashes: Sequence[BlockHash] = (),
    ) -> bool:
        """Create the block table of a new sequence covering `num_tokens`, reusing `hit_block_ids`.

        All or nothing: returns False and changes nothing when the blocks are not there.
        """
        if seq_id in self.seqs or seq_id in self.swapped:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        needed = max(0, -(-num_tokens // self.block_size) - len(hit_block_ids))
        if needed > self.num_allocatable(tenant, reusing=hit_block_ids):
            return False
        seq = SeqBlocks(seq_id, tenant, salt, hashes=list(hashes))
        self.seqs[seq_id] = seq
        self.tenants.setdefault(tenant, TenantBlockStats())
        now = self.clock()
        for depth, block_id in enumerate(hit_block_ids):
            self._claim(self.blocks[block_id], depth, now)
            seq.block_ids.append(block_id)
        seq.num_full = len(hit_block_ids)
        self._grow(seq, needed, now)
        return True

    def append_slots(self, seq_id: str, num_tokens: int) -> bool:
        """Make the sequence's block table cover `num_tokens` tokens in all. All or nothing."""
        seq = self.seqs[seq_id]
        needed = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if needed <= 0:
            return True
        if needed > self.num_allocatable(seq.tenant):
            return False
        self._grow(seq, needed, self.clock())
        return True

    def mark_computed(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """K/V is now written for the first `num_computed` tokens: blocks that filled up become FULL
        and, with prefix caching on, enter the prefix-cache map."""
        seq = self.seqs[seq_id]
        num_full = min(num_computed // self.block_size, len(seq.block_ids))
        if num_full <= seq.num_full:
            return
        if self.enable_prefix_caching and len(seq.hashes) < num_full:
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes.extend(block_hashes(token_ids[: num_full * self.block_size], self.block_size,
                                           seq.salt, start=len(seq.hashes), parent=parent))
        for index in range(seq.num_full, num_full):
            block = self.blocks[seq.block_ids[index]]
            if block.state is BlockState.FILLING:
                self._set_state(block, BlockState.FULL)
            if self.enable_prefix_caching and block.hash is None:
                block_hash = seq.hashes[index]
                if block_hash not in self.cached:  # an identical block computed concurrently keeps the key
                    block.hash = block_hash
                    self.cached[block_hash] = block.block_id
        seq.num_full = num_full

    def fork(self, parent_id: str, child_id: str) -> list[tuple[int, int]] | None:
        """Give `child_id` the parent's blocks: full ones shared, the filling one copied.

        Returns the (source, destination) block copies the caller must perform, or None
        when there is no block for the copy.
        """
        if parent_id in self.swapped:
            raise ValueError(f"sequence {parent_id!r} is swapped out: swap it in before forking it")
        parent = self.seqs[parent_id]
        if child_id in self.seqs or child_id in self.swapped:
            raise ValueError(f"sequence {child_id!r} already holds blocks")
        shared = parent.block_ids[: parent.num_full]
        partial = parent.block_ids[parent.num_full :]
        if len(partial) > self.num_allocatable(parent.tenant):
            return None
        child = SeqBlocks(child_id, parent.tenant, parent.salt, hashes=list(parent.hashes[: parent.num_full]))
        self.seqs[child_id] = child
        for block_id in shared:
            self.blocks[block_id].ref_count += 1
            child.block_ids.append(block_id)
        child.num_full = len(shared)
        now = self.clock()
        self._grow(child, len(partial), now)
        return list(zip(partial, child.block_ids[len(shared) :], strict=True))

    # -------------------------------------------------------------------- swap

    def can_swap_out(self, seq_id: str) -> bool:
        """The host pool has a free block for every block of the sequence's table."""
        return len(self.seqs[seq_id].block_ids) <= self.host_pool.num_free

    def swap_out(self, seq_id: str) -> list[tuple[int, int]]:
        """Move a sequence's K/V to the host pool; returns the (device block, host block) copies the
        caller must perform before any device block is written again (before the next forward pass).

        Every block gets its own host copy, shared ones too, so the host table never depends on what
        other sequences keep on the device. The device blocks are then released as by `free`: full
        hashed ones stay CACHED, so a swap-in may find them again without a copy.
        """
        seq = self.seqs[seq_id]
        contents = [(self._content_hash(seq, index), self.blocks[block_id].owner)
                    for index, block_id in enumerate(seq.block_ids)]
        host_seq = self.host_pool.store(seq, contents)  # raises, changing nothing, when the host pool is full
        copies = list(zip(seq.block_ids, host_seq.block_ids, strict=True))
        self._release(seq_id, aborted=False)
        self.swap_out_blocks_total += len(copies)
        return copies

    def swap_in(self, seq_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give a swapped-out sequence a device table again, covering its host table and `num_tokens`.

        Returns the (host block, device block) copies the caller must perform before the forward
        pass, or None, changing nothing, when the device blocks (within the tenant's quota) are not
        there. A full block whose key is in the prefix cache is taken from there, without a copy.
        """
        host_seq = self.swapped[seq_id]
        tenant = host_seq.tenant
        num_blocks = max(len(host_seq.block_ids), -(-num_tokens // self.block_size))
        # index in the table -> cached device block with the same content
        reused = self.host_pool.found_in(seq_id, self.cached) if self.enable_prefix_caching else {}
        if num_blocks - len(reused) > self.num_allocatable(tenant, reusing=list(reused.values())):
            return None

        seq = SeqBlocks(seq_id, tenant, host_seq.salt, hashes=list(host_seq.hashes), num_full=host_seq.num_full)
        self.seqs[seq_id] = seq
        self.tenants.setdefault(tenant, TenantBlockStats())
        now = self.clock()
        table: list[int | None] = [None] * num_blocks
        # Claim the reused blocks before taking new ones, so that no eviction can take them.
        for index, block_id in reused.items():
            self._claim(self.blocks[block_id], index, now)
            table[index] = block_id
        copies: list[tuple[int, int]] = []
        for index in range(num_blocks):
            if table[index] is not None:
                continue
            block = self._new_block(tenant, index, now)
            table[index] = block.block_id
            if index >= len(host_seq.block_ids):
                continue  # growth beyond the host table: nothing to copy
            host = self.host_pool.blocks[host_seq.block_ids[index]]
            copies.append((host.block_id, block.block_id))
            if index < seq.num_full:
                self._set_state(block, BlockState.FULL)
                if self.enable_prefix_caching and host.hash is not None and host.hash not in self.cached:
                    block.hash = host.hash
                    self.cached[host.hash] = block.block_id
        seq.block_ids = [block_id for block_id in table if block_id is not None]
        # FREE at once: the scheduler swaps in only in steps that swap nothing out, so no copy lands there first.
        self.host_pool.drop(seq_id)
        self.swap_in_blocks_total += len(copies)
        self.swap_in_reused_total += len(reused)
        return copies

    def drop_swapped(self, seq_id: str) -> None:
        """A swapped-out sequence is aborted: its host blocks go FREE."""
        self.host_pool.drop(seq_id)

    # ----------------------------------------------------------------- release

    def free(self, seq_id: str) -> None:
        """A finished (or preempted) sequence lets go: hashed blocks stay CACHED for reuse."""
        self._release(seq_id, aborted=False)

    def abort(self, seq_id: str) -> None:
        """An aborted sequence lets go: its unshared blocks go PENDING_FREE until the next reclaim."""
        self._release(seq_id, aborted=True)

    def reclaim_pending(self) -> int:
        """Move every PENDING_FREE block to FREE in one batch; returns how many."""
        count = len(self.pending_free)
        for block_id in self.pending_free:
            block = self.blocks[block_id]
            self._set_owner(block, None)
            self._set_state(block, BlockState.FREE)
            self.free_queue.push(block_id)
        self.pending_free.clear()
        return count

    def evict(self, max_blocks: int | None = None) -> int:
        """Drop up to `max_blocks` cached blocks (all when None) to FREE; returns how many."""
        count = 0
        while len(self.evictor) and (max_blocks is None or count < max_blocks):
            block = self.evictor.pop()
            self._uncache(block)
            self._set_owner(block, None)
            self._set_state(block, BlockState.FREE, from_evictor=True)
            self.free_queue.push(block.block_id)
            count += 1
        return count

    # ------------------------------------------------------------------- knobs

    def set_prefix_caching(self, enabled: bool) -> None:
        if not enabled:
            self.evict()
            for block_hash, block_id in list(self.cached.items()):
                self.blocks[block_id].hash = None
                del self.cached[block_hash]
        self.enable_prefix_caching = enabled

    def set_eviction_policy(self, name: str) -> None:
        self.evictor.rebuild(make_policy(name))

    def set_quota(self, tenant: str, blocks: int | None) -> None:
        """Cap the blocks `tenant` may own (None lifts the cap). Blocks it already owns above a new
        cap are not taken away; it recycles its own cached blocks until it is under the cap."""
        if blocks is None:
            self.quotas.pop(tenant, None)
        else:
            if blocks < 1:
                raise ValueError(f"a quota must be at least one block (got {blocks})")
            self.quotas[tenant] = blocks

    # --------------------------------------------------------------- internals

    def _grow(self, seq: SeqBlocks, count: int, now: float) -> None:
        for _ in range(count):
            seq.block_ids.append(self._new_block(seq.tenant, len(seq.block_ids), now).block_id)

    def _new_block(self, tenant: str, depth: int, now: float) -> Block:
        """A FILLING block owned by `tenant` at `depth` of its sequence's table."""
        block = self._take_block(tenant)
        block.ref_count = 1
        self._set_owner(block, tenant)
        block.depth = depth
        block.last_access = now
        block.freq = 1.0
        return block

    def _claim(self, block: Block, depth: int, now: float) -> None:
        """One more reference to a block found in the prefix cache (a cached one comes back to FULL)."""
        if block.state is BlockState.CACHED:
            self._set_state(block, BlockState.FULL)
        block.ref_count += 1
        self.evictor.policy.on_hit(block, now)
        block.depth = depth

    def _take_block(self, tenant: str) -> Block:
        self.allocations_total += 1
        quota = self.quotas.get(tenant)
        at_quota = quota is not None and self.owned[tenant] >= quota
        if not at_quota:
            if not self.free_queue and self.pending_free:
                self.reclaim_pending()
            if self.free_queue:
                block = self.blocks[self.free_queue.pop()]
                self._set_state(block, BlockState.FILLING)
                return block
        block = self.evictor.pop(tenant if at_quota else ANY_OWNER)
        self.evictions_total += 1
        victim = block.owner or DEFAULT_TENANT
        if victim != tenant:
            self.tenants.setdefault(tenant, TenantBlockStats()).evictions_caused += 1
            self.tenants.setdefault(victim, TenantBlockStats()).evictions_suffered += 1
        self._uncache(block)
        self._set_owner(block, None)
        self._set_state(block, BlockState.FILLING, from_evictor=True)
        return block

    def _content_hash(self, seq: SeqBlocks, index: int) -> BlockHash | None:
        """The prefix-cache key of the sequence's block at `index` when it is full and known: the
        block's own, else the sequence's (a block computed while an identical one held the key has none)."""
        block_hash = self.blocks[seq.block_ids[index]].hash
        if block_hash is None and index < min(seq.num_full, len(seq.hashes)):
            block_hash = seq.hashes[index]
        return block_hash

    def _uncache(self, block: Block) -> None:
        if block.hash is not None:
            if self.cached.get(block.hash) == block.block_id:
                del self.cached[block.hash]
            block.hash = None

    def _release(self, seq_id: str, aborted: bool) -> None:
        seq = self.seqs.pop(seq_id)
        now = self.clock()
        # Tail first, so that among blocks released together the evictor sees the deepest as oldest.
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if aborted:
                self._uncache(block)
                self._set_state(block, BlockState.PENDING_FREE)
                self.pending_free.append(block_id)
            elif block.hash is not None and block.state is BlockState.FULL:
                self.evictor.policy.touch(block, now)
                self._set_state(block, BlockState.CACHED)
                self.evictor.add(block)
            else:
                self._uncache(block)
                self._set_owner(block, None)
                self._set_state(block, BlockState.FREE)
                self.free_queue.push(block_id)

    def _set_owner(self, block: Block, owner: str | None) -> None:
        if block.owner is not None:
            self.owned[block.owner] -= 1
        if owner is not None:
            self.owned[owner] += 1
        block.owner = owner

    def _set_state(self, block: Block, state: BlockState, from_evictor: bool = False) -> None:
        """The one place a block changes state."""
        old = block.state
        if old is state:
            return
        if old is BlockState.CACHED and not from_evictor:
            self.evictor.remove(block)
        self.state_counts[old] -= 1
        self.state_counts[state] += 1
        block.state = state
