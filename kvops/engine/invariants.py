"""The block manager's invariants, checked on demand (tests, `/admin/check`, debug builds)."""

from __future__ import annotations

from collections import Counter

from kvops.engine.block import BlockState
from kvops.engine.block_manager import BlockManager


class InvariantError(AssertionError):
    pass


def check_invariants(bm: BlockManager) -> None:
    """Raise InvariantError naming the first broken invariant."""
    problems: list[str] = []
    refs: Counter[int] = Counter()
    for seq in bm.seqs.values():
        if len(set(seq.block_ids)) != len(seq.block_ids):
            problems.append(f"sequence {seq.seq_id} holds a block twice: {seq.block_ids}")
        refs.update(seq.block_ids)
        for index, block_id in enumerate(seq.block_ids):
            state = bm.blocks[block_id].state
            expected = (BlockState.FULL,) if index < seq.num_full else (BlockState.FILLING, BlockState.FULL)
            if state not in expected:
                problems.append(f"block {block_id} of {seq.seq_id} at index {index} is {state.name}")

    free = list(bm.free_queue)
    free_set = set(free)
    cached_live = {b.block_id for b in bm.evictor.blocks()}
    pending = set(bm.pending_free)
    if len(free) != len(free_set):
        problems.append("a block is in the free queue twice")
    if len(bm.pending_free) != len(pending):
        problems.append("a block is pending reclaim twice")
    if len(cached_live) != len(bm.evictor):
        problems.append(f"evictor counts {len(bm.evictor)} blocks but holds {len(cached_live)}")

    actual_counts: Counter[BlockState] = Counter()
    for block in bm.blocks:
        bid, state = block.block_id, block.state
        actual_counts[state] += 1
        if block.ref_count != refs[bid]:
            problems.append(f"block {bid} has ref_count {block.ref_count} but {refs[bid]} sequences hold it")
        if (bid in free_set) != (state is BlockState.FREE):
            problems.append(f"block {bid} is {state.name} and {'' if bid in free_set else 'not '}in the free queue")
        if (bid in cached_live) != (state is BlockState.CACHED):
            problems.append(f"block {bid} is {state.name} and {'' if bid in cached_live else 'not '}evictable")
        if (bid in pending) != (state is BlockState.PENDING_FREE):
            problems.append(f"block {bid} is {state.name} and {'' if bid in pending else 'not '}pending reclaim")
        if state in (BlockState.FREE, BlockState.CACHED, BlockState.PENDING_FREE) and block.ref_count:
            problems.append(f"block {bid} is {state.name} with ref_count {block.ref_count}")
        if state in (BlockState.FILLING, BlockState.FULL) and block.ref_count < 1:
            problems.append(f"block {bid} is {state.name} with no reference")
        if state is BlockState.FILLING and block.ref_count != 1:
            problems.append(f"FILLING block {bid} is shared by {block.ref_count} sequences")
        if state is BlockState.CACHED and (block.hash is None or bm.cached.get(block.hash) != bid):
            problems.append(f"CACHED block {bid} is not in the prefix-cache map")
        if state in (BlockState.FREE, BlockState.PENDING_FREE, BlockState.FILLING) and block.hash is not None:
            problems.append(f"{state.name} block {bid} still has a hash")
    for block_hash, bid in bm.cached.items():
        block = bm.blocks[bid]
        if block.hash != block_hash or block.state not in (BlockState.FULL, BlockState.CACHED):
            problems.append(f"prefix-cache map entry points to block {bid} in state {block.state.name}")
    owners = Counter(block.owner for block in bm.blocks if block.owner is not None)
    if {t: c for t, c in bm.owned.items() if c} != dict(owners):
        problems.append(f"owned counts {dict(bm.owned)} disagree with block owners {dict(owners)}")
    counted = {s: c for s, c in bm.state_counts.items() if c}
    if counted != {s: c for s, c in actual_counts.items() if c}:
        problems.append(f"state counts {dict(bm.state_counts)} disagree with the blocks {dict(actual_counts)}")
    if sum(actual_counts.values()) != bm.num_blocks:
        problems.append("free + in use + cached + pending does not add up to the pool")
    if actual_counts[BlockState.SWAPPED]:
        problems.append(f"{actual_counts[BlockState.SWAPPED]} device blocks are SWAPPED")
    _check_host_pool(bm, problems)
    if problems:
        raise InvariantError("; ".join(problems[:10]))


