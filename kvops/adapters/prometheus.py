"""A Prometheus text scrape, flattened to what the adapters ask of it: a sample's value summed over its
label sets, a label's values, and a histogram's buckets.

Parsed with `prometheus_client.parser.text_string_to_metric_families`. Sums over labels because a server
exports one series per model, engine or tensor-parallel rank, and the adapters want the server's total.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


class ScrapeError(ValueError):
    """The text is not the Prometheus exposition format; the message says where it broke."""


@dataclass
class Scrape:
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # family name -> counter | gauge | histogram | ...
    damaged_lines: list[str] = field(default_factory=list)  # lines dropped because they did not parse

    @classmethod
    def parse(cls, text: str) -> Scrape:
        """Parse the scrape; a scrape cut off mid-line (a dropped connection, a truncated file) loses only the
        lines that do not parse, which are kept in `damaged_lines`."""
        try:
            return cls._parse(text)
        except ScrapeError:
            pass
        kept, damaged = [], []
        for line in text.splitlines():
            if line.strip() and not line.startswith("#"):
                try:
                    list(text_string_to_metric_families(line + "\n"))
                except (ValueError, TypeError, IndexError):
                    damaged.append(line)
                    continue
            kept.append(line)
        scrape = cls._parse("\n".join(kept) + "\n")
        scrape.damaged_lines = damaged
        return scrape

    @classmethod
    def _parse(cls, text: str) -> Scrape:
        samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        types: dict[str, str] = {}
        try:
            for family in text_string_to_metric_families(text):
                types[family.name] = family.type
                for sample in family.samples:
                    samples[sample.name].append((dict(sample.labels), float(sample.value)))
        except (ValueError, TypeError, IndexError) as exc:
            raise ScrapeError(f"not Prometheus text exposition format: {exc}") from None
        return cls(dict(samples), types)

    @property
    def names(self) -> set[str]:
        return set(self.samples)

    def has(self, name: str) -> bool:
        return name in self.samples

    def value(self, name: str) -> float | None:
        """The sum over every label set (None when the sample is absent or not a number)."""
        series = self.samples.get(name)
        if not series:
            return None
        total = sum(v for _, v in series)
        return None if math.isnan(total) else total

    def mean(self, name: str) -> float | None:
        """The mean over label sets: for fractions (one usage gauge per engine of a data-parallel server)."""
        series = self.samples.get(name)
        if not series:
            return None
        mean = sum(v for _, v in series) / len(series)
        return None if math.isnan(mean) else mean

    def first(self, *names: str) -> tuple[str, float] | None:
        """The first of `names` present, with its value: newer names first, older fallbacks after."""
        for name in names:
            value = self.value(name)
            if value is not None:
                return name, value
        return None

    def label(self, name: str, label: str) -> str | None:
        for labels, _ in self.samples.get(name, []):
            if label in labels:
                return labels[label]
        return None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Values of one sample per value of `label`, summed over the other labels."""
        out: dict[str, float] = defaultdict(float)
        for labels, value in self.samples.get(name, []):
            if label in labels:
                out[labels[label]] += value
        return dict(out)

    def histogram(self, base: str) -> tuple[list[float], list[int], float, int] | None:
        """Upper bounds (without +Inf), per-bucket counts (not cumulative; one more than bounds: above the
        last), sum and count, summed over label sets. None when the histogram is absent."""
        buckets = self.samples.get(f"{base}_bucket")
        if not buckets:
            return None
        cumulative: dict[float, float] = defaultdict(float)
        for labels, value in buckets:
            try:
                cumulative[float(labels.get("le", "nan"))] += value
            except ValueError:
                continue
        bounds = sorted(b for b in cumulative if not math.isnan(b))
        finite = [b for b in bounds if not math.isinf(b)]
        total = cumulative.get(math.inf, self.value(f"{base}_count") or 0.0)
        counts: list[int] = []
        previous = 0.0
        for bound in finite:
            counts.append(max(0, round(cumulative[bound] - previous)))
            previous = cumulative[bound]
        counts.append(max(0, round(total - previous)))
        return finite, counts, self.value(f"{base}_sum") or 0.0, round(total)
