"""What a load run measured: per tenant and overall, and second by second."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

MAX_ERRORS = 5  # distinct error messages kept per tenant


class Latency(BaseModel):
    count: int = 0
    mean_ms: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None


def _percentile(ordered: list[float], q: float) -> float:
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency(seconds: list[float]) -> Latency:
    if not seconds:
        return Latency()
    ordered = sorted(seconds)
    ms = [1000 * v for v in (sum(ordered) / len(ordered), *(_percentile(ordered, q) for q in (50, 95, 99)))]
    return Latency(count=len(ordered), mean_ms=round(ms[0], 3), p50_ms=round(ms[1], 3), p95_ms=round(ms[2], 3),
                   p99_ms=round(ms[3], 3))


class TenantStats(BaseModel):
    tenant: str
    requests_sent: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0  # in flight when the run was stopped
    in_flight: int = 0
    peak_in_flight: int = 0
    mean_in_flight: float = 0.0  # time-averaged over the run (Little's law)
    errors: list[str] = Field(default_factory=list)  # the first few distinct messages
    prompt_tokens: int = 0  # of finished requests, as the engine counted them
    cached_tokens: int = 0
    hit_rate: float | None = None  # cached / prompt tokens
    generated_tokens: int = 0
    throughput_tok_s: float = 0.0  # generated tokens / elapsed
    requests_per_s: float = 0.0  # finished requests / elapsed
    ttft: Latency = Field(default_factory=Latency)
    itl: Latency = Field(default_factory=Latency)  # gaps between streamed tokens, over all requests
    e2e: Latency = Field(default_factory=Latency)


class Counts(BaseModel):
    """What finished in a span of the run (one second, or a window of them), of one tenant or all."""

    requests_finished: int = 0
    requests_failed: int = 0
    generated_tokens: int = 0  # streamed in the span, of requests finished or not
    prompt_tokens: int = 0  # of the requests that finished in the span
    cached_tokens: int = 0
    hit_rate: float | None = None  # cached / prompt tokens

    def add(self, other: Counts) -> None:
        self.requests_finished += other.requests_finished
        self.requests_failed += other.requests_failed
        self.generated_tokens += other.generated_tokens
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.hit_rate = _ratio(self.cached_tokens, self.prompt_tokens)


class TimelinePoint(Counts):
    t: int  # the second [t, t+1) of the run
    tenants: dict[str, Counts] = Field(default_factory=dict)


class LoadReport(BaseModel):
    url: str
    model: str
    started_at: float  # unix time
    elapsed_s: float
    complete: bool  # False: a snapshot of a running load, or a stopped one
    stopped: bool = False
    total: TenantStats
    tenants: dict[str, TenantStats]
    timeline: list[TimelinePoint]
    # The spec as run, as plain data: a saved report loads again without the trace files it replayed.
    spec: dict[str, Any]

    def window(self, start_s: float = 0.0, end_s: float | None = None, tenant: str | None = None) -> Counts:
        """The timeline summed over the seconds in [start_s, end_s), for `tenant` or all: e.g. a tenant's
        hit rate before and after a fix, or while a flood runs."""
        out = Counts()
        for point in self.timeline:
            if point.t >= start_s and (end_s is None or point.t < end_s):
                part = point if tenant is None else point.tenants.get(tenant)
                if part is not None:
                    out.add(part)
        return out

    def table(self) -> str:
        """Per-tenant results as a fixed-width text table."""
        header = ("tenant", "sent", "done", "failed", "prompt tok", "hit rate", "gen tok", "tok/s",
                  "TTFT p50/p95/p99 ms", "ITL p50/p95/p99 ms", "E2E p50/p95 ms")
        rows = [header, *(_row(s) for s in [*self.tenants.values(), self.total])]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        state = "complete" if self.complete else ("stopped" if self.stopped else "running")
        lines.insert(0, f"kvops bench load: {self.url} ({self.model}), {self.elapsed_s:.1f} s, {state}")
        if self.total.requests_cancelled:
            lines.append(f"{self.total.requests_cancelled} request(s) in flight were cancelled when the run stopped")
        for stats in self.tenants.values():
            lines += [f"  {stats.tenant}: error: {e}" for e in stats.errors]
        return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else (f"{value:.0f}" if value >= 10 else f"{value:.1f}")


def _row(s: TenantStats) -> tuple[str, ...]:
    hit = "-" if s.hit_rate is None else f"{s.hit_rate:.1%}"
    prompt = f"{s.prompt_tokens} ({s.cached_tokens} cached)"
    return (s.tenant, str(s.requests_sent), str(s.requests_finished), str(s.requests_failed), prompt, hit,
            str(s.generated_tokens), f"{s.throughput_tok_s:.1f}",
            "/".join(_ms(v) for v in (s.ttft.p50_ms, s.ttft.p95_ms, s.ttft.p99_ms)),
            "/".join(_ms(v) for v in (s.itl.p50_ms, s.itl.p95_ms, s.itl.p99_ms)),
            "/".join(_ms(v) for v in (s.e2e.p50_ms, s.e2e.p95_ms)))


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the run's start."""

    tenant: str
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each streamed token chunk
    done: float | None = None
    error: str | None = None
    cancelled: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.done is not None and self.error is None and not self.cancelled

    @property
    def generated(self) -> int:
        return self.completion_tokens if self.finished else len(self.chunks)


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


