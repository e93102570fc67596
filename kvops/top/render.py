"""Plain-text pieces of `kvops top`, shared by the Textual app and `--once` / `--json`."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvops.schema.kv_events import EventStreamHealth, KvEventStats
from kvops.schema.snapshot import Histogram, Snapshot, TenantStats, histogram_since
from kvops.top.client import EngineView, Poller, Source, SupervisorRefused
from kvops.top.counters import hit_rate_now, hit_rates, latency_totals
from kvops.top.prefix_view import prefix_lines


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def capacity(s: Snapshot) -> str:
    tokens = s.engine.num_blocks * s.engine.block_size
    return f"{s.engine.num_blocks} blk / {tokens:,} tok / {fmt_bytes(s.engine.kv_cache_bytes)}"


def health(view: EngineView) -> str:
    if view.entry.crash_loop:
        return "CRASH LOOP"
    if not view.entry.up:
        return "DOWN"
    return "up" if view.latest is not None else "starting"


def series(history: Sequence[Snapshot]) -> dict[str, list[float]]:
    """The sparkline series over a history, oldest first: KV usage, hit rate (the engine's window, or
    from a server's counters: kvops.top.counters), swap rate (fractions); then, between consecutive
    snapshots (one point fewer), throughput (generated tokens/s) and the mean time to first token and
    inter-token latency (seconds) of the tokens generated in between (the last value carried over an
    interval with none, 0 before the first)."""
    throughput: list[float] = []
    latency: dict[str, list[float]] = {"ttft": [], "itl": []}
    for prev, cur in itertools.pairwise(history):
        dt = cur.time - prev.time
        tokens = cur.requests.generation_tokens_total - prev.requests.generation_tokens_total
        throughput.append(max(0.0, tokens / dt) if dt > 0 else 0.0)
        for field, means in latency.items():
            before, now = latency_totals(prev, field), latency_totals(cur, field)
            means.append(_interval_mean(now[0] - before[0], now[1] - before[1], means))
    return {
        "kv_usage": [s.blocks.usage for s in history],
        "hit_rate": hit_rates(history),
        "swap_rate": [s.swap.window.swap_rate for s in history],
        "throughput": throughput,
        "ttft": latency["ttft"],
        "itl": latency["itl"],
    }


def _interval_mean(seconds: float, count: int, so_far: list[float]) -> float:
    if count > 0:  # a restarted engine's counters go back to zero: negative counts are skipped
        return max(0.0, seconds / count)
    return so_far[-1] if so_far else 0.0


def fmt_seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def histogram_lines(h: Histogram, width: int = 30, fit: tuple[int, int] | None = None) -> list[str]:
    """One bar per bucket (counts are per bucket), then the percentiles. `fit` = (columns, rows) of the box the
    lines go in: the bars shrink to its width (never past `width`), and when it has fewer rows than buckets the
    empty buckets below the first and above the last filled one are left out and the percentiles come first, so
    that they and the filled buckets stay in sight (vLLM's 12 prompt-length buckets wrapped and pushed its
    percentiles out of a 100x30 terminal)."""
    labels = [f"≤{b:g}" for b in h.buckets] + [f">{h.buckets[-1]:g}" if h.buckets else "all"]
    rows = list(zip(labels, h.counts, strict=False))
    percentiles = f"p50 {_or_dash(h.p50)}  p95 {_or_dash(h.p95)}  p99 {_or_dash(h.p99)}  (n={h.count})"
    short = fit is not None and len(rows) + 1 > fit[1]
    if short:
        filled = [i for i, (_, count) in enumerate(rows) if count]
        if filled:
            rows = rows[filled[0]:filled[-1] + 1]
    top = max((count for _, count in rows), default=0) or 1
    pad = max((len(label) for label, _ in rows), default=0)
    if fit is not None:  # label, space, bar, space, count
        width = max(1, min(width, fit[0] - pad - 2 - len(str(top))))
    lines = [f"{label:>{pad}} {'█' * round(count / top * width):<{width}} {count}" for label, count in rows]
    # In a short box the percentiles come first: what does not fit is then the bars at the end.
    return [percentiles, *lines] if short else [*lines, percentiles]


def tenant_field(s: Snapshot, tenant: TenantStats, field: str) -> str:
    """A tenant's count, or "-" where the source does not report it (a gateway's tenants hold no blocks it sees)."""
    return str(getattr(tenant, field)) if s.knows(f"tenants.*.{field}") else "-"


def engine_summary(view: EngineView) -> list[str]:
    e = view.entry
    head = f"{e.name}  [{health(view)}]  {e.url}  pid {e.pid or '-'}  restarts {e.restarts}"
    s = view.latest
    if s is None:
        return [head, f"  no snapshot: {view.error or e.last_error or 'starting'}"]
    counts = " ".join(f"{k}={v}" for k, v in s.blocks.counts.items())
    hit_rate, covers = hit_rate_now(s, view.history)
    lines = [
        head,
        f"  model {s.engine.model}  block {s.engine.block_size}  kv {s.engine.kv_cache_dtype}  "
        f"capacity {capacity(s)}  uptime {fmt_duration(s.uptime_s)}",
        f"  kv usage {fmt_pct(s.blocks.usage)}  hit rate {fmt_pct(hit_rate)}{covers}  "
        f"swap rate {fmt_pct(s.swap.window.swap_rate) if s.knows('swap') else '-'}  running {s.requests.running}  "
        f"waiting {s.requests.waiting}",
        f"  blocks {counts}",
        f"  prompt len p50 {_or_dash(s.prompt_lengths.p50)}  p95 {_or_dash(s.prompt_lengths.p95)}  "
        f"p99 {_or_dash(s.prompt_lengths.p99)}",
    ]
    for name, t in sorted(s.tenants.items()):
        quota = t.quota_blocks if t.quota_blocks is not None else "-"
        held, caused, suffered = (tenant_field(s, t, f) for f in ("blocks_held", "evictions_caused",
                                                                  "evictions_suffered"))
        lines.append(f"  tenant {name}: held {held} quota {quota} hit {fmt_pct(t.hit_rate)} "
                     f"evictions caused {caused} suffered {suffered}")
    if s.kv_events is not None:
        ev = s.kv_events
        resident = ", ".join(f"{medium} {n}" for medium, n in sorted(ev.resident.items())) or "none"
        lines.append(f"  kv events: resident blocks {resident}; {pool_line(ev)}")
        lines.extend(f"  kv events: {line}" for line in kv_event_lines(view.history or [s]))
    return lines


def tenant_detail(name: str, t: TenantStats, s: Snapshot | None = None) -> str:
    quota = f"{t.quota_blocks} blocks" if t.quota_blocks is not None else "none"
    held, owned, caused, suffered = (tenant_field(s, t, f) if s is not None else str(getattr(t, f))
                                     for f in ("blocks_held", "blocks_owned", "evictions_caused", "evictions_suffered"))
    why = " (its tenants come from the gateway, which sees no blocks)" if s is not None and s.gateway else ""
    unseen = (f"-: not reported by {s.source}{why}\n"
              if s is not None and "-" in (held, owned, caused, suffered) else "")
    return (f"requests {t.requests_total}  prompt tokens {t.prompt_tokens_total}  served from cache "
            f"{t.hit_tokens_total} ({fmt_pct(t.hit_rate)})\n"
            f"blocks held by live requests {held}  owned (cached included) {owned}  quota {quota}\n"
            f"evictions caused {caused}  suffered {suffered}\n{unseen}"
            f"cache salt {t.cache_salt or '(own)'}: tenants with the same salt share prefix blocks")


def render_once(client: Source, history_s: float = 60.0) -> str:
    """A plain-text picture of every engine, its diagnoses and the recent audit log (`kvops top --once`).
    Raises SupervisorUnreachable when the supervisor does not answer."""
    state = Poller(client, history_s=history_s).poll()
    out = [f"kvops top  {client.url}  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(state.time))}"]
    if not state.engines:
        out.append("no engines")
    for view in state.engines:
        out.append("")
        out.extend(engine_summary(view))
    out.append("")
    out.append(f"diagnoses ({len(state.diagnoses)})")
    for d in state.diagnoses:
        subject = f" [{d.subject}]" if d.subject else ""
        out.append(f"  {d.severity.value:<8} {d.engine} {d.rule}{subject}: {d.summary}")
        if d.fix is not None:
            out.append(f"           fix ({d.fix.kind.value}): {d.fix.description}")
    out.append(f"audit (last 10 of {len(state.audit)})")
    for a in state.audit[-10:]:
        out.append(f"  #{a.id} {time.strftime('%H:%M:%S', time.localtime(a.time))} {a.action:<11} {a.engine} "
                   f"{a.rule} {a.message}")
    return "\n".join(out) + "\n"


def render_json(client: Source) -> str:
    """`kvops top --json`: {engine name: its latest snapshot (the Snapshot schema), or null}.
    The client validates every snapshot against the schema before it gets here."""
    out: dict[str, object] = {}
    for entry in client.engines():
        try:
            out[entry.name] = json.loads(client.snapshot(entry.name).model_dump_json())
        except SupervisorRefused:  # no snapshot yet (starting, or down since the supervisor started)
            out[entry.name] = None
    return json.dumps(out, indent=2) + "\n"


# ----------------------------------------------------------------- KV cache events (a vLLM with events on)

# Media that are not the engine's GPU pool: vLLM's offloading tiers (MEDIUM_CPU, MEDIUM_STORAGE). Every other
# medium (vLLM's "GPU") holds blocks of the pool that `pool_blocks` sizes.
OFFLOAD_MEDIA = ("CPU", "STORAGE")


def fmt_age(seconds: float | None) -> str:
    """A duration from milliseconds to hours in a few columns: 320 ms, 4.2 s, 3m20s."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s" if seconds < 60 else fmt_duration(seconds)


