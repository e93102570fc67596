"""Cache health: the rules catalog run over the few snapshots doctor takes, each diagnosis turned into a
line with its evidence and the remedy for this kind of server.

Doctor has seconds, not the supervisor's hour of history. Counters are cumulative since the engine
started, so the history doctor hands the rules starts with a baseline at the engine's start (counters
zero, gauges as first seen): counter deltas then cover the whole run, and gauges show no invented trend.
The rules' windows are set to that span; their thresholds are untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from kvops.doctor.report import Check, Status
from kvops.history import EngineHistory, at_start
from kvops.kinds import Capability, Remedy, profile, profile_of
from kvops.rules import RULES, evaluate_all, kv_oom_runtime, low_hit_cause, prompt_variance
from kvops.rules.block_size_waste import CAPACITY_SUBJECT
from kvops.rules.common import capacity_fix, reclaimable_blocks
from kvops.schema.diagnosis import Diagnosis, Severity
from kvops.schema.reports import KVQuantProfile
from kvops.schema.snapshot import Snapshot

SECTION = "Cache health"
TRAFFIC_RULES = ("queueing", "aborted_requests", "latency_slo")  # shown by kvops.doctor.traffic
ENGINE = "doctor"

# The long-prompt flood has no rule (the supervisor sees it through tenant pollution and OOM risk): doctor's
# own reading of the prompt-length histogram. A flood: the slowest 1% of prompts at least FLOOD_RATIO times
# the median, holding at least FLOOD_TOKEN_SHARE of all prompt tokens, over at least FLOOD_MIN_PROMPTS.
FLOOD_RATIO = 8.0
FLOOD_TOKEN_SHARE = 0.5
FLOOD_MIN_PROMPTS = 50

SEVERITY_STATUS = {Severity.CRITICAL: Status.FAIL, Severity.WARNING: Status.WARN, Severity.INFO: Status.INFO}
# The device keys of a kind's KV pool flags (its notes "kv_pool_flag_cpu", "kv_pool_flag_cuda").
POOL_DEVICES = ("cpu", "cuda")


def pool_flag(snap: Snapshot) -> str:
    """The kind's KV pool flag for the device the snapshot knows, else the wording for every device."""
    notes = profile_of(snap).notes
    device = snap.engine.device if snap.knows("engine.device") else ""
    key = next((key for key in POOL_DEVICES if device.startswith(key)), "")
    return notes.get(f"kv_pool_flag_{key}" if key else "kv_pool_flag", "")


def external_capacity(snap: Snapshot, evidence: Mapping[str, object] | None = None) -> str:
    """The kind's capacity remedy, with the concurrency that fits when the rule sized it ("" for a kind
    without one)."""
    fit = (evidence or {}).get("fit_max_num_seqs")
    return profile_of(snap).remedy(Remedy.CAPACITY, to_fit=f" to {fit}" if fit else "", pool=pool_flag(snap))


def _block_size_fix(diagnosis: Diagnosis, snap: Snapshot) -> str:
    """The capacity fix already speaks the kind's flag (`--block-size N`) where it has one; a server kvops does
    not run is not drained."""
    if "block_size" not in profile_of(snap).flags:
        return ""
    return diagnosis.fix.description.removeprefix("drain and ") if diagnosis.fix else ""


def _reuse_capacity(diagnosis: Diagnosis, snap: Snapshot) -> str:
    """A pool too small for the reuse distance (thrash, eviction before reuse): the kind's capacity remedy and the
    pool the reused blocks need."""
    text, needed = external_capacity(snap, diagnosis.evidence), diagnosis.evidence.get("needed_blocks")
    return f"{text}; the pool needs ~{needed} blocks to keep the reused ones" if text and needed else text


