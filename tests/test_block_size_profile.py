"""The block-size profile: every candidate timed on the engine's own model and recent lengths, the
serving pool left alone, and the admin endpoint in front of it. Kept small (short contexts, one or
two repeats): these check what is measured, not how fast anything is."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient

from kvops.engine.block_size_profile import DEFAULT_PROMPT_LENS, profile_block_size
from kvops.engine.llm import LLM
from kvops.engine.sampling import SamplingParams
from kvops.engine.serving.app import build_app
from kvops.engine.stats import EngineStats
from kvops.schema.reports import BlockSizeProfile
from kvops.schema.snapshot import StepSample

TOKEN = "block-size-token"
PROMPT_LENS = (20, 45, 70)
MAX_TOKENS = 4


def expected_fragmentation(lens: list[int], block_size: int) -> float:
    return 1 - sum(lens) / sum(math.ceil(length / block_size) * block_size for length in lens)


@pytest.fixture
def fresh_stats(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> EngineStats:
    """The shared engine with counters of its own, so what other tests served does not leak in."""
    stats = EngineStats()
    monkeypatch.setattr(llm.engine, "stats", stats)
    return stats


@pytest.fixture
def served(llm: LLM, fresh_stats: EngineStats) -> LLM:
    """The engine after serving three prompts of known lengths together, MAX_TOKENS tokens each."""
    prompts = [[(7 * i + j) % 500 + 10 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]
    llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return llm


def test_every_candidate_timed_best_is_fastest(llm: LLM, fresh_stats: EngineStats):
    profile = profile_block_size(llm.engine, candidates=(32, 8, 16, 8), batch_size=2, repeats=2, max_context=96)
    assert [c.block_size for c in profile.candidates] == [8, 16, 32]  # deduplicated, in order
    timing = {c.block_size: c for c in profile.candidates}
    assert timing[profile.best].relative == 1.0
    assert all(c.relative >= 1.0 and c.decode_step_ms > 0 and c.iqr_ms >= 0 for c in profile.candidates)
    assert timing[profile.best].decode_step_ms == min(c.decode_step_ms for c in profile.candidates)
    assert profile.configured == llm.engine.config.block_size and profile.repeats == 2
    # Nothing served yet: the default set plus 64 generated tokens, capped at max_context.
    assert profile.lengths_from == "default" and profile.generated_tokens == 64 and profile.batch_size == 2
    assert len(profile.context_lens) == 2 and max(profile.context_lens) <= 96
    assert all(length in [min(96, n + 64) for n in DEFAULT_PROMPT_LENS] for length in profile.context_lens)
    for c in profile.candidates:
        assert c.fragmentation == pytest.approx(expected_fragmentation(profile.context_lens, c.block_size), abs=1e-6)
    assert profile.duration_s > 0 and profile.measured_at > 0


def test_recent_lengths_and_batch_are_used(served: LLM):
    profile = profile_block_size(served.engine, candidates=(4, 16, 64), repeats=1)
    assert profile.lengths_from == "recent" and profile.generated_tokens == MAX_TOKENS
    # All three ran together in every step, and the lengths are the prompts' own plus what they generated.
    assert profile.batch_size == len(PROMPT_LENS)
    assert profile.context_lens == [n + MAX_TOKENS for n in PROMPT_LENS]
    frag = {c.block_size: c.fragmentation for c in profile.candidates}
    assert frag[4] == pytest.approx(expected_fragmentation([24, 49, 74], 4), abs=1e-6)
    assert frag[64] == pytest.approx(1 - 147 / 256, abs=1e-6)


def test_serving_pool_untouched(served: LLM):
    engine = served.engine
    bm = engine.block_manager
    before = (bm.state_map(), dict(bm.state_counts), engine.kv_slots(), [layer.data.clone()
                                                                          for layer in engine.kv_pool.device])
    profile_block_size(engine, candidates=(8, 32), batch_size=2, repeats=1)
    assert bm.state_map() == before[0] and dict(bm.state_counts) == before[1] and engine.kv_slots() == before[2]
    assert all(torch.equal(layer.data, kept) for layer, kept in zip(engine.kv_pool.device, before[3], strict=True))


def test_batch_that_does_not_fit_the_pool_is_refused(llm: LLM, fresh_stats: EngineStats):
    fresh_stats.on_admit("default", 1000, 0)  # one recent prompt near max_model_len: 8 of them overflow the pool
    with pytest.raises(ValueError, match="more than the serving pool"):
        profile_block_size(llm.engine, batch_size=8, repeats=1)
    # Left to itself, the batch shrinks to what the pool holds at the largest candidate's padding.
    fresh_stats.on_step(StepSample(t=0, duration_s=0.1, num_seqs=8, num_tokens=8, decode_only=True,
                                   max_context_len=1000), generated_tokens=8)
    with pytest.raises(ValueError, match="at block size 1024"):
        profile_block_size(llm.engine, candidates=(8, 1024), batch_size=3, repeats=1)
    fits = llm.engine.capacity.tokens // 1024
    assert profile_block_size(llm.engine, candidates=(8, 1024), repeats=1, max_context=1000).batch_size == fits


@pytest.fixture
def http(llm: LLM) -> Iterator[TestClient]:
    with TestClient(build_app(llm.engine, admin_token=TOKEN)) as client:
        yield client


def test_endpoint(http: TestClient, llm: LLM):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert http.get("/admin/profile/block-size").status_code == 401
    assert http.get("/admin/profile/block-size", headers={"Authorization": "Bearer wrong"}).status_code == 403
    response = http.get("/admin/profile/block-size?candidates=16,8&batch_size=1&repeats=1&max_context=48",
                        headers=auth)
    assert response.status_code == 200, response.text
    profile = BlockSizeProfile.model_validate_json(response.text)
    assert [c.block_size for c in profile.candidates] == [8, 16] and profile.batch_size == 1
    assert profile.repeats == 1 and max(profile.context_lens) <= 48
    max_seqs = llm.engine.config.max_num_seqs
    for query, message in [("candidates=8,x", "comma-separated"), ("candidates=0", "out of range"),
                           (f"candidates={llm.engine.max_model_len + 1}", "max_model_len"),
                           ("candidates=1,2,3,4,5,6,7,8,9", "at most 8"), ("repeats=0", "repeats 0"),
                           ("repeats=51", "use 1 to 50"), ("batch_size=0", "batch_size 0"),
                           (f"batch_size={max_seqs + 1}", "max_num_seqs"), ("repeats=many", "repeats"),
                           ("max_context=0", "max_context")]:
        bad = http.get(f"/admin/profile/block-size?{query}", headers=auth)
        assert bad.status_code == 400, (query, bad.text)
        error = bad.json()["error"]
        assert message in error["message"] and error["code"] == 400, (query, error)
