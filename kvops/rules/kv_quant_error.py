"""KV quantization error: the per-layer error profile flags layers whose dequantized K/V drift.

The profile (`history.kv_profile`, taken on demand) compares each layer's dequantized cache with
full precision (cosine similarity). Flagged layers not yet kept in the model dtype are the fix:
`kv_cache_dtype_skip_layers`, merged with the layers already skipped. A profile of another dtype
(a "would int4 be safe?" probe) says nothing about the running engine and is ignored.
"""

from __future__ import annotations

from pydantic import Field

from kvops.history import EngineHistory
from kvops.rules.common import SnapshotRuleSettings, diagnosis, fresh_latest
from kvops.schema.diagnosis import Diagnosis, Fix, FixKind, Severity

RULE_ID = "kv_quant_error"
TITLE = "KV quantization error: some layers lose precision"
DESCRIPTION = "the KV error profile flags layers below the cosine threshold that are still quantized"


class Settings(SnapshotRuleSettings):
    critical_cosine: float = Field(0.9, gt=0, le=1, description="critical when a flagged layer's worst cosine "
                                                                "similarity is below this")


def _layers(layers: list[int]) -> str:
    return ",".join(str(layer) for layer in layers)


def evaluate(history: EngineHistory, settings: Settings, now: float) -> list[Diagnosis]:
    latest = fresh_latest(history, now, settings.max_snapshot_age_s)
    profile = history.kv_profile
    if latest is None or profile is None or not profile.flagged:
        return []
    engine = latest.engine
    if profile.kv_cache_dtype != engine.kv_cache_dtype:
        return []
    skipped = set(engine.kv_cache_dtype_skip_layers)
    new = sorted(set(profile.flagged) - skipped)
    if not new:
        return []  # already kept in full precision (the profile predates the restart)
    flagged = [layer for layer in profile.layers if layer.layer in new]
    worst = min(flagged, key=lambda layer: layer.min_cosine, default=None)
    proposed = sorted(skipped | set(new))
    critical = worst is not None and worst.min_cosine < settings.critical_cosine
    return [diagnosis(
        history, RULE_ID, TITLE, Severity.CRITICAL if critical else Severity.WARNING,
        f"{engine.kv_cache_dtype} KV: layer(s) {_layers(new)} below cosine {profile.threshold}"
        + (f" (worst: layer {worst.layer} at {worst.min_cosine:.4f})" if worst is not None else ""),
        {
            "kv_cache_dtype": engine.kv_cache_dtype,
            "threshold": profile.threshold,
            "flagged_layers": _layers(new),
            "flagged_count": len(new),
            "worst_layer": None if worst is None else worst.layer,
            "worst_cosine": None if worst is None else worst.min_cosine,
            "skip_layers": _layers(sorted(skipped)),
            "proposed_skip_layers": _layers(proposed),
            "layers_profiled": len(profile.layers),
            "tokens_compared": profile.tokens_compared,
        },
        fix=Fix(kind=FixKind.RESTART, action="restart_engine", params={"kv_cache_dtype_skip_layers": proposed},
                description=f"restart keeping layer(s) {_layers(proposed)} in the model dtype "
                            f"(kv_cache_dtype_skip_layers); the other layers stay {engine.kv_cache_dtype}",
                # No objective: the error shows only in the KV error profile (taken on demand), not in
                # the snapshots the judge measures; the fix is kept or rolled back by policy.
                objectives=[]),
    )]