def fmt_rate(per_s: float | None) -> str:
    if per_s is None:
        return "-"
    return f"{per_s:.1f}/s" if per_s < 100 else f"{per_s:,.0f}/s"


def pool_resident(ev: KvEventStats) -> int:
    return sum(n for medium, n in ev.resident.items() if medium.upper() not in OFFLOAD_MEDIA)


def free_blocks(ev: KvEventStats) -> int | None:
    """Blocks of the GPU pool holding nothing the events know of; None while the pool size is unknown."""
    return None if ev.pool_blocks is None else max(0, ev.pool_blocks - pool_resident(ev))


def pool_line(ev: KvEventStats) -> str:
    free = free_blocks(ev)
    if free is None:  # cache_config_info not read (an older vLLM, or metrics not scraped yet)
        return "pool size unknown (no cache_config_info): free blocks not shown"
    return f"pool {ev.pool_blocks} blocks, {pool_resident(ev)} resident, {free} free"


def stream_line(stream: EventStreamHealth) -> str:
    """The stream's health in one line; "STALE" and "stream error" are what the panel colours."""
    age = "no event yet" if stream.last_event_age_s is None else f"last event {fmt_age(stream.last_event_age_s)} ago"
    line = (f"events {stream.events_per_s:.0f}/s  gaps {stream.gaps_total}  dropped {stream.dropped_batches_total}  "
            f"malformed {stream.malformed_total}  {age}")
    if stream.publisher_restarts_total:
        line += f"  restarts {stream.publisher_restarts_total}"
    if stream.stale:
        line += "  STALE"
    if stream.error:
        line += f"\nstream error: {stream.error}"
    return line


