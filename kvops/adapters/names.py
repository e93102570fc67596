"""Metric names across a server's versions, and reading a scrape through them.

Each engine module (vllm.py, sglang.py) keeps one table of `MetricSource`s: for a snapshot field, the metric
names that carry it, newest first, and the version or flag that provides them. The adapter reads through a
`Reader`, which tries the names in order and records which one it found (`Snapshot.metrics_read`, for doctor's
`-v`), or marks the field unknown. The same table gives doctor's "could not check" lines their remedy, and
docs/doctor.md its names table (tests/test_adapters.py checks the two agree).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from kvops.adapters.prometheus import Scrape
from kvops.schema.snapshot import RankStats

# Labels that tell ranks of one server apart: vLLM V1's `engine` (one per data-parallel engine core), the
# tensor / data / pipeline parallel ranks SGLang adds, and SGLang's prefill / decode role when disaggregated.
RANK_LABELS = ("engine", "dp_rank", "tp_rank", "pp_rank", "engine_type")


@dataclass(frozen=True, slots=True)
class MetricSource:
    field: str  # the snapshot field, as a dotted path
    names: tuple[str, ...]  # newest first; the first one present wins
    provided_by: str  # which version or flag provides them: doctor's remedy when none is there


def table(*sources: MetricSource) -> dict[str, MetricSource]:
    return {source.field: source for source in sources}


class Reader:
    """A scrape read into a snapshot's JSON form through one engine's names table."""

    def __init__(self, scrape: Scrape, data: dict[str, Any], sources: dict[str, MetricSource]) -> None:
        self.scrape, self.data, self.sources = scrape, data, sources
        self.read: dict[str, list[str]] = data.setdefault("metrics_read", {})

    def name(self, field: str) -> str | None:
        """The first of the field's names the scrape has (recorded as read), else None."""
        for name in self.sources[field].names:
            if self.scrape.has(name) or self.scrape.has(f"{name}_bucket"):
                self.note(field, name)
                return name
        return None

    def value(self, field: str, mean: bool = False) -> float | None:
        """The field's value (summed over ranks, or their mean for a fraction); None and unknown if absent."""
        name = self.name(field)
        value = None if name is None else (self.scrape.mean(name) if mean else self.scrape.value(name))
        if value is None:
            self.unknown(field)
        elif value < 0:
            self.problem(f"{name} = {value:g}: negative, which a count or a fraction cannot be")
        return value

    def counts(self, *fields: str) -> None:
        """Each field's value, rounded to a whole count, into its place in the snapshot ("requests.running" ->
        data["requests"]["running"]); an absent one stays unknown."""
        for field in fields:
            value = self.value(field)
            if value is not None:
                section, key = field.split(".")
                self.data[section][key] = round(value)

    def note(self, field: str, *names: str) -> None:
        """Record metrics read for a field outside the table's lookups (labels of an info metric, ...)."""
        self.read.setdefault(field, []).extend(n for n in names if n not in self.read.get(field, []))

    def unknown(self, field: str) -> None:
        self.data["unknown"].append(field)

    def problem(self, text: str) -> None:
        """A value the server reported that cannot be right: a metrics problem, not a diagnosis."""
        self.data.setdefault("data_problems", []).append(text)

    def fraction(self, field: str, name: str, value: float) -> float:
        """A 0..1 gauge as reported, clamped into range; out of range is a data problem."""
        if not 0.0 <= value <= 1.0:
            self.problem(f"{name} = {value:g}: a fraction outside 0..1 (read as {min(1.0, max(0.0, value)):g})")
        return min(1.0, max(0.0, value))


def ranks(scrape: Scrape, usage: str | None, running: str | None, waiting: str | None) -> list[RankStats]:
    """The server's ranks, when its gauges carry rank labels with more than one value: KV usage, running and
    waiting per rank. Empty for a single rank."""
    per_rank: dict[tuple[tuple[str, str], ...], dict[str, float]] = defaultdict(dict)
    for key, name in (("kv_usage", usage), ("running", running), ("waiting", waiting)):
        for labels, value in scrape.samples.get(name or "", []):
            rank = tuple((label, labels[label]) for label in RANK_LABELS if label in labels)
            if rank:
                per_rank[rank][key] = per_rank[rank].get(key, 0.0) + value
    if len(per_rank) < 2:
        return []
    return [RankStats(labels=dict(rank), kv_usage=values.get("kv_usage"),
                      running=None if "running" not in values else round(values["running"]),
                      waiting=None if "waiting" not in values else round(values["waiting"]))
            for rank, values in sorted(per_rank.items())]
