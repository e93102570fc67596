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


def _scrape(metrics) -> dict[str, dict[str, float]]:
    """{sample name: {tenant label: value}} of the per-tenant samples (histogram buckets left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        for sample in family.samples:
            if "tenant" in sample.labels and "le" not in sample.labels and "finish_reason" not in sample.labels:
                samples.setdefault(sample.name, {})[sample.labels["tenant"]] = sample.value
    return samples


def test_tenant_labels_are_capped_with_the_rest_summed_as_other(small_llm):
    from kvops.engine.serving.metrics import EngineMetrics
    from kvops.schema.snapshot import TenantStats

    cap = 4
    base = small_llm.engine.snapshot(include_gpu=False)

    def stats(i: int, grown: int = 0) -> TenantStats:
        return TenantStats(requests_total=i + grown, prompt_tokens_total=100 * i + grown, hit_tokens_total=i,
                           blocks_held=i % 3, evictions_caused=i, evictions_suffered=2 * i + grown)

    # cap + 5 tenants, one of them really named "other": it is summed into the aggregate, never its own series
    tenants = {f"t{i}": stats(i) for i in range(1, cap + 5)} | {"other": stats(50)}
    snap = base.model_copy(update={"tenants": tenants})
    metrics = EngineMetrics(lambda: snap, max_tenant_labels=cap)
    first = _scrape(metrics)
    heaviest = {"t8", "t7", "t6", "t5"}  # by prompt tokens, "other" (the heaviest) not counted
    field_of = {"kvops_tenant_requests_total": "requests_total", "kvops_tenant_prompt_tokens_total":
                "prompt_tokens_total", "kvops_tenant_prefix_hit_tokens_total": "hit_tokens_total",
                "kvops_tenant_blocks": "blocks_held", "kvops_tenant_cross_evictions_caused_total": "evictions_caused",
                "kvops_tenant_cross_evictions_suffered_total": "evictions_suffered"}
    for name, field in field_of.items():
        assert set(first[name]) == heaviest | {"other"}, name
        assert sum(first[name].values()) == sum(getattr(s, field) for s in tenants.values()), name  # sums kept
        assert first[name]["t8"] == getattr(tenants["t8"], field)
    assert first["kvops_tenant_requests_total"]["other"] == 1 + 2 + 3 + 4 + 50

    # Later: every tenant grew and a new, heavier one came. Labels stay as they were (a series moving between
    # its own label and "other" would break both counters), so every counter only grows.
    tenants = {name: stats(int(name[1:]) if name != "other" else 50, grown=7) for name in tenants}
    tenants["newcomer"] = stats(90)
    snap = base.model_copy(update={"tenants": tenants})
    metrics.observe_request_finished("newcomer", prompt_tokens=5, generation_tokens=1, finish_reason="stop")
    metrics.observe_request_finished("t8", prompt_tokens=5, generation_tokens=1, finish_reason="stop")
    second = _scrape(metrics)
    for name in field_of:
        assert set(second[name]) == heaviest | {"other"}, name
        if name.endswith("_total"):
            assert all(second[name][label] >= first[name][label] for label in second[name]), name
    assert second["kvops_tenant_requests_total"]["other"] == 1 + 2 + 3 + 4 + 50 + 5 * 7 + 90
    assert set(second["kvops_request_prompt_tokens_count"]) == {"other", "t8"}  # the event metrics follow suit
    assert metrics.tenant_labels.labelled == heaviest