@dataclass(frozen=True)
class EventRates:
    """Rates between the last two snapshots, and shares and percentiles over the whole history shown."""

    stores_per_s: float | None  # None: a single snapshot so far, or the counters restarted in between
    removes_per_s: float | None
    window_s: float | None  # the span the rest covers; None: everything since kvops started reading
    stores: int
    restores: int
    restored_tokens: int
    lifetime_s: Histogram
    idle_before_evict_s: Histogram


def _counting_run(history: Sequence[Snapshot]) -> list[tuple[float, KvEventStats]]:
    """The latest snapshots with events, back to the first where the counters started again (kvops restarted)
    or events were off: differences are meaningful within it. Oldest first."""
    run: list[tuple[float, KvEventStats]] = []
    for s in reversed(history):
        ev = s.kv_events
        if ev is None or (run and (ev.stores_total > run[-1][1].stores_total
                                   or ev.removes_total > run[-1][1].removes_total)):
            break
        run.append((s.time, ev))
    run.reverse()
    return run


def event_rates(history: Sequence[Snapshot]) -> EventRates | None:
    """None when the latest snapshot has no events."""
    run = _counting_run(history)
    if not run:
        return None
    (t0, first), (t1, last) = run[0], run[-1]
    stores_per_s = removes_per_s = None
    if len(run) >= 2 and t1 > run[-2][0]:
        prev, dt = run[-2][1], t1 - run[-2][0]
        stores_per_s = (last.stores_total - prev.stores_total) / dt
        removes_per_s = (last.removes_total - prev.removes_total) / dt
    before = first if t1 > t0 else None
    return EventRates(
        stores_per_s=stores_per_s, removes_per_s=removes_per_s, window_s=t1 - t0 if before else None,
        stores=last.stores_total - (before.stores_total if before else 0),
        restores=last.restores_total - (before.restores_total if before else 0),
        restored_tokens=last.restored_tokens_total - (before.restored_tokens_total if before else 0),
        lifetime_s=histogram_since(last.lifetime_s, before.lifetime_s if before else None),
        idle_before_evict_s=histogram_since(last.idle_before_evict_s, before.idle_before_evict_s if before else None))


