"""Cross-tenant duplicates: a store whose token chain (token ids and parent chain, without salt or LoRA) is
already resident under another tenant: the same prefix kept twice because the salts or LoRAs differ.

Two chains can only be the same if their roots are: so CrossTenant keeps every resident root by its salt-free
chain key (one entry a prompt, not a block), and only the chains whose root two tenants hold ("mixed" roots)
have their blocks kept by chain key too. A deployment whose tenants send different prompts pays a column write
a block and an entry a prompt; the blocks of a shared system prompt under many salts pay a table entry each.
When a root turns mixed, the blocks already resident under the first tenant's copy are found with one numpy
pass over the slots and entered.

ChainHolders keeps, per chain key, how many resident blocks hold it and, while they are all one tenant's,
which one. A chain two tenants hold is "mixed" (tenant -1) and its per-tenant counts move to a dict, which only
such chains enter: so "held by another tenant?" is O(1) however many tenants hold the chain (a thousand per-user
salts over one system prompt). It is open addressing (linear probing, deletion by backward shift) in three typed
arrays, 16 bytes an entry at a load of at most one half, where a dict would take about 80 bytes an entry (a
Python int key and a dict entry). Key 0 marks an empty entry, so callers keep chain keys in 1 .. 2**62.
"""

from __future__ import annotations

from array import array

import numpy as np

from kvops.events.chains import SlotTable

INITIAL = 1024
MIXED = -1


class ChainHolders:
    __slots__ = ("_counts", "_keys", "_mask", "_mixed", "_tenants", "count")

    def __init__(self, capacity: int = INITIAL) -> None:
        self.count = 0  # distinct chain keys held
        self._mixed: dict[tuple[int, int], int] = {}  # (chain, tenant) -> blocks, for mixed chains only
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._keys = memoryview(array("q", bytes(8 * capacity)))
        self._tenants = memoryview(array("i", bytes(4 * capacity)))
        self._counts = memoryview(array("i", bytes(4 * capacity)))
        self._mask = capacity - 1

    def tenant_of(self, chain: int) -> int | None:
        """The tenant holding `chain` (MIXED when several do), None when no block holds it."""
        keys, mask = self._keys, self._mask
        i = chain & mask
        key = keys[i]
        while key and key != chain:
            i = (i + 1) & mask
            key = keys[i]
        return self._tenants[i] if key else None

    def add(self, chains: list[int], tenant: int) -> int:
        """One more resident block of `tenant` holds each of `chains` (a store's new blocks); how many of them
        another tenant's block held already."""
        others = 0
        keys, tenants, counts = self._keys, self._tenants, self._counts
        for chain in chains:
            mask = self._mask
            i = chain & mask
            key = keys[i]
            while key and key != chain:
                i = (i + 1) & mask
                key = keys[i]
            if not key:
                keys[i] = chain
                tenants[i] = tenant
                counts[i] = 1
                self.count += 1
                if self.count * 2 > mask + 1:
                    self._grow()
                    keys, tenants, counts = self._keys, self._tenants, self._counts
                continue
            holder = tenants[i]
            counts[i] += 1
            if holder == tenant:
                continue
            mixed = self._mixed
            if holder != MIXED:  # a second tenant: from now on this chain is counted per tenant
                mixed[(chain, holder)] = counts[i] - 1
                tenants[i] = MIXED
                mixed[(chain, tenant)] = 1
                others += 1
                continue
            own = mixed.get((chain, tenant), 0)
            mixed[(chain, tenant)] = own + 1
            others += counts[i] - 1 > own
        return others

    def remove(self, chains: list[int], tenants_of: list[int]) -> None:
        """One resident block fewer holds each chain; tenants_of[n] is the tenant of the block of chains[n]."""
        keys, tenants, counts, mask = self._keys, self._tenants, self._counts, self._mask
        for chain, tenant in zip(chains, tenants_of, strict=True):
            i = chain & mask
            key = keys[i]
            while key and key != chain:
                i = (i + 1) & mask
                key = keys[i]
            if not key:
                continue  # not held (never here: blocks resident before the table are added when it is built)
            left = counts[i] - 1
            if tenants[i] == MIXED:
                own = self._mixed.get((chain, tenant), 0) - 1
                if own > 0:
                    self._mixed[(chain, tenant)] = own
                else:
                    self._mixed.pop((chain, tenant), None)
            if left:
                counts[i] = left
                continue
            self.count -= 1
            # Backward shift: move up each later entry of the run that may sit at the freed place, so every
            # entry stays reachable from its home without tombstones.
            j = i
            while True:
                j = (j + 1) & mask
                key = keys[j]
                if not key:
                    break
                home = key & mask
                if (home <= i < j) or (i < j < home) or (j < home <= i):
                    keys[i], tenants[i], counts[i] = key, tenants[j], counts[j]
                    i = j
            keys[i] = 0

    def _grow(self) -> None:
        """Twice the entries, filled in numpy rounds: each round every key not yet placed tries the next entry of
        its probe run, and the first key for a free entry takes it. A key goes past an entry only when that entry
        was taken, and nothing is taken away while filling, so every key stays reachable from its home."""
        taken = np.flatnonzero(np.frombuffer(self._keys, dtype=np.int64))
        keys = np.frombuffer(self._keys, dtype=np.int64)[taken]
        tenants = np.frombuffer(self._tenants, dtype=np.int32)[taken]
        counts = np.frombuffer(self._counts, dtype=np.int32)[taken]
        capacity = 2 * len(self._keys)
        new_keys = np.zeros(capacity, dtype=np.int64)
        new_tenants = np.zeros(capacity, dtype=np.int32)
        new_counts = np.zeros(capacity, dtype=np.int32)
        where = keys & (capacity - 1)
        pending = np.arange(len(keys))
        while pending.size:
            target = where[pending]
            first = np.zeros(pending.size, dtype=bool)
            first[np.unique(target, return_index=True)[1]] = True
            placed = first & (new_keys[target] == 0)
            new_keys[target[placed]] = keys[pending[placed]]
            new_tenants[target[placed]] = tenants[pending[placed]]
            new_counts[target[placed]] = counts[pending[placed]]
            pending = pending[~placed]
            where[pending] = (where[pending] + 1) & (capacity - 1)
        self._keys = memoryview(array("q", new_keys.tobytes()))
        self._tenants = memoryview(array("i", new_tenants.tobytes()))
        self._counts = memoryview(array("i", new_counts.tobytes()))
        self._mask = capacity - 1

    def nbytes(self) -> int:
        return 16 * len(self._keys)


