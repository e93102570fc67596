"""The host swap pool: where preempted sequences keep their K/V until they are swapped back in.

Bookkeeping only; the K/V data lives in the KV pool's host tensors (`kv_pool.py`). A host block is
FREE (in the free queue) or SWAPPED (in exactly one swapped-out sequence's table) and changes state
only in `_set_state`, so the counts per state and the free queue cannot disagree with the blocks.
The block manager decides what goes to the host and back; this class hands out and takes back
the host blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from kvops.engine.block import Block, BlockState, SeqBlocks, state_map
from kvops.engine.free_queue import FreeBlockQueue
from kvops.engine.hashing import BlockHash


class HostPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"the host pool cannot have a negative size (got {num_blocks} blocks)")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(range(num_blocks))
        self.state_counts: Counter[BlockState] = Counter({BlockState.FREE: num_blocks})
        self.tables: dict[str, SeqBlocks] = {}  # host block tables of swapped-out sequences

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_swapped(self) -> int:
        """Host blocks holding a swapped-out sequence's K/V."""
        return self.state_counts[BlockState.SWAPPED]

    def state_map(self) -> str:
        return state_map(self.blocks)

    def store(self, seq: SeqBlocks, contents: Sequence[tuple[BlockHash | None, str | None]]) -> SeqBlocks:
        """Give the device sequence `seq` a host table: one SWAPPED block per entry of `contents`, the
        (prefix-cache key, owner) of the device block at that index, so a swap-in can find the content in
        the device prefix cache again. Returns the table; the caller copies the data."""
        if len(contents) > self.num_free:
            raise ValueError(f"sequence {seq.seq_id!r} needs {len(contents)} host blocks, the host pool has "
                             f"{self.num_free} free")
        table = SeqBlocks(seq.seq_id, seq.tenant, seq.salt, hashes=list(seq.hashes), num_full=seq.num_full)
        for depth, (block_hash, owner) in enumerate(contents):
            block = self.blocks[self.free_queue.pop()]
            self._set_state(block, BlockState.SWAPPED)
            block.ref_count = 1
            block.hash = block_hash
            block.owner = owner
            block.depth = depth
            table.block_ids.append(block.block_id)
        self.tables[seq.seq_id] = table
        return table

    def release(self, block_ids: Iterable[int]) -> None:
        """The blocks' content is back on the device or no longer wanted: they go FREE."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count = 0
            block.hash = None
            block.owner = None
            self._set_state(block, BlockState.FREE)
            self.free_queue.push(block_id)

    def found_in(self, seq_id: str, cached: Mapping[BlockHash, int]) -> dict[int, int]:
        """Index in a swapped-out sequence's table -> the device block in `cached` (the prefix-cache map)
        that already holds the same content: swapping in takes those without a copy."""
        found = {}
        for index, host_id in enumerate(self.tables[seq_id].block_ids):
            block_hash = self.blocks[host_id].hash
            if block_hash is not None and block_hash in cached:
                found[index] = cached[block_hash]
        return found

    def drop(self, seq_id: str) -> None:
        """A swapped-out sequence is aborted: its table goes and its blocks go FREE."""
        self.release(self.tables.pop(seq_id).block_ids)

    def _set_state(self, block: Block, state: BlockState) -> None:
        """The one place a host block changes state."""
        old = block.state
        if old is state:
            return
        self.state_counts[old] -= 1
        self.state_counts[state] += 1
        block.state = state
