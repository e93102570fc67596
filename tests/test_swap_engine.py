"""Swap on the real engine: under memory pressure every request finishes with exactly the fp32
greedy tokens, the snapshot and /metrics report the swapping, and no block leaks in either pool."""

from __future__ import annotations

import pytest

from kvops.engine.block import BlockState
from kvops.engine.block_manager import BlockManager
from kvops.engine.config import EngineConfig
from kvops.engine.invariants import check_invariants
from kvops.engine.llm import LLM
from kvops.engine.sampling import SamplingParams
from kvops.engine.serving.metrics import snapshot_families
from kvops.engine.snapshot_builder import swap_window
from kvops.engine.stats import EngineStats
from kvops.schema.errors import ConfigError

BLOCK_BYTES = 16 * 46080  # one block of 16 tokens, fp32 SmolLM2-135M
GREEDY = SamplingParams(temperature=0, max_tokens=64)


def _pressured(swap_blocks: int, **overrides: object) -> LLM:
    """24 device blocks for 16 requests that need ~7 each: most of them are preempted at least once."""
    return LLM(EngineConfig(**{"kv_cache_memory": 24 * BLOCK_BYTES, "max_model_len": 256,  # type: ignore[arg-type]
                               "swap_space": swap_blocks * BLOCK_BYTES, **overrides}))


def _assert_nothing_leaked(llm: LLM) -> None:
    bm = llm.engine.block_manager
    check_invariants(bm)
    assert not bm.seqs and not bm.swapped
    assert bm.num_swapped_blocks == 0 and bm.host_state_map() == "." * bm.num_host_blocks
    assert {b.state for b in bm.blocks} <= {BlockState.FREE, BlockState.CACHED}


def test_swap_under_pressure_keeps_greedy_outputs_exact(chat_prompts, hf_greedy):
    llm = _pressured(swap_blocks=200)
    outputs = llm.generate(chat_prompts, GREEDY)
    assert [o.token_ids for o in outputs] == hf_greedy
    snap = llm.engine.snapshot(include_gpu=False)
    swap = snap.swap
    assert swap.preemption_mode == "swap" and swap.host_blocks == 200
    assert swap.swap_preemptions_total > 0 and swap.swap_fallbacks_total == 0
    assert swap.swap_out_total > 0 and swap.swap_in_total > 0
    assert swap.swap_in_total + swap.swap_in_reused_total == swap.swap_out_total  # everything came back
    assert snap.requests.preemptions_total == swap.swap_preemptions_total
    assert swap.window.swap_rate > 0 and swap.window.swap_out == swap.swap_out_total
    assert snap.blocks.counts["swapped"] == 0 and swap.swapped_seqs == 0
    _assert_nothing_leaked(llm)
    metrics = {f.name: f for f in snapshot_families(snap)}
    assert metrics["kvops_swap_out_blocks"].samples[0].value == swap.swap_out_total
    assert metrics["kvops_swap_rate"].samples[0].value == pytest.approx(swap.window.swap_rate)


def test_full_host_pool_falls_back_to_recompute_and_stays_exact(chat_prompts, hf_greedy):
    llm = _pressured(swap_blocks=8)
    outputs = llm.generate(chat_prompts, GREEDY)
    assert [o.token_ids for o in outputs] == hf_greedy
    swap = llm.engine.snapshot(include_gpu=False).swap
    assert swap.swap_fallbacks_total > 0 and swap.swap_preemptions_total > 0
    _assert_nothing_leaked(llm)


def test_swapped_sequences_show_in_the_snapshot_and_abort_frees_their_host_blocks(chat_prompts):
    llm = _pressured(swap_blocks=200)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in chat_prompts]
    for _ in range(200):
        engine.step()
        if engine.scheduler.swapped:
            break
    snap = engine.snapshot(include_gpu=False)
    assert snap.swap.swapped_seqs == len(engine.scheduler.swapped) > 0
    assert snap.blocks.counts["swapped"] == snap.swap.swapped_blocks > 0
    assert "s" in snap.swap.host_state_map
    for request_id in ids:
        engine.abort_request(request_id)
    engine.step()  # reclaims the aborted device blocks
    engine.block_manager.reclaim_pending()
    _assert_nothing_leaked(llm)


def test_swap_rate_follows_its_definition_on_a_scripted_sequence():
    """swap rate = blocks swapped out / device blocks allocated, over the window."""
    now = [0.0]
    bm = BlockManager(num_blocks=12, block_size=4, num_host_blocks=8)
    stats = EngineStats(window_s=60, clock=lambda: now[0])

    def record() -> None:
        stats.on_swap_counters(bm.swap_out_blocks_total, bm.swap_in_blocks_total, bm.allocations_total)

    bm.allocate("a", 16)  # 4 blocks
    bm.allocate("b", 16)  # 4 blocks
    record()
    assert swap_window(stats).swap_rate == 0.0
    now[0] = 10.0
    assert len(bm.swap_out("a")) == 4  # a's 4 blocks go to the host pool
    bm.allocate("c", 32)  # 8 blocks: 4 were a's
    record()
    window = swap_window(stats)
    assert (window.swap_out, window.allocations) == (4, 16)
    assert window.swap_rate == pytest.approx(4 / 16)
    assert window.swap_out_per_s == pytest.approx(4 / 10.0)
    bm.free("c")
    now[0] = 20.0
    assert len(bm.swap_in("a", 16) or []) == 4
    record()
    window = swap_window(stats)
    assert (window.swap_out, window.swap_in, window.allocations) == (4, 4, 20)
    assert window.swap_rate == pytest.approx(4 / 20)
    now[0] = 20.0 + 61  # everything has left the window; the totals remain
    assert swap_window(stats).swap_rate == 0.0 and swap_window(stats).swap_out == 0
    assert bm.swap_out_blocks_total == 4 and bm.allocations_total == 20


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"preemption_mode": "swap"}, "--preemption-mode swap needs a host pool"),
        ({"swap_space": "1KiB"}, r"--swap-space 1.0 KiB is smaller than one block \(737280 bytes\)"),
        ({"swap_space": "lots"}, "cannot read 'lots' as a size"),
        ({"preemption_mode": "drop"}, "--preemption-mode 'drop' is not one of swap, recompute"),
    ],
)
def test_bad_swap_settings_are_refused_with_the_fix(overrides: dict[str, object], message: str):
    with pytest.raises(ConfigError, match=message):
        LLM(EngineConfig(**{"kv_cache_memory": "32MiB", "max_model_len": 256, **overrides}))  # type: ignore[arg-type]
