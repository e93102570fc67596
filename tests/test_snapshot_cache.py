"""The snapshot `/stats` serves without crossing threads: when the step loop rebuilds it, and when the
server must not serve it (older than MAX_AGE_S, or older than a change a client may read back at once)."""

from __future__ import annotations

from kvops.engine.serving.snapshot_cache import INTEREST_S, MAX_AGE_S, REFRESH_S, SnapshotCache
from kvops.schema.snapshot import Snapshot
from tests.helpers.synthetic import snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def cache() -> tuple[SnapshotCache, Clock, list[int]]:
    clock, builds = Clock(), []

    def build() -> Snapshot:
        builds.append(1)
        return snapshot(float(len(builds)))  # snapshot n has time n

    return SnapshotCache(build, clock), clock, builds


def served(snapshots: SnapshotCache) -> float | None:
    entry = snapshots.serve()
    if entry is None:
        return None
    assert Snapshot.model_validate_json(entry.body) == entry.snapshot  # what /stats sends is what was built
    return entry.snapshot.time


def test_an_unpolled_engine_builds_nothing_between_steps():
    snapshots, clock, builds = cache()
    for _ in range(50):
        clock.now += REFRESH_S
        snapshots.refresh_if_polled()
    assert builds == []


def test_polled_it_refreshes_once_per_interval_and_serves_the_latest():
    snapshots, clock, builds = cache()
    assert served(snapshots) is None  # nothing built yet: the server builds one on the step thread
    assert snapshots.refresh().snapshot.time == 1
    snapshots.refresh_if_polled()  # just built: not due
    assert len(builds) == 1
    clock.now += REFRESH_S / 2
    snapshots.refresh_if_polled()
    assert served(snapshots) == 1 and len(builds) == 1
    clock.now += REFRESH_S
    snapshots.refresh_if_polled()
    assert served(snapshots) == 2
    assert snapshots.served_total == 2 and snapshots.built_total == 2


def test_it_is_never_served_older_than_max_age():
    snapshots, clock, _ = cache()
    snapshots.refresh()
    clock.now += MAX_AGE_S
    assert served(snapshots) == 1
    clock.now += 0.001  # a long step kept the loop from refreshing
    assert served(snapshots) is None


def test_a_change_invalidates_it_until_rebuilt():
    snapshots, _, _ = cache()
    snapshots.refresh()
    snapshots.invalidate()  # a command ran, or a step finished a request
    assert served(snapshots) is None
    snapshots.refresh_if_polled()  # the step loop rebuilds at once, not an interval later
    assert served(snapshots) == 2


def test_it_stops_refreshing_when_polls_stop():
    snapshots, clock, builds = cache()
    snapshots.serve()
    snapshots.refresh()
    clock.now += INTEREST_S + REFRESH_S
    snapshots.refresh_if_polled()
    assert len(builds) == 1
