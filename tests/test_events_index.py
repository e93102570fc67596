"""The resident-block index (kvops.events.index) on event streams: the real vLLM recordings in
tests/fixtures/kv-events/, and small streams built here and put through the wire exactly as vLLM sends them
(kvops.bench.events.vllm_payload, then kvops.events.wire.decode_batch)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvops.bench.events import vllm_payload
from kvops.events import counters
from kvops.events import index as index_module
from kvops.events.duplicates import ChainHolders
from kvops.events.index import ResidentIndex
from kvops.events.recording import read_recording
from kvops.events.restores import RemovedMemory
from kvops.events.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, DecodedBatch, Event, decode_batch
from kvops.schema.kv_events import NO_TENANT, RESIDENCY_BOUNDS_S, EventStreamHealth, KvEventStats

FIXTURES = Path(__file__).parent / "fixtures" / "kv-events"
HEALTH = EventStreamHealth(endpoint="ipc:///kv")
SIZE = 4  # tokens per block in the built streams


def store(hashes: list[BlockHash], parent: BlockHash | None = None, tokens: list[int] | None = None,
          extra: list[Any] | None = None, lora: str | None = None, medium: str | None = "GPU",
          size: int = SIZE) -> BlockStored:
    """Blocks as one BlockStored; by default each block's tokens are its hash's, so chains differ."""
    if tokens is None:
        tokens = [int(h) * 10 + k if isinstance(h, int) else k for h in hashes for k in range(size)]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size,
                       medium=medium, lora_name=lora, extra_keys=extra)


def remove(*hashes: BlockHash, medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def batch(ts: float, *events: Event) -> DecodedBatch:
    """The events through vLLM's encoding and kvops's decoder."""
    return decode_batch(vllm_payload(ts, list(events)))


def built(*batches: tuple[float, list[Event]], window: float = 300.0) -> ResidentIndex:
    index = ResidentIndex(restore_window_s=window)
    for ts, events in batches:
        index.apply(batch(ts, *events))
    return index


def view(index: ResidentIndex, now: float = 1000.0) -> KvEventStats:
    return index.stats(now, HEALTH)


def replayed(name: str) -> tuple[ResidentIndex, float]:
    index = ResidentIndex()
    last = 0.0
    for frame in read_recording(FIXTURES / f"{name}.kvev"):
        decoded = decode_batch(frame.payload)
        index.apply(decoded)
        last = decoded.ts
    return index, last


def bucket(value: float) -> int:
    return next((i for i, bound in enumerate(RESIDENCY_BOUNDS_S) if value <= bound), len(RESIDENCY_BOUNDS_S))


# ------------------------------------------------------------------------------ stores, removes, clears

def test_stores_removes_and_clears_are_counted_per_medium() -> None:
    index = built((0.0, [store([1, 2, 3]), store([4, 5], parent=3), store([9], medium=None)]),
                  (5.0, [remove(5), store([7], medium="CPU")]))
    stats = view(index, now=14.0)
    assert stats.resident == {"GPU": 5, "CPU": 1}  # None is GPU
    assert (index.resident_blocks, stats.resident_tokens, stats.block_size) == (6, 6 * SIZE, SIZE)
    assert (stats.stores_total, stats.removes_total, stats.clears_total) == (7, 1, 0)
    assert stats.resident_by_age == [1, 5, 0, 0, 0]  # the CPU block is 9 s old, the rest 14 s
    assert stats.lifetime_s.count == 1 and stats.root_stores_total == 3

    index.apply(batch(6.0, AllBlocksCleared(), store([1])))
    stats = view(index, now=20.0)
    assert stats.resident == {"GPU": 1, "CPU": 0}
    assert (stats.clears_total, stats.stores_total, stats.restores_total) == (1, 8, 0)
    assert stats.lifetime_s.count == 1  # cleared blocks are not evictions


def test_a_store_of_a_resident_hash_is_a_use_not_a_store() -> None:
    # vLLM's kv_cache_report_mode "full" reports hits as BlockStored of blocks already resident.
    index = built((0.0, [store([1, 2])]), (50.0, [store([1, 2])]), (60.0, [remove(2, 1)]))
    stats = view(index)
    assert stats.stores_total == 2
    assert stats.idle_before_evict_s.sum == pytest.approx(20.0)  # both last used at 50, not 0


def test_removing_what_was_never_stored_is_counted_and_harmless() -> None:
    index = built((0.0, [remove(42), remove(43, medium="CPU")]), (1.0, [store([1]), remove(1), remove(1)]))
    stats = view(index)
    assert (stats.removes_total, stats.lifetime_s.count, index.resident_blocks) == (4, 1, 0)


# ------------------------------------------------------------------------------ restores and residency times

def test_a_store_of_a_hash_removed_within_the_window_is_a_restore() -> None:
    index = built((0.0, [store([1, 2])]), (10.0, [remove(2, 1)]), (100.0, [store([1, 2])]), window=300.0)
    stats = view(index)
    assert (stats.restores_total, stats.restored_tokens_total, stats.root_restores_total) == (2, 2 * SIZE, 1)
    assert (stats.reuse_gap_s.count, stats.reuse_gap_s.sum) == (2, pytest.approx(180.0))
    assert stats.reuse_gap_s.counts[bucket(90.0)] == 2


def test_a_store_after_the_window_is_not_a_restore() -> None:
    index = built((0.0, [store([1, 2])]), (10.0, [remove(2, 1)]), (311.0, [store([1, 2])]), window=300.0)
    assert view(index).restores_total == 0


def test_lifetime_and_idle_before_eviction_take_the_uses_below_a_block() -> None:
    # R at 0, C under it at 30, G under C at 50; evicted tail first, as vLLM does.
    index = built((0.0, [store([1])]), (30.0, [store([2], parent=1)]), (50.0, [store([3], parent=2)]),
                  (60.0, [remove(3)]), (61.0, [remove(2)]), (62.0, [remove(1)]))
    stats = view(index)
    assert stats.lifetime_s.sum == pytest.approx(10 + 31 + 62)
    assert stats.idle_before_evict_s.sum == pytest.approx(10 + 11 + 12)  # each last used at 50, by G's store
    assert stats.lifetime_s.counts[bucket(62.0)] == 1 and stats.idle_before_evict_s.counts[bucket(10.0)] == 1
    assert stats.idle_before_evict_s.count == 3 and stats.lifetime_s.p50 is not None


# ------------------------------------------------------------------------------ tenants

@pytest.mark.parametrize(("extra", "lora", "tenant"), [
    ([["tenant-a"]], None, "tenant-a"),  # a cache salt
    (None, "adapter", "adapter"),  # a LoRA, extra keys absent (vLLM < 0.11)
    ([["adapter"]], "adapter", "adapter"),  # a LoRA's name is the first extra key
    ([["adapter", "salt-1"]], "adapter", "salt-1"),  # the salt wins over the LoRA
    ([[["mm-digest", 0], "salt-2", b"\x01" * 32]], None, "salt-2"),  # multimodal pair, salt, embeddings digest
    ([[["mm-digest", 0]]], None, NO_TENANT),
    (None, None, NO_TENANT),
])
def test_a_chain_s_tenant_is_its_salt_else_its_lora(extra: list[Any] | None, lora: str | None, tenant: str) -> None:
    # vLLM puts the salt in the first block's extra keys only: the blocks below inherit it.
    index = built((0.0, [store([1], extra=extra, lora=lora)]), (1.0, [store([2, 3], parent=1, lora=lora)]))
    assert {name: t.resident for name, t in view(index).tenants.items()} == {tenant: 3}


def test_cross_tenant_duplicates_are_the_same_chain_under_another_salt() -> None:
    tokens = [7] * 2 * SIZE
    index = built((0.0, [store([1, 2], tokens=tokens)]),  # no salt: the duplicate table is not on yet
                  (1.0, [store([11, 12], tokens=tokens, extra=[["a"], None])]),
                  (2.0, [store([21, 22], tokens=tokens, extra=[["b"], None])]),
                  (3.0, [store([31, 32], tokens=[8] * 2 * SIZE, extra=[["c"], None])]),  # other tokens
                  (4.0, [store([41], tokens=tokens[:SIZE], extra=[[["image", 0], "d"]])]))  # same ids, an image
    stats = view(index)
    assert stats.cross_tenant_duplicates_total == 4  # a's two blocks and b's two
    assert {name: t.resident for name, t in stats.tenants.items()} == {NO_TENANT: 2, "a": 2, "b": 2, "c": 2, "d": 1}
    index.apply(batch(5.0, remove(2, 1, 12, 11)))
    index.apply(batch(6.0, store([51, 52], tokens=tokens, extra=[["e"], None])))  # b's copy is still resident
    assert view(index).cross_tenant_duplicates_total == 6


def test_evicted_others_are_other_tenants_removals_in_the_batches_a_tenant_stored_in() -> None:
    index = built((0.0, [store([1, 2], extra=[["a"], None]), store([3], extra=[["b"]])]),
                  (1.0, [remove(1, 2), remove(3), store([4], extra=[["b"]])]),  # b's store evicted a's 2 blocks
                  (2.0, [store([5], extra=[["a"]])]))
    tenants = view(index).tenants
    assert (tenants["b"].evicted_others_total, tenants["a"].evicted_others_total) == (2, 0)
    assert (tenants["a"].removed_total, tenants["b"].removed_total, tenants["b"].stores_total) == (2, 1, 2)


def test_tenants_past_the_cap_are_folded_and_keep_their_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(counters, "MAX_TENANTS", 4)
    monkeypatch.setattr(counters, "REPORTED_TENANTS", 2)
    index = ResidentIndex()
    for n in range(10):
        index.apply(batch(float(n), store([n], extra=[[f"t{n}"]])))
        index.apply(batch(n + 0.5, remove(n)))
    index.apply(batch(20.0, store([100], extra=[["t9"]])))
    tenants = view(index).tenants
    assert len(tenants) <= 3 and counters.OTHER_TENANTS in tenants
    assert sum(t.stores_total for t in tenants.values()) == 11
    assert sum(t.removed_total for t in tenants.values()) == 10
    assert sum(t.resident for t in tenants.values()) == 1


# ------------------------------------------------------------------------------ prefixes and variants

def test_shared_prefixes_are_branch_points_by_resident_descendants() -> None:
    index = built((0.0, [store([1, 2, 3], tokens=list(range(12)))]),
                  (1.0, [store([4], parent=3), store([5], parent=3), store([6, 7], parent=3)]),
                  (2.0, [store([8], parent=4), store([9], parent=4)]))
    prefixes = view(index).shared_prefixes
    assert [(p.depth, p.tokens, p.descendants) for p in prefixes] == [(3, 12, 6), (4, 16, 2)]
    assert prefixes[0].first_tokens == list(range(4)) and prefixes[0].tenant == NO_TENANT
    assert prefixes[0].block_hash == f"{3:016x}"


def test_a_removed_block_cuts_the_prefix_and_a_store_joins_it_again() -> None:
    # 1 -> 2 -> {3, 4}, and 1 -> 5, 1 -> 6. With 2 gone, 3 and 4 are out of reach of 1 (vLLM's lookup stops at 2).
    index = built((0.0, [store([1, 2]), store([3], parent=2), store([4], parent=2), store([5], parent=1),
                         store([6], parent=1)]), (1.0, [remove(2)]))
    stats = view(index)
    assert [(p.block_hash, p.descendants) for p in stats.shared_prefixes] == [(f"{1:016x}", 2)]
    assert index.resident_blocks == 5
    index.apply(batch(2.0, store([2], parent=1)))
    stats = view(index, now=1001.0)
    assert [(p.block_hash, p.descendants) for p in stats.shared_prefixes] == [(f"{1:016x}", 5), (f"{2:016x}", 2)]
    assert stats.restores_total == 1


def test_a_parent_never_seen_does_not_crash_and_is_joined_when_it_comes() -> None:
    # The index joined late: the first stores hang from blocks it never saw stored.
    index = built((0.0, [store([5], parent=4, lora="ad"), store([6], parent=4, lora="ad")]),
                  (1.0, [remove(777), store([9, 10], parent=8)]))
    stats = view(index)
    assert (index.resident_blocks, stats.root_stores_total) == (4, 0)
    assert {name: t.resident for name, t in stats.tenants.items()} == {"ad": 2, NO_TENANT: 2}
    index.apply(batch(2.0, store([4], lora="ad")))  # the parent comes: two resident below it
    assert [(p.descendants, p.depth) for p in view(index, now=1001.0).shared_prefixes] == [(2, 1)]
    index.apply(batch(3.0, remove(5, 6, 4, 10, 9)))
    assert index.resident_blocks == 0 and view(index, now=1002.0).shared_prefixes == []


def test_root_variants_group_roots_that_differ_in_a_few_positions() -> None:
    base = list(range(100, 132))
    roots = []
    for n in range(5):
        tokens = list(base)
        tokens[3], tokens[7] = 900 + n, 950 + n % 2  # a request number and a parity flag
        roots.append(store([1000 + n], tokens=tokens, size=32))
    far = list(base)
    far[:10] = range(10)  # 10 positions: not a variant
    salted = list(base)
    salted[5] = 1  # one position, but another tenant
    index = built((0.0, [*roots, store([2000], tokens=far, size=32), store([3000], tokens=salted, size=32,
                                                                            extra=[["s"]])]))
    variants = view(index).root_variants
    assert len(variants) == 1
    group = variants[0]
    assert (group.block_tokens, group.roots, group.positions, group.tenant) == (32, 5, [3, 7], NO_TENANT)
    assert group.variants[:2] == [[900, 950], [901, 951]]


def test_small_blocks_need_fewer_differences_to_be_variants() -> None:
    # Less than a tenth of the block: a 16-token root may differ in one position only.
    one = [store([1], tokens=list(range(16)), size=16), store([2], tokens=[99, *range(1, 16)], size=16)]
    two = [store([3], tokens=[7, 7, *range(2, 16)], size=16)]
    assert [v.roots for v in view(built((0.0, one))).root_variants] == [2]
    assert [v.roots for v in view(built((0.0, [*one[:1], *two]))).root_variants] == []


# ------------------------------------------------------------------------------ reset and bounded memory

def test_reset_empties_the_index_and_keeps_the_counters() -> None:
    index = built((0.0, [store([1, 2], extra=[["a"], None])]), (10.0, [remove(2)]))
    index.reset()
    stats = view(index)
    assert (index.resident_blocks, stats.resident_tokens, sum(stats.resident_by_age)) == (0, 0, 0)
    assert (stats.stores_total, stats.removes_total, stats.lifetime_s.count) == (2, 1, 1)
    assert (stats.tenants["a"].resident, stats.tenants["a"].stores_total) == (0, 2)
    index.apply(batch(20.0, store([1, 2], extra=[["a"], None])))
    assert view(index).restores_total == 0  # the removed memory went with the old publisher
    assert view(index).stores_total == 4


def test_the_removed_memory_is_bounded() -> None:
    memory = RemovedMemory(window_s=300.0, cap=100)
    for n in range(1000):
        memory.rotate(float(n))
        memory.current[n] = float(n)
    assert len(memory) <= 100
    assert memory.take(999) == 999.0 and memory.take(5) is None


def test_the_chain_table_answers_as_a_model_through_collisions_growth_and_many_tenants() -> None:
    rng = random.Random(31)
    holders = ChainHolders(capacity=8)
    chains = [8, 16, 24, 9, 17, 1 << 59, (1 << 59) + 8, *range(100, 140)]  # most share a home at first
    model: dict[int, list[int]] = {}  # chain -> the tenants of its holders
    for step in range(4000):
        chain = rng.choice(chains)
        held = model.setdefault(chain, [])
        if held and rng.random() < 0.45:
            tenant = held.pop(rng.randrange(len(held)))
            holders.remove([chain], [tenant])
        else:
            tenant = rng.randrange(5)
            assert bool(holders.add([chain], tenant)) == any(t != tenant for t in held), step
            held.append(tenant)
    assert holders.count == sum(1 for held in model.values() if held)


def test_shared_prefixes_of_a_large_index_are_refreshed_every_few_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_module, "PREFIX_EVERY_CALL", 0)
    index = built((0.0, [store([1]), store([2], parent=1), store([3], parent=1)]))
    assert [p.descendants for p in view(index, now=100.0).shared_prefixes] == [2]
    index.apply(batch(1.0, store([4], parent=1)))
    assert [p.descendants for p in view(index, now=101.0).shared_prefixes] == [2]  # not due yet
    assert [p.descendants for p in view(index, now=100.0 + index_module.PREFIX_REFRESH_S).shared_prefixes] == [3]


def test_32_byte_hashes_are_keys_and_short_names() -> None:
    a, b, c = (bytes([n]) * 32 for n in (1, 2, 3))
    index = built((0.0, [store([a], tokens=list(range(SIZE))), store([b], parent=a), store([c], parent=a)]),
                  (1.0, [remove(c)]), (2.0, [store([c], parent=a)]))
    stats = view(index)
    assert index.resident_blocks == 3 and stats.restores_total == 1
    index.apply(batch(3.0, store([bytes([4]) * 32], parent=a)))
    assert view(index, now=1001.0).shared_prefixes[0].block_hash == "01" * 8


# ------------------------------------------------------------------------------ the recorded vLLM streams

def test_thrash_recording_counts_every_second_pass_store_as_a_restore() -> None:
    # 14 prompts of 28 blocks, twice the pool, sent twice: every block of the second pass was evicted before.
    index, last = replayed("thrash")
    stats = view(index, now=last)
    assert (stats.stores_total, stats.removes_total, index.resident_blocks) == (784, 604, 180)
    assert (stats.restores_total, stats.root_restores_total, stats.root_stores_total) == (392, 14, 28)
    assert stats.restored_tokens_total == 392 * 32
    assert stats.lifetime_s.count == stats.idle_before_evict_s.count == 604
    assert stats.reuse_gap_s.count == 392 and stats.reuse_gap_s.p50 is not None


def test_salts_recording_shows_two_tenants_holding_the_same_chains() -> None:
    index, last = replayed("salts")
    stats = view(index, now=last)
    assert {name: (t.resident, t.stores_total) for name, t in stats.tenants.items()} == {
        "tenant-a": (35, 35), "tenant-b": (35, 35)}
    assert stats.cross_tenant_duplicates_total == 35  # all of tenant-b's blocks
    assert [(p.tenant, p.depth, p.descendants) for p in stats.shared_prefixes] == [
        ("tenant-a", 5, 30), ("tenant-b", 5, 30)]  # the 160-token system part, six prompts under it


def test_shared_prefix_recording_names_the_608_token_prefix() -> None:
    index, last = replayed("shared-prefix")
    top = view(index, now=last).shared_prefixes
    assert [(p.depth, p.tokens, p.descendants) for p in top] == [(19, 608, 24)]
    assert len(top[0].first_tokens) == 16


def test_variance_recording_finds_the_timestamp_positions() -> None:
    index, last = replayed("variance")
    variants = view(index, now=last).root_variants
    assert [(v.roots, v.positions, v.block_tokens) for v in variants] == [(12, [16, 18, 19], 32)]
    assert len(variants[0].variants) == 8


def test_reset_recording_empties_on_the_clear_and_counts_no_restore() -> None:
    index, last = replayed("reset")
    stats = view(index, now=last)
    assert (stats.clears_total, index.resident_blocks, stats.restores_total, stats.removes_total) == (2, 12, 0, 0)
