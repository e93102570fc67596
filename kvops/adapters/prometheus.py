"""A Prometheus text scrape, flattened to what the adapters ask of it: a sample's value summed over its
label sets, a label's values, and a histogram's buckets.

Sums over labels because a server exports one series per model, engine or tensor-parallel rank, and the adapters
want the server's total. Parsed here rather than with `prometheus_client.parser`, which reads a character at a
time: it took 16-30 ms for one 52 KB vLLM scrape on a 2-vCPU EPYC, so a supervisor polling 300 vLLMs at 2 Hz
would have spent several cores parsing (docs/benchmarks.md, "A fleet"). Parsing is lazy: one pass groups the lines
by sample name, and a name's labels and values are parsed when first asked for, since an adapter reads about a
fifth of what vLLM exports (its histograms' buckets are most of the text). A line that does not parse costs only
itself: it is kept in `damaged_lines`, as a scrape cut off mid-line loses its last line.

The grouping pass is three regular expressions over the whole text and a loop over runs of lines of one name (a
histogram's buckets are one run), not a loop over lines; and a label set is parsed once per process, not once per
line and scrape: the same `{engine="0",le="0.5",model_name="m"}` comes back every poll, from every replica of a
model. Lines end at "\n", as prometheus_client reads them.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

Series = list[tuple[dict[str, str], float]]

# Read from "\n" + text, a line's start is the "\n" before it (a MULTILINE "^" costs the engine ~7x as much: it is
# tried at every character). A sample line: its name, and the rest of the line.
_LINE = re.compile(r"\n([a-zA-Z_:][a-zA-Z0-9_:]*)([^\n]*)")
_TYPE = re.compile(r"\n#[ \t]+TYPE[ \t]+(\S+)[ \t]+(\S+)")
_OTHER = re.compile(r"\n([^#a-zA-Z_:\n][^\n]*)")  # neither a comment nor a sample: damaged unless blank
# After the name: the text between the braces (label values may hold '}' or ',', so the last '}' closes it), the
# value, and an optional millisecond timestamp, which kvops does not need.
_REST = re.compile(r"(?:\s*\{(.*)\}\s*|\s+)([+-]?(?:[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+\.|Inf|inf|NaN|nan))"
                   r"(?:\s+-?\d+)?\s*")
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"(?:[^"\\]|\\.)*"'
_LABELS = re.compile(rf"\s*(?:{_LABEL}\s*(?:,\s*|$))*")  # a whole label set, checked in one pass
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_ESCAPE = re.compile(r"\\(.)")
_ESCAPED = {"n": "\n", "\\": "\\", '"': '"'}


class ScrapeError(ValueError):
    """The text is not the Prometheus exposition format; the message says where it broke."""


@functools.lru_cache(maxsize=16384)
def _labels(text: str) -> dict[str, str] | None:
    """The label set between a sample's braces; None when it does not parse. Shared by every line that has the same
    text: the series' label dicts are read, never changed."""
    if _LABELS.fullmatch(text) is None:
        return None
    if "\\" not in text:
        return dict(_PAIR.findall(text))
    return {name: _ESCAPE.sub(lambda m: _ESCAPED.get(m.group(1), m.group(0)), value)
            for name, value in _PAIR.findall(text)}


def _sample(rest: str) -> tuple[dict[str, str], float] | None:
    """A sample from what follows its name on the line; None when it does not parse."""
    found = _REST.fullmatch(rest)
    if found is None:
        return None
    inside = found.group(1)
    labels = _labels(inside) if inside else {}
    return None if labels is None else (labels, float(found.group(2)))


