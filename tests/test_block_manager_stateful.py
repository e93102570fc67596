"""Stateful property test of the block manager.

Random sequences of admit (with or without prefix-cache lookup), chunked prefill, decode, fork,
abort, finish, swap-out / swap-in / drop of swapped sequences, explicit eviction, reclaim and live
knob changes run against a small pool and host pool, next to a model that knows which token
prefix every full block holds. After every step the engine's own invariants hold and the model
agrees with the prefix-cache map; allocation (swap-in included) is all or nothing and takes free
blocks, then pending ones, then the cheapest cached ones; a swap-in takes a block still in the
prefix cache instead of copying it; draining everything leaks nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvops.engine.block import BlockState
from kvops.engine.block_manager import DEFAULT_TENANT, BlockManager
from kvops.engine.hashing import block_hashes
from kvops.engine.invariants import check_invariants, fingerprint

VOCAB = 3  # a tiny vocabulary so that prefixes repeat
MAX_LEN = 20
TENANTS = {"a": "salt-a", "b": "salt-b", "c": None}
TIME_STEPS = [0.0, 0.0, 0.5, 1.0, 7.0, 45.0, 300.0]  # ties, small steps, and several LFU half-lives

FREE, FILLING, FULL, CACHED, PENDING, SWAPPED = (
    BlockState.FREE,
    BlockState.FILLING,
    BlockState.FULL,
    BlockState.CACHED,
    BlockState.PENDING_FREE,
    BlockState.SWAPPED,
)

Content = tuple[str | None, tuple[int, ...]]  # (salt, every token up to the end of the block)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ModelSeq:
    tenant: str
    salt: str | None
    tokens: list[int]  # prompt + generated so far
    num_computed: int  # tokens whose K/V is written
    covered: int  # tokens the block table has slots for


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.clock = FakeClock()
        self.seqs: dict[str, ModelSeq] = {}
        self.swapped: dict[str, ModelSeq] = {}  # swapped-out sequences: their K/V is in the host pool
        self.content: dict[int, Content] = {}  # what each full (FULL or CACHED) block holds
        self.model_cached: dict[Content, int] = {}  # the prefix-cache map, as the model sees it
        self.history: list[tuple[str, list[int]]] = []
        self.next_id = 0

    # ------------------------------------------------------------------ helpers

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _count(self, *wanted: BlockState) -> int:
        return sum(1 for b in self.bm.blocks if b.state in wanted)

    def _purge(self) -> None:
        """Forget what blocks that left FULL/CACHED held (evicted, reclaimed, aborted, reused)."""
        for bid in [b for b in self.content if self.bm.blocks[b].state not in (FULL, CACHED)]:
            del self.content[bid]
        for key in [k for k, b in self.model_cached.items() if self.bm.blocks[b].state not in (FULL, CACHED)]:
            del self.model_cached[key]

    def _content(self, salt: str | None, tokens: list[int], index: int) -> Content:
        bs = self.bm.block_size
        return (salt, tuple(tokens[: (index + 1) * bs]))

    def _model_lookup(self, tokens: list[int], salt: str | None) -> list[int]:
        if not self.bm.enable_prefix_caching:
            return []
        self._purge()
        hits = []
        for index in range((len(tokens) - 1) // self.bm.block_size):
            bid = self.model_cached.get(self._content(salt, tokens, index))
            if bid is None:
                break
            hits.append(bid)
        return hits

    def _checked_lookup(self, tokens: list[int], salt: str | None) -> tuple[list[int], list[bytes]]:
        bm = self.bm
        before = fingerprint(self.bm)
        hits, hashes = bm.lookup(tokens, salt)
        assert fingerprint(self.bm) == before, "lookup changed the block manager"
        if not bm.enable_prefix_caching:
            assert (hits, hashes) == ([], [])
            return hits, hashes
        assert hashes == block_hashes(tokens, bm.block_size, salt)
        assert len(hits) * bm.block_size <= len(tokens) - 1, "a prefix hit covers the last token"
        assert hits == self._model_lookup(tokens, salt)
        for index, bid in enumerate(hits):
            assert bm.blocks[bid].state in (FULL, CACHED)
            assert self.content[bid] == self._content(salt, tokens, index), "hit block holds another prefix"
        return hits, hashes

    def _eviction_context(self) -> dict:
        bm = self.bm
        return {
            "cached": {b.block_id: (bm.evictor.policy.key(b), b.owner) for b in bm.evictor.blocks()},
            "free_or_pending": self._count(FREE, PENDING),
            "total": bm.evictions_total,
            "allocations": bm.allocations_total,
            "tenants": {t: (s.evictions_caused, s.evictions_suffered) for t, s in bm.tenants.items()},
        }

    def _check_evictions(
        self, ctx: dict, tenant: str, hits: list[int], needed: int, new_blocks: list[int]
    ) -> None:
        """Free blocks first, then the pending batch, then the cheapest cached ones; cross-tenant counted."""
        bm = self.bm
        candidates = {b: v for b, v in ctx["cached"].items() if b not in hits}
        evicted = [b for b in candidates if bm.blocks[b].state is not CACHED]
        expected = max(0, needed - ctx["free_or_pending"])
        assert len(evicted) == expected, f"evicted {len(evicted)} cached blocks, expected {expected}"
        if evicted:
            event("evicted on allocation")
        cheapest = sorted(candidates, key=lambda b: candidates[b][0])[:expected]
        assert set(evicted) == set(cheapest), "eviction did not follow the policy's order"
        assert set(evicted) <= set(new_blocks)
        assert bm.evictions_total - ctx["total"] == expected
        assert bm.allocations_total - ctx["allocations"] == len(new_blocks)
        caused: dict[str, int] = {}
        suffered: dict[str, int] = {}
        for b in evicted:
            victim = candidates[b][1] or DEFAULT_TENANT
            if victim != tenant:
                event("cross-tenant eviction")
                caused[tenant] = caused.get(tenant, 0) + 1
                suffered[victim] = suffered.get(victim, 0) + 1
        for t, stats in bm.tenants.items():
            c0, s0 = ctx["tenants"].get(t, (0, 0))
            assert stats.evictions_caused - c0 == caused.get(t, 0)
            assert stats.evictions_suffered - s0 == suffered.get(t, 0)

    def _pick(self, data: st.DataObject, ids) -> str:
        return data.draw(st.sampled_from(sorted(ids)), label="seq")

    # -------------------------------------------------------------------- setup

    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.integers(1, 4),
        prefix_caching=st.sampled_from([True, True, True, False]),
        policy=st.sampled_from(["lru", "lfu"]),
        num_host_blocks=st.sampled_from([0, 2, 6, 12, 40]),
    )
    def setup(self, num_blocks: int, block_size: int, prefix_caching: bool, policy: str, num_host_blocks: int) -> None:
        self.bm = BlockManager(
            num_blocks, block_size, enable_prefix_caching=prefix_caching, eviction_policy=policy,
            clock=self.clock, num_host_blocks=num_host_blocks,
        )

    # -------------------------------------------------------------------- rules

    def _admit(self, data: st.DataObject) -> str | None:
        """Admit a new sequence; returns its id, or None when the allocation was (rightly) refused."""
        bm = self.bm
        self.clock.now += data.draw(st.sampled_from(TIME_STEPS), label="time passes")
        tenant = data.draw(st.sampled_from(sorted(TENANTS)), label="tenant")
        prefix: list[int] = []
        if self.history and data.draw(st.integers(0, 3), label="reuse a prefix") > 0:
            base_tenant, base = data.draw(st.sampled_from(self.history[-8:]), label="base")
            if data.draw(st.integers(0, 3), label="same tenant") > 0:
                tenant = base_tenant
            whole = data.draw(st.booleans(), label="whole base")
            prefix = base if whole else base[: data.draw(st.integers(0, len(base)), label="cut")]
        salt = TENANTS[tenant]
        suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=8), label="suffix")
        tokens = ([*prefix, *suffix] or [0])[:MAX_LEN]

        if data.draw(st.integers(0, 3), label="use prefix cache") > 0:
            hits, hashes = self._checked_lookup(tokens, salt)
            if hits:
                event("prefix hit")
            if data.draw(st.integers(0, 3), label="use fewer hits") == 0:
                hits = hits[: data.draw(st.integers(0, len(hits)), label="hits used")]
        else:
            hits, hashes = [], []

        # The scheduler may admit only a first prefill chunk: cover at least one uncached token.
        covered = len(tokens)
        if data.draw(st.integers(0, 3), label="chunked") == 0:
            covered = data.draw(st.integers(len(hits) * bm.block_size + 1, len(tokens)), label="covered")
        needed = ceil_div(covered, bm.block_size) - len(hits)
        available = self._count(FREE, PENDING) + sum(
            1 for b in bm.blocks if b.state is CACHED and b.block_id not in hits
        )
        ctx = self._eviction_context()
        before = fingerprint(self.bm)
        seq_id = self._new_id()
        ok = bm.allocate(seq_id, covered, tenant=tenant, salt=salt, hit_block_ids=hits, hashes=hashes)
        assert ok == (needed <= available), f"allocate said {ok} with {needed} needed, {available} available"
        if not ok:
            event("allocation refused")
            assert fingerprint(self.bm) == before, "a rejected allocation changed state"
            return None
        table = bm.block_table(seq_id)
        assert len(table) == ceil_div(covered, bm.block_size)
        assert table[: len(hits)] == hits
        assert all(bm.blocks[b].state is FILLING for b in table[len(hits) :])
        assert all(bm.blocks[b].owner == tenant for b in table[len(hits) :])
        self._check_evictions(ctx, tenant, hits, needed, table[len(hits) :])
        self.seqs[seq_id] = ModelSeq(tenant, salt, tokens, len(hits) * bm.block_size, covered)
        self.history.append((tenant, tokens))
        return seq_id

    def _compute(self, seq_id: str, upto: int) -> None:
        """K/V is written for the first `upto` tokens (a prefill chunk or a decode step)."""
        bm = self.bm
        self._purge()  # blocks evicted earlier in this step may be about to fill with new content
        seq = self.seqs[seq_id]
        table = list(bm.block_table(seq_id))
        old_full = bm.seqs[seq_id].num_full
        bm.mark_computed(seq_id, seq.tokens, upto)
        new_full = upto // bm.block_size
        assert bm.seqs[seq_id].num_full == max(old_full, new_full)
        assert bm.block_table(seq_id) == table
        for index in range(old_full, new_full):
            bid = table[index]
            assert bm.blocks[bid].state is FULL
            content = self._content(seq.salt, seq.tokens, index)
            self.content[bid] = content
            if bm.enable_prefix_caching and content not in self.model_cached:
                self.model_cached[content] = bid
        seq.num_computed = max(seq.num_computed, upto)

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Admit a sequence, and maybe run (part of) its first prefill chunk right away."""
        seq_id = self._admit(data)
        if seq_id is not None:
            seq = self.seqs[seq_id]
            upto = data.draw(st.integers(seq.num_computed, seq.covered), label="computed")
            if upto > seq.num_computed:
                self._compute(seq_id, upto)

    @rule(data=st.data())
    def request(self, data: st.DataObject) -> None:
        """A whole prefill in one go, usually followed by the end of the request."""
        seq_id = self._admit(data)
        if seq_id is None:
            return
        seq = self.seqs[seq_id]
        if seq.covered < len(seq.tokens) and not self._extend(seq_id, len(seq.tokens)):
            return
        self._compute(seq_id, len(seq.tokens))
        check_invariants(self.bm)
        ending = data.draw(st.sampled_from(["finish", "finish", "abort", "keep running"]), label="ending")
        if ending != "keep running":
            self._release(seq_id, aborted=ending == "abort")

    @precondition(lambda self: any(s.num_computed < s.covered for s in self.seqs.values()))
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        seq_id = self._pick(data, [k for k, s in self.seqs.items() if s.num_computed < s.covered])
        seq = self.seqs[seq_id]
        self._compute(seq_id, data.draw(st.integers(seq.num_computed + 1, seq.covered), label="computed"))

    def _extend(self, seq_id: str, target: int) -> bool:
        """append_slots up to `target` tokens; checks all-or-nothing and where the blocks came from."""
        bm = self.bm
        seq = self.seqs[seq_id]
        table = list(bm.block_table(seq_id))
        needed = max(0, ceil_div(target, bm.block_size) - len(table))
        available = self._count(FREE, PENDING, CACHED)
        ctx = self._eviction_context()
        before = fingerprint(self.bm)
        ok = bm.append_slots(seq_id, target)
        assert ok == (needed <= available)
        if not ok or needed == 0:
            assert fingerprint(self.bm) == before, "a refused or empty append changed state"
            if not ok:
                event("append refused")
            else:
                seq.covered = max(seq.covered, target)
            return ok
        new_table = bm.block_table(seq_id)
        assert new_table[: len(table)] == table
        assert len(new_table) == ceil_div(target, bm.block_size)
        assert all(bm.blocks[b].state is FILLING for b in new_table[len(table) :])
        self._check_evictions(ctx, seq.tenant, [], needed, new_table[len(table) :])
        seq.covered = max(seq.covered, target)
        return True

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, VOCAB - 1), max_size=4))
    def append(self, data: st.DataObject, new_tokens: list[int]) -> None:
        """The sequence grows (a sampled token, or the next prefill chunk): make room for its slots."""
        seq_id = self._pick(data, self.seqs)
        seq = self.seqs[seq_id]
        tokens = [*seq.tokens, *new_tokens][: max(MAX_LEN, len(seq.tokens))]
        target = data.draw(st.integers(seq.num_computed, len(tokens)), label="cover up to")
        if self._extend(seq_id, target):
            seq.tokens = tokens

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        bm = self.bm
        parent_id = self._pick(data, self.seqs)
        parent = self.seqs[parent_id]
        ptable = list(bm.block_table(parent_id))
        num_full = bm.seqs[parent_id].num_full
        partial = ptable[num_full:]
        available = self._count(FREE, PENDING, CACHED)
        ctx = self._eviction_context()
        before = fingerprint(self.bm)
        child_id = self._new_id()
        copies = bm.fork(parent_id, child_id)
        if len(partial) > available:
            assert copies is None
            assert fingerprint(self.bm) == before, "a rejected fork changed state"
            return
        assert copies is not None
        ctable = bm.block_table(child_id)
        assert bm.block_table(parent_id) == ptable
        assert ctable[:num_full] == ptable[:num_full]
        assert copies == list(zip(partial, ctable[num_full:], strict=True))
        assert not set(ctable[num_full:]) & set(ptable)
        assert bm.seqs[child_id].num_full == num_full
        self._check_evictions(ctx, parent.tenant, [], len(partial), ctable[num_full:])
        self.seqs[child_id] = ModelSeq(
            parent.tenant, parent.salt, list(parent.tokens), parent.num_computed, parent.covered
        )

    def _releasing(self, seq_id: str) -> tuple[list[int], dict[int, int], set[int], set[int]]:
        """What `_check_released` needs to know about a table before it is released."""
        bm = self.bm
        table = list(bm.block_table(seq_id))
        refs = {b: bm.blocks[b].ref_count for b in table}
        hashed = {b for b in table if bm.blocks[b].hash is not None}
        full = {b for b in table if bm.blocks[b].state is FULL}
        return table, refs, hashed, full

    def _check_released(
        self, released: tuple[list[int], dict[int, int], set[int], set[int]], aborted: bool
    ) -> None:
        table, refs, hashed, full = released
        for b in table:
            block = self.bm.blocks[b]
            if refs[b] > 1:
                assert block.ref_count == refs[b] - 1
                assert block.state is (FULL if b in full else FILLING)
            elif aborted:
                assert block.state is PENDING
            elif b in hashed and b in full:
                assert block.state is CACHED
            else:
                assert block.state is FREE

    def _release(self, seq_id: str, aborted: bool) -> None:
        bm = self.bm
        seq = self.seqs.pop(seq_id)
        released = self._releasing(seq_id)
        table, _, hashed, _ = released
        (bm.abort if aborted else bm.free)(seq_id)
        assert seq_id not in bm.seqs
        self._check_released(released, aborted)
        self._purge()
        # What the finished sequence computed can be found again, and only where it really is.
        self._checked_lookup(seq.tokens, seq.salt)
        if not aborted and bm.enable_prefix_caching:
            hits = bm.lookup(seq.tokens, seq.salt)[0]
            own = table[: seq.num_computed // bm.block_size]
            # Its own blocks that held a cache key are still there to hit, unless another copy holds the key.
            for index, b in enumerate(own[: len(hits)]):
                if b in hashed:
                    assert hits[index] == b

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._release(self._pick(data, self.seqs), aborted=False)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self._release(self._pick(data, self.seqs), aborted=True)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        """Preempt by swapping: every block gets a host copy, the device blocks are released as by free."""
        bm = self.bm
        seq_id = self._pick(data, self.seqs)
        seq = self.seqs[seq_id]
        real = bm.seqs[seq_id]
        num_full = real.num_full
        owners = [bm.blocks[b].owner for b in real.block_ids]
        device_hashes = [bm.blocks[b].hash for b in real.block_ids]
        free_host = list(bm.host_pool.free_queue)
        before = fingerprint(self.bm)
        if len(real.block_ids) > len(free_host):
            event("swap-out refused: host pool full")
            assert not bm.can_swap_out(seq_id)
            with pytest.raises(ValueError):
                bm.swap_out(seq_id)
            assert fingerprint(self.bm) == before, "a refused swap-out changed state"
            return
        assert bm.can_swap_out(seq_id)
        released = self._releasing(seq_id)
        table = released[0]
        swapped_before = bm.num_swapped_blocks
        out_before = bm.swap_out_blocks_total
        copies = bm.swap_out(seq_id)
        event("swapped out")
        host_ids = free_host[: len(table)]
        assert copies == list(zip(table, host_ids, strict=True))
        assert seq_id not in bm.seqs
        host = bm.swapped[seq_id]
        assert host.block_ids == host_ids
        assert (host.tenant, host.salt, host.num_full) == (seq.tenant, seq.salt, num_full)
        for index, host_id in enumerate(host_ids):
            block = bm.host_pool.blocks[host_id]
            assert (block.state, block.ref_count, block.depth, block.owner) == (SWAPPED, 1, index, owners[index])
            if device_hashes[index] is not None:
                assert block.hash == device_hashes[index]
            if block.hash is not None:  # the key of exactly the content the block holds
                assert index < num_full
                assert block.hash == block_hashes(seq.tokens[: (index + 1) * bm.block_size], bm.block_size,
                                                  seq.salt)[-1]
        assert bm.num_swapped_blocks == swapped_before + len(table)
        assert bm.swap_out_blocks_total == out_before + len(table)
        self._check_released(released, aborted=False)
        self._purge()
        self.swapped[seq_id] = self.seqs.pop(seq_id)
        refused = fingerprint(self.bm)
        with pytest.raises(ValueError):
            bm.fork(seq_id, self._new_id())
        assert fingerprint(self.bm) == refused, "forking a swapped sequence changed state"

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        """Resume a swapped sequence, maybe with more tokens to compute: all or nothing, cached blocks reused."""
        bm = self.bm
        seq_id = self._pick(data, self.swapped)
        seq = self.swapped[seq_id]
        self.clock.now += data.draw(st.sampled_from(TIME_STEPS), label="time passes")
        target = data.draw(st.integers(seq.num_computed, len(seq.tokens)), label="cover up to")
        host = bm.swapped[seq_id]
        host_ids = list(host.block_ids)
        num_full = host.num_full
        host_hashed = [bm.host_pool.blocks[h].hash is not None for h in host_ids]
        num_blocks = max(len(host_ids), ceil_div(target, bm.block_size))
        self._purge()
        reused: dict[int, int] = {}
        if bm.enable_prefix_caching:
            for index in range(len(host_ids)):
                bid = self.model_cached.get(self._content(seq.salt, seq.tokens, index)) if host_hashed[index] else None
                if bid is not None:
                    assert index < num_full
                    reused[index] = bid
        needed = num_blocks - len(reused)
        available = self._count(FREE, PENDING) + sum(
            1 for b in bm.blocks if b.state is CACHED and b.block_id not in reused.values()
        )
        refs = {b: bm.blocks[b].ref_count for b in reused.values()}
        ctx = self._eviction_context()
        before = fingerprint(self.bm)
        copies = bm.swap_in(seq_id, target)
        if needed > available:
            event("swap-in refused")
            assert copies is None
            assert fingerprint(self.bm) == before, "a refused swap-in changed state"
            return
        assert copies is not None
        event("swapped in")
        if reused:
            event("swap-in reused cached blocks")
        table = bm.block_table(seq_id)
        assert len(table) == num_blocks
        assert all(table[index] == bid for index, bid in reused.items())
        assert all(bm.blocks[b].ref_count == refs[b] + 1 for b in reused.values())
        fresh = [table[index] for index in range(num_blocks) if index not in reused]
        assert copies == [(host_ids[i], table[i]) for i in range(len(host_ids)) if i not in reused]
        assert all(bm.blocks[b].owner == seq.tenant for b in fresh)
        assert [bm.blocks[b].state for b in table] == [FULL] * num_full + [FILLING] * (num_blocks - num_full)
        assert bm.seqs[seq_id].num_full == num_full
        assert all(bm.host_pool.blocks[h].state is FREE for h in host_ids)
        assert seq_id not in bm.swapped
        self._check_evictions(ctx, seq.tenant, list(reused.values()), needed, fresh)
        # New blocks go FULL at once, so what an evicted one held before must be forgotten here.
        for bid in fresh:
            self.content.pop(bid, None)
        self.model_cached = {k: b for k, b in self.model_cached.items() if b not in fresh}
        for index in range(num_full):
            content = self._content(seq.salt, seq.tokens, index)
            self.content[table[index]] = content
            if bm.enable_prefix_caching and host_hashed[index] and content not in self.model_cached:
                self.model_cached[content] = table[index]
        seq.covered = max(seq.covered, target)
        self.seqs[seq_id] = self.swapped.pop(seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def drop_swapped(self, data: st.DataObject) -> None:
        """A swapped sequence is aborted: only its host blocks are affected."""
        bm = self.bm
        seq_id = self._pick(data, self.swapped)
        host_ids = list(bm.swapped[seq_id].block_ids)
        device = fingerprint(self.bm, host=False)
        bm.drop_swapped(seq_id)
        assert fingerprint(self.bm, host=False) == device
        assert all(bm.host_pool.blocks[h].state is FREE for h in host_ids)
        assert seq_id not in bm.swapped
        del self.swapped[seq_id]

    @rule(limit=st.one_of(st.none(), st.integers(0, 6)))
    def evict(self, limit: int | None) -> None:
        bm = self.bm
        order = sorted(bm.evictor.blocks(), key=bm.evictor.policy.key)
        expected = [b.block_id for b in (order if limit is None else order[:limit])]
        total = bm.evictions_total
        assert bm.evict(limit) == len(expected)
        assert all(bm.blocks[b].state is FREE for b in expected)
        assert self._count(CACHED) == len(order) - len(expected)
        assert bm.evictions_total == total  # evictions_total counts evictions forced by allocations only

    @rule()
    def reclaim(self) -> None:
        bm = self.bm
        pending = list(bm.pending_free)
        assert bm.reclaim_pending() == len(pending)
        assert all(bm.blocks[b].state is FREE for b in pending)
        assert not bm.pending_free

    @rule(data=st.data())
    def knobs(self, data: st.DataObject) -> None:
        """Live knob changes: prefix caching on/off, eviction policy."""
        if data.draw(st.booleans(), label="which knob"):
            enabled = data.draw(st.sampled_from([True, True, False]), label="prefix caching")
            self._toggle_prefix_caching(enabled)
        else:
            self._set_policy(data.draw(st.sampled_from(["lru", "lfu"]), label="policy"))

    def _toggle_prefix_caching(self, enabled: bool) -> None:
        bm = self.bm
        was = bm.enable_prefix_caching
        cached = [b.block_id for b in bm.blocks if b.state is CACHED]
        before = fingerprint(self.bm)
        bm.set_prefix_caching(enabled)
        assert bm.enable_prefix_caching == enabled
        if enabled:
            if not was:
                assert not bm.cached
            assert fingerprint(self.bm) == before
        else:
            self.model_cached.clear()
            assert not bm.cached
            assert all(bm.blocks[b].state is FREE for b in cached)
            assert all(b.hash is None for b in bm.blocks)

    def _set_policy(self, policy: str) -> None:
        bm = self.bm
        before = sorted(b.block_id for b in bm.evictor.blocks())
        bm.set_eviction_policy(policy)
        assert bm.eviction_policy == policy
        assert sorted(b.block_id for b in bm.evictor.blocks()) == before

    @rule(data=st.data())
    def drain(self, data: st.DataObject) -> None:
        self._drain(data.draw(st.lists(st.booleans(), min_size=len(self.seqs), max_size=len(self.seqs))))

    def _drain(self, abort_flags: list[bool]) -> None:
        """Everything finishes or aborts, the pending batch is reclaimed, the cache dropped: all FREE."""
        bm = self.bm
        for seq_id in sorted(self.swapped):
            bm.drop_swapped(seq_id)
            del self.swapped[seq_id]
            check_invariants(bm)
        for seq_id, aborted in zip(sorted(self.seqs), abort_flags, strict=True):
            (bm.abort if aborted else bm.free)(seq_id)
            del self.seqs[seq_id]
            check_invariants(bm)
        bm.reclaim_pending()
        bm.evict()
        check_invariants(bm)
        assert bm.state_map() == "." * bm.num_blocks, f"blocks leaked: {bm.state_map()}"
        assert len(bm.free_queue) == bm.num_blocks
        assert bm.num_allocatable() == bm.num_blocks
        assert not bm.cached and not bm.pending_free and not len(bm.evictor)
        assert all(b.ref_count == 0 and b.hash is None for b in bm.blocks)
        assert bm.host_state_map() == "." * bm.num_host_blocks and not bm.swapped
        assert len(bm.host_pool.free_queue) == bm.num_host_blocks
        self._purge()
        assert not self.content and not self.model_cached

    # --------------------------------------------------------------- invariants

    @invariant()
    def block_manager_invariants(self) -> None:
        if self.bm is not None:
            check_invariants(self.bm)

    @invariant()
    def model_agrees(self) -> None:
        bm = self.bm
        if bm is None:
            return
        self._purge()
        assert sorted(bm.cached.values()) == sorted(self.model_cached.values())
        for (salt, prefix), bid in self.model_cached.items():
            key = block_hashes(list(prefix), bm.block_size, salt)[-1]
            assert bm.blocks[bid].hash == key
            assert bm.cached[key] == bid
        assert set(bm.seqs) == set(self.seqs)
        assert set(bm.swapped) == set(self.swapped)
        for seq_id, seq in self.swapped.items():
            host = bm.swapped[seq_id]
            assert host.tenant == seq.tenant and host.salt == seq.salt
            assert len(host.block_ids) == ceil_div(seq.covered, bm.block_size)
            assert host.num_full == seq.num_computed // bm.block_size
        for seq_id, seq in self.seqs.items():
            real = bm.seqs[seq_id]
            assert real.tenant == seq.tenant and real.salt == seq.salt
            assert seq.num_computed <= seq.covered <= len(seq.tokens)
            assert len(real.block_ids) == ceil_div(seq.covered, bm.block_size)
            assert real.num_full == seq.num_computed // bm.block_size
            for index, bid in enumerate(real.block_ids[: real.num_full]):
                assert self.content[bid] == self._content(seq.salt, seq.tokens, index)
        assert bm.num_allocatable() == self._count(FREE, CACHED, PENDING)

    def teardown(self) -> None:
        if self.bm is not None:
            self._drain([False] * len(self.seqs))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