def _low_hit_fix(diagnosis: Diagnosis, snap: Snapshot) -> str:
    """By cause: the pool or the block size in the kind's flags; "" for the causes whose fix is advice."""
    cause = diagnosis.evidence.get("cause")
    if cause == low_hit_cause.EVICTION_BEFORE_REUSE:
        return _reuse_capacity(diagnosis, snap)
    return _block_size_fix(diagnosis, snap) if cause == low_hit_cause.SHORT_PROMPTS else ""


ExternalRemedy = Callable[[Diagnosis, Snapshot], str]
# A server without kvops's admin API: the remedies in its own flags, by rule.
EXTERNAL_REMEDIES: dict[str, ExternalRemedy] = {
    "kv_oom_runtime": lambda d, s: external_capacity(s, d.evidence),
    "swap_storm": lambda d, s: external_capacity(s, d.evidence),
    "kv_oom_start": lambda d, s: external_capacity(s, d.evidence),
    "prompt_variance": lambda d, s: prompt_variance.EXTERNAL_ADVICE,
    "prefix_caching_off": lambda d, s: profile_of(s).remedy(Remedy.PREFIX_CACHING_ON),
    "block_size_mismatch": _block_size_fix,
    "prefix_cache_thrash": _reuse_capacity,
    "low_hit_cause": _low_hit_fix,
}


def _settings(span: float) -> dict[str, BaseModel]:
    """Each rule's defaults with its window stretched over the run (and the fewest samples it allows)."""
    out: dict[str, BaseModel] = {}
    for rule_id, rule in RULES.items():
        fields = rule.settings_type.model_fields
        overrides: dict[str, Any] = {"window_s": span} if "window_s" in fields else {}
        for samples in (2, 3):
            if "min_samples" in fields:
                overrides["min_samples"] = samples
            try:
                out[rule_id] = rule.settings_type(**overrides)
                break
            except ValidationError:
                continue
    return out


