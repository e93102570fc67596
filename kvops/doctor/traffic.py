"""Traffic: how requests fare, next to the cache's health. Queueing while the KV cache has room, aborted
requests, time to first token and between tokens against an SLO, and ranks that carry unequal load.

The lines report the diagnoses of the rules `kvops run` uses too (queueing, aborted_requests, latency_slo),
and the plain numbers when none fired; a line whose metric the server lacks says which one it would need.
"""

from __future__ import annotations

from kvops.doctor.cache import from_diagnosis, unreported
from kvops.doctor.report import Check, Status
from kvops.kinds import profile_of
from kvops.schema.diagnosis import Diagnosis
from kvops.schema.snapshot import Histogram, Snapshot

SECTION = "Traffic"
# Ranks whose KV usage differs by more than this, or that queue while others do not, are shown one by one.
RANK_USAGE_SPREAD = 0.2


def traffic_checks(snaps: list[Snapshot], diagnoses: list[Diagnosis]) -> list[Check]:
    latest = snaps[-1]
    checks = [_queueing(latest, [d for d in diagnoses if d.rule == "queueing"]),
              _aborted(latest, [d for d in diagnoses if d.rule == "aborted_requests"]),
              *_latency(latest, [d for d in diagnoses if d.rule == "latency_slo"])]
    ranks = _ranks(latest)
    return checks + ([ranks] if ranks else [])


def _queueing(latest: Snapshot, found: list[Diagnosis]) -> Check:
    title = "Queueing"
    if found:
        return from_diagnosis(title, found[0], latest, SECTION)
    if not latest.knows("requests.waiting"):
        return unreported(title, latest, "waiting requests", "requests.waiting", SECTION)
    requests = latest.requests
    usage = f", KV usage {latest.blocks.usage:.0%}" if latest.knows("blocks.usage") else ""
    return Check(section=SECTION, title=title, status=Status.OK,
                 evidence=f"{requests.waiting} waiting, {requests.running} running{usage}")


def _aborted(latest: Snapshot, found: list[Diagnosis]) -> Check:
    title = "Aborted requests"
    if found:
        return from_diagnosis(title, found[0], latest, SECTION)
    requests = latest.requests
    abandoned = requests.abandoned_total or 0
    counted = latest.knows("requests.aborted_total")
    if not counted and requests.abandoned_total is None:
        return _untold(title, latest)
    if not latest.knows("requests.finished_total"):
        status = Status.INFO if requests.aborted_total else Status.OK
        return Check(section=SECTION, title=title, status=status,
                     evidence=f"{requests.aborted_total} aborted or failed since start; {latest.source} reports no "
                              "count of finished requests to compare them with",
                     remedy=f"needs {profile_of(latest).missing_metric('requests.finished_total')}")
    aborted = (requests.aborted_total if counted else 0) + abandoned
    ended = aborted + requests.finished_total
    share = f" ({aborted / ended:.1%})" if ended else ""
    uncounted = (f" ({abandoned} abandoned: a first token and no end, which {latest.source} does not count as an "
                 "abort)") if abandoned else ""
    # No abort counter (vLLM's V0 engine): what is shown is the estimate alone, blind before the first token.
    estimate = "" if counted else (f"; this {profile_of(latest).title} counts no aborts: only the abandoned requests "
                                   "its histograms show are counted, not those given up before their first token")
    return Check(section=SECTION, title=title, status=Status.OK,
                 evidence=f"{aborted} of {ended} ended requests{share}{uncounted} since start{estimate}")


def _untold(title: str, latest: Snapshot) -> Check:
    """No abort count and no estimate. Where the server counts finished requests and its kind could estimate the
    abandoned ones from other counters (vLLM: its V0 engine counts no abort at all), the line says that this
    server's counters cannot tell them, and what would; else (no finished count either) what it lacks."""
    kind = profile_of(latest)
    source = kind.metrics.get("requests.abandoned_total")
    if source is None or not latest.knows("requests.finished_total"):
        return unreported(title, latest, "aborted requests", "requests.aborted_total", SECTION)
    return Check(section=SECTION, title=title, status=Status.SKIPPED,
                 evidence=f"this {kind.title}'s counters cannot tell abandoned requests: it reports no aborts, and no "
                          "plausible first-token and end-to-end counts to estimate them from",
                 remedy=f"needs {kind.missing_metric('requests.aborted_total')}; or, to estimate them, "
                        f"{' and '.join(source.names)}, from {source.provided_by}")