def summarize(tenant: str, results: list[RequestRecord], elapsed: float, peak: int) -> TenantStats:
    finished = [r for r in results if r.finished]
    errors: list[str] = []
    for r in results:
        if r.error is not None and r.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(r.error)
    prompt = sum(r.prompt_tokens for r in finished)
    cached = sum(r.cached_tokens for r in finished)
    generated = sum(r.generated for r in results)
    busy = sum((r.done if r.done is not None else elapsed) - r.sent for r in results)
    span = max(elapsed, 1e-9)
    return TenantStats(
        tenant=tenant, requests_sent=len(results), requests_finished=len(finished),
        requests_failed=sum(1 for r in results if r.error is not None),
        requests_cancelled=sum(1 for r in results if r.cancelled),
        in_flight=sum(1 for r in results if r.done is None), peak_in_flight=peak,
        mean_in_flight=round(busy / span, 3), errors=errors, prompt_tokens=prompt, cached_tokens=cached,
        hit_rate=_ratio(cached, prompt), generated_tokens=generated, throughput_tok_s=round(generated / span, 3),
        requests_per_s=round(len(finished) / span, 3),
        ttft=latency([r.chunks[0] - r.sent for r in finished if r.chunks]),
        itl=latency([b - a for r in finished for a, b in itertools.pairwise(r.chunks)]),
        e2e=latency([(r.done or 0.0) - r.sent for r in finished]),
    )


def build_timeline(results: list[RequestRecord], elapsed: float) -> list[TimelinePoint]:
    points = [TimelinePoint(t=t) for t in range(max(1, math.ceil(elapsed)))]

    def at(t: float, tenant: str) -> tuple[TimelinePoint, Counts]:
        point = points[min(max(0, int(t)), len(points) - 1)]
        return point, point.tenants.setdefault(tenant, Counts())

    for r in sorted(results, key=lambda r: r.tenant):
        for t in r.chunks:
            for counts in at(t, r.tenant):
                counts.generated_tokens += 1
        if r.done is None or r.cancelled:
            continue
        for counts in at(r.done, r.tenant):
            if r.error is not None:
                counts.requests_failed += 1
                continue
            counts.generated_tokens += max(0, r.completion_tokens - len(r.chunks))  # tokens a chunk held back
            counts.requests_finished += 1
            counts.prompt_tokens += r.prompt_tokens
            counts.cached_tokens += r.cached_tokens
    for point in points:
        for counts in (point, *point.tenants.values()):
            counts.hit_rate = _ratio(counts.cached_tokens, counts.prompt_tokens)
    return points
