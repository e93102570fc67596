"""The supervisor's memory of an engine: bounded, downsampled, and its derived series right."""

from __future__ import annotations

import itertools

import pytest

from kvops.history import EngineHistory
from tests.helpers.synthetic import snapshot


def test_recent_kept_at_full_rate_older_downsampled_oldest_dropped():
    history = EngineHistory("e", full_rate_s=60, bucket_s=10, max_age_s=600)
    for i in range(0, 2000):  # 0.5 s apart: 1000 s
        history.add(snapshot(1000.0 + i * 0.5))
    times = [s.time for s in history.snapshots]
    assert times[-1] == 1000.0 + 1999 * 0.5
    recent = [t for t in times if t >= times[-1] - 60]
    older = [t for t in times if t < times[-1] - 60]
    assert len(recent) == 121  # every snapshot of the last minute
    assert len(older) <= 55 and all(b - a >= 9.5 for a, b in itertools.pairwise(older))
    assert times[0] >= times[-1] - 600  # nothing older than max_age_s


def test_rate_and_delta_survive_a_counter_reset():
    history = EngineHistory("e")
    values = [0, 10, 20, 5, 15]  # the engine restarted between 20 and 5
    for i, v in enumerate(values):
        history.add(snapshot(100.0 + i, requests={"preemptions_total": v}))
    get = lambda s: s.requests.preemptions_total  # noqa: E731
    assert history.delta(get, 60) == 10 + 10 + 5 + 10
    assert history.rate(get, 60) == pytest.approx(35 / 4)


def test_the_same_snapshot_polled_twice_is_kept_once():
    # an engine's /stats answers from a snapshot its step loop refreshes every 100 ms: a faster poller sees
    # one snapshot twice, which would be a zero-length interval in every rate
    history = EngineHistory("e")
    for t in (100.0, 100.0, 100.1, 100.1, 100.2):
        history.add(snapshot(t))
    assert [s.time for s in history.snapshots] == [100.0, 100.1, 100.2]


def test_polled_faster_than_its_resolution_it_keeps_the_newest_and_one_per_interval():
    history = EngineHistory("e", resolution_s=0.5)
    for i in range(21):  # 10 Hz for 2 s
        history.add(snapshot(100.0 + i * 0.1, requests={"preemptions_total": i}))
    times = [round(s.time, 1) for s in history.snapshots]
    assert times == [100.0, 100.5, 101.0, 101.5, 102.0]
    assert history.latest is not None and history.latest.requests.preemptions_total == 20
    assert history.delta(lambda s: s.requests.preemptions_total, 60) == 20  # counters lose nothing
    history.add(snapshot(102.1))
    assert [round(s.time, 1) for s in history.snapshots][-2:] == [102.0, 102.1]  # the newest is always kept


def test_trend_of_a_falling_gauge():
    history = EngineHistory("e")
    for i in range(10):
        history.add(snapshot(100.0 + i, requests={"running": 50 - 3 * i}))
    assert history.trend(lambda s: s.requests.running, 60) == pytest.approx(-3.0)
    assert EngineHistory("empty").trend(lambda s: s.requests.running, 60) is None


def test_an_engine_clock_that_stepped_back_still_gives_windows_in_time_order():
    history = EngineHistory("e")
    for t in (100.0, 101.0, 102.0):
        history.add(snapshot(t))
    assert [s.time for s in history.window(60)] == [100.0, 101.0, 102.0]
    history.add(snapshot(100.5))  # the clock stepped back 1.5 s: the newest arrival is not the newest snapshot
    assert [s.time for s in history.snapshots] == [100.0, 100.5, 101.0, 102.0]
    assert [s.time for s in history.window(1.0, now=101.0)] == [100.0, 100.5, 101.0]
    history.add(snapshot(103.0))
    times = [s.time for s in history.snapshots]
    assert times == sorted(times) and times[-1] == 103.0
