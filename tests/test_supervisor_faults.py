"""Faults in the supervisor itself: a rule that raises, an engine whose reading fails inside kvops, an engine that
hangs. kvops keeps polling the rest, counts each fault per rule or engine on /metrics, and says what happened."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvops.processes import free_port
from kvops.rules import RULES
from kvops.schema.diagnosis import Diagnosis
from kvops.supervisor import exporter
from kvops.supervisor.config import parse_config
from kvops.supervisor.supervisor import Supervisor


def _supervisor(tmp_path: Path, *urls: str) -> Supervisor:
    return Supervisor(parse_config({
        "supervisor": {"state_dir": str(tmp_path), "alert_warmup_s": 0},
        "engines": [{"name": f"e{i}", "url": url} for i, url in enumerate(urls)],
    }, "test"))


def _samples(sup: Supervisor, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = exporter.render(sup)[0].decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == name)
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples}


def test_a_rule_that_raises_is_counted_and_the_others_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def broken(*_: object) -> list[Diagnosis]:
        raise ZeroDivisionError("a bug in the rule")

    monkeypatch.setitem(RULES, "queueing", dataclasses.replace(RULES["queueing"], evaluate=broken))
    sup = _supervisor(tmp_path, "http://127.0.0.1:9")
    for _ in range(3):
        sup.poll_once()
    errors = _samples(sup, "kvops_rule_errors")
    assert errors[(("engine", "e0"), ("kind", "auto"), ("rule", "queueing"))] == 3
    assert errors[(("engine", "e0"), ("kind", "auto"), ("rule", "engine_down"))] == 0
    assert any(d.rule == "engine_down" for d in sup.diagnoses)  # the other rules were not blinded


def test_polls_faster_than_the_evaluation_interval_run_the_rules_every_nth_poll(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch):
    # poll at 10 Hz (kvops top's live numbers), judge at 2 Hz: the rules run on polls 1, 6, 11
    runs: list[int] = []

    def counted(*_: object) -> list[Diagnosis]:
        runs.append(1)
        return []

    monkeypatch.setitem(RULES, "queueing", dataclasses.replace(RULES["queueing"], evaluate=counted))
    sup = Supervisor(parse_config({
        "supervisor": {"state_dir": str(tmp_path), "poll_interval_s": 0.1, "evaluation_interval_s": 0.5},
        "engines": [{"name": "e0", "url": "http://127.0.0.1:9"}],
    }, "test"))
    assert sup.evaluate_every == 5 and sup.engines["e0"].history.resolution_s == 0.5
    for _ in range(11):
        sup.poll_once()
    assert len(runs) == 3 and sup.polls_total == 11
    assert len(sup.engines["e0"].history.health) == 11  # every poll still reads the engine
    slower = Supervisor(parse_config({  # polled about as often as judged: every poll judged, every snapshot kept
        "supervisor": {"state_dir": str(tmp_path), "poll_interval_s": 0.4, "evaluation_interval_s": 0.5},
        "engines": [{"name": "e0", "url": "http://127.0.0.1:9"}],
    }, "test"))
    assert slower.evaluate_every == 1 and slower.engines["e0"].history.resolution_s == 0


def test_a_fault_reading_one_engine_is_counted_and_the_others_are_still_polled(tmp_path: Path):
    sup = _supervisor(tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:19")
    broken = sup.engines["e0"]

    def fault() -> None:
        raise KeyError("a field the adapter did not expect")

    broken.client.snapshot = fault  # type: ignore[method-assign]
    for _ in range(3):
        sup.poll_once()
    assert sup.polls_total == 3
    assert broken.last_error.startswith("poll failed in kvops: KeyError")
    assert _samples(sup, "kvops_engine_poll_errors")[(("engine", "e0"), ("kind", "auto"))] == 3
    assert sup.engines["e1"].history.health  # the other engine was read every time
    assert len(sup.engines["e1"].history.health) == 3


@pytest.fixture
def hanging_engine() -> Iterator[str]:
    """An engine that accepts connections and never answers: each read waits for the client's 5 s timeout."""
    release = threading.Event()

    class Hang(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            release.wait(30)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Hang)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    release.set()
    server.shutdown()


def test_hanging_engines_are_read_side_by_side(tmp_path: Path, hanging_engine: str):
    sup = _supervisor(tmp_path, hanging_engine, hanging_engine, "http://127.0.0.1:9")
    started = time.monotonic()
    sup.poll_once()
    took = time.monotonic() - started
    # Recognising an unknown server waits out two 5 s timeouts: read one after the other, the two hanging engines
    # took 20 s; side by side, one's 10 s.
    assert took < 15, took
    assert all(sup.engines[name].history.health for name in ("e0", "e1", "e2"))
    assert "timed out" in sup.engines["e0"].last_error or "timeout" in sup.engines["e0"].last_error.lower()
