"""A KV block and the states it moves through (see DESIGN.md, "Block states")."""

from __future__ import annotations

import enum


class BlockState(enum.Enum):
    FREE = "free"
    FILLING = "filling"  # being written by exactly one running sequence
    FULL = "full"  # every slot written, referenced by at least one sequence
    CACHED = "cached"  # full, unreferenced, kept for prefix reuse, evictable
    PENDING_FREE = "pending_free"  # released by an abort, reclaimed in a batch
    SWAPPED = "swapped"  # a host-pool block holding a swapped-out sequence's K/V (device blocks never are)

    @property
    def code(self) -> str:
        """One character per state, used by the compact block map."""
        return _CODES[self]


_CODES = {
    BlockState.FREE: ".",
    BlockState.FILLING: "f",
    BlockState.FULL: "F",
    BlockState.CACHED: "c",
    BlockState.PENDING_FREE: "p",
    BlockState.SWAPPED: "s",
}


class Block:
    """Bookkeeping for one block of the device pool or the host (swap) pool; the K/V data lives in
    the pool tensors."""

    __slots__ = ("block_id", "depth", "evict_version", "freq", "hash", "last_access", "owner", "ref_count", "state")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.state = BlockState.FREE
        self.ref_count = 0
        self.hash: bytes | None = None
        self.depth = 0  # index of this block in its sequence's block table (its place in the hash chain)
        self.owner: str | None = None  # tenant whose sequence allocated it
        self.last_access = 0.0
        self.freq = 0.0
        self.evict_version = 0  # bumped whenever the block leaves CACHED, so stale evictor entries are skipped

    def __repr__(self) -> str:
        return f"Block({self.block_id}, {self.state.name}, ref={self.ref_count})"