def evaluate(snaps: list[Snapshot], kv_profile: KVQuantProfile | None = None,
             overrides: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[list[Diagnosis], EngineHistory]:
    """The rules over doctor's snapshots; `overrides` sets rule settings by rule id (an SLO, say)."""
    latest = snaps[-1]
    history = EngineHistory(ENGINE, managed=False, full_rate_s=1e12, max_age_s=1e12)
    baseline = at_start(snaps[0])
    for snap in (baseline, *snaps):
        history.add(snap)
    history.kv_profile = kv_profile
    span = max(1.0, latest.time - baseline.time + 1.0)
    settings = _settings(span)
    for rule_id, values in (overrides or {}).items():
        settings[rule_id] = settings[rule_id].model_copy(update=dict(values))
    return evaluate_all(history, settings, latest.time), history


def remedy(diagnosis: Diagnosis, snap: Snapshot) -> str:
    """The diagnosis's fix as the remedy for this kind of server: with kvops's admin API, the fix as kvops run
    applies it; else the server's own flags (kvops cannot change them on a server it does not run)."""
    kind = profile_of(snap)
    if kind.can(Capability.ADMIN_API):
        if diagnosis.fix is None:
            return ""
        how = " (kvops run applies it with policy auto)" if diagnosis.fix.kind != "report" else ""
        return diagnosis.fix.description + how
    external = EXTERNAL_REMEDIES.get(diagnosis.rule)
    text = external(diagnosis, snap) if external else ""
    if not text:
        return diagnosis.fix.description if diagnosis.fix is not None and diagnosis.fix.kind == "report" else ""
    if diagnosis.fix is None or diagnosis.fix.kind == "report":
        return text
    if kind.can(Capability.MANAGED) and diagnosis.fix.kind == "restart":
        return (f"{text} (kvops run applies it to a {kind.title} it manages by restarting it; a watched one is yours "
                "to restart)")
    return f"{text} (kvops cannot apply this itself: a {snap.source} server has no kvops admin API)"


def from_diagnosis(title: str, diagnosis: Diagnosis, snap: Snapshot, section: str = SECTION) -> Check:
    """A diagnosis as a doctor line: its summary, the remedy for this kind of server, its evidence with -v."""
    detail = [f"rule {diagnosis.rule}: {diagnosis.title}"]
    detail.extend(f"{key} = {value}" for key, value in diagnosis.evidence.items())
    return Check(section=section, title=title, status=SEVERITY_STATUS[diagnosis.severity],
                 evidence=diagnosis.summary, remedy=remedy(diagnosis, snap), detail=detail, rule=diagnosis.rule)


def _pick(diagnoses: list[Diagnosis], *rules: str) -> list[Diagnosis]:
    return [d for d in diagnoses if d.rule in rules]


def cache_checks(snaps: list[Snapshot], kv_profile: KVQuantProfile | None = None,
                 kv_profile_why_not: str = "", diagnoses: list[Diagnosis] | None = None) -> list[Check]:
    latest = snaps[-1]
    if diagnoses is None:
        diagnoses, _ = evaluate(snaps, kv_profile)
    source = latest.source
    checks = [
        _usage(latest, snaps, _pick(diagnoses, kv_oom_runtime.RULE_ID), source),
        _preemptions(latest, _pick(diagnoses, kv_oom_runtime.RULE_ID), source),
        *_hit_rate(latest, _pick(diagnoses, "prompt_variance", "prefix_caching_off", "no_prefix_hits"), source,
                   any(d.evidence.get("prefix_blocked") for d in _pick(diagnoses, "block_size_mismatch"))),
        _swap(latest, _pick(diagnoses, "swap_storm"), source),
        _prompt_lengths(latest),
        *_tenants(latest, _pick(diagnoses, "tenant_pollution"), source),
        _kv_quant(latest, _pick(diagnoses, "kv_quant_error"), kv_profile, kv_profile_why_not, source),
    ]
    shown = {"kv_oom_runtime", "prompt_variance", "prefix_caching_off", "no_prefix_hits", "swap_storm",
             "tenant_pollution", "kv_quant_error", "kv_oom_start",  # kv_oom_start: Configuration's concurrency line
             *TRAFFIC_RULES}  # the Traffic section's lines
    for diagnosis in diagnoses:
        if diagnosis.rule not in shown:
            capacity = diagnosis.subject == CAPACITY_SUBJECT
            title = f"Block size {latest.engine.block_size} (KV capacity)" if capacity else diagnosis.title
            checks.append(from_diagnosis(title, diagnosis, latest))
    return checks


def unreported(title: str, snap: Snapshot, what: str, field: str = "", section: str = SECTION) -> Check:
    """A line that could not be checked: what the server lacks, and the metric (with the version or flag that
    provides it) that would make it checkable."""
    needs = profile_of(snap).missing_metric(field) if field else ""
    return Check(section=section, title=title, status=Status.SKIPPED, evidence=f"{snap.source} does not report {what}",
                 remedy=f"needs {needs}" if needs else "")


def _usage(latest: Snapshot, snaps: list[Snapshot], found: list[Diagnosis], source: str) -> Check:
    if not latest.knows("blocks"):
        return unreported("KV cache usage", latest, "KV cache usage", "blocks.usage")
    usage = latest.blocks.usage
    reclaimable = reclaimable_blocks(latest) / latest.engine.num_blocks if latest.engine.num_blocks else 0.0
    trend = ""
    if len(snaps) >= 2 and snaps[-1].time > snaps[0].time:
        slope = (snaps[-1].blocks.usage - snaps[0].blocks.usage) / (snaps[-1].time - snaps[0].time)
        trend = f", trend {slope * 100:+.2f} points/s over {snaps[-1].time - snaps[0].time:.0f} s"
    pool = (f" of {latest.engine.num_blocks} blocks" if latest.knows("engine.num_blocks") else "")
    evidence = f"{usage:.1%} in use{pool}, {reclaimable:.1%} reclaimable{trend}"
    if found:
        check = from_diagnosis("KV cache usage", found[0], latest)
        check.evidence = f"{found[0].summary} ({evidence})"
        return check
    settings = kv_oom_runtime.Settings()
    if reclaimable <= settings.exhausted_fraction and latest.requests.preemptions_total > 0:
        # A scrape or doctor's few seconds: the rule needs a trend; an exhausted pool with preemptions needs none.
        return Check(section=SECTION, title="KV cache usage", status=Status.FAIL,
                     evidence=f"pool exhausted: {evidence}, {latest.requests.preemptions_total} preemptions so far",
                     remedy=_capacity_remedy(latest), rule=kv_oom_runtime.RULE_ID)
    return Check(section=SECTION, title="KV cache usage", status=Status.OK, evidence=evidence)


def _capacity_remedy(latest: Snapshot) -> str:
    if profile_of(latest).can(Capability.ADMIN_API):  # kvops run sizes it itself: the remedy names no number
        return profile_of(latest).remedy(Remedy.CAPACITY)
    # The rule's sizing, from this one snapshot: the concurrency that fits the pool.
    _, numbers = capacity_fix(latest, [latest], kv_oom_runtime.Settings().target_usage, "")
    return external_capacity(latest, numbers)


def _preemptions(latest: Snapshot, found: list[Diagnosis], source: str) -> Check:
    if not latest.knows("requests.preemptions_total"):
        note = profile(source).notes.get("no_preemption_counter")
        why = f" ({note})" if note else ""
        return unreported("Preemptions", latest, f"preemptions{why}", "requests.preemptions_total")
    total = latest.requests.preemptions_total
    per_s = total / latest.uptime_s if latest.uptime_s > 0 else 0.0
    since = "since start" if latest.knows("uptime_s") else "over the scrape's assumed hour (no process start time)"
    evidence = f"{total} in total, {per_s:.2f}/s {since}"
    rising = [d for d in found if (d.evidence.get("preemptions_per_s_recent") or 0) > 0]
    if rising:
        check = from_diagnosis("Preemptions", rising[0], latest)
        check.evidence = f"{evidence}; {rising[0].summary}"
        return check
    threshold = kv_oom_runtime.Settings().min_preemptions_per_s
    if per_s >= threshold:  # since start: doctor's seconds are too short for the rule's halves
        return Check(section=SECTION, title="Preemptions", status=Status.WARN,
                     evidence=f"{evidence} (at least {threshold:g}/s: sequences are evicted and recomputed)",
                     remedy=_capacity_remedy(latest), rule=kv_oom_runtime.RULE_ID)
    return Check(section=SECTION, title="Preemptions", status=Status.OK, evidence=evidence)


def _hit_rate(latest: Snapshot, found: list[Diagnosis], source: str, blocked: bool = False) -> list[Check]:
    prefix = latest.prefix_cache
    title = "Prefix cache hit rate"
    kind = profile(source)
    if found:
        checks = [from_diagnosis(title, d, latest) for d in found]
        for check, diagnosis in zip(checks, found, strict=True):
            if not kind.can(Capability.SHADOW_CACHE) and diagnosis.rule == "prompt_variance":
                # The rule's summary proposes kvops's shadow normalization, which these servers lack.
                evidence = diagnosis.evidence
                check.evidence = (f"low: the prefix cache hits {evidence['hit_rate']:.1%} of "
                                  f"{evidence['queried_tokens']} prompt tokens over {evidence['requests']} requests")
        return checks
    if not latest.knows("prefix_cache.queries_total"):
        if not latest.knows("prefix_cache.hit_rate"):
            return [unreported(title, latest, "prefix-cache hits", "prefix_cache.queries_total")]
        low = prompt_variance.Settings().shadow_probe_max_hit_rate
        status = Status.INFO if prefix.hit_rate <= low else Status.OK
        return [Check(section=SECTION, title=title, status=status,
                      evidence=f"{prefix.hit_rate:.1%} (the server's own recent rate; no counters to check it over "
                               "the run)" + (f", at most {low:.0%}: low" if status is Status.INFO else ""),
                      remedy=prompt_variance.EXTERNAL_ADVICE if status is Status.INFO else "")]
    if not latest.engine.enable_prefix_caching and latest.knows("engine.enable_prefix_caching"):
        would = (f"; caching would have served {prefix.potential_hit_rate:.1%}"
                 if kind.can(Capability.SHADOW_CACHE) else "")
        return [Check(section=SECTION, title=title, status=Status.INFO, evidence=f"prefix caching is off{would}",
                      remedy=kind.remedy(Remedy.PREFIX_CACHING_ON))]
    evidence = f"{prefix.hit_rate:.1%} of {prefix.queries_total} prompt tokens"
    if blocked:  # block_size_mismatch's capacity diagnosis: prompts shorter than one block
        return [Check(section=SECTION, title=title, status=Status.INFO,
                      evidence=f"{evidence}: most prompts are shorter than one block of {latest.engine.block_size}, "
                               "so no shared block ever fills (see the block size line)",
                      rule="block_size_mismatch")]
    detail = []
    if prefix.normalization == "shadow" and prefix.shadow_queries_total:
        gain = prefix.shadow_hit_rate - prefix.hit_rate
        evidence += f"; normalized prompts would hit {prefix.shadow_hit_rate:.1%} (+{gain:.1%})"
    elif kind.can(Capability.LIVE_NORMALIZATION) and latest.knows("prefix_cache.normalization"):
        detail.append(f"normalization {prefix.normalization}: shadow mode measures what it would add "
                      "(PUT /admin/normalization {\"mode\": \"shadow\"})")
    return [Check(section=SECTION, title=title, status=Status.OK, evidence=evidence, detail=detail)]


def _swap(latest: Snapshot, found: list[Diagnosis], source: str) -> Check:
    if found:
        return from_diagnosis("Swap", found[0], latest)
    if not latest.knows("swap"):
        no_metric = profile(source).notes.get("no_swap_metric")
        if no_metric:  # nothing to swap: no metric to ask for
            return unreported("Swap", latest, f"swap ({no_metric})")
        return unreported("Swap", latest, "swap", "swap")
    swap = latest.swap
    if swap.host_blocks == 0 and swap.swapped_seqs == 0 and latest.knows("swap.swap_out_total"):
        return Check(section=SECTION, title="Swap", status=Status.OK,
                     evidence="no host swap pool: preempted sequences are recomputed")
    if not latest.knows("swap.window"):
        return Check(section=SECTION, title="Swap", status=Status.OK,
                     evidence=f"{swap.swapped_seqs} sequence(s) swapped out now (no swap rate in the scrape)")
    window = swap.window
    return Check(section=SECTION, title="Swap", status=Status.OK,
                 evidence=f"swap rate {window.swap_rate:.2f} ({window.swap_out_per_s:.1f} blocks/s out, "
                          f"{window.swap_in_per_s:.1f} in), {swap.swapped_blocks} of {swap.host_blocks} host "
                          "blocks used")


def _prompt_lengths(latest: Snapshot) -> Check:
    title = "Prompt lengths"
    hist = latest.prompt_lengths
    if not latest.knows("prompt_lengths"):
        return unreported(title, latest, "a prompt-length histogram", "prompt_lengths")
    if hist.count == 0 or hist.p50 is None or hist.p99 is None:
        return Check(section=SECTION, title=title, status=Status.SKIPPED, evidence="no finished request yet")
    evidence = f"p50 {hist.p50:.0f}, p95 {hist.p95:.0f}, p99 {hist.p99:.0f} tokens over {hist.count} requests"
    # Token share of prompts well above the median: bucket midpoints (the histogram has no raw values).
    long_from = 4 * hist.p50
    long_tokens = 0.0
    lower = 0.0
    for index, count in enumerate(hist.counts):
        upper = hist.buckets[index] if index < len(hist.buckets) else (hist.buckets[-1] if hist.buckets else 0.0)
        if lower >= long_from:
            long_tokens += count * (lower + upper) / 2
        lower = upper
    share = min(1.0, long_tokens / hist.sum) if hist.sum > 0 else 0.0
    ratio = hist.p99 / hist.p50 if hist.p50 > 0 else 0.0
    detail = [f"prompts of {long_from:.0f}+ tokens (4× the median) carry ~{share:.0%} of prompt tokens",
              f"buckets {hist.buckets}", f"counts {hist.counts}"]
    if hist.count >= FLOOD_MIN_PROMPTS and ratio >= FLOOD_RATIO and share >= FLOOD_TOKEN_SHARE:
        return Check(section=SECTION, title=title, status=Status.WARN,
                     evidence=f"long-prompt flood: {evidence}; the longest 1% are {ratio:.0f}× the median and "
                              f"carry ~{share:.0%} of prompt tokens",
                     remedy=profile_of(latest).remedy(Remedy.LONG_PROMPTS),
                     detail=detail)
    return Check(section=SECTION, title=title, status=Status.OK, evidence=evidence, detail=detail)


def _tenants(latest: Snapshot, found: list[Diagnosis], source: str) -> list[Check]:
    if not latest.knows("tenants"):
        return [unreported("Tenants", latest, "per-tenant usage")]
    if found:
        return [from_diagnosis(f"Tenant {d.subject}", d, latest) for d in found]
    tenants = latest.tenants
    detail = [f"{name}: {t.requests_total} requests, hit rate {t.hit_rate:.1%}, {t.blocks_held} blocks held, "
              f"evictions caused {t.evictions_caused} / suffered {t.evictions_suffered}" for name, t in tenants.items()]
    return [Check(section=SECTION, title="Tenants", status=Status.OK,
                  evidence=f"{len(tenants)} tenant(s), none evicting the others' cached blocks", detail=detail)]


def _kv_quant(latest: Snapshot, found: list[Diagnosis], kv_profile: KVQuantProfile | None, why_not: str,
              source: str) -> Check:
    title = "KV quantization error"
    if found:
        return from_diagnosis(title, found[0], latest)
    engine = latest.engine
    kind = profile(source)
    if kind.can(Capability.KV_QUANTIZATION) and engine.kv_cache_dtype == engine.dtype and kv_profile is None \
            and not why_not:
        return Check(section=SECTION, title=title, status=Status.OK,
                     evidence=f"KV stored in the model dtype ({engine.dtype}): nothing is quantized",
                     detail=["`--kv-quant` still profiles another dtype's error on request"])
    if kv_profile is None and not kind.can(Capability.PROFILES):
        return unreported(title, latest, "a per-layer KV quantization error profile")
    if kv_profile is None:
        return Check(section=SECTION, title=title, status=Status.SKIPPED, evidence=why_not or "not profiled",
                     remedy="kvops doctor --kv-quant (pauses serving for a few seconds)" if not why_not else "")
    worst = min(kv_profile.layers, key=lambda layer: layer.min_cosine, default=None)
    evidence = (f"{kv_profile.kv_cache_dtype}: worst layer {worst.layer} at cosine {worst.min_cosine:.4f} "
                f"(threshold {kv_profile.threshold})" if worst else f"{kv_profile.kv_cache_dtype}: no layer profiled")
    if kv_profile.flagged and kv_profile.kv_cache_dtype != engine.kv_cache_dtype:
        return Check(section=SECTION, title=title, status=Status.INFO,
                     evidence=f"{evidence}; if you switch to {kv_profile.kv_cache_dtype}, keep layers "
                              f"{','.join(map(str, kv_profile.flagged))} in the model dtype",
                     remedy=f"--kv-cache-dtype-skip-layers {','.join(map(str, kv_profile.flagged))}")
    return Check(section=SECTION, title=title, status=Status.OK, evidence=evidence,
                 detail=[f"layer {layer.layer} ({layer.kv_dtype}): {layer.min_cosine:.4f}"
                         for layer in kv_profile.layers])
