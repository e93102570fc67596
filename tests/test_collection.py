"""The garbage collector paced by the poll loop (kvops/supervisor/collection.py): off while the loop runs, the
young generations collected after every cycle, the whole heap once every `full_every_s`, and back on after."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvops.supervisor.collection import Collection
from tests.helpers.waiting import wait_for


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    """A reference cycle nobody holds: only the cyclic collector frees it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_the_loop_turns_the_automatic_collector_off_and_back_on(collector_on: None) -> None:
    collection = Collection()
    collection.start()
    try:
        assert not gc.isenabled()
    finally:
        collection.stop()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        collection = Collection()
        collection.start()
        collection.stop()
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


def test_garbage_made_in_a_cycle_is_freed_after_it(collector_on: None) -> None:
    collection = Collection()
    collection.start()
    try:
        garbage = _cycle()
        assert garbage() is not None  # the automatic collector is off: nothing freed it yet
        collection.after_cycle()
        assert garbage() is None
        assert collection.full_collections == 0
    finally:
        collection.stop()


def test_the_whole_heap_is_collected_once_every_full_every_s(collector_on: None) -> None:
    now = [0.0]
    collection = Collection(full_every_s=60.0, clock=lambda: now[0])
    collection.start()
    try:
        # Garbage that has survived a young collection is in the oldest generation: only a full collection frees it.
        old = _Node()
        old.other = _Node()
        old.other.other = old
        collection.after_cycle()  # moves it to the oldest generation while it is still held
        garbage = weakref.ref(old)
        del old
        for t in (0.5, 30.0, 59.5):
            now[0] = t
            collection.after_cycle()
        assert garbage() is not None and collection.full_collections == 0
        now[0] = 60.0
        collection.after_cycle()
        assert garbage() is None and collection.full_collections == 1
        now[0] = 90.0
        collection.after_cycle()
        assert collection.full_collections == 1  # the next one is due at 120 s
    finally:
        collection.stop()


def test_the_supervisors_poll_loop_paces_the_collector(tmp_path: Path, collector_on: None) -> None:
    from kvops.supervisor.config import parse_config
    from kvops.supervisor.supervisor import Supervisor

    config = parse_config({"supervisor": {"state_dir": str(tmp_path / "state"), "poll_interval_s": 0.05},
                           "engines": [{"name": "e", "url": "http://127.0.0.1:9"}]}, "test")
    sup = Supervisor(config)
    sup.start()
    try:
        wait_for("the poll loop to take the collector over", lambda: not gc.isenabled(), 10, every_s=0.02)
        garbage = _cycle()
        wait_for("a cycle's young collection", lambda: garbage() is None, 10, every_s=0.02)
    finally:
        sup.stop()
    assert gc.isenabled()