def _percentiles(histogram: Histogram) -> str:
    """p50, p95, p99 and the mean; a percentile above the highest bound reads "> bound" (the bucket has no top)."""
    finite = histogram.count - histogram.counts[-1]
    parts = []
    for q, value in ((50, histogram.p50), (95, histogram.p95), (99, histogram.p99)):
        if value is None:
            continue
        above = histogram.buckets and q / 100 * histogram.count > finite
        parts.append(f"p{q} > {histogram.buckets[-1]:g}" if above else f"p{q} {value:.3g}")
    if histogram.count:
        parts.append(f"mean {histogram.sum / histogram.count:.3g}")
    return ", ".join(parts)


def _latency(latest: Snapshot, found: list[Diagnosis]) -> list[Check]:
    checks = []
    for field, title, samples in (("ttft", "Time to first token", "requests"), ("itl", "Inter-token latency",
                                                                             "tokens")):
        broken = [d for d in found if d.subject == field]
        if broken:
            checks.append(from_diagnosis(title, broken[0], latest, SECTION))
            continue
        histogram = latest.ttft if field == "ttft" else latest.itl
        if histogram is None or not latest.knows(field):
            checks.append(unreported(title, latest, f"a {title.lower()} histogram", field, SECTION))
        elif histogram.count == 0:
            checks.append(Check(section=SECTION, title=title, status=Status.SKIPPED, evidence="nothing measured yet"))
        else:
            checks.append(Check(section=SECTION, title=title, status=Status.OK,
                                evidence=f"{_percentiles(histogram)} s over {histogram.count} {samples} since start",
                                detail=["set an SLO to check against: kvops doctor --ttft-slo SECONDS --itl-slo "
                                        "SECONDS, or [rules.latency_slo.settings] in kvops run's config"]))
    return checks


def _ranks(latest: Snapshot) -> Check | None:
    """The ranks one by one, when their load differs; None when there is one rank or they agree."""
    ranks = latest.ranks
    if len(ranks) < 2:
        return None
    usages = [r.kv_usage for r in ranks if r.kv_usage is not None]
    waiting = [r.waiting or 0 for r in ranks]
    spread = max(usages) - min(usages) if usages else 0.0
    uneven_queue = any(waiting) and not all(waiting)
    detail = [", ".join(f"{k}={v}" for k, v in r.labels.items()) + ": "
              + ", ".join(part for part in (f"KV usage {r.kv_usage:.0%}" if r.kv_usage is not None else "",
                                            f"{r.running} running" if r.running is not None else "",
                                            f"{r.waiting} waiting" if r.waiting is not None else "") if part)
              for r in ranks]
    if spread <= RANK_USAGE_SPREAD and not uneven_queue:
        return Check(section=SECTION, title="Ranks", status=Status.OK,
                     evidence=f"{len(ranks)} ranks with even load (KV usage within {spread:.0%})", detail=detail)
    busiest = max(ranks, key=lambda r: ((r.waiting or 0), r.kv_usage or 0.0))
    idlest = min(ranks, key=lambda r: ((r.waiting or 0), r.kv_usage or 0.0))
    return Check(section=SECTION, title="Ranks", status=Status.WARN,
                 evidence=f"{len(ranks)} ranks with uneven load: {detail[ranks.index(busiest)]} against "
                          f"{detail[ranks.index(idlest)]}",
                 remedy="the router or the data-parallel balancer sends more to some ranks: check its policy "
                        "(round robin vs. shortest queue) and the prompts' affinity", detail=detail)
