"""The rules catalog: one module per rule, each a pure function of an engine's history.

A rule module defines `RULE_ID` (stable, snake_case), `TITLE`, `DESCRIPTION`, a pydantic
`Settings` model (its thresholds, unknown keys rejected) and
`evaluate(history, settings, now) -> list[Diagnosis]`, and may set `CLEAR_FOR_S`: how long the
supervisor holds a diagnosis after the rule stopped raising it (kvops.supervisor.hysteresis).
`now` is unix seconds, passed in so rules never read the clock (and tests replay any moment). A
rule returns [] when the data is too thin to decide: it never guesses. See docs/rules.md for the catalog.

One problem, one diagnosis: where two rules see the same fact, one from better numbers than the other (the
KV events against the aggregate counters), `SUPERSEDED` says which diagnosis gives way, and `evaluate_all`
drops it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Generic, TypeVar

import structlog
from pydantic import BaseModel

from kvops.history import EngineHistory
from kvops.rules import (
    aborted_requests,
    block_size_mismatch,
    crash_loop,
    engine_down,
    gateway_down,
    host_bound,
    kv_oom_runtime,
    kv_oom_start,
    kv_quant_error,
    latency_slo,
    low_hit_cause,
    no_prefix_hits,
    prefix_cache_thrash,
    prefix_caching_off,
    prompt_variance,
    queueing,
    salt_split,
    swap_storm,
    tenant_pollution,
)
from kvops.schema.diagnosis import Diagnosis, FixKind

log = structlog.get_logger(__name__)

SettingsT = TypeVar("SettingsT", bound=BaseModel)

DEFAULT_CLEAR_FOR_S = 30.0  # a rule's diagnosis is held this long after the rule stopped raising it


@dataclass(frozen=True)
class Rule(Generic[SettingsT]):
    id: str
    evaluate: Callable[[EngineHistory, SettingsT, float], list[Diagnosis]]
    settings_type: type[SettingsT]
    description: str
    clear_for_s: float = DEFAULT_CLEAR_FOR_S


def _rule(module: ModuleType) -> Rule[Any]:
    return Rule(id=module.RULE_ID, evaluate=module.evaluate, settings_type=module.Settings,
                description=module.DESCRIPTION, clear_for_s=getattr(module, "CLEAR_FOR_S", DEFAULT_CLEAR_FOR_S))


_MODULES = (
    engine_down,
    crash_loop,
    gateway_down,
    kv_oom_start,
    kv_oom_runtime,
    swap_storm,
    tenant_pollution,
    prompt_variance,
    salt_split,
    prefix_caching_off,
    block_size_mismatch,
    kv_quant_error,
    host_bound,
    queueing,
    aborted_requests,
    latency_slo,
    no_prefix_hits,
    prefix_cache_thrash,
    low_hit_cause,
)

RULES: dict[str, Rule[Any]] = {rule.id: rule for rule in map(_rule, _MODULES)}


@dataclass(frozen=True)
class Supersession:
    """When rule `winner` raises a diagnosis for an engine, that engine's diagnoses of rule `loser` for which
    `applies(winner's, loser's)` holds are dropped: they say the same thing from thinner numbers."""

    winner: str
    loser: str
    applies: Callable[[Diagnosis, Diagnosis], bool]


def _low_hit_note(_: Diagnosis, other: Diagnosis) -> bool:
    # prompt_variance's low-hit-rate note on a server without normalization (advice, no root variants named);
    # a kvops engine's shadow-mode proposal is an admin fix and stays.
    return other.fix is not None and other.fix.kind is FixKind.REPORT and not prompt_variance.from_events(other)


SUPERSEDED: tuple[Supersession, ...] = (
    # low_hit_cause names the measured cause of what no_prefix_hits and prompt_variance's note guess at.
    Supersession(low_hit_cause.RULE_ID, no_prefix_hits.RULE_ID, lambda mine, other: True),
    Supersession(low_hit_cause.RULE_ID, prompt_variance.RULE_ID, _low_hit_note),
    Supersession(low_hit_cause.RULE_ID, block_size_mismatch.RULE_ID,
                 lambda mine, other: mine.evidence.get("cause") == low_hit_cause.SHORT_PROMPTS
                 and low_hit_cause.blocked_only(other)),
    # Roots differing in a few tokens are why no prefix is shared: prompt_variance names the tokens.
    Supersession(prompt_variance.RULE_ID, low_hit_cause.RULE_ID,
                 lambda mine, other: prompt_variance.from_events(mine)
                 and other.evidence.get("cause") == low_hit_cause.NO_SHARED_PREFIX),
    # Eviction before reuse is thrash seen from the hit rate: the re-stores measure it directly (and explain
    # the hits no_prefix_hits misses, where the histograms are too thin for low_hit_cause to name it).
    Supersession(prefix_cache_thrash.RULE_ID, low_hit_cause.RULE_ID,
                 lambda mine, other: other.evidence.get("cause") == low_hit_cause.EVICTION_BEFORE_REUSE),
    Supersession(prefix_cache_thrash.RULE_ID, no_prefix_hits.RULE_ID, lambda mine, other: True),
)


def without_superseded(diagnoses: list[Diagnosis]) -> list[Diagnosis]:
    """`diagnoses` (of one engine) less those another one supersedes (`SUPERSEDED`), order kept. Judged on the
    whole list: a diagnosis that gives way to one rule still supersedes another's."""
    dropped: set[int] = set()
    for rule in SUPERSEDED:
        winners = [d for d in diagnoses if d.rule == rule.winner]
        for index, other in enumerate(diagnoses):
            if other.rule == rule.loser and any(rule.applies(mine, other) for mine in winners
                                                if mine.engine == other.engine):
                dropped.add(index)
    return [d for index, d in enumerate(diagnoses) if index not in dropped]


def evaluate_all(history: EngineHistory, settings_by_rule: Mapping[str, BaseModel] | None,
                 now: float, errors: Counter[str] | None = None) -> list[Diagnosis]:
    """Every rule, with its settings (the defaults when absent). A rule that raises is logged, counted in
    `errors` (by rule id) and skipped: one broken rule must not blind the others. A diagnosis another one
    supersedes (`SUPERSEDED`) is dropped."""
    settings_by_rule = settings_by_rule or {}
    for unknown in sorted(set(settings_by_rule) - set(RULES)):
        log.warning("settings for an unknown rule ignored", rule=unknown, engine=history.engine)
    diagnoses: list[Diagnosis] = []
    for rule in RULES.values():
        try:
            settings = settings_by_rule.get(rule.id)
            if settings is None:
                settings = rule.settings_type()
            if not isinstance(settings, rule.settings_type):
                raise TypeError(f"settings for {rule.id} are a {type(settings).__name__}, "
                                f"not {rule.settings_type.__name__}")
            diagnoses.extend(rule.evaluate(history, settings, now))
        except Exception:
            log.exception("rule failed", rule=rule.id, engine=history.engine)
            if errors is not None:
                errors[rule.id] += 1
    return without_superseded(diagnoses)
