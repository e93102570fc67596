"""The blocks the index knows, as parallel columns, and what stats() reads off them in one vectorized pass:
resident blocks by age, the largest shared prefixes (branch points), and the resident chains (linear ones too).

A block is a slot: an index into typed arrays (array.array, a few bytes per field) instead of one Python object
per block, which is what keeps a million resident blocks within the memory budget (docs/benchmarks.md, "KV
event index"). A slot holds a resident block, or a removed block that is still the parent of resident ones (a
"ghost": it keeps their chain joined, so a later store of the same hash joins them again), or nothing (free).
stats() reads the columns through numpy views, which cost no copy.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvops.events.wire import BlockHash
from kvops.schema.kv_events import NO_TENANT, ResidentChain, SharedPrefix

GROW_MIN = 1024
SHARED_PREFIXES = 5
RESIDENT_CHAINS = 5


_COLUMNS = (("parent", "i"), ("children", "i"), ("alive", "b"), ("tenant", "i"), ("chain", "q"), ("tokens", "i"),
            ("stored_at", "d"), ("last_use", "d"), ("root_chain", "q"), ("held", "b"), ("hits", "i"))


class SlotTable:
    """Per-block columns. parent: the parent's slot or -1; children: slots whose parent this is (resident or
    ghost); alive: 1 when resident; chain: a hash of the token chain without salt or LoRA, and root_chain its
    root's; held: 1 when entered in the cross-tenant block table (kvops.events.duplicates); hits: stores of the
    block while it was resident (reuses vLLM reported). Times are the publisher's clock.

    Each column is an array.array read and written through a memoryview, which takes an item in half the time
    the array itself does. A column cannot grow while a view of it is out, so the hot paths reserve() the slots
    they may need first, then take `columns` and alloc() no more than that: alloc() never grows the table.
    A freed slot keeps its old values (children 0, alive 0): every column is set again when it is handed out.
    """

    __slots__ = ("_arrays", "alive", "chain", "children", "columns", "free", "hashes", "held", "hits", "last_use",
                 "parent", "root_chain", "stored_at", "tenant", "tokens", "used")

    def __init__(self) -> None:
        self._arrays = [array(code) for _, code in _COLUMNS]
        self.hashes: list[BlockHash | None] = []  # the same object as the medium's dict key: no copy
        self.used = 0  # slots ever handed out; the columns are len(hashes) long
        self.free: list[int] = []
        self._views()

    def _views(self) -> None:
        views = tuple(memoryview(a) for a in self._arrays)
        self.columns = views
        (self.parent, self.children, self.alive, self.tenant, self.chain, self.tokens, self.stored_at,
         self.last_use, self.root_chain, self.held, self.hits) = views

    def reserve(self, count: int) -> None:
        """Room for `count` more slots without growing (call before taking `columns`)."""
        short = count - len(self.free) - (len(self.hashes) - self.used)
        if short <= 0:
            return
        # In steps of at least a quarter of the size, so growing stays amortized O(1) a slot, and at most a fifth
        # of the columns is slack.
        more = max(short, GROW_MIN, len(self.hashes) // 4)
        for view in self.columns:
            view.release()
        for column in self._arrays:
            column.frombytes(bytes(more * column.itemsize))
        self.hashes.extend([None] * more)
        self._views()

    def alloc(self, block_hash: BlockHash) -> int:
        """A slot for a new block or ghost, within what was reserved; the caller sets every column."""
        if self.free:
            slot = self.free.pop()
        else:
            slot = self.used
            self.used = slot + 1
        self.hashes[slot] = block_hash
        return slot

    def release(self, slot: int) -> None:
        self.hashes[slot] = None
        self.parent[slot] = -1
        self.children[slot] = 0
        self.alive[slot] = 0
        self.free.append(slot)

    def nbytes(self) -> int:
        return sum(c.buffer_info()[1] * c.itemsize for c in self._arrays) + 8 * len(self.hashes)


def resident_by_age(table: SlotTable, now: float, bounds: list[float]) -> list[int]:
    """Resident blocks per age class: stored less than bounds[0] seconds before `now`, ..., older than the last."""
    n = table.used
    alive = np.frombuffer(table.alive, dtype=np.int8, count=n).astype(bool)
    ages = now - np.frombuffer(table.stored_at, dtype=np.float64, count=n)[alive]
    classes = np.searchsorted(np.asarray(bounds, dtype=np.float64), ages, side="right")
    return [int(c) for c in np.bincount(classes, minlength=len(bounds) + 1)]


def descendants(table: SlotTable) -> np.ndarray:
    """Resident blocks below each slot, reached through resident blocks only (past a removed block vLLM's prefix
    lookup stops, so what hangs below it is not part of the prefix). Leaves first, level by level (Kahn's
    order over the children counts): the loop runs once per level of the deepest chain."""
    n = table.used
    alive = np.frombuffer(table.alive, dtype=np.int8, count=n).astype(bool)
    parent = np.frombuffer(table.parent, dtype=np.int32, count=n)
    pending = np.frombuffer(table.children, dtype=np.int32, count=n).copy()
    in_use = alive | (pending > 0)
    below = np.zeros(n, dtype=np.int64)
    frontier = np.flatnonzero(in_use & (pending == 0))
    while frontier.size:
        up = parent[frontier]
        linked = up >= 0
        frontier, up = frontier[linked], up[linked]
        if not up.size:
            break
        # Sorted by parent, the children of one parent are a run: sums and counts per run, no ufunc.at.
        order = np.argsort(up)
        up = up[order]
        gained = np.where(alive[frontier], below[frontier] + 1, 0)[order]
        starts = np.flatnonzero(np.concatenate(([True], up[1:] != up[:-1])))
        parents = up[starts]
        below[parents] += np.add.reduceat(gained, starts)
        pending[parents] -= np.diff(np.append(starts, up.size)).astype(np.int32)
        frontier = parents[pending[parents] == 0]
    below[~alive] = 0
    return below


def shared_prefixes(table: SlotTable, tenant_names: list[str | None],
                    first_tokens: Callable[[list[BlockHash]], dict[BlockHash, list[int]]],
                    limit: int = SHARED_PREFIXES) -> list[SharedPrefix]:
    """The resident branch points (two or more resident children: where requests that share the chain above
    part) with the most resident blocks below them; `first_tokens` names their roots where it can."""
    n = table.used
    if n == 0:
        return []
    alive = np.frombuffer(table.alive, dtype=np.int8, count=n).astype(bool)
    parent = np.frombuffer(table.parent, dtype=np.int32, count=n)
    linked = alive & (parent >= 0)
    resident_children = np.bincount(parent[linked], minlength=n)[:n]
    branches = np.flatnonzero(alive & (resident_children >= 2))
    if not branches.size:
        return []
    below = descendants(table)
    top = branches[np.argsort(-below[branches], kind="stable")[:limit]]
    heads = [(slot, *_walk_up(table, slot)) for slot in top.tolist()]
    named = first_tokens([h for _, _, _, root in heads if (h := table.hashes[root]) is not None])
    out: list[SharedPrefix] = []
    for slot, depth, tokens, root in heads:
        tenant = table.tenant[slot]
        root_hash = table.hashes[root]
        out.append(SharedPrefix(
            block_hash=short_hash(table.hashes[slot]), depth=depth, tokens=tokens, descendants=int(below[slot]),
            tenant=(tenant_names[tenant] if tenant < len(tenant_names) else None) or NO_TENANT,
            first_tokens=named.get(root_hash, []) if root_hash is not None else []))
    return out


@dataclass(frozen=True)
class PrefixView:
    """The branch points and the resident chains, computed together: the index refreshes them on one clock."""

    shared: list[SharedPrefix] = field(default_factory=list)
    chains: list[ResidentChain] = field(default_factory=list)
    chains_total: int = 0


def prefix_view(table: SlotTable, tenant_names: list[str | None],
                first_tokens: Callable[[list[BlockHash]], dict[BlockHash, list[int]]]) -> PrefixView:
    chains, total = resident_chains(table, tenant_names, RESIDENT_CHAINS)
    return PrefixView(shared_prefixes(table, tenant_names, first_tokens), chains, total)


def resident_chains(table: SlotTable, tenant_names: list[str | None],
                    limit: int = RESIDENT_CHAINS) -> tuple[list[ResidentChain], int]:
    """The runs of resident blocks linked parent to child (linear or branching), most blocks first, and how many
    there are. A run starts at a resident block whose parent is not resident: past a removed block vLLM's prefix
    lookup stops, so what hangs below it is a run of its own. Each block finds its run's first block by pointer
    jumping (every pass doubles how far up a block's pointer reaches): log2 of the deepest chain passes, not
    its depth."""
    n = table.used
    alive = np.frombuffer(table.alive, dtype=np.int8, count=n).astype(bool)
    if not alive.any():
        return [], 0
    parent = np.frombuffer(table.parent, dtype=np.int32, count=n).astype(np.int64)
    tokens = np.frombuffer(table.tokens, dtype=np.int32, count=n).astype(np.int64)
    linked = alive & (parent >= 0)
    linked[linked] = alive[parent[linked]]  # its parent resident too
    up = np.where(linked, parent, np.arange(n))
    # Edges from each block up to `up`, and the tokens of the blocks above it up to and including `up`.
    edges = linked.astype(np.int64)
    above = np.where(linked, tokens[up], 0)
    for _ in range(max(1, n.bit_length())):  # a cycle (a broken or hostile stream) must not hang stats()
        further = up[up]
        if np.array_equal(further, up):
            break
        edges += edges[up]
        above += above[up]
        up = further
    heads = np.flatnonzero(alive & ~linked)
    member = alive & ~linked[up]  # reached its run's head (a block on a cycle never does)
    root = up[member]
    blocks = np.bincount(root, minlength=n)
    children = np.bincount(parent[linked], minlength=n)[:n]
    leaf = member & (children == 0)
    leaves = np.bincount(up[leaf], minlength=n)
    branches = np.bincount(up[member & (children >= 2)], minlength=n)
    hits = np.frombuffer(table.hits, dtype=np.int32, count=n).astype(np.int64)
    hit_tokens = np.bincount(root, weights=(hits * tokens)[member], minlength=n)
    # A run's longest path ends at one of its leaves: the deepest leaf of each head, the most tokens among equals.
    depth, path_tokens = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    ends = np.flatnonzero(leaf)
    if ends.size:
        order = ends[np.lexsort((above[ends] + tokens[ends], edges[ends], up[ends]))]
        last = order[np.append(up[order][1:] != up[order][:-1], True)]
        depth[up[last]] = edges[last] + 1
        path_tokens[up[last]] = above[last] + tokens[last]
    top = heads[np.argsort(-blocks[heads], kind="stable")[:limit]]
    out = []
    for head in top.tolist():
        tenant = table.tenant[head]
        out.append(ResidentChain(
            block_hash=short_hash(table.hashes[head]), blocks=int(blocks[head]), depth=int(depth[head]),
            tokens=int(path_tokens[head]), leaves=int(leaves[head]), branches=int(branches[head]),
            hits=int(hits[head]), hit_tokens=int(hit_tokens[head]),
            tenant=(tenant_names[tenant] if tenant < len(tenant_names) else None) or NO_TENANT,
            detached=bool(parent[head] >= 0)))
    return out, int(heads.size)


def _walk_up(table: SlotTable, slot: int) -> tuple[int, int, int]:
    """Blocks and tokens from the chain's first known block to `slot`, and that block's slot."""
    depth, tokens, root = 0, 0, slot
    steps = table.used  # a cycle (a broken or hostile stream) must not hang stats()
    while slot >= 0 and steps > 0:
        depth += 1
        tokens += table.tokens[slot]
        root = slot
        slot = table.parent[slot]
        steps -= 1
    return depth, tokens, root


def short_hash(block_hash: BlockHash | None) -> str:
    """A block hash as the view names it: hex, 16 characters."""
    if block_hash is None:
        return ""
    if isinstance(block_hash, int):
        return f"{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"
    return block_hash.hex()[:16]
