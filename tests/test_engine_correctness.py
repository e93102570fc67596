"""Greedy fp32 decoding is token-for-token what transformers' `generate` gives, in every mode, compiled or not."""

from __future__ import annotations

import pytest

from kvops.engine.config import EngineConfig
from kvops.engine.invariants import check_invariants
from kvops.engine.llm import LLM
from kvops.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=64)


def _mismatches(outputs: list[list[int]], expected: list[list[int]]) -> list[int]:
    return [i for i, (got, want) in enumerate(zip(outputs, expected, strict=True)) if got != want]


# The compiled step (--compile, kvops/engine/compiled.py) and the unfused one; the other tests here run at the default,
# auto, which compiles where a C++ compiler is present, as in CI.
@pytest.mark.parametrize(
    ("block_size", "prefix_caching", "compile"),
    [(16, True, "on"), (16, True, "off"), (16, False, "on"), (1, True, "on"), (8, True, "off"), (32, False, "on")],
)
def test_batched_greedy_matches_transformers(block_size, prefix_caching, compile, chat_prompts, hf_greedy):
    llm = LLM(EngineConfig(block_size=block_size, enable_prefix_caching=prefix_caching, compile=compile,
                           kv_cache_memory="128MiB", max_model_len=1024))
    outputs = llm.generate(chat_prompts, GREEDY)
    assert _mismatches([o.token_ids for o in outputs], hf_greedy) == []
    check_invariants(llm.engine.block_manager)
    assert sum(len(o) for o in hf_greedy) > 16 * 40  # the comparison covers real continuations, not just EOS


def test_prefix_cache_hits_give_the_same_tokens(chat_prompts, hf_greedy):
    llm = LLM(EngineConfig(block_size=8, kv_cache_memory="128MiB", max_model_len=1024))
    first = llm.generate(chat_prompts, GREEDY)
    again = llm.generate(chat_prompts, GREEDY)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert _mismatches([o.token_ids for o in first], hf_greedy) == []
    assert _mismatches([o.token_ids for o in again], hf_greedy) == []
    snap = llm.engine.snapshot(include_gpu=False)
    # The first round hits too: its requests share the chat template's system prompt, and those admitted
    # after the first wait a step for its blocks instead of computing them again (kvops/engine/scheduler.py).
    assert sum(o.num_cached_tokens for o in first) > 0
    assert snap.prefix_cache.hits_total == sum(o.num_cached_tokens for o in first + again)


def test_requests_joining_running_decodes(chat_prompts, hf_greedy):
    """Continuous batching: new requests join while others decode; every output stays exact."""
    llm = LLM(EngineConfig(block_size=16, kv_cache_memory="128MiB", max_model_len=1024))
    engine = llm.engine
    ids: dict[str, int] = {}
    results: dict[int, list[int]] = {}
    pending = list(enumerate(chat_prompts))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 5 == 0:
            index, prompt = pending.pop(0)
            ids[engine.add_request(prompt, GREEDY)] = index
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out.token_ids
        steps += 1
    assert max(s.num_seqs for s in engine.stats.steps) > 1
    assert _mismatches([results[i] for i in range(len(chat_prompts))], hf_greedy) == []


def test_preemption_with_recompute_keeps_outputs_exact(chat_prompts, hf_greedy):
    # 34 blocks of 16 tokens for 16 sequences of ~100 tokens: sequences must be preempted and recomputed.
    llm = LLM(EngineConfig(block_size=16, kv_cache_memory="24MiB", max_model_len=256))
    outputs = llm.generate(chat_prompts, GREEDY)
    snap = llm.engine.snapshot(include_gpu=False)
    assert snap.requests.preemptions_total > 0
    assert _mismatches([o.token_ids for o in outputs], hf_greedy) == []
    # recomputed tokens are not prefix hits: hits only count first admissions
    assert snap.prefix_cache.queries_total == sum(len(p) for p in chat_prompts)
    assert snap.blocks.counts["filling"] == snap.blocks.counts["full"] == 0
    check_invariants(llm.engine.block_manager)


def test_chunked_prefill_keeps_outputs_exact(chat_prompts, hf_greedy):
    llm = LLM(EngineConfig(block_size=16, kv_cache_memory="128MiB", max_model_len=1024,
                           max_num_batched_tokens=24, max_num_seqs=4))
    outputs = llm.generate(chat_prompts[:6], GREEDY)
    assert _mismatches([o.token_ids for o in outputs], hf_greedy[:6]) == []
    assert max(s.num_tokens for s in llm.engine.stats.steps) <= 24


@pytest.mark.slow
def test_the_recorded_reference_is_what_transformers_gives_today(llm, chat_prompts):
    """The recording hf_greedy reads (tests/fixtures/hf-greedy/) against a live transformers run, with its key."""
    import json

    from tests.conftest import HF_GREEDY_FILE, hf_greedy_live, hf_reference_key

    stored = json.loads(HF_GREEDY_FILE.read_text())
    assert stored["key"] == hf_reference_key(), "recorded with another model or versions: KVOPS_RECORD_REFERENCE=1"
    assert stored["prompts"] == chat_prompts
    assert stored["outputs"] == hf_greedy_live(llm, chat_prompts)
