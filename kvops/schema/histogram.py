"""A cumulative histogram as the snapshot carries it, and the two things every reader does with one: a quantile
from bucket counts, and the observations between two snapshots."""

from __future__ import annotations

import re
from collections.abc import Callable

from pydantic import BaseModel


class Histogram(BaseModel):
    buckets: list[float]  # upper bounds (inclusive), ascending
    counts: list[int]  # per bucket, not cumulative; one more than buckets: the last is above every bound
    sum: float
    count: int
    p50: float | None
    p95: float | None
    p99: float | None


# The percentiles every histogram reports, read off Histogram's p<q> fields: producers fill them
# through `percentile_fields`, so a percentile is added or dropped in Histogram alone.
HISTOGRAM_PERCENTILES = tuple(int(name[1:]) for name in Histogram.model_fields if re.fullmatch(r"p\d+", name))


def percentile_fields(value: Callable[[int], float | None]) -> dict[str, float | None]:
    """Histogram's percentile fields, each `value(q)` for q (in percent) in HISTOGRAM_PERCENTILES."""
    return {f"p{q}": value(q) for q in HISTOGRAM_PERCENTILES}


def bucket_quantile(bounds: list[float], counts: list[int], q: float) -> float | None:
    """Prometheus's histogram_quantile over per-bucket counts (Histogram's `counts`, the last above every
    bound): linear within the bucket holding the q-th observation; the highest bound when it falls above."""
    total = sum(counts)
    if total <= 0 or not bounds:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts[:-1]):
        if seen + count >= rank and count > 0:
            lower = bounds[index - 1] if index > 0 else 0.0
            return lower + (bounds[index] - lower) * (rank - seen) / count
        seen += count
    return bounds[-1]


def histogram_since(now: Histogram, before: Histogram | None) -> Histogram:
    """The observations of a cumulative histogram between two snapshots, with their percentiles; `now` itself
    when `before` is missing, has other buckets, or counts more (the server restarted in between)."""
    if (before is None or before.buckets != now.buckets or len(before.counts) != len(now.counts)
            or before.count > now.count):
        return now
    counts = [max(0, a - b) for a, b in zip(now.counts, before.counts, strict=True)]
    return Histogram(buckets=now.buckets, counts=counts, sum=max(0.0, now.sum - before.sum),
                     count=sum(counts), **percentile_fields(lambda q: bucket_quantile(now.buckets, counts, q / 100)))
