"""kvops's own Prometheus text parser (kvops/adapters/prometheus.py) against prometheus_client's, which it replaced
for speed: the same samples from every captured and published scrape, lines that do not parse kept apart, and a
name's lines parsed only when it is read."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvops.adapters.prometheus import Scrape

FIXTURES = Path(__file__).parent / "fixtures"
# Every fixture that is Prometheus text: not the servers' logs (vllm-cpu-logs/) nor trtllm-serve's JSON /metrics.
SCRAPES = sorted(p for p in FIXTURES.rglob("*.txt") if p.name != "SOURCES.txt" and p.parent.name != "vllm-cpu-logs"
                 and not p.name.endswith("-metrics-json.txt"))


def _reference(text: str) -> dict[str, list[tuple[dict[str, str], float]]] | None:
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name].append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError):
        return None  # the excerpts cut mid-line: prometheus_client gives up on the whole text
    return dict(samples)


def _comparable(samples: dict) -> dict:
    return {name: [(labels, "nan" if math.isnan(v) else v) for labels, v in series] for name, series in samples.items()}


@pytest.mark.parametrize("path", SCRAPES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_every_fixture_parses_as_prometheus_client_parses_it(path: Path):
    text = path.read_text()
    reference = _reference(text)
    scrape = Scrape.parse(text)
    if reference is None:
        assert scrape.samples, path  # what parses is kept
        return
    assert _comparable(dict(scrape.samples)) == _comparable(reference)
    assert scrape.damaged_lines == []


def test_escapes_braces_in_values_timestamps_and_damaged_lines():
    text = ('# TYPE x gauge\n'
            'x{a="q\\"uo\\\\te\\nn",b="}{,"} 1\n'
            'x{a="1"b="2"} 2\n'  # no comma between labels
            'x{} 3\n'
            'x 4 1700000000000\n'
            'y{a="1",} +Inf\n'
            'x5\n'  # a name cut off with no value: not x = 5
            '# TYPE c counter\n'
            'c 7\n')  # a counter without _total is read as prometheus_client names it
    scrape = Scrape.parse(text)
    assert scrape.samples["x"] == [({"a": 'q"uo\\te\nn', "b": "}{,"}, 1.0), ({}, 3.0), ({}, 4.0)]
    assert scrape.value("y") == math.inf and scrape.value("c_total") == 7.0
    assert scrape.damaged_lines == ['x{a="1"b="2"} 2', "x5"]


def test_a_name_is_parsed_when_read():
    text = (FIXTURES / "vllm-cpu" / "loaded.txt").read_text()
    scrape = Scrape.parse(text)
    assert scrape.samples._parsed == {}  # type: ignore[attr-defined]
    assert scrape.value("vllm:num_requests_running") == 8.0
    assert set(scrape.samples._parsed) == {"vllm:num_requests_running"}  # type: ignore[attr-defined]
    assert "vllm:kv_cache_usage_perc" in scrape.names and scrape.has("vllm:kv_cache_usage_perc")
