"""Volatile values in prompts: the timestamps and ids that make prompts differ where nothing else does, so that a
prefix cache never reuses them (the seed's "a timestamp at the top of the system prompt").

A tenant's policy `mask` names patterns of this catalog; the gateway replaces each match with the pattern's
placeholder (`<timestamp>`, `<uuid>`, ...) before the upstream sees the prompt. Unlike whitespace normalization this
changes what the model reads: a person (or a fix) turns it on for a tenant whose answers do not depend on the value.
The patterns are anchored on word boundaries and match whole values only, so a number or a word is never cut.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Volatile:
    name: str
    pattern: re.Pattern[str]
    example: str  # a value it matches, checked by the tests

    @property
    def placeholder(self) -> str:
        return f"<{self.name}>"


_DATE = r"\d{4}-\d{2}-\d{2}"
_TIME = r"\d{2}:\d{2}(?::\d{2}(?:[.,]\d{1,9})?)?"
_ZONE = r"(?:Z|[+-]\d{2}:?\d{2}|\s?UTC)?"

CATALOG: dict[str, Volatile] = {v.name: v for v in (
    # ISO 8601 and the log-style "2026-12-04 03:12:14", with fractions and a zone
    Volatile("timestamp", re.compile(rf"\b{_DATE}[T ]{_TIME}{_ZONE}(?!\w)"), "2026-12-04T03:12:14.123Z"),
    Volatile("uuid", re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
             "123e4567-e89b-12d3-a456-426614174000"),
    # a request or trace id: 16 or more hex digits with at least one letter and one digit (not a plain number)
    Volatile("hex_id", re.compile(r"\b(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{16,}\b"),
             "4bf92f3577b34da6a3ce929d0e0e4736"),
)}
# The catalog's order is the order of replacement (check_mask keeps it): a timestamp goes before the ids.
MASK_RULE = f"a list of {', '.join(CATALOG)}"


def check_mask(names: list[str]) -> list[str]:
    """The names, in the catalog's order and without repeats; ValueError naming an unknown one."""
    unknown = [name for name in names if name not in CATALOG]
    if unknown:
        raise ValueError(f"mask: {', '.join(map(repr, unknown))} is not a volatile pattern; {MASK_RULE}")
    return [name for name in CATALOG if name in names]


def mask_text(text: str, names: list[str]) -> str:
    """`text` with every value of the named patterns replaced by its placeholder."""
    for name in names:
        volatile = CATALOG[name]
        text = volatile.pattern.sub(volatile.placeholder, text)
    return text


def found(text: str) -> dict[str, int]:
    """Characters of `text` each catalog pattern matches (0 left out): what masking it would take out."""
    counts: dict[str, int] = {}
    for name, volatile in CATALOG.items():
        chars = sum(len(m.group()) for m in volatile.pattern.finditer(text))
        if chars:
            counts[name] = chars
    return counts