class _Samples(Mapping[str, Series]):
    """Sample name -> its series, each name's lines parsed on first access. A name every line of which is damaged
    is absent."""

    def __init__(self, lines: dict[str, list[str]], damaged: list[str], raw: frozenset[str] = frozenset()) -> None:
        self._lines = lines  # name -> what follows the name on each of its lines
        self._raw = raw  # the names as written (a counter's lacking `_total` is filed under name + "_total")
        self._parsed: dict[str, Series] = {}
        self._damaged = damaged

    def _series(self, name: str) -> Series | None:
        series = self._parsed.get(name)
        if series is None:
            lines = self._lines.get(name)
            if lines is None:
                return None
            series = []
            for rest in lines:
                sample = _sample(rest)
                if sample is None:
                    self._damaged.append(name.removesuffix("_total") + rest if name not in self._raw else name + rest)
                else:
                    series.append(sample)
            self._parsed[name] = series
            del self._lines[name]
        return series or None

    def __getitem__(self, name: str) -> Series:
        series = self._series(name)
        if series is None:
            raise KeyError(name)
        return series

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._series(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter([name for name in [*self._parsed, *self._lines] if self._series(name) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def raw_names(self) -> set[str]:
        return set(self._parsed).union(self._lines)


@dataclass
class Scrape:
    samples: Mapping[str, Series] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # family name (as in its TYPE line) -> counter | gauge | ...
    _damaged: list[str] = field(default_factory=list, repr=False)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        """Parse the scrape; a scrape cut off mid-line (a dropped connection, a truncated file) loses only the
        lines that do not parse, which are kept in `damaged_lines`."""
        text = "\n" + (text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text)
        types = dict(_TYPE.findall(text))
        damaged = [line for line in _OTHER.findall(text) if not line.isspace()]
        lines: dict[str, list[str]] = {}
        for name, run in itertools.groupby(_LINE.findall(text), key=_FIRST):
            lines.setdefault(name, []).extend(map(_SECOND, run))
        raw = frozenset(lines)
        for name in [n for n in lines if types.get(n) == "counter" and not n.endswith("_total")]:
            # as prometheus_client names a counter's sample (Triton's, llama.cpp's lack `_total`)
            lines.setdefault(name + "_total", []).extend(lines.pop(name))
        return cls(_Samples(lines, damaged, raw), types, damaged)

    @property
    def damaged_lines(self) -> list[str]:
        """The lines that did not parse (reading this parses every line)."""
        for _ in self.samples:
            pass
        return self._damaged

    @property
    def names(self) -> set[str]:
        """Every sample name in the text (a name whose every line is damaged included: reading it parses none)."""
        samples = self.samples
        return samples.raw_names() if isinstance(samples, _Samples) else set(samples)

    def has(self, name: str) -> bool:
        return name in self.samples

    def value(self, name: str) -> float | None:
        """The sum over every label set (None when the sample is absent or not a number)."""
        series = self.samples.get(name)
        if not series:
            return None
        total = sum(v for _, v in series)
        return None if math.isnan(total) else total

    def mean(self, name: str) -> float | None:
        """The mean over label sets: for fractions (one usage gauge per engine of a data-parallel server)."""
        series = self.samples.get(name)
        if not series:
            return None
        mean = sum(v for _, v in series) / len(series)
        return None if math.isnan(mean) else mean

    def first(self, *names: str) -> tuple[str, float] | None:
        """The first of `names` present, with its value: newer names first, older fallbacks after."""
        for name in names:
            value = self.value(name)
            if value is not None:
                return name, value
        return None

    def label(self, name: str, label: str) -> str | None:
        for labels, _ in self.samples.get(name, []):
            if label in labels:
                return labels[label]
        return None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Values of one sample per value of `label`, summed over the other labels."""
        out: dict[str, float] = defaultdict(float)
        for labels, value in self.samples.get(name, []):
            if label in labels:
                out[labels[label]] += value
        return dict(out)

    def histogram(self, base: str) -> tuple[list[float], list[int], float, int] | None:
        """Upper bounds (without +Inf), per-bucket counts (not cumulative; one more than bounds: above the
        last), sum and count, summed over label sets. None when the histogram is absent."""
        buckets = self.samples.get(f"{base}_bucket")
        if not buckets:
            return None
        cumulative: dict[float, float] = defaultdict(float)
        for labels, value in buckets:
            try:
                cumulative[float(labels.get("le", "nan"))] += value
            except ValueError:
                continue
        bounds = sorted(b for b in cumulative if not math.isnan(b))
        finite = [b for b in bounds if not math.isinf(b)]
        total = cumulative.get(math.inf, self.value(f"{base}_count") or 0.0)
        counts: list[int] = []
        previous = 0.0
        for bound in finite:
            counts.append(max(0, round(cumulative[bound] - previous)))
            previous = cumulative[bound]
        counts.append(max(0, round(total - previous)))
        return finite, counts, self.value(f"{base}_sum") or 0.0, round(total)
