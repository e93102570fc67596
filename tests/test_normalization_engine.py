"""Prompt normalization on the real engine: `on` raises the hit rate of whitespace-noisy
prompts, and `shadow` predicts that rate beforehand while serving prompts unchanged."""

from __future__ import annotations

from kvops.engine.config import EngineConfig
from kvops.engine.llm import LLM
from kvops.engine.sampling import SamplingParams

BASE = (
    "You are a support assistant for a bakery. Answer briefly and politely. The bakery opens at seven, "
    "closes at six, sells sourdough, rye and croissants, and takes orders by phone. Question number {}: "
    "what time do you open?"
)
NOISE = ["{}", "{}  ", "  {}", "{}\r\n", "{}\n\n\n", "{}\u00a0", "\t{}", "{} \u200b"]


def _noisy_prompts() -> list[str]:
    prompts = []
    for i, wrap in enumerate(NOISE * 2):
        text = BASE.format(i % 3).replace(". ", ".  " if i % 2 else ". ").replace(", ", ",\u00a0" if i % 3 else ", ")
        prompts.append(wrap.format(text))
    return prompts


def _run(llm: LLM, tenant: str) -> float:
    engine = llm.engine
    for prompt in _noisy_prompts():
        llm.generate([engine.prepare_prompt(prompt, tenant)], SamplingParams(temperature=0, max_tokens=1),
                     tenants=[tenant])
    stats = engine.snapshot(include_gpu=False).tenants[tenant]
    return stats.hit_tokens_total / stats.prompt_tokens_total


def test_shadow_predicts_and_on_delivers_the_gain():
    llm = LLM(EngineConfig(kv_cache_memory="64MiB", max_model_len=512, block_size=8))
    llm.engine.set_normalization("shadow")
    served_raw = _run(llm, "shadow-tenant")
    predicted = llm.engine.snapshot(include_gpu=False).prefix_cache.shadow_hit_rate
    llm.engine.set_normalization("on")
    measured = _run(llm, "on-tenant")
    assert measured > served_raw + 0.2
    assert abs(measured - predicted) <= 0.05
    assert llm.engine.snapshot(include_gpu=False).prefix_cache.normalization == "on"


def test_with_prefix_caching_off_the_engine_measures_what_it_would_have_hit(llm):
    engine = llm.engine
    engine.block_manager.set_prefix_caching(False)
    try:
        before = engine.snapshot(include_gpu=False).prefix_cache
        llm.generate([BASE.format(1), BASE.format(2), BASE.format(1)], SamplingParams(temperature=0, max_tokens=2))
        after = engine.snapshot(include_gpu=False).prefix_cache
    finally:
        engine.block_manager.set_prefix_caching(True)
    assert after.hits_total == before.hits_total  # nothing was served from the cache...
    queried = after.potential_queries_total - before.potential_queries_total
    hits = after.potential_hits_total - before.potential_hits_total
    assert queried == 3 * len(engine.tokenizer(BASE.format(1)).input_ids)
    assert hits >= 2 * 16 * (len(engine.tokenizer(BASE.format(1)).input_ids) // 16 - 1)  # ...but would have been
    assert after.potential_hit_rate > 0
