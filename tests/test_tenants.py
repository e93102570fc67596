"""Tenant isolation on the real engine: a tenant flooding long unique prompts evicts another
tenant's cached prefix, and a quota on the flooder stops that."""

from __future__ import annotations

import pytest

from kvops.engine.config import EngineConfig
from kvops.engine.errors import InvalidRequestError
from kvops.engine.invariants import check_invariants
from kvops.engine.llm import LLM
from kvops.engine.sampling import SamplingParams

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def small_llm() -> LLM:
    # 45 blocks of 16 tokens; a max-length request (256 tokens) takes 16.
    return LLM(EngineConfig(kv_cache_memory="32MiB", max_model_len=256))


def _victim_hit_rate(llm: LLM, victim: str, flooder: str | None, rounds: int = 6) -> float:
    engine = llm.engine
    prefix = [100 + (i % 50) for i in range(96)]  # six full blocks shared by every victim prompt
    before = engine.snapshot(include_gpu=False).tenants.get(victim)
    queried0 = before.prompt_tokens_total if before else 0
    hits0 = before.hit_tokens_total if before else 0
    for r in range(rounds):
        llm.generate([[*prefix, 7000 + r, 7001 + r]], ONE_TOKEN, tenants=[victim])
        if flooder is not None:
            for f in range(3):  # 3 × 15 unique blocks: more than the pool holds besides the victim's
                llm.generate([[9000 + 97 * r + 13 * f + (i % 11) for i in range(240)]], ONE_TOKEN, tenants=[flooder])
    after = engine.snapshot(include_gpu=False).tenants[victim]
    return (after.hit_tokens_total - hits0) / (after.prompt_tokens_total - queried0)


def test_quota_keeps_a_flooding_tenant_from_evicting_others(small_llm):
    alone = _victim_hit_rate(small_llm, "victim-alone", None)
    flooded = _victim_hit_rate(small_llm, "victim-flooded", "flood-free")
    small_llm.engine.set_tenant_quota("flood-capped", 16)
    protected = _victim_hit_rate(small_llm, "victim-protected", "flood-capped")
    snap = small_llm.engine.snapshot(include_gpu=False)
    assert alone > 0.6
    assert flooded < 0.5 * alone  # without a quota the flood wipes the victim's prefix
    assert snap.tenants["victim-flooded"].evictions_suffered > 0
    assert snap.tenants["flood-free"].evictions_caused > 0
    assert protected >= 0.9 * alone
    # it may evict stale blocks while growing to its quota, never more than that
    assert snap.tenants["flood-capped"].evictions_caused <= 16
    assert snap.tenants["flood-capped"].blocks_owned <= 16 and snap.tenants["flood-capped"].quota_blocks == 16
    check_invariants(small_llm.engine.block_manager)


def test_quota_smaller_than_one_request_is_refused(small_llm):
    with pytest.raises(InvalidRequestError, match=r"must hold one request of max_model_len 256 \(16 blocks\)"):
        small_llm.engine.set_tenant_quota("tiny", 4)


def test_quota_limited_tenant_waits_while_others_proceed(small_llm):
    engine = small_llm.engine
    engine.set_tenant_quota("capped", 16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    capped = [engine.add_request([200 + i] * 120, params, tenant="capped") for i in range(3)]  # 8 blocks each
    free_rider = engine.add_request([300] * 40, params, tenant="other")
    owned_max = 0
    finished: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
        owned_max = max(owned_max, engine.block_manager.owned["capped"])
    assert set(finished) == {*capped, free_rider}
    assert owned_max <= 16
    assert finished.index(free_rider) < finished.index(capped[-1])  # not stuck behind the capped tenant
    check_invariants(engine.block_manager)