class CrossTenant:
    """Resident roots by chain key, and the blocks under mixed roots; over every medium (a chain kept on the GPU
    under one salt and offloaded to CPU under another is kept twice all the same)."""

    __slots__ = ("blocks", "roots")

    def __init__(self, table: SlotTable) -> None:
        self.roots = ChainHolders()
        self.blocks = ChainHolders()
        n = table.used
        alive = np.frombuffer(table.alive, dtype=np.int8, count=n)
        parent = np.frombuffer(table.parent, dtype=np.int32, count=n)
        chain = np.frombuffer(table.chain, dtype=np.int64, count=n)
        tenant = np.frombuffer(table.tenant, dtype=np.int32, count=n)
        roots = np.flatnonzero((alive == 1) & (parent < 0))
        for owner in np.unique(tenant[roots]).tolist():
            self.roots.add(chain[roots[tenant[roots] == owner]].tolist(), owner)

    def stored(self, table: SlotTable, fresh: list[int], tenant: int, root_chain: int, root_stored: bool) -> int:
        """A store's new resident blocks (one chain, under `root_chain`; its root among them when
        `root_stored`): how many of them another tenant holds."""
        before = self.roots.tenant_of(root_chain)
        after = before
        if root_stored:
            self.roots.add([root_chain], tenant)
            after = self.roots.tenant_of(root_chain)
        if after != MIXED:
            return 0
        held = table.held
        for slot in fresh:
            held[slot] = 1
        if before != MIXED:
            self._enter_tree(table, root_chain)
        chain = table.chain
        return self.blocks.add([chain[slot] for slot in fresh], tenant)

    def _enter_tree(self, table: SlotTable, root_chain: int) -> None:
        """A root just turned mixed: enter the resident blocks under its chain not entered yet."""
        n = table.used
        alive = np.frombuffer(table.alive, dtype=np.int8, count=n)
        under = np.frombuffer(table.root_chain, dtype=np.int64, count=n)
        held = np.frombuffer(table.held, dtype=np.int8, count=n)
        found = np.flatnonzero((alive == 1) & (under == root_chain) & (held == 0))
        chain = np.frombuffer(table.chain, dtype=np.int64, count=n)[found]
        tenant = np.frombuffer(table.tenant, dtype=np.int32, count=n)[found]
        for owner in np.unique(tenant).tolist():
            self.blocks.add(chain[tenant == owner].tolist(), owner)
        for slot in found.tolist():
            table.held[slot] = 1

    def removed(self, roots: tuple[list[int], list[int]], blocks: tuple[list[int], list[int]]) -> None:
        """Removed roots and removed entered blocks, each as (chain keys, tenants)."""
        if roots[0]:
            self.roots.remove(*roots)
        if blocks[0]:
            self.blocks.remove(*blocks)
