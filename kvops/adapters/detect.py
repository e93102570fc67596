"""Which server a `/metrics` scrape (and `/v1/models`) comes from: a kvops engine, vLLM or SGLang."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvops.adapters import sglang, vllm
from kvops.adapters.kvops_metrics import snapshot_from_kvops_metrics
from kvops.adapters.names import MetricSource
from kvops.adapters.prometheus import Scrape
from kvops.adapters.sglang import snapshot_from_sglang
from kvops.adapters.vllm import snapshot_from_vllm
from kvops.schema.kinds import ENGINE_KINDS, EngineKind
from kvops.schema.snapshot import Snapshot

_PREFIXES: dict[EngineKind, str] = {"kvops": "kvops_", "vllm": "vllm:", "sglang": "sglang:"}

Builder = Callable[[Scrape, float, dict[str, Any] | None, float | None], Snapshot]
BUILDERS: dict[EngineKind, Builder] = {
    "kvops": snapshot_from_kvops_metrics,
    "vllm": snapshot_from_vllm,
    "sglang": snapshot_from_sglang,
}

# The names tables of the servers kvops reads through metrics (a kvops engine sends its snapshot whole).
METRIC_SOURCES: dict[str, dict[str, MetricSource]] = {"vllm": vllm.METRICS, "sglang": sglang.METRICS}


def missing_metric(kind: str, field: str) -> str:
    """What would report `field` on this kind of server: its metric names and the version or flag that has
    them; "" when kvops has no name for it there."""
    source = METRIC_SOURCES.get(kind, {}).get(field)
    if source is None:
        return ""
    return f"{' or '.join(source.names)}, from {source.provided_by}"


def detect_flavour(scrape: Scrape | None, models: dict[str, Any] | None = None) -> EngineKind | None:
    """From the metric names (the prefix with the most series wins: a proxy may add a few of another's),
    else from `/v1/models`' `owned_by`. None: not an inference server kvops knows."""
    if scrape is not None:
        counts = {f: sum(1 for n in scrape.names if n.startswith(p)) for f, p in _PREFIXES.items()}
        best = max(counts, key=lambda f: counts[f])
        if counts[best] > 0:
            return best
    owner = str(model_card(models).get("owned_by", "")).lower()
    for flavour in ENGINE_KINDS:
        if flavour in owner:
            return flavour
    return None


def model_card(models: dict[str, Any] | None) -> dict[str, Any]:
    """The first model of a `/v1/models` answer ({} when there is none)."""
    data = (models or {}).get("data") if isinstance(models, dict) else None
    return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}


def snapshot_from_scrape(flavour: EngineKind, scrape: Scrape, t: float, models: dict[str, Any] | None = None,
                         started_at: float | None = None) -> Snapshot:
    return BUILDERS[flavour](scrape, t, model_card(models), started_at)
