"""`kvops bench fleet` (kvops/bench/fleet.py) and its simulated engines (kvops/bench/fleet_engines.py): the real vLLM
capture replayed with its counters advancing, troubles that read as the diagnoses they stand for, and one short run
of four engines under a real `kvops run`, alerts included."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvops.adapters.prometheus import Scrape
from kvops.bench.fleet import EXPECTED_ALERT, run_one
from kvops.bench.fleet_engines import TROUBLES, Capture, choose_troubles
from kvops.kinds import snapshot_from_scrape

pytestmark = pytest.mark.clock  # it measures how many polls are on time (tests/helpers/clock_worker.py)


def _snapshot(capture: Capture, elapsed: float, trouble: str | None = None, trouble_s: float = 0.0):
    text = capture.render(elapsed, TROUBLES[trouble] if trouble else {}, trouble_s).decode()
    return snapshot_from_scrape("vllm", Scrape.parse(text), elapsed, None, 0.0)


def test_counters_advance_at_the_captures_rate_and_gauges_hold():
    capture = Capture.load()
    first, later = _snapshot(capture, 0.0), _snapshot(capture, 60.0)
    assert first.requests.prompt_tokens_total == 829  # as captured
    assert later.requests.prompt_tokens_total > first.requests.prompt_tokens_total
    assert later.requests.finished_total > first.requests.finished_total
    assert later.blocks.usage == first.blocks.usage and later.requests.running == first.requests.running == 8


def test_troubles_change_what_their_diagnosis_reads():
    capture = Capture.load()
    full = _snapshot(capture, 100.0, "kv_pressure", 20.0)
    assert full.blocks.usage >= 0.99 and full.requests.preemptions_total >= 40
    queued = _snapshot(capture, 100.0, "queueing", 20.0)
    assert queued.requests.waiting == 24 and queued.blocks.usage < 0.1
    before, after = _snapshot(capture, 100.0, "zero_hits", 10.0), _snapshot(capture, 110.0, "zero_hits", 20.0)
    assert after.prefix_cache.hits_total == before.prefix_cache.hits_total
    assert after.prefix_cache.queries_total - before.prefix_cache.queries_total >= 700
    assert _snapshot(capture, 100.0, "kv_pressure", 0.0).blocks.usage < 0.1  # not begun yet


def test_troubles_land_on_distinct_engines_never_the_first():
    assert choose_troubles(1) == {}
    assert choose_troubles(3) == {1: "kv_pressure", 2: "queueing"}
    assert choose_troubles(4) == {1: "kv_pressure", 2: "queueing", 3: "zero_hits"}
    assert sorted(choose_troubles(300)) == [1, 100, 199]


def test_a_small_fleet_is_polled_on_time_and_each_trouble_alerts(tmp_path: Path):
    row = run_one(4, duration_s=32.0, workdir=tmp_path, warmup_s=2.0, trouble_at_s=6.0)
    assert row.engines_up == 4 and row.poll_errors == 0
    assert row.polls > 40 and row.polls_on_time > 0.9, row
    assert 0 < row.cpu_cores < 2 and row.rss_mb > 0 and row.evaluation_mean_s is not None
    for engine, alert in row.alerts.items():
        assert alert["alertname"] == EXPECTED_ALERT[str(alert["trouble"])], (engine, row.alerts)
        assert alert["latency_s"] is not None and float(alert["latency_s"]) >= row.alert_for_s, (engine, alert)