def _check_host_pool(bm: BlockManager, problems: list[str]) -> None:
    """The host pool: each block FREE and queued, or SWAPPED and held by exactly one swapped table."""
    if set(bm.swapped) & set(bm.seqs):
        problems.append(f"sequences {sorted(set(bm.swapped) & set(bm.seqs))} are both swapped and on the device")
    pool = bm.host_pool
    holders: Counter[int] = Counter()
    for seq in bm.swapped.values():
        holders.update(seq.block_ids)
        if seq.num_full > len(seq.block_ids):
            problems.append(f"swapped sequence {seq.seq_id} has {seq.num_full} full blocks in a table of "
                            f"{len(seq.block_ids)}")
    free = list(pool.free_queue)
    free_set = set(free)
    if len(free) != len(free_set):
        problems.append("a host block is in the host free queue twice")
    if len(pool.blocks) != pool.num_blocks:
        problems.append(f"the host pool has {len(pool.blocks)} blocks, not {pool.num_blocks}")
    actual_counts: Counter[BlockState] = Counter()
    for block in pool.blocks:
        bid, state = block.block_id, block.state
        actual_counts[state] += 1
        if state not in (BlockState.FREE, BlockState.SWAPPED):
            problems.append(f"host block {bid} is {state.name}")
        if (bid in free_set) != (state is BlockState.FREE):
            where = "in" if bid in free_set else "not in"
            problems.append(f"host block {bid} is {state.name} and {where} the host free queue")
        if (holders[bid] == 1) != (state is BlockState.SWAPPED):
            problems.append(f"host block {bid} is {state.name} and held by {holders[bid]} swapped sequences")
        expected_refs = 1 if state is BlockState.SWAPPED else 0
        if block.ref_count != expected_refs:
            problems.append(f"host block {bid} is {state.name} with ref_count {block.ref_count}")
        if state is BlockState.FREE and (block.hash is not None or block.owner is not None):
            problems.append(f"FREE host block {bid} still has a hash or an owner")
    counted = {s: c for s, c in pool.state_counts.items() if c}
    if counted != {s: c for s, c in actual_counts.items() if c}:
        problems.append(f"host state counts {dict(pool.state_counts)} disagree with the host blocks "
                        f"{dict(actual_counts)}")
    if sum(actual_counts.values()) != pool.num_blocks:
        problems.append("free + swapped host blocks do not add up to the host pool")


def fingerprint(bm: BlockManager, host: bool = True) -> dict[str, object]:
    """Everything observable in the block manager (the device side only when not `host`): two equal
    fingerprints around an operation show that it changed nothing, as a refused operation must."""
    device = {
        "state_map": bm.state_map(),
        "state_counts": {s: c for s, c in bm.state_counts.items() if c},
        "free_queue": list(bm.free_queue),
        "pending_free": list(bm.pending_free),
        "cached": dict(bm.cached),
        "seqs": {k: (list(v.block_ids), v.num_full, list(v.hashes)) for k, v in bm.seqs.items()},
        "blocks": [(b.ref_count, b.hash, b.owner, b.depth, b.last_access, b.freq) for b in bm.blocks],
        "evictable": (sorted(b.block_id for b in bm.evictor.blocks()), len(bm.evictor)),
        "tenants": {t: (s.evictions_caused, s.evictions_suffered) for t, s in bm.tenants.items()},
        "owned": dict(bm.owned),
        "totals": (bm.evictions_total, bm.allocations_total, bm.swap_out_blocks_total, bm.swap_in_blocks_total,
                   bm.swap_in_reused_total),
    }
    if not host:
        return device
    pool = bm.host_pool
    return {
        **device,
        "host_state_map": pool.state_map(),
        "host_free_queue": list(pool.free_queue),
        "swapped": {k: (list(v.block_ids), v.num_full, list(v.hashes)) for k, v in pool.tables.items()},
        "host_blocks": [(b.ref_count, b.hash, b.owner, b.depth) for b in pool.blocks],
    }
