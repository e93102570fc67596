"""What masks and shared salts would reuse, measured by the gateway, and the rules that propose them:
prompt_variance's mask for a tenant whose prompts carry timestamps or ids, and salt_split's move of an isolated
tenant into the namespace that cached its text.

The shadow caches are exercised directly and through the real gateway app (in front of the recording upstream of
gateway_servers: a stand-in for vLLM's request parsing, as in test_gateway_fixes); the rules' inputs are synthetic
snapshots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from kvops.gateway.accounting import TenantStatsList
from kvops.gateway.shadow import CHUNK_CHARS, ShadowReuse, prompt_texts
from kvops.history import EngineHistory
from kvops.rules import evaluate_all
from kvops.schema.diagnosis import Diagnosis, FixKind, Severity
from kvops.supervisor.gateway_tenants import gateway_tenant
from tests.helpers.gateway_servers import ADMIN, Recorder, auth, gateway_in_front_of, serving
from tests.helpers.synthetic import T0
from tests.test_gateway_fixes import SHARED, gateway_view
from tests.test_rules_kv_events import history, vllm

WHOLE = len(SHARED) // CHUNK_CHARS * CHUNK_CHARS  # what a cache can reuse of SHARED: its whole chunks


def stamped(i: int) -> dict[str, Any]:
    """A prompt that starts with a timestamp and a request id, then the shared text: nothing is ever reused."""
    return {"prompt": f"time 2026-12-04T06:{i % 60:02d}:{i % 7:02d}Z request {i:08x}-aaaa-4bbb-8ccc-{i:012x}\n"
                      + SHARED + f"question {i}"}


# ------------------------------------------------------------------ the shadow caches


def test_masked_prompts_are_reused_where_neither_as_sent_nor_normalized_are():
    shadow = ShadowReuse()
    seen = [shadow.observe("tenant:a", prompt_texts(stamped(i))) for i in range(6)]
    assert all(r.reused == 0 and r.normalized_reused == 0 for r in seen)
    assert seen[0].masked_reused == 0 and all(r.masked_reused >= WHOLE - CHUNK_CHARS for r in seen[1:])
    assert seen[0].volatile == {"timestamp": 20, "uuid": 36}
    # A prompt without volatile values gains nothing from the masked cache.
    plain = [shadow.observe("tenant:b", prompt_texts({"prompt": SHARED + f"q{i}"})) for i in range(3)]
    assert all(r.masked_reused == r.normalized_reused == r.reused and not r.volatile for r in plain)


def test_the_unsalted_cache_counts_what_only_sharing_a_namespace_would_reuse():
    shadow = ShadowReuse()
    assert shadow.observe("tenant:a", prompt_texts({"prompt": SHARED})).shareable == {}
    first = shadow.observe("tenant:b", prompt_texts({"prompt": SHARED}))
    assert first.reused == 0 and first.shareable == {"tenant:a": WHOLE}
    # b has it under its own salt now: sharing would add nothing
    assert shadow.observe("tenant:b", prompt_texts({"prompt": SHARED})).shareable == {}
    # a shared tenant (no salt) is the namespace "shared"; a different text shares nothing
    assert shadow.observe(None, prompt_texts({"prompt": SHARED})).shareable == {"tenant:b": WHOLE}
    assert shadow.observe("group:ops", prompt_texts({"prompt": "other " * 100})).shareable == {}
    assert shadow.observe("tenant:c", prompt_texts({"prompt": SHARED + "more"})).shareable == {"shared": WHOLE}


def test_the_gateway_serves_and_the_supervisor_reads_what_masks_and_sharing_would_reuse(tmp_path: Path):
    recorder = Recorder()
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path) as (url, _):
        for i in range(4):
            response = httpx.post(f"{url}/v1/completions", json={"model": "m", "max_tokens": 2, **stamped(i)},
                                  headers=auth("team-a"))
            assert response.status_code == 200, response.text
        body = {"model": "m", "max_tokens": 2, "prompt": SHARED + "hello"}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth("team-b")).status_code == 200
        stats = TenantStatsList.model_validate(httpx.get(f"{url}/stats/tenants").json())
        metrics = httpx.get(f"{url}/metrics").text
        # masks are off: the upstream got every timestamp as sent
        assert all("2026-12-04T06" in b["prompt"] for b in recorder.bodies[:4])
        assert httpx.get(f"{url}/admin/tenants", headers=ADMIN).status_code == 200
    a, b = (gateway_tenant(next(t for t in stats.tenants if t.tenant == name)) for name in ("team-a", "team-b"))
    assert a.reusable_chars_total == 0 and a.masked_reusable_chars_total >= 3 * (WHOLE - CHUNK_CHARS)
    assert a.volatile_chars_total == {"timestamp": 4 * 20, "uuid": 4 * 36}
    # team-a's prompts start with a timestamp: no chunk of team-b's prompt is found in front of them
    assert b.shareable_chars_total == {} and a.shareable_chars_total == {}
    assert 'kvops_gateway_reusable_prompt_chars_total{form="masked",tenant="team-a"}' in metrics
    assert 'kvops_gateway_volatile_prompt_chars_total{pattern="uuid",tenant="team-a"} 144.0' in metrics


def test_sharing_is_counted_per_namespace_through_the_gateway(tmp_path: Path):
    recorder = Recorder()
    with serving(recorder.app) as upstream, gateway_in_front_of(upstream, tmp_path) as (url, _):
        for tenant in ("team-a", "team-b"):
            body = {"model": "m", "max_tokens": 2, "prompt": SHARED + f"from {tenant}"}
            assert httpx.post(f"{url}/v1/completions", json=body, headers=auth(tenant)).status_code == 200
        stats = TenantStatsList.model_validate(httpx.get(f"{url}/stats/tenants").json())
        metrics = httpx.get(f"{url}/metrics").text
    b = gateway_tenant(next(t for t in stats.tenants if t.tenant == "team-b"))
    assert b.cache == "isolated" and b.shareable_chars_total == {"tenant:team-a": WHOLE}
    assert (f'kvops_gateway_shareable_prompt_chars_total{{namespace="tenant:team-a",tenant="team-b"}} {WHOLE}.0'
            in metrics)


# ------------------------------------------------------------------ prompt_variance: masks


def fired(h: EngineHistory, rule: str) -> list[Diagnosis]:
    return [d for d in evaluate_all(h, None, T0) if d.rule == rule]


def stamped_scene(normalize: bool = False, mask: tuple[str, ...] = (), normalized: float = 0.1,
                  masked: float = 0.7, volatile: tuple[str, ...] = ("timestamp", "uuid")):
    def scene(i: int, t: float) -> dict[str, Any]:
        snap = vllm(i, hits=300)
        return {**snap, "unknown": [f for f in snap["unknown"] if f != "tenants"],
                "tenants": {"support": {"prompt_tokens_total": 1000 * i, "hit_tokens_total": 100 * i}},
                "gateway": gateway_view({"support": {
                    "normalize": normalize, "mask": list(mask), "prompt_chars_total": 4000 * i,
                    "reusable_chars_total": 200 * i, "normalized_reusable_chars_total": int(normalized * 4000) * i,
                    "masked_reusable_chars_total": int(masked * 4000) * i,
                    "volatile_chars_total": {p: 56 * i for p in volatile}}})}

    return scene


def test_prompt_variance_behind_a_gateway_masks_the_volatile_values_it_found():
    [d] = fired(history(stamped_scene()), "prompt_variance")
    assert d.severity is Severity.WARNING and d.subject == "support"
    assert d.fix is not None and d.fix.kind is FixKind.GATEWAY
    assert d.fix.params == {"tenant": "support", "normalize": True, "mask": ["timestamp", "uuid"]}
    assert d.evidence["masked_reusable_share"] == pytest.approx(0.7) and d.evidence["gap"] == pytest.approx(0.65)
    assert d.evidence["volatile_patterns"] == "timestamp,uuid" and "timestamp, uuid" in d.summary
    assert [(o.measure, o.subject) for o in d.fix.objectives] == [("tenant_hit_rate", "support")]


def test_normalization_comes_first_and_a_mask_already_set_is_not_proposed_again():
    [d] = fired(history(stamped_scene(normalized=0.6)), "prompt_variance")
    assert d.fix is not None and d.fix.params == {"tenant": "support", "normalize": True}
    # normalization on, the timestamps masked already: only the ids are added
    [d] = fired(history(stamped_scene(normalize=True, mask=("timestamp",))), "prompt_variance")
    assert d.fix is not None and d.fix.params["mask"] == ["timestamp", "uuid"]
    assert d.evidence["gap"] == pytest.approx(0.6)
    assert not fired(history(stamped_scene(normalize=True, mask=("timestamp", "uuid"))), "prompt_variance")
    assert not fired(history(stamped_scene(volatile=())), "prompt_variance")  # no value to mask
    assert not fired(history(stamped_scene(masked=0.15)), "prompt_variance")  # +10%: too little


# ------------------------------------------------------------------ salt_split


def split_scene(cache_b: str = "isolated", namespace: str = "tenant:a", share: float = 0.5, cache_a: str = "isolated"):
    def scene(i: int, t: float) -> dict[str, Any]:
        snap = vllm(i, hits=300)
        return {**snap, "unknown": [f for f in snap["unknown"] if f != "tenants"],
                "tenants": {"b": {"prompt_tokens_total": 1000 * i, "hit_tokens_total": 100 * i}},
                "gateway": gateway_view({
                    "a": {"cache": cache_a, "prompt_chars_total": 4000 * i},
                    "b": {"cache": cache_b, "prompt_chars_total": 4000 * i,
                          "shareable_chars_total": {namespace: int(share * 4000) * i, "group:x": 40 * i}}})}

    return scene


def test_an_isolated_tenant_sharing_text_with_a_group_is_moved_into_it():
    [d] = fired(history(split_scene(namespace="group:ops", cache_a="group:ops")), "salt_split")
    assert d.subject == "b" and d.severity is Severity.INFO and d.evidence["shareable_share"] == pytest.approx(0.5)
    assert d.fix is not None and d.fix.kind is FixKind.GATEWAY
    assert d.fix.params == {"tenant": "b", "cache": "group:ops"}
    assert [(o.measure, o.subject) for o in d.fix.objectives] == [("tenant_hit_rate", "b")]
    assert "'group:ops' namespace ('a')" in d.summary and "50%" in d.summary
    [d] = fired(history(split_scene(namespace="shared", cache_a="shared")), "salt_split")
    assert d.fix is not None and d.fix.params == {"tenant": "b", "cache": "shared"}


def test_two_isolated_tenants_get_advice_and_shared_or_small_overlaps_nothing():
    [d] = fired(history(split_scene()), "salt_split")
    assert d.fix is not None and d.fix.kind is FixKind.REPORT and "'b' and 'a'" in d.fix.description
    assert "isolated tenant 'a'" in d.summary
    assert not fired(history(split_scene(share=0.1)), "salt_split")
    assert not fired(history(split_scene(cache_b="group:ops")), "salt_split")  # only isolated tenants are moved