def _p50_p95(h: Histogram | None) -> str:
    return "-" if h is None or h.count == 0 else f"p50 {fmt_age(h.p50)} p95 {fmt_age(h.p95)}"


def kv_event_lines(history: Sequence[Snapshot]) -> list[str]:
    """The events' numbers for the latest snapshot of `history` (oldest first): the stream's health, store and
    remove rates, re-stores, block lifetime and idle time before eviction, the resident chains and their reuse."""
    latest = history[-1] if history else None
    rates = event_rates(history)
    if latest is None or latest.kv_events is None or rates is None:
        return []
    ev = latest.kv_events
    span = f"last {fmt_duration(rates.window_s)}" if rates.window_s else "since kvops started reading"
    lines = [
        stream_line(ev.stream),
        f"stores {fmt_rate(rates.stores_per_s)}  removes {fmt_rate(rates.removes_per_s)}  "
        f"clears {ev.clears_total}  resident {sum(ev.resident.values())} blk / {ev.resident_tokens:,} tok",
        f"{span}: re-stores {fmt_pct(rates.restores / rates.stores if rates.stores else None)} of "
        f"{rates.stores} stores, {rates.restored_tokens:,} tokens recomputed",
        f"lifetime {_p50_p95(rates.lifetime_s)}  idle before eviction {_p50_p95(rates.idle_before_evict_s)}",
    ]
    if latest.residency is not None:  # vLLM's own sampled histograms (--kv-cache-metrics), cumulative
        r = latest.residency
        lines.append(f"vLLM's metrics: lifetime {_p50_p95(r.lifetime_s)}  idle {_p50_p95(r.idle_before_evict_s)}")
    lines.extend(prefix_lines(latest))  # the resident chains and what served them (kvops.top.prefix_view)
    return lines


def _or_dash(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"
