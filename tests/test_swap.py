"""Host swap: the block manager's host pool and swap-mode preemption in the scheduler.

No model: a fake KV pool writes each token id into its slot, performs the copies the scheduler
asks for (all swap-outs, then all swap-ins, before the "forward pass"), and checks that every
sequence reads back exactly its own tokens. Invariants are checked after every operation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Tokens

import pytest

from kvops.engine.block import BlockState
from kvops.engine.block_manager import BlockManager
from kvops.engine.invariants import check_invariants, fingerprint
from kvops.engine.sampling import SamplingParams
from kvops.engine.scheduler import Scheduler, SchedulerOutput
from kvops.engine.sequence import Sequence, SequenceStatus

FREE, FILLING, FULL, CACHED, SWAPPED = (
    BlockState.FREE,
    BlockState.FILLING,
    BlockState.FULL,
    BlockState.CACHED,
    BlockState.SWAPPED,
)


# ---------------------------------------------------------------------- helpers


def start(bm: BlockManager, seq_id: str, tokens: Tokens[int], *, tenant: str = "default",
          salt: str | None = None) -> list[int]:
    """Admit a sequence the way the scheduler does (lookup, allocate, prefill); returns its table."""
    hits, hashes = bm.lookup(tokens, salt)
    assert bm.allocate(seq_id, len(tokens), tenant=tenant, salt=salt, hit_block_ids=hits, hashes=hashes)
    bm.mark_computed(seq_id, tokens, len(tokens))
    check_invariants(bm)
    return list(bm.block_table(seq_id))


def states(bm: BlockManager, block_ids: Tokens[int]) -> list[BlockState]:
    return [bm.blocks[b].state for b in block_ids]


class FakeKV:
    """Device and host pools whose slots hold the token id written there."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.device: list[list[int | None]] = [[None] * bm.block_size for _ in range(bm.num_blocks)]
        self.host: list[list[int | None]] = [[None] * bm.block_size for _ in range(bm.num_host_blocks)]

    def copy(self, out: SchedulerOutput) -> None:
        for device_block, host_block in out.blocks_to_swap_out:
            self.host[host_block] = list(self.device[device_block])
        for host_block, device_block in out.blocks_to_swap_in:
            self.device[device_block] = list(self.host[host_block])

    def forward(self, seq: Sequence, num_new: int) -> None:
        """Check the K/V the sequence attends to, then write its new tokens."""
        bs = self.bm.block_size
        table = self.bm.block_table(seq.seq_id)
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        assert len(table) * bs >= end, f"{seq.seq_id}: table too short for {end} tokens"
        seen = [self.device[table[pos // bs]][pos % bs] for pos in range(start)]
        assert seen == seq.token_ids[:start], f"{seq.seq_id} reads the wrong K/V"
        for pos in range(start, end):
            self.device[table[pos // bs]][pos % bs] = seq.token_ids[pos]


def new_seq(seq_id: str, prompt: list[int], max_tokens: int, tenant: str = "default",
            arrival: float | None = None) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingParams(max_tokens=max_tokens), tenant, tenant)
    if arrival is not None:
        seq.arrival_time = arrival
    return seq


def step(sched: Scheduler, kv: FakeKV) -> SchedulerOutput:
    """One engine step: schedule, copy, forward, mark computed, sample a token, finish."""
    out = sched.schedule()
    check_invariants(sched.bm)
    kv.copy(out)
    for item in out.scheduled:
        kv.forward(item.seq, item.num_new_tokens)
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens
        sched.bm.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
    for item in out.scheduled:
        seq = item.seq
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(1000 + len(seq.token_ids))  # position-dependent, so reads are checked
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.remove(seq, aborted=False)
    check_invariants(sched.bm)
    return out


def assert_no_leak(bm: BlockManager) -> None:
    check_invariants(bm)
    assert not bm.seqs and not bm.swapped
    assert set(bm.state_map()) <= {".", "c"}, bm.state_map()
    assert bm.host_state_map() == "." * bm.num_host_blocks
    assert bm.num_swapped_blocks == 0


# ------------------------------------------------------------ block manager


def test_host_pool_starts_free_and_empty_by_default():
    bm = BlockManager(4, 2)
    assert bm.num_host_blocks == 0 and bm.host_state_map() == ""
    bm = BlockManager(4, 2, num_host_blocks=3)
    assert bm.host_state_map() == "..."
    assert bm.num_swapped_blocks == 0
    check_invariants(bm)
    with pytest.raises(ValueError):
        BlockManager(4, 2, num_host_blocks=-1)


def test_swap_out_then_in_restores_the_table_through_copies():
    bm = BlockManager(8, 4, num_host_blocks=6)
    tokens = list(range(10))  # two full blocks and a partial one
    table = start(bm, "a", tokens)
    allocations = bm.allocations_total
    assert bm.can_swap_out("a")
    copies = bm.swap_out("a")
    check_invariants(bm)
    assert copies == [(table[0], 0), (table[1], 1), (table[2], 2)]
    assert "a" not in bm.seqs and bm.swapped["a"].block_ids == [0, 1, 2]
    assert bm.swapped["a"].num_full == 2
    assert bm.host_state_map() == "sss..."
    assert bm.num_swapped_blocks == 3
    assert states(bm, table) == [CACHED, CACHED, FREE]  # released exactly as by free
    assert [b.hash for b in bm.host_pool.blocks[:2]] == [bm.blocks[table[0]].hash, bm.blocks[table[1]].hash]
    assert bm.host_pool.blocks[2].hash is None
    assert bm.swap_out_blocks_total == 3

    bm.evict()  # nothing left on the device: every block comes back by a copy
    back = bm.swap_in("a", 11)
    check_invariants(bm)
    assert back is not None
    new_table = bm.block_table("a")
    assert back == [(0, new_table[0]), (1, new_table[1]), (2, new_table[2])]
    assert states(bm, new_table) == [FULL, FULL, FILLING]
    assert bm.seqs["a"].num_full == 2
    assert bm.lookup([*tokens, 99], None)[0] == new_table[:2]  # its full blocks are cached again
    assert bm.host_state_map() == "......"
    assert (bm.swap_in_blocks_total, bm.swap_in_reused_total) == (3, 0)
    assert bm.allocations_total == allocations + 3
    bm.mark_computed("a", [*tokens, 10, 11], 12)  # the sequence carries on as before
    assert states(bm, new_table) == [FULL, FULL, FULL]
    bm.free("a")
    check_invariants(bm)


def test_swap_in_grows_the_table_to_the_tokens_it_will_compute():
    bm = BlockManager(8, 2, num_host_blocks=4)
    start(bm, "a", [1, 2, 3])
    bm.swap_out("a")
    bm.evict()
    copies = bm.swap_in("a", 6)
    check_invariants(bm)
    table = bm.block_table("a")
    assert len(table) == 3
    assert [device for _, device in copies] == table[:2]  # the new third block has nothing to copy
    assert states(bm, table) == [FULL, FILLING, FILLING]


def test_swap_in_takes_blocks_still_in_the_prefix_cache_without_a_copy():
    bm = BlockManager(8, 2, num_host_blocks=8)
    table = start(bm, "a", [1, 2, 3, 4, 5])
    start(bm, "b", [1, 2, 7])  # shares the first block
    bm.swap_out("a")
    check_invariants(bm)
    assert states(bm, table) == [FULL, CACHED, FREE]
    copies = bm.swap_in("a", 5)
    check_invariants(bm)
    new_table = bm.block_table("a")
    assert new_table[:2] == table[:2]
    assert copies == [(2, new_table[2])]  # only the partial block travels
    assert [bm.blocks[b].ref_count for b in new_table[:2]] == [2, 1]
    assert states(bm, new_table) == [FULL, FULL, FILLING]
    assert (bm.swap_in_blocks_total, bm.swap_in_reused_total) == (1, 2)


def test_swap_out_needs_a_host_block_for_every_block():
    bm = BlockManager(8, 2, num_host_blocks=2)
    start(bm, "a", [1, 2, 3, 4, 5])
    before = fingerprint(bm)
    assert not bm.can_swap_out("a")
    with pytest.raises(ValueError, match="host"):
        bm.swap_out("a")
    assert fingerprint(bm) == before


def test_swap_in_is_all_or_nothing():
    bm = BlockManager(4, 2, num_host_blocks=8)
    start(bm, "a", [1, 2, 3, 4, 5])
    bm.swap_out("a")
    bm.evict()
    start(bm, "b", [9, 9, 9, 9, 9])  # three of four blocks
    before = fingerprint(bm)
    assert bm.swap_in("a", 5) is None
    assert fingerprint(bm) == before
    check_invariants(bm)
    bm.free("b")
    assert bm.swap_in("a", 5) is not None  # b's cached blocks are evicted for it
    check_invariants(bm)


def test_swap_in_honours_the_tenant_quota():
    bm = BlockManager(8, 2, num_host_blocks=8)
    bm.set_quota("t", 3)
    start(bm, "t1", [1, 2, 3, 4, 5], tenant="t", salt="t")
    bm.swap_out("t1")
    bm.evict()
    assert bm.owned["t"] == 0
    assert bm.allocate("t2", 4, tenant="t", salt="t")  # two FILLING blocks, owned by t
    before = fingerprint(bm)
    assert bm.swap_in("t1", 5) is None  # five free blocks, but only one left under the quota
    assert fingerprint(bm) == before
    assert bm.quota_limited("t")
    bm.abort("t2")
    bm.reclaim_pending()
    assert bm.swap_in("t1", 5) is not None
    assert bm.owned["t"] == 3
    check_invariants(bm)


def test_an_isolated_tenant_reusing_another_tenants_cached_block_is_refused_not_broken():
    # Tenants sharing a cache salt share blocks. The other tenant's cached hit leaves the evictor,
    # so it cannot also be the block evicted for the new one: refuse cleanly, change nothing.
    bm = BlockManager(3, 1, num_host_blocks=4)
    start(bm, "u1", [1, 2], tenant="u", salt="shared")
    bm.free("u1")
    assert bm.allocate("w", 1, tenant="w")
    bm.set_quota("t", 5)
    hits, hashes = bm.lookup([1, 2, 3], "shared")
    assert len(hits) == 2
    before = fingerprint(bm)
    assert not bm.allocate("t1", 3, tenant="t", salt="shared", hit_block_ids=hits, hashes=hashes)
    assert fingerprint(bm) == before
    check_invariants(bm)


def test_drop_swapped_frees_the_host_blocks():
    bm = BlockManager(8, 2, num_host_blocks=4)
    start(bm, "a", [1, 2, 3])
    bm.swap_out("a")
    bm.drop_swapped("a")
    check_invariants(bm)
    assert not bm.swapped
    assert bm.host_state_map() == "...."
    assert all(b.hash is None and b.owner is None for b in bm.host_pool.blocks)


def test_a_swapped_sequence_cannot_be_forked_or_reallocated():
    bm = BlockManager(8, 2, num_host_blocks=4)
    start(bm, "a", [1, 2, 3])
    bm.swap_out("a")
    before = fingerprint(bm)
    with pytest.raises(ValueError, match="swapped out"):
        bm.fork("a", "child")
    with pytest.raises(ValueError):
        bm.allocate("a", 2)
    start(bm, "b", [4, 5])
    with pytest.raises(ValueError):
        bm.fork("b", "a")
    assert bm.host_state_map() == before["host_state_map"]
    assert bm.swapped["a"].block_ids == [0, 1]
    check_invariants(bm)


def test_host_blocks_keep_the_hash_of_a_full_block_that_did_not_hold_the_key():
    # Two sequences computed the same first block concurrently: only the first block holds the key.
    bm = BlockManager(8, 2, num_host_blocks=4)
    assert bm.allocate("a", 3)
    assert bm.allocate("b", 3)
    bm.mark_computed("a", [1, 2, 3], 3)
    bm.mark_computed("b", [1, 2, 3], 3)
    key_holder = bm.block_table("a")[0]
    assert bm.blocks[bm.block_table("b")[0]].hash is None
    bm.swap_out("b")
    assert bm.host_pool.blocks[0].hash == bm.blocks[key_holder].hash
    copies = bm.swap_in("b", 3)
    check_invariants(bm)
    assert bm.block_table("b")[0] == key_holder  # found by its content
    assert len(copies) == 1


# ---------------------------------------------------------------- scheduler


def test_unknown_preemption_mode_is_refused():
    with pytest.raises(ValueError, match="preemption mode"):
        Scheduler(BlockManager(4, 2), 4, 64, preemption_mode="discard")


def run_all(sched: Scheduler, kv: FakeKV, seqs: list[Sequence], max_steps: int = 500) -> list[SchedulerOutput]:
    for seq in seqs:
        sched.add(seq)
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched, kv))
        assert len(outs) < max_steps, "no progress"
    for seq in seqs:
        assert seq.finished
        assert seq.output_token_ids == [1000 + len(seq.prompt_token_ids) + i for i in range(seq.params.max_tokens)]
    assert_no_leak(sched.bm)
    return outs


def crowded_requests() -> list[Sequence]:
    """Three requests that together need far more than a six-block pool."""
    return [new_seq(f"s{i}", [10 * i + j for j in range(3)], max_tokens=6, arrival=float(i)) for i in range(3)]


def test_swap_mode_swaps_victims_out_and_back_in_without_recomputing():
    bm = BlockManager(6, 2, num_host_blocks=12)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap")
    seqs = crowded_requests()
    outs = run_all(sched, FakeKV(bm), seqs)
    assert sched.swap_preemptions_total > 0
    assert sched.preemptions_total == sched.swap_preemptions_total
    assert sched.swap_fallbacks_total == 0
    assert bm.swap_out_blocks_total == sum(len(o.blocks_to_swap_out) for o in outs) > 0
    assert bm.swap_in_blocks_total == sum(len(o.blocks_to_swap_in) for o in outs)
    # Nothing is computed twice: every step's tokens add up to the prompts and the sampled tokens.
    assert sum(o.num_tokens for o in outs) == sum(len(s.token_ids) - 1 for s in seqs)
    for out in outs:
        assert not (out.blocks_to_swap_out and out.blocks_to_swap_in)  # a preempting step resumes nobody
        assert {s.seq_id for s in out.swapped_out} <= {s.seq_id for s in out.preempted}
        assert {s.seq_id for s in out.swapped_in} <= {i.seq.seq_id for i in out.scheduled}


def test_swapped_sequences_are_marked_and_keep_their_progress():
    bm = BlockManager(6, 2, num_host_blocks=12)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap")
    kv = FakeKV(bm)
    for seq in crowded_requests():
        sched.add(seq)
    while not sched.swapped:
        progress = {s.seq_id: s.num_computed_tokens for s in sched.running}
        out = step(sched, kv)
    for seq in out.swapped_out:
        assert seq.status is SequenceStatus.SWAPPED
        assert seq.num_computed_tokens == progress[seq.seq_id]
        assert seq.seq_id in bm.swapped and seq.num_preemptions == 1


def trace(mode: str, num_host_blocks: int) -> tuple[list, Scheduler]:
    bm = BlockManager(6, 2, num_host_blocks=num_host_blocks)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode=mode)
    outs = run_all(sched, FakeKV(bm), crowded_requests())
    return [[(i.seq.seq_id, i.num_new_tokens) for i in o.scheduled] for o in outs], sched


def test_swap_mode_falls_back_to_recompute_when_the_host_pool_is_full():
    recompute, plain = trace("recompute", 0)
    fallback, sched = trace("swap", 1)  # no request fits in one host block
    assert fallback == recompute  # exactly recompute mode's schedule
    assert sched.preemptions_total == sched.swap_fallbacks_total == plain.preemptions_total > 0
    assert sched.swap_preemptions_total == 0
    assert sched.bm.swap_out_blocks_total == 0


def test_recompute_mode_never_swaps_even_with_a_host_pool():
    recompute, _ = trace("recompute", 0)
    same, sched = trace("recompute", 12)
    assert same == recompute
    assert sched.swap_preemptions_total == sched.swap_fallbacks_total == 0
    assert sched.bm.swap_out_blocks_total == 0 and not sched.swapped


def swap_out_b() -> tuple[Scheduler, FakeKV, Sequence, Sequence]:
    """a and b fill a four-block pool; a's growth swaps b out."""
    bm = BlockManager(4, 2, num_host_blocks=8)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap")
    kv = FakeKV(bm)
    a = new_seq("a", [1, 2, 3, 4], max_tokens=3, arrival=0.0)
    b = new_seq("b", [5, 6, 7], max_tokens=3, arrival=1.0)
    sched.add(a)
    sched.add(b)
    step(sched, kv)
    out = step(sched, kv)
    assert out.swapped_out == [b] and list(sched.swapped) == [b]
    assert [i.seq for i in out.scheduled] == [a]
    return sched, kv, a, b


def test_a_swapped_sequence_resumes_before_waiting_ones():
    sched, kv, _, b = swap_out_b()
    c = new_seq("c", [8], max_tokens=1, arrival=2.0)
    sched.add(c)
    order: list[str] = []
    while sched.has_unfinished():
        out = step(sched, kv)
        if b in sched.swapped:
            assert c not in [i.seq for i in out.scheduled]
        order.extend(i.seq.seq_id for i in out.scheduled if i.seq.seq_id not in order)
    assert order.index("b") < order.index("c")
    assert_no_leak(sched.bm)


def test_no_waiting_sequence_is_admitted_while_a_swapped_one_does_not_fit():
    sched, kv, a, b = swap_out_b()
    c = new_seq("c", [8], max_tokens=1, arrival=2.0)
    sched.add(c)
    out = step(sched, kv)  # b does not fit yet; c would (by evicting b's cached block) but must wait
    assert [i.seq for i in out.scheduled] == [a]
    assert list(sched.swapped) == [b] and list(sched.waiting) == [c]
    assert sched.bm.num_allocatable() >= 1


def _two_sequences_of_a_tenant_with_quota() -> tuple[BlockManager, Scheduler, FakeKV, Sequence, Sequence]:
    """Tenant t (quota 3 blocks of 2 tokens) runs t1 and t2 after one step."""
    bm = BlockManager(8, 2, num_host_blocks=8)
    bm.set_quota("t", 3)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap")
    kv = FakeKV(bm)
    t1 = new_seq("t1", [1, 2, 3, 4], max_tokens=3, tenant="t", arrival=0.0)
    t2 = new_seq("t2", [5, 6], max_tokens=3, tenant="t", arrival=1.0)
    sched.add(t1)
    sched.add(t2)
    step(sched, kv)
    return bm, sched, kv, t1, t2


def test_a_step_that_preempts_resumes_nobody():
    bm, sched, kv, _t1, t2 = _two_sequences_of_a_tenant_with_quota()
    # Another tenant's sequence is already in the host pool, and the device has room for it.
    x = new_seq("x", [7, 8, 9], max_tokens=2, tenant="u", arrival=2.0)
    x.status = SequenceStatus.SWAPPED
    sched.swapped.append(x)
    assert bm.allocate("x", 3, tenant="u", salt="u")
    kv.forward(x, 3)
    x.num_computed_tokens = 3
    bm.mark_computed("x", x.token_ids, 3)
    x.token_ids.append(1003)
    kv.copy(SchedulerOutput(blocks_to_swap_out=bm.swap_out("x")))
    check_invariants(bm)
    out = step(sched, kv)  # t1 outgrows t's quota: t2 is swapped out
    assert out.swapped_out == [t2]
    assert not out.swapped_in and x in sched.swapped
    assert bm.num_allocatable("u") >= 2  # x would have fitted
    out = step(sched, kv)
    assert out.swapped_in == [x]
    while sched.has_unfinished():
        step(sched, kv)
    assert_no_leak(bm)


def test_resumed_sequences_respect_max_num_seqs():
    sched, kv, a, b = swap_out_b()
    sched.max_num_seqs = 1
    while not a.finished:
        out = step(sched, kv)
        assert not out.swapped_in
    sched.max_num_seqs = 4
    out = step(sched, kv)
    assert out.swapped_in == [b]
    assert b.status is SequenceStatus.RUNNING


def test_aborting_a_swapped_sequence_frees_its_host_blocks():
    sched, kv, _, b = swap_out_b()
    assert sched.bm.num_swapped_blocks == 2
    sched.remove(b, aborted=True)
    check_invariants(sched.bm)
    assert b.finished and not sched.swapped and not sched.bm.swapped
    assert sched.bm.host_state_map() == "." * 8
    while sched.has_unfinished():
        step(sched, kv)
    assert_no_leak(sched.bm)


def test_has_unfinished_counts_swapped_sequences():
    sched, _, a, _ = swap_out_b()
    sched.remove(a, aborted=True)
    assert not sched.running and not sched.waiting
    assert sched.has_unfinished()


def test_the_oldest_swapped_sequence_resumes_first():
    # One step swaps out its youngest victim first; the oldest must still come back first.
    bm = BlockManager(4, 2, num_host_blocks=12)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap")
    kv = FakeKV(bm)
    a, b, c, d = (new_seq(name, [10 * i, 10 * i + 1], max_tokens=2 if name in "ab" else 3, arrival=float(i))
                  for i, name in enumerate("abcd"))
    for seq in (a, b, c, d):
        sched.add(seq)
    step(sched, kv)
    out = step(sched, kv)  # a and b each need a second block: d, then c, make room
    assert out.swapped_out == [d, c]
    assert list(sched.swapped) == [c, d]
    out = step(sched, kv)
    assert out.swapped_in == [c, d]
    while sched.has_unfinished():
        step(sched, kv)
    assert_no_leak(bm)


def test_a_swapped_sequence_held_back_by_its_quota_lets_other_tenants_go():
    bm, sched, kv, _t1, t2 = _two_sequences_of_a_tenant_with_quota()
    out = step(sched, kv)  # t1 grows past t's quota: t's most recent sequence, t2, is swapped out
    assert out.swapped_out == [t2]
    u = new_seq("u", [7], max_tokens=1, tenant="u", arrival=2.0)
    sched.add(u)
    out = step(sched, kv)
    assert list(sched.swapped) == [t2]  # still over t's quota
    assert u in [i.seq for i in out.scheduled]  # another tenant is not held up by it
    while sched.has_unfinished():
        step(sched, kv)
    assert t2.finished
    assert_no_leak(bm)


def test_a_step_may_swap_out_with_nothing_scheduled():
    # t owns blocks that u's sequence still uses (they share a salt), so at t's quota the first
    # running sequence, t's, preempts itself: the step has a swap-out and nothing to run.
    bm = BlockManager(8, 2, num_host_blocks=8)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap")
    kv = FakeKV(bm)
    shared = [1, 2, 3, 4]
    t0 = Sequence("t0", shared, SamplingParams(max_tokens=1), "t", "s")
    sched.add(t0)
    step(sched, kv)
    bm.set_quota("t", 3)
    t1 = Sequence("t1", [9], SamplingParams(max_tokens=4), "t", "s")
    u1 = Sequence("u1", [*shared, 5], SamplingParams(max_tokens=4), "u", "s")
    sched.add(t1)
    step(sched, kv)
    sched.add(u1)
    step(sched, kv)
    assert u1.num_cached_tokens == 4 and bm.owned["t"] == 3
    out = step(sched, kv)
    assert out.swapped_out == [t1] and out.blocks_to_swap_out
    assert not out.scheduled
    while sched.has_unfinished():
        step(sched, kv)
    assert all(s.finished for s in (t0, t1, u1))
    assert_no_leak(bm)


@pytest.mark.parametrize("seed", range(25))
def test_random_workloads_read_back_their_own_kv_and_leak_nothing(seed: int):
    rng = random.Random(seed)
    bm = BlockManager(rng.randint(6, 12), rng.randint(1, 4), num_host_blocks=rng.choice([0, 3, 8, 40]),
                      eviction_policy=rng.choice(["lru", "lfu"]))
    sched = Scheduler(bm, max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.choice([4, 8, 64]),
                      preemption_mode="swap")
    if rng.random() < 0.3:
        bm.set_quota("t1", bm.num_blocks - 1)
    kv = FakeKV(bm)
    prefixes = [[rng.randint(0, 3) for _ in range(rng.randint(0, 6))] for _ in range(3)]
    seqs = []
    for i in range(rng.randint(4, 10)):
        tokens = [*rng.choice(prefixes), *[rng.randint(0, 3) for _ in range(rng.randint(1, 5))]]
        seqs.append(new_seq(f"r{i}", tokens, max_tokens=rng.randint(1, 8), tenant=f"t{i % 2}", arrival=float(i)))
    pending = list(seqs)
    aborted = set()
    steps = 0
    while pending or sched.has_unfinished():
        while pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if rng.random() < 0.05:
            victims = list(sched.swapped) + sched.running + list(sched.waiting)
            if victims:
                victim = rng.choice(victims)
                sched.remove(victim, aborted=True)
                aborted.add(victim.seq_id)
                check_invariants(bm)
        step(sched, kv)
        steps += 1
        assert steps < 2000, "no progress"
    for seq in seqs:
        assert seq.finished
        if seq.seq_id not in aborted:
            assert len(seq.output_token_ids) == seq.params.max_tokens
    bm.reclaim_pending()
    assert_no_leak(bm)
    assert sched.preemptions_total == sched.swap_preemptions_total + sched.swap_fallbacks_total
