"""Unit tests of the block manager: behaviour a user of the engine would notice.

See docs/engine.md, "Block states", "Prefix caching" and "Eviction".
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvops.engine.block import BlockState
from kvops.engine.block_manager import BlockManager
from kvops.engine.eviction import LFU
from kvops.engine.hashing import block_hashes
from kvops.engine.invariants import check_invariants, fingerprint
from kvops.engine.snapshot_builder import blocks_held, owner_map

FREE, FILLING, FULL, CACHED, PENDING = (
    BlockState.FREE,
    BlockState.FILLING,
    BlockState.FULL,
    BlockState.CACHED,
    BlockState.PENDING_FREE,
)


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def set(self, now: float) -> None:
        self.now = now


def make(num_blocks: int, block_size: int, **kwargs) -> tuple[BlockManager, FakeClock]:
    clock = FakeClock()
    return BlockManager(num_blocks, block_size, clock=clock, **kwargs), clock


def start(
    bm: BlockManager, seq_id: str, tokens: Sequence[int], *, tenant: str = "default", salt: str | None = None,
    compute: bool = True,
) -> list[int]:
    """Admit a sequence the way the scheduler does (lookup, allocate, prefill); returns its prefix hits."""
    hits, hashes = bm.lookup(tokens, salt)
    assert bm.allocate(seq_id, len(tokens), tenant=tenant, salt=salt, hit_block_ids=hits, hashes=hashes)
    if compute:
        bm.mark_computed(seq_id, tokens, len(tokens))
    check_invariants(bm)
    return hits


def run(bm: BlockManager, seq_id: str, tokens: Sequence[int], **kwargs) -> list[int]:
    """A whole request: admit, prefill, finish. Returns its prefix hits."""
    hits = start(bm, seq_id, tokens, **kwargs)
    bm.free(seq_id)
    check_invariants(bm)
    return hits


def states(bm: BlockManager, block_ids: Sequence[int]) -> list[BlockState]:
    return [bm.blocks[b].state for b in block_ids]


# ----------------------------------------------------------------- construction


def test_rejects_empty_pool_and_unknown_policy():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    with pytest.raises(ValueError):
        BlockManager(4, 4, eviction_policy="fifo")
    bm, _ = make(4, 4)
    with pytest.raises(ValueError):
        bm.set_eviction_policy("mru")
    assert bm.eviction_policy == "lru"


def test_fresh_pool_is_all_free():
    bm, _ = make(5, 4)
    assert bm.state_map() == "....."
    assert bm.num_allocatable() == 5
    check_invariants(bm)


def test_duplicate_sequence_id_is_refused():
    bm, _ = make(4, 2)
    start(bm, "a", [1, 2, 3])
    before = fingerprint(bm)
    with pytest.raises(ValueError):
        bm.allocate("a", 2)
    with pytest.raises(ValueError):
        bm.fork("a", "a")
    assert fingerprint(bm) == before


# --------------------------------------------------------------- prefix caching


def test_prefix_hits_are_whole_blocks_and_never_the_last_token():
    bm, _ = make(8, 4)
    tokens = list(range(10))  # two full blocks and a partial one
    assert run(bm, "a", tokens) == []
    assert bm.state_map().count("c") == 2  # the partial block is not cached
    assert bm.state_map().count(".") == 6
    cached = sorted(bm.cached.values())

    def hit_count(query: Sequence[int]) -> int:
        hits, _ = bm.lookup(query, None)
        assert set(hits) <= set(cached)
        return len(hits)

    assert hit_count(tokens) == 2
    assert hit_count(tokens[:9]) == 2
    assert hit_count(tokens[:8]) == 1  # the second block holds the last token: it must be recomputed
    assert hit_count(tokens[:5]) == 1
    assert hit_count(tokens[:4]) == 0
    assert hit_count(tokens[:3]) == 0
    assert hit_count([]) == 0
    assert hit_count([*tokens[:7], 99, 8, 9]) == 1  # diverges inside block 1
    assert hit_count([99, *tokens[1:]]) == 0  # diverges inside block 0: nothing after it counts either
    assert hit_count([*tokens, 10, 11, 12]) == 2


def test_lookup_returns_hashes_of_every_full_block():
    bm, _ = make(8, 4)
    hits, hashes = bm.lookup(list(range(10)), "s")
    assert hits == []
    assert hashes == block_hashes(list(range(10)), 4, "s")
    assert len(hashes) == 2


def test_lookup_changes_nothing():
    bm, _ = make(4, 2)
    run(bm, "a", [1, 2, 3, 4, 5])
    before = fingerprint(bm)
    assert len(bm.lookup([1, 2, 3, 4, 5], None)[0]) == 2
    assert fingerprint(bm) == before


def test_hit_blocks_are_reused_not_copied():
    bm, _ = make(8, 2)
    run(bm, "a", [1, 2, 3, 4, 5])
    first = sorted(bm.cached.values())
    hits = start(bm, "b", [1, 2, 3, 4, 6, 7], compute=False)
    assert sorted(hits) == first
    assert bm.block_table("b")[:2] == hits
    assert states(bm, hits) == [FULL, FULL]
    assert bm.seqs["b"].num_full == 2


def test_running_sequences_share_their_full_blocks():
    bm, _ = make(8, 2)
    start(bm, "a", [1, 2, 3, 4, 5])
    hits = start(bm, "b", [1, 2, 3, 4, 9])
    assert hits == bm.block_table("a")[:2]
    assert [bm.blocks[b].ref_count for b in hits] == [2, 2]
    bm.free("a")
    assert states(bm, hits) == [FULL, FULL]  # still held by b
    bm.free("b")
    assert states(bm, hits) == [CACHED, CACHED]
    check_invariants(bm)


def test_identical_blocks_computed_concurrently_keep_one_cache_entry():
    bm, _ = make(8, 2)
    start(bm, "a", [1, 2, 3], compute=False)
    start(bm, "b", [1, 2, 3], compute=False)
    bm.mark_computed("a", [1, 2, 3], 3)
    bm.mark_computed("b", [1, 2, 3], 3)
    check_invariants(bm)
    a0, b0 = bm.block_table("a")[0], bm.block_table("b")[0]
    assert list(bm.cached.values()) == [a0]
    bm.free("a")
    bm.free("b")
    check_invariants(bm)
    assert bm.blocks[a0].state is CACHED
    assert bm.blocks[b0].state is FREE
    assert bm.lookup([1, 2, 3], None)[0] == [a0]


def test_chunked_prefill_caches_blocks_as_they_fill():
    bm, _ = make(8, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    start(bm, "a", tokens, compute=False)
    table = bm.block_table("a")
    assert states(bm, table) == [FILLING] * 4
    bm.mark_computed("a", tokens, 3)
    assert states(bm, table) == [FULL, FILLING, FILLING, FILLING]
    assert bm.lookup(tokens, None)[0] == table[:1]
    bm.mark_computed("a", tokens, 7)
    assert states(bm, table) == [FULL, FULL, FULL, FILLING]
    assert bm.lookup([*tokens, 8], None)[0] == table[:3]
    check_invariants(bm)


def test_decode_appends_blocks_and_caches_generated_tokens():
    bm, _ = make(8, 2)
    tokens = [1, 2, 3]
    start(bm, "a", tokens)
    assert len(bm.block_table("a")) == 2
    tokens.append(4)
    assert bm.append_slots("a", len(tokens))
    assert len(bm.block_table("a")) == 2  # the slot was already there
    bm.mark_computed("a", tokens, 4)
    tokens.append(5)
    assert bm.append_slots("a", len(tokens))
    assert len(bm.block_table("a")) == 3
    bm.mark_computed("a", tokens, 5)
    check_invariants(bm)
    bm.free("a")
    assert len(bm.lookup([1, 2, 3, 4, 5], None)[0]) == 2


# ---------------------------------------------------------------------- tenants


def test_tenants_with_different_salts_never_share_blocks():
    bm, _ = make(16, 2)
    tokens = [1, 2, 3, 4, 5]
    run(bm, "a1", tokens, tenant="a", salt="salt-a")
    assert run(bm, "b1", tokens, tenant="b", salt="salt-b") == []
    assert run(bm, "n1", tokens, tenant="n", salt=None) == []
    assert len(bm.cached) == 6  # three independent copies of two blocks
    # Every block's key differs, not only the first: the salt is chained into the rest.
    all_hashes = [block_hashes(tokens, 2, s) for s in ("salt-a", "salt-b", None)]
    assert len({h for hs in all_hashes for h in hs}) == 6
    # Running sequences of different tenants don't share either.
    start(bm, "a2", tokens, tenant="a", salt="salt-a")
    start(bm, "b2", tokens, tenant="b", salt="salt-b")
    assert not set(bm.block_table("a2")) & set(bm.block_table("b2"))
    check_invariants(bm)


def test_tenants_with_the_same_salt_share_blocks():
    bm, _ = make(16, 2)
    tokens = [1, 2, 3, 4, 5]
    run(bm, "a1", tokens, tenant="a", salt="shared")
    cached = sorted(bm.cached.values())
    hits = run(bm, "b1", tokens, tenant="b", salt="shared")
    assert sorted(hits) == cached
    # The same tenant under the same salt hits too.
    assert sorted(run(bm, "a2", tokens, tenant="a", salt="shared")) == cached


def test_cross_tenant_evictions_are_counted():
    bm, _ = make(2, 2)
    run(bm, "a1", [1, 1, 1], tenant="a", salt="sa")  # one cached block of tenant a
    assert bm.state_map().count("c") == 1
    start(bm, "b1", [2, 2, 2, 2], tenant="b", salt="sb")  # needs both blocks: evicts a's
    assert bm.evictions_total == 1
    assert bm.tenants["b"].evictions_caused == 1
    assert bm.tenants["a"].evictions_suffered == 1
    assert bm.tenants["a"].evictions_caused == 0
    assert bm.tenants["b"].evictions_suffered == 0
    bm.free("b1")  # two cached blocks of tenant b
    # b evicting its own blocks is an eviction, but not a cross-tenant one.
    start(bm, "b2", [3, 3], tenant="b", salt="sb")
    assert bm.evictions_total == 2
    assert (bm.tenants["b"].evictions_caused, bm.tenants["b"].evictions_suffered) == (1, 0)
    # A third tenant that never allocated before still gets its counters.
    start(bm, "c1", [4, 4], tenant="c", salt="sc")
    assert bm.evictions_total == 3
    assert bm.tenants["c"].evictions_caused == 1
    assert bm.tenants["b"].evictions_suffered == 1
    assert bm.tenants["a"].evictions_suffered == 1
    check_invariants(bm)


def test_explicit_eviction_is_not_charged_to_a_tenant():
    bm, _ = make(4, 2)
    run(bm, "a1", [1, 1, 1], tenant="a", salt="sa")
    assert bm.evict() == 1
    assert bm.tenants["a"].evictions_suffered == 0
    assert bm.state_map() == "...."


def test_blocks_held_and_owner_map_follow_tenants():
    bm, _ = make(6, 2)
    start(bm, "a1", [1, 2, 3], tenant="a", salt="sa")
    start(bm, "b1", [1, 2, 3, 4, 5], tenant="b", salt="sb")
    assert blocks_held(bm) == {"a": 2, "b": 3}
    owners = owner_map(bm)
    assert sorted(o for o in owners if o) == ["a", "a", "b", "b", "b"]
    assert owners.count(None) == 1


# --------------------------------------------------------------------- eviction


def test_lru_eviction_order_via_allocation():
    bm, clock = make(3, 2)
    blocks = {}
    for t, tok in enumerate((1, 2, 3), start=1):
        clock.set(t)
        run(bm, f"s{tok}", [tok, tok])
        blocks[tok] = bm.lookup([tok, tok, 0], None)[0][0]
    clock.set(10)
    run(bm, "s1-again", [1, 1, 5])  # hits block 1 (refresh), needs one more block: evicts 2
    assert bm.blocks[blocks[1]].state is CACHED
    assert bm.lookup([2, 2, 0], None)[0] == []
    assert bm.lookup([3, 3, 0], None)[0] == [blocks[3]]
    clock.set(11)
    start(bm, "x", [7, 7, 7, 7])  # needs two blocks: one free (the partial of s1-again), then evicts 3
    assert bm.lookup([3, 3, 0], None)[0] == []
    assert bm.lookup([1, 1, 0], None)[0] == [blocks[1]]
    assert bm.evictions_total == 2


def evict_order(bm: BlockManager) -> list[int]:
    order = []
    while True:
        before = {b.block_id for b in bm.evictor.blocks()}
        if not bm.evict(1):
            return order
        (gone,) = before - {b.block_id for b in bm.evictor.blocks()}
        assert bm.blocks[gone].state is FREE
        order.append(gone)
        check_invariants(bm)


def test_lru_evicts_in_recency_order():
    bm, clock = make(4, 2)
    ids = []
    for t, tok in enumerate((1, 2, 3), start=1):
        clock.set(t)
        run(bm, f"s{tok}", [tok, tok])
        ids.append(bm.lookup([tok, tok, 0], None)[0][0])
    clock.set(4)
    run(bm, "again", [1, 1, 0])  # refresh the oldest
    assert evict_order(bm) == [ids[1], ids[2], ids[0]]


def test_lru_tie_evicts_tail_of_longest_chain_first():
    bm, _ = make(8, 1)  # the clock never moves: every cached block ties on recency
    start(bm, "long", [1, 2, 3, 4])
    start(bm, "short", [5, 6])
    long_table, short_table = list(bm.block_table("long")), list(bm.block_table("short"))
    bm.free("short")
    bm.free("long")
    order = evict_order(bm)
    assert order[:2] == [long_table[3], long_table[2]]
    # Prefixes outlive suffixes: every block leaves after its chain successor.
    for table in (long_table, short_table):
        positions = [order.index(b) for b in table]
        assert positions == sorted(positions, reverse=True)
    assert set(order[-2:]) == {long_table[0], short_table[0]}


def test_lru_tie_chain_tail_first_via_allocation():
    bm, _ = make(6, 1)
    run(bm, "long", [1, 2, 3, 4, 5])
    run(bm, "short", [6])  # a chain of one block; the clock never moves, so all six tie on recency
    assert bm.state_map().count("c") == 6
    start(bm, "x", [9, 9])  # evicts two blocks
    # The long prefix lost its tail only: a query for it still hits its first three blocks.
    assert len(bm.lookup([1, 2, 3, 4, 5], None)[0]) == 3


def test_lru_counts_a_block_as_used_until_its_sequence_finishes():
    bm, clock = make(3, 2)
    start(bm, "long", [1, 1])  # admitted at t=0, runs for a while
    long_block = bm.block_table("long")[0]
    clock.set(1)
    run(bm, "short", [2, 2])  # comes and goes at t=1
    short_block = bm.lookup([2, 2, 0], None)[0][0]
    clock.set(5)
    bm.free("long")  # finishes at t=5: its block was in use until then
    assert evict_order(bm) == [short_block, long_block]


@pytest.mark.parametrize(("policy", "survivor"), [("lfu", "popular"), ("lru", "recent")])
def test_lfu_keeps_frequently_hit_block_over_recent_once_used_one(policy, survivor):
    bm, clock = make(3, 2, eviction_policy=policy)
    popular = [1, 1]
    run(bm, "p0", popular)
    for t in range(1, 6):
        clock.set(t)
        assert len(run(bm, f"p{t}", [*popular, 0])) == 1
    clock.set(10)
    run(bm, "r", [2, 2])  # used once, more recently
    clock.set(11)
    start(bm, "new", [3, 3, 3, 3])  # one free block, one eviction
    assert bm.evictions_total == 1
    kept = {"popular": len(bm.lookup([*popular, 0], None)[0]), "recent": len(bm.lookup([2, 2, 0], None)[0])}
    assert kept == {"popular": int(survivor == "popular"), "recent": int(survivor == "recent")}


@pytest.mark.parametrize(("gap", "evicted"), [(600.0, "old"), (10.0, "new")])
def test_lfu_recent_hits_weigh_more_than_old_ones(gap, evicted):
    """Three old hits against two newer ones: the old ones lose once they are several half-lives old."""
    bm, clock = make(3, 2, eviction_policy="lfu")
    half_life = bm.evictor.policy.half_life_s
    assert half_life == 60.0
    old, new = [1, 1], [2, 2]
    run(bm, "o", old)
    for t in (1, 2, 3):
        clock.set(t)
        run(bm, f"o{t}", [*old, 0])
    clock.set(gap)
    run(bm, "n", new)
    for t in (1, 2):
        clock.set(gap + t)
        run(bm, f"n{t}", [*new, 0])
    clock.set(gap + 5)
    start(bm, "x", [3, 3, 3, 3])  # one free block, one eviction
    assert bm.evictions_total == 1
    alive = {"old": bool(bm.lookup([*old, 0], None)[0]), "new": bool(bm.lookup([*new, 0], None)[0])}
    assert alive == {"old": evicted != "old", "new": evicted != "new"}


def test_lfu_frequency_decays_with_half_life():
    policy = LFU(half_life_s=10.0)
    block = BlockManager(1, 1).blocks[0]
    block.freq, block.last_access = 4.0, 0.0
    policy.on_hit(block, 10.0)
    assert block.freq == pytest.approx(4.0 * 0.5 + 1.0)
    # freq * 2**((t - now)/H) ranks like log2(freq) + t/H: half the frequency one half-life later ranks equal.
    a, b = BlockManager(2, 1).blocks
    a.freq, a.last_access = 4.0, 0.0
    b.freq, b.last_access = 2.0, 10.0
    assert policy.key(a)[0] == pytest.approx(policy.key(b)[0])


def test_lfu_hit_after_one_half_life_halves_the_old_frequency():
    bm, clock = make(2, 2, eviction_policy="lfu")
    run(bm, "a", [1, 1])  # cached at t=0 with frequency 1
    block = bm.lookup([1, 1, 0], None)[0][0]
    assert bm.blocks[block].freq == 1.0
    clock.set(60.0)  # one half-life later
    start(bm, "b", [1, 1, 0])
    assert bm.blocks[block].freq == pytest.approx(1.0 * 0.5 + 1.0)


def test_lfu_old_hits_do_not_count_fully_after_a_late_hit():
    """Eight hits ten half-lives ago plus one now must not outweigh four hits a few seconds ago."""
    bm, clock = make(3, 2, eviction_policy="lfu")
    old, new = [1, 1], [2, 2]
    run(bm, "o", old)
    for t in range(1, 9):
        clock.set(t)
        run(bm, f"o{t}", [*old, 0])
    clock.set(590)
    run(bm, "n", new)
    for t in range(591, 595):
        clock.set(t)
        run(bm, f"n{t}", [*new, 0])
    clock.set(600)
    run(bm, "o-late", [*old, 0])  # one late hit on the old block
    clock.set(601)
    start(bm, "x", [3, 3, 3, 3])  # one free block, one eviction
    assert bm.evictions_total == 1
    assert bm.lookup([*new, 0], None)[0], "the block with four recent hits was evicted"
    assert not bm.lookup([*old, 0], None)[0]


def test_switching_eviction_policy_live_reorders_cached_blocks():
    bm, clock = make(3, 2)  # starts LRU
    run(bm, "p0", [1, 1])
    for t in range(1, 6):
        clock.set(t)
        run(bm, f"p{t}", [1, 1, 0])
    clock.set(10)
    run(bm, "r", [2, 2])
    cached_before = sorted(b.block_id for b in bm.evictor.blocks())
    bm.set_eviction_policy("lfu")
    assert bm.eviction_policy == "lfu"
    assert sorted(b.block_id for b in bm.evictor.blocks()) == cached_before
    check_invariants(bm)
    clock.set(11)
    start(bm, "x", [3, 3, 3, 3])
    assert bm.lookup([1, 1, 0], None)[0]  # LFU keeps the popular block
    assert not bm.lookup([2, 2, 0], None)[0]
    bm.set_eviction_policy("lru")
    assert bm.eviction_policy == "lru"
    check_invariants(bm)


def test_evict_counts_and_limits():
    bm, _ = make(8, 1)
    run(bm, "a", [1, 2, 3, 4, 5])
    assert bm.state_map().count("c") == 5
    assert bm.evict(0) == 0
    assert bm.evict(2) == 2
    assert bm.state_map().count("c") == 3
    assert bm.evict() == 3
    assert bm.evict() == 0
    assert bm.state_map() == "." * 8
    assert bm.cached == {}
    check_invariants(bm)


def test_evictor_heap_stays_bounded_under_repeated_hits():
    bm, clock = make(3, 1)
    run(bm, "seed", [1, 2])  # blocks for [1] and [1, 2] cached
    for i in range(300):
        clock.set(i)
        assert len(run(bm, f"s{i}", [1, 2, 3])) == 2
        assert sum(len(h) for h in bm.evictor._heaps.values()) <= 70  # stale entries are compacted away
    check_invariants(bm)


# --------------------------------------------------------------- abort / reclaim


def test_aborted_sequence_blocks_go_pending_free_then_free_on_reclaim():
    bm, _ = make(4, 2)
    start(bm, "a", [1, 2, 3, 4, 5])
    table = list(bm.block_table("a"))
    bm.abort("a")
    check_invariants(bm)
    assert states(bm, table) == [PENDING] * 3
    assert bm.state_map().count("p") == 3
    assert bm.lookup([1, 2, 3, 4, 5], None)[0] == []  # an aborted prefix is not reused
    assert bm.cached == {}
    assert bm.num_allocatable() == 4
    assert bm.reclaim_pending() == 3
    assert bm.reclaim_pending() == 0
    assert bm.state_map() == "...."
    assert set(bm.free_queue) == {0, 1, 2, 3}
    check_invariants(bm)


def test_abort_keeps_blocks_still_shared_with_others():
    bm, _ = make(8, 2)
    start(bm, "a", [1, 2, 3, 4, 5])
    hits = start(bm, "b", [1, 2, 3, 4, 6])
    assert len(hits) == 2
    own = bm.block_table("a")[2]
    bm.abort("a")
    check_invariants(bm)
    assert states(bm, hits) == [FULL, FULL]
    assert bm.blocks[own].state is PENDING
    assert bm.lookup([1, 2, 3, 4, 7], None)[0] == hits  # still cached via b


def test_abort_of_forked_child_leaves_parent_alone():
    bm, _ = make(8, 2)
    start(bm, "p", [1, 2, 3, 4, 5])
    bm.fork("p", "c")
    parent_table = list(bm.block_table("p"))
    child_own = bm.block_table("c")[2]
    bm.abort("c")
    check_invariants(bm)
    assert states(bm, parent_table) == [FULL, FULL, FILLING]
    assert bm.blocks[child_own].state is PENDING


def test_pending_blocks_are_reclaimed_automatically_before_evicting_cache():
    bm, _ = make(4, 2)
    run(bm, "keep", [9, 9])  # one cached block
    keep = bm.lookup([9, 9, 0], None)[0]
    start(bm, "a", [1, 2, 3, 4, 5])
    bm.abort("a")
    assert bm.state_map().count("p") == 3
    assert len(bm.free_queue) == 0
    start(bm, "b", [5, 6, 7, 8, 9])  # needs 3 blocks: the pending ones, not the cached one
    assert bm.state_map().count("p") == 0
    assert bm.evictions_total == 0
    assert bm.lookup([9, 9, 0], None)[0] == keep
    start(bm, "c", [7, 7])  # now the cache has to give
    assert bm.evictions_total == 1
    assert bm.lookup([9, 9, 0], None)[0] == []
    check_invariants(bm)


def test_free_queue_is_used_before_pending_blocks():
    bm, _ = make(4, 1)
    start(bm, "a", [1, 2])
    bm.abort("a")
    start(bm, "b", [3, 4])  # two free blocks left: pending ones stay pending
    assert bm.state_map().count("p") == 2
    start(bm, "c", [5])  # no free block left: the batch is reclaimed
    assert bm.state_map().count("p") == 0
    assert bm.state_map().count(".") == 1
    check_invariants(bm)


# ------------------------------------------------------------------------- fork


def test_fork_shares_full_blocks_and_copies_the_filling_one():
    bm, _ = make(6, 4)
    tokens = list(range(10))
    start(bm, "p", tokens)
    parent = list(bm.block_table("p"))
    copies = bm.fork("p", "c")
    check_invariants(bm)
    child = bm.block_table("c")
    assert child[:2] == parent[:2]
    assert child[2] not in parent
    assert copies == [(parent[2], child[2])]
    assert [bm.blocks[b].ref_count for b in parent] == [2, 2, 1]
    assert bm.blocks[child[2]].state is FILLING
    assert bm.seqs["c"].num_full == 2
    assert bm.seqs["c"].tenant == bm.seqs["p"].tenant
    # The two continue independently.
    p_tokens, c_tokens = [*tokens, 100, 101], [*tokens, 200, 201]
    bm.mark_computed("p", p_tokens, 12)
    bm.mark_computed("c", c_tokens, 12)
    check_invariants(bm)
    bm.free("p")
    assert states(bm, parent) == [FULL, FULL, CACHED]
    bm.free("c")
    check_invariants(bm)
    assert bm.lookup([*p_tokens, 0], None)[0] == parent
    assert bm.lookup([*c_tokens, 0], None)[0] == [*parent[:2], child[2]]


def test_fork_copies_every_block_not_yet_full():
    bm, _ = make(8, 2)
    start(bm, "p", [1, 2, 3, 4, 5, 6], compute=False)
    bm.mark_computed("p", [1, 2, 3, 4, 5, 6], 3)  # one full, two filling
    copies = bm.fork("p", "c")
    parent, child = bm.block_table("p"), bm.block_table("c")
    assert copies == list(zip(parent[1:], child[1:], strict=True))
    assert child[0] == parent[0]
    check_invariants(bm)


def test_fork_of_a_sequence_with_only_full_blocks_copies_nothing():
    bm, _ = make(4, 2)
    start(bm, "p", [1, 2, 3, 4])
    free_before = len(bm.free_queue)
    assert bm.fork("p", "c") == []
    assert len(bm.free_queue) == free_before
    assert bm.block_table("c") == bm.block_table("p")
    check_invariants(bm)


def test_fork_without_room_changes_nothing():
    bm, _ = make(3, 4)
    start(bm, "p", list(range(10)))
    before = fingerprint(bm)
    assert bm.fork("p", "c") is None
    assert fingerprint(bm) == before
    assert "c" not in bm.seqs


def test_fork_can_evict_cache_for_its_copy():
    bm, _ = make(4, 2)
    run(bm, "old", [7, 7])
    start(bm, "p", [1, 2, 3, 4, 5])
    assert bm.fork("p", "c") is not None
    assert bm.evictions_total == 1
    check_invariants(bm)


# ----------------------------------------------------------- prefix caching knob


def test_disabling_prefix_caching_drops_cached_blocks():
    bm, _ = make(8, 2)
    run(bm, "done", [1, 2, 3, 4, 5])
    start(bm, "running", [6, 7, 8, 9, 10])
    running_full = bm.block_table("running")[:2]
    assert bm.state_map().count("c") == 2
    bm.set_prefix_caching(False)
    check_invariants(bm)
    assert bm.state_map().count("c") == 0
    assert bm.cached == {}
    assert bm.lookup([1, 2, 3, 4, 5], None) == ([], [])
    assert all(bm.blocks[b].hash is None for b in running_full)
    bm.free("running")
    check_invariants(bm)
    assert bm.state_map() == "." * 8
    # While off, nothing computed enters the cache.
    run(bm, "off", [1, 2, 3, 4, 5])
    assert bm.cached == {}
    assert bm.state_map() == "." * 8
    # Back on: new computations are cached again.
    bm.set_prefix_caching(True)
    run(bm, "on", [1, 2, 3, 4, 5])
    assert len(bm.lookup([1, 2, 3, 4, 5], None)[0]) == 2


def test_reenabling_prefix_caching_mid_sequence_hashes_later_blocks_correctly():
    bm, _ = make(8, 2)
    bm.set_prefix_caching(False)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    start(bm, "a", tokens, compute=False)
    bm.mark_computed("a", tokens, 2)  # block 0 full, not cached
    bm.set_prefix_caching(True)
    bm.mark_computed("a", tokens, 7)  # blocks 1 and 2 fill: cached under their chained keys
    check_invariants(bm)
    expected = block_hashes(tokens, 2, None)
    table = bm.block_table("a")
    assert bm.blocks[table[0]].hash is None
    assert [bm.blocks[b].hash for b in table[1:3]] == expected[1:3]
    bm.free("a")
    # Block 0 was never cached, so the chain can't be entered: no hits.
    assert bm.lookup(tokens, None)[0] == []
    check_invariants(bm)


# ------------------------------------------------------------------ all or nothing


def test_allocation_is_all_or_nothing():
    bm, _ = make(4, 2)
    before = fingerprint(bm)
    assert not bm.allocate("big", 9)  # five blocks
    assert fingerprint(bm) == before
    assert "big" not in bm.seqs
    assert bm.allocate("fits", 8)
    check_invariants(bm)


def test_allocation_counts_hit_blocks_as_taken_from_the_cache():
    bm, _ = make(4, 2)
    base = [1, 2, 3, 4, 5, 6]
    run(bm, "a", base)  # three cached blocks, one free
    assert bm.state_map().count("c") == 3
    tokens = [*base, 7, 8, 9, 10]  # five blocks: three hits + two new, but only one block is really free
    hits, hashes = bm.lookup(tokens, None)
    assert len(hits) == 3
    before = fingerprint(bm)
    assert not bm.allocate("b", len(tokens), hit_block_ids=hits, hashes=hashes)
    assert fingerprint(bm) == before
    tokens = [*base, 7, 8]  # four blocks: three hits + one new
    hits, hashes = bm.lookup(tokens, None)
    assert bm.allocate("b", len(tokens), hit_block_ids=hits, hashes=hashes)
    assert bm.evictions_total == 0
    check_invariants(bm)


def test_append_slots_is_all_or_nothing():
    bm, _ = make(4, 2)
    start(bm, "a", [1, 2, 3])
    start(bm, "b", [4])
    before = fingerprint(bm)
    assert not bm.append_slots("a", 7)  # needs two more blocks, one is free
    assert fingerprint(bm) == before
    assert bm.append_slots("a", 4)  # covered already
    assert fingerprint(bm) == before
    assert bm.append_slots("a", 5)
    assert len(bm.block_table("a")) == 3
    assert bm.state_map().count(".") == 0
    check_invariants(bm)


def test_everything_released_means_no_leak():
    bm, clock = make(6, 2)
    start(bm, "a", [1, 2, 3, 4, 5])
    start(bm, "b", [1, 2, 3, 4, 6, 7])
    bm.fork("b", "c")
    bm.abort("a")
    bm.free("b")
    clock.set(5)
    bm.free("c")
    bm.reclaim_pending()
    bm.evict()
    check_invariants(bm)
    assert bm.state_map() == "......"
    assert len(bm.free_queue) == 6
    assert all(b.ref_count == 0 and b.hash is None for b in bm.blocks)
