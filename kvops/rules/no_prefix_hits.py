"""Prefix caching is on but (almost) nothing hits: the cache costs memory and lookups and saves no prefill.

Over the window (counter deltas, since caching or the normalization mode last changed), at least
`min_queried_tokens` prompt tokens were looked up and at most `max_hit_rate` of them hit. The usual causes,
named in the diagnosis when the numbers point at one: shared prefixes shorter than one block (only full
blocks are cached: block_size_mismatch's `prefix_blocked`), hybrid or sliding-window models (vLLM disables
or limits prefix caching for them), per-request cache salts, chat templates that put a date or a timestamp
before the shared part.

One problem, one diagnosis: on a kvops engine with normalization `off` or `shadow`, prompt_variance owns a
low hit rate (normalization may help; it measures that), except when shadow mode measured that normalized
prompts hit no better. On vLLM and SGLang, prompt_variance's low-hit-rate note yields to this rule at or
below `NEAR_ZERO_HIT_RATE`.
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.kinds import Capability, profile_of
from kvops.rules.common import (
    WindowRuleSettings,
    cache_lookups,
    covered_steady_span,
    diagnosis,
    fresh_latest,
    rounded,
)
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity
from kvops.schema.snapshot import Snapshot

RULE_ID = "no_prefix_hits"
FULL_POOL_USAGE = 0.95  # KV usage from which the pool is too full to keep cached blocks
TITLE = "Prefix caching is on but nothing hits"
DESCRIPTION = "prefix caching is on and many prompt tokens were looked up, but (almost) none hit"

# The hit rate at or below which this rule, not prompt_variance, reports a server without normalization.
NEAR_ZERO_HIT_RATE = 0.01

# Model-name fragments of hybrid (attention + state-space) and sliding-window families, whose prefix caching
# vLLM disables or restricts. A hint only: the summary says "may".
HYBRID_HINTS = ("gemma-2", "gemma2", "gemma-3", "gemma3", "jamba", "mamba", "zamba", "bamba", "falcon-h1",
                "nemotron-h", "granite-4", "qwen3-next", "minimax", "hybrid")


class Settings(WindowRuleSettings):
    min_queried_tokens: int = Field(1000, ge=1, description="prompt tokens looked up in the window")
    max_hit_rate: float = Field(NEAR_ZERO_HIT_RATE, ge=0, lt=1, description="fire at or below this hit rate")


def _mode(snap: Snapshot) -> tuple[bool, str]:
    # The same steady span as prompt_variance: switching caching or normalization changes what counts.
    return snap.engine.enable_prefix_caching, snap.prefix_cache.normalization


def _caching_on(latest: Snapshot, queries: float) -> bool:
    if latest.knows("engine.enable_prefix_caching"):
        return latest.engine.enable_prefix_caching
    return queries > 0  # not reported: lookups mean the cache is on


def _prompt_tokens(history: EngineHistory, latest: Snapshot, span: float) -> float | None:
    """The typical prompt of the window: the histogram's median, else prompt tokens per ended request."""
    if latest.knows("prompt_lengths") and latest.prompt_lengths.count > 0 and latest.prompt_lengths.p50 is not None:
        return latest.prompt_lengths.p50
    prompts = history.delta(lambda s: s.requests.prompt_tokens_total, span) or 0.0
    ended = history.delta(lambda s: s.requests.finished_total, span) or 0.0
    return prompts / ended if ended > 0 and latest.knows("requests.prompt_tokens_total") else None


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    if latest is None or not latest.knows("prefix_cache.queries_total") or not latest.knows("prefix_cache.hits_total"):
        return []
    span = covered_steady_span(history, latest, settings, _mode)
    if span is None:
        return []
    queries, hits = cache_lookups(history, span)
    if not _caching_on(latest, queries) or queries < settings.min_queried_tokens:
        return []  # off: prefix_caching_off's case
    hit_rate = hits / queries
    if hit_rate > settings.max_hit_rate:
        return []
    shadow_hit_rate = None
    if profile_of(latest).can(Capability.LIVE_NORMALIZATION):
        mode = latest.prefix_cache.normalization
        shadow_queries, shadow_hits = cache_lookups(history, span, "shadow_")
        shadow_hit_rate = shadow_hits / shadow_queries if shadow_queries > 0 else None
        # Normalization may help (off: prompt_variance proposes measuring it) or measurably does (shadow).
        if mode == "off" or (mode == "shadow" and (shadow_hit_rate is None or shadow_hit_rate > settings.max_hit_rate)):
            return []

    block_size = latest.engine.block_size if latest.knows("engine.block_size") else None
    prompt = _prompt_tokens(history, latest, span)
    # Only full blocks are shared: a prompt shorter than one block never leaves a cacheable block behind.
    short_prompts = block_size is not None and block_size > 1 and prompt is not None and prompt < block_size
    model = latest.engine.model.lower()
    hybrid = any(hint in model for hint in HYBRID_HINTS)
    salts = {t.cache_salt for t in latest.tenants.values()} if latest.knows("tenants") else set()
    causes = []
    if short_prompts:
        causes.append(f"the typical prompt ({prompt:.0f} tokens) is shorter than one block of {block_size}, so "
                      f"no shared block ever fills: a smaller --block-size (see the block size line)")
    if hybrid:
        causes.append(f"{latest.engine.model} may be a hybrid or sliding-window model, for which vLLM disables or "
                      f"limits prefix caching")
    if len(salts) > 1:
        causes.append(f"{len(salts)} different cache salts split the cache between tenants")
    # A pool held by running sequences keeps nothing cached: a shared block is evicted before the next prompt.
    full_pool = latest.knows("blocks.usage") and (latest.blocks.usage >= FULL_POOL_USAGE or (
        history.delta(lambda s: s.requests.preemptions_total, span) or 0) > 0)
    if full_pool:
        causes.insert(0, f"the KV pool is full ({latest.blocks.usage:.0%} held by running requests"
                         + (", with preemptions" if latest.requests.preemptions_total else "")
                         + "): cached blocks are evicted before the next prompt can reuse them (see the KV cache "
                           "usage line)")
    causes.append("likely shared prefixes shorter than one block, a hybrid or sliding-window model, per-request "
                  "cache salts, or a chat template that puts a date or timestamp before the shared part"
                  if not causes else "else per-request cache salts or a dated chat template")
    summary = (f"prefix caching is on but hit {hit_rate:.1%} of {queries:.0f} prompt tokens in the last "
               f"{span:.0f} s: {causes[0]}")
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.WARNING, summary,
        {
            "queried_tokens": int(queries),
            "hit_tokens": int(hits),
            "hit_rate": round(hit_rate, 4),
            "shadow_hit_rate": rounded(shadow_hit_rate),
            "block_size": block_size,
            "prompt_tokens_p50": rounded(prompt, 1),
            "short_prompts": short_prompts,
            "hybrid_model_hint": hybrid,
            "cache_salts": len(salts) if salts else None,
            "full_pool": full_pool,
            "window_s": round(span, 1),
        },
        fix=Fix(kind=FixKind.REPORT, action="advice",
                description="; ".join(causes) + "; or turn prefix caching off to save its lookups and memory"),
    )]
