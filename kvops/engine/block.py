"""A KV block and the states it moves through (see docs/engine.md, "Block states")."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvops.engine.hashing import BlockHash
from kvops.schema.snapshot import BLOCK_STATE_CODES


class BlockState(enum.Enum):
    FREE = "free"
    FILLING = "filling"  # being written by exactly one running sequence
    FULL = "full"  # every slot written, referenced by at least one sequence
    CACHED = "cached"  # full, unreferenced, kept for prefix reuse, evictable
    PENDING_FREE = "pending_free"  # released by an abort, reclaimed in a batch
    SWAPPED = "swapped"  # a host-pool block holding a swapped-out sequence's K/V (device blocks never are)

    # One character per state, used by the compact block map (the schema defines them, for every reader).
    # A plain attribute of each member, set below: the map reads one per block at every snapshot, and an
    # enum's `.value` (a descriptor) or its hash (a Python method) would take 3-4 ms at 16k blocks.
    code: str


for _state in BlockState:
    _state.code = BLOCK_STATE_CODES[_state.value]


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


def state_map(blocks: Iterable[Block]) -> str:
    """One state code per block, in the order given (block id order for a pool)."""
    return "".join([block.state.code for block in blocks])


@dataclass
class SeqBlocks:
    """The block table of one live sequence, plus the hashes of its full blocks. For a swapped-out
    sequence the table holds host block ids."""

    seq_id: str
    tenant: str
    salt: str | None
    block_ids: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    num_full: int = 0  # leading blocks already marked FULL
